"""Training throughput: step time and tokens/s of posattn's training step, per position family.

Question: how fast does a model train on this CPU, where does the step's time go, and how does it
compare with the PyTorch x-transformers library on the same shape (the goal, docs/benchmarks.md:
at least 1.5x its tokens/s for a 4-layer, d_model 128 model at length 256)?

Run (from the repository root):
    python benchmarks/train_throughput.py --rounds 3                 # tiny and small, every family
    python benchmarks/train_throughput.py --configs small --families rope alibi \
        --xtransformers $REFENV/bin/python --rounds 3                # the goal, side by side
    python benchmarks/train_throughput.py --crossover --rounds 3     # the rule behind "auto"
    python benchmarks/train_throughput.py --crossover --crossover-bias none --rounds 3
    python benchmarks/train_throughput.py --pieces --rounds 3        # the pieces of "other"
    python benchmarks/train_throughput.py --configs tiny small --families rope alibi \
        --dtypes float32 bfloat16 --rounds 3                         # bfloat16 compute
    python benchmarks/train_throughput.py --products --rounds 3      # its products alone
($REFENV: a separate virtual environment with torch and x-transformers; the numbers these print,
with their machine: docs/benchmarks.md and docs/attention.md.)

Configs (both built from configs/tiny.py through the command-line override path):
  tiny   the length-extrapolation experiment's shape (configs/extrapolation.py): configs/tiny.py
         with 4 / 4 heads and batch 32: d_model 64, 2 layers, 4 heads of 16, T 64 (2048 tokens
         per step).
  small  d_model 128, 4 layers, 4 / 4 heads (head dim 32), d_ff 512, T 256, batch 16 (4096
         tokens per step): the goal's shape and benchmarks/xtransformers_baseline.py's defaults.

The step is `posattn.train.steps.train_step` jitted with donated state, as `posattn.train` runs it
(AdamW, clipping, bound projection, metrics), on `data.train_batch` batches of the stdlib corpus
built before timing, in a process started as `python -m posattn.train` starts (with glibc's malloc
tunables that keep XLA:CPU's scratch in the heap, `posattn.hostmem`; `POSATTN_HUGE_PAGES=0` times
it without them, `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` with huge pages alone). The page faults
and system (kernel) CPU time a step, the process's over the round, are printed beside its time:
scratch served by fresh 4 KiB pages every step shows up there. A round times --steps consecutive
steps (wall clock, ended by `block_until_ready` on the metrics) after three untimed ones, as each
of the baseline's rounds does (and the first round after 10 s of untimed steps of every case); the
rounds of every (config, family) and of the baseline alternate, so each sees the same contention;
min and median over rounds are printed.

Before and after every round (ours: its timed window; the baseline's: its subprocess) the round
trip of a cache line between the first two CPUs is timed (`_machine.CoreRoundTrip`, built with the
C compiler where there is one). A VM's host can move its two virtual CPUs far apart for seconds at
a time, and a step split across both threads then runs the same work in more CPU time
(docs/benchmarks.md, "What the slow rounds are"). The lines after the table name every round over
1.25x the fastest of its series, with the round trips before and after it and our step's user CPU
time a step; the JSON has both for every round.

Where the time goes, measured by timing the pieces alone, in the same process, in every round:
  attention  `attention(q, k, v, bias=the family's (BiasFn, params) of layer 0, causal,
             implementation=the config's)` forward + backward (value_and_grad over q, k, v and the
             bias parameters the model trains: T5's table, Kerple's, not ALiBi's constant
             slopes, as in the step) at the step's [B, T, N, H], times the number of layers;
  matmuls    every dense product of the step at its shape as a 2-D GEMM, forward (x W) and both
             backward products (dY W^T, X^T dY, the latter in the orientation the step's
             `posattn.nn.layers.dense` computes it): q, k, v, output projections, the MLP's two,
             the tied logits; in the model's compute dtype (`--dtypes`).
The attention piece runs in float32 for every dtype (see `Case._attention_piece`).
"other" is the step minus both: norms, RoPE, GELU, residuals, embedding, cross-entropy, the
optimiser. Pieces timed alone are not additive to the microsecond (XLA fuses across them in the
step), so the shares are approximate; their sum can exceed 100% under contention.

With --crossover, instead: attention forward + backward alone (causal, ALiBi as a (BiasFn, params)
pair, value_and_grad over q, k, v and the slopes; with --crossover-bias none, no bias and a static
causal mask, as a RoPE model's attention, over q, k and v) with implementation "chunked",
"native", "blockwise" and "xla" at --shapes B,T,N,H, interleaved, best of --rounds: the
measurement behind "auto"'s rule (posattn.attention.AUTO_CHUNKED_MAX_HEAD_LOGITS,
docs/attention.md).

With --pieces, instead: pieces of "other" alone at the small config's shape, forward + backward
(value_and_grad of a weighted sum), best of --rounds x 10 calls: RoPE on one [B, T, N, H] q or k
(per layout), GELU (tanh and exact) and ReLU on the MLP's [B T, d_ff], RMSNorm on [B, T, D], the
cross-entropy on [B, T, vocab].

With --products, instead: the small config's MLP product in its three forms (forward, both
backward products) with float32 operands and with bfloat16 ones (bfloat16 or float32 result),
best of --rounds x 20 calls: whether the CPU's GEMM library runs the step's products faster in
bfloat16 (`--dtypes` times the whole step). Then square float32 products (n x n by n x n, n = 256,
512, 1024) in the same library, best of --rounds x 10 calls, in GFLOP/s: the rate this process's
threads reach on products large enough to run near the CPU's peak, against which "matmuls alone"
of a step's products can be read.

With --xtransformers PYTHON, benchmarks/xtransformers_baseline.py runs under that interpreter (one
with torch and x-transformers; never a posattn dependency) for the families it has (rope, alibi,
learned, nope) on configs whose key/value heads equal the query heads, alternating with our rounds;
the ratio is our tokens/s over its, at the median and at the best round of each. Its model is
x-transformers' own Decoder of the same width, depth, heads, head dim (d_model / heads, not its
default 64), ff_mult 4 and length, RoPE on the whole head (LayerNorm, exact GELU, untied logits:
the library's defaults), AdamW and clipping, torch threads as given. "its matmuls alone" are our
step's products ("matmuls alone": the same shapes, forward, dX and dW) in torch, timed in each of
its rounds: the two GEMM libraries on the same work, so that the step's time outside its products
can be compared too.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time

from posattn import hostmem

if __name__ == "__main__":
    hostmem.reexec_with_malloc_tunables()  # as `python -m posattn.train` runs (posattn.hostmem)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from posattn import attention as attention_lib  # noqa: E402
from posattn import config as config_lib  # noqa: E402
from posattn import data, families  # noqa: E402
from posattn.attention import native as native_lib  # noqa: E402
from posattn.nn import layers  # noqa: E402
from posattn.nn.layers import compute_dtype  # noqa: E402
from posattn.nn.model import TransformerLM  # noqa: E402
from posattn.train import steps  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _machine import CoreRoundTrip, cpu_name  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = {
    "tiny": ["model.num_kv_heads=4", "train.batch_size=32"],
    "small": [
        "model.d_model=128",
        "model.num_layers=4",
        "model.num_heads=4",
        "model.num_kv_heads=4",
        "data.seq_len=256",
        "train.batch_size=16",
    ],
}
BASELINE_POSITIONS = ("rope", "alibi", "learned", "nope")


def step_setup(config_name: str, family: str, overrides=()):
    """(config, model config, OptimConfig, optax transform, graphdef) of one (config, family):
    configs/tiny.py with CONFIGS[config_name], the family as `model.position`, then `overrides`
    (key=value). The pieces `train_step` is built from, before anything is initialised."""
    args = CONFIGS[config_name] + [f"model.position={family}", *overrides]
    config = config_lib.load_config(ROOT / "configs" / "tiny.py", [f"--config.{a}" for a in args])
    cfg = config_lib.validate(config)
    optim = steps.OptimConfig.from_config(config.train)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(params=0))))
    return config, cfg, optim, steps.make_optimizer(optim), graphdef


def timed(fn, *args, repeats: int = 1) -> float:
    """Best wall-clock seconds of `repeats` calls of fn(*args) (already compiled)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


# Untimed steps before each round's window, as the baseline takes before its own
# (benchmarks/xtransformers_baseline.py): a round starts warm after the other side's round.
WARMUP_STEPS = 3
# Untimed steps of every case, in turn, for this long before the first round. After the minutes
# of single-threaded compiling that build the cases, a VM's host held its two CPUs apart for the
# first seconds of two-threaded work: the first round of every run was slow, and the
# baseline's first round after it (docs/benchmarks.md, "What the slow rounds are").
WARMUP_SECONDS = 10.0


class Case:
    """One (config, family): the jitted step, its batches, and the pieces timed alone."""

    def __init__(
        self,
        config_name: str,
        family: str,
        *,
        steps_per_round: int,
        overrides: list[str],
        label: str = "",
    ):
        self.name, self.family = config_name + (f" [{label}]" if label else ""), family
        config, cfg, optim, tx, graphdef = step_setup(config_name, family, overrides)
        self.cfg = cfg
        self.B, self.T = int(config.train.batch_size), int(config.data.seq_len)
        self.state = steps.jit_init_train_state(cfg, tx)(jax.random.key(0))
        self.step = jax.jit(functools.partial(steps.train_step, graphdef, optim), donate_argnums=0)
        corpus = data.load_corpus(config.data.corpus)
        options = data.batch_options(config.data, causal=cfg.causal, vocab_size=cfg.vocab_size)
        self.batches = [
            data.train_batch(corpus, seed=0, step=s, batch_size=self.B, seq_len=self.T, **options)
            for s in range(steps_per_round)
        ]
        self.steps_per_round = steps_per_round
        self._attention_piece()
        self._matmul_piece()
        self.rounds: list[dict] = []
        self.run_steps()  # compile and warm up

    def run_steps(self) -> tuple[float, float, float, float]:
        """(seconds, page faults, system seconds, user seconds) per step over one window of
        consecutive steps; the last three are the process's (minor faults, kernel and user CPU
        time on every thread)."""
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        for batch in self.batches:
            self.state, metrics = self.step(self.state, batch)
        jax.block_until_ready(metrics)
        seconds = time.perf_counter() - start
        after, n = resource.getrusage(resource.RUSAGE_SELF), len(self.batches)
        faults, system = after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime
        return seconds / n, faults / n, system / n, (after.ru_utime - before.ru_utime) / n

    def _attention_piece(self):
        cfg = self.cfg
        B, T, N, K, H = self.B, self.T, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        model = TransformerLM(cfg, rngs=nnx.Rngs(params=0))
        layer = model.blocks[0].attn
        bias_fn, bias_params = layer.bias() if layer.bias is not None else (None, {})
        keys = jax.random.split(jax.random.key(1), 4)
        # float32 whatever the model's dtype: alone, XLA:CPU 0.10 compiles the kernel's bfloat16
        # products to a dot it cannot run (BF16 x BF16 = F32), which it fuses away in the step.
        q = jax.random.normal(keys[0], (B, T, N, H))
        k, v = (jax.random.normal(key, (B, T, K, H)) for key in keys[1:3])
        d_out = jax.random.normal(keys[3], (B, T, N, H))

        def loss(q, k, v, params):
            bias = None if bias_fn is None else (bias_fn, params)
            out = attention_lib.attention(
                q,
                k,
                v,
                bias=bias,
                causal=layer.causal,
                scale=layer.scale,
                softcap=layer.softcap,
                implementation=layer.implementation,
            )
            return jnp.sum(out * d_out)

        # Differentiated: the floating bias parameters the step trains; the others (ALiBi's
        # constant slopes, whose step asks for no bias gradient) are arguments too, as in the
        # step, but not differentiated.
        trained = {
            n: p
            for n, p in bias_params.items()
            if isinstance(layer.bias.values[n], nnx.Param) and jnp.issubdtype(p.dtype, jnp.floating)
        }
        fixed = {n: p for n, p in bias_params.items() if n not in trained}
        fn = jax.jit(
            jax.value_and_grad(
                lambda q, k, v, t, f: loss(q, k, v, {**t, **f}), argnums=(0, 1, 2, 3)
            )
        )
        self.attention_args = (fn, q, k, v, trained, fixed)
        self.attention_impl = (
            attention_lib.choose_implementation(q, k, None, softcap=layer.softcap)
            if layer.implementation == "auto"
            else layer.implementation
        )
        timed(*self.attention_args)

    def _matmul_piece(self):
        cfg = self.cfg
        M, D, F, V = self.B * self.T, cfg.d_model, cfg.ff_dim, cfg.vocab_size
        NH, KH = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        owners = sum(i % cfg.kv_share == 0 for i in range(cfg.num_layers))
        shapes = (
            [(D, NH), (NH, D), (D, F), (F, D)] * cfg.num_layers
            + [(D, KH), (D, KH)] * owners
            + [(D, V)]
        )
        keys = iter(jax.random.split(jax.random.key(2), 3 * len(shapes)))
        dt = compute_dtype(cfg.dtype)  # the step's operands are in the compute dtype
        operands = [
            (
                jax.random.normal(next(keys), (M, i), dt),
                jax.random.normal(next(keys), (i, o), dt),
                jax.random.normal(next(keys), (M, o), dt),
            )
            for i, o in shapes
        ]

        def products(x, w, dy):  # forward, dX, dW, the latter two as the step's dense does them
            y, pullback = jax.vjp(layers._matmul, x, w)
            return (y, *pullback(dy))

        @jax.jit
        def gemms(operands):
            return [products(*xs) for xs in operands]

        self.matmul_args = (gemms, operands)
        self.matmul_shapes = (M, shapes)
        self.matmul_flops = sum(3 * 2 * M * i * o for i, o in shapes)
        timed(gemms, operands)

    def run_round(self, round_trip=None) -> dict:
        """One timed window and the pieces alone; `round_trip` (a `_machine.CoreRoundTrip`) is
        timed just before and just after the window, where the machine allows."""
        for batch in self.batches[:WARMUP_STEPS]:  # untimed
            self.state, metrics = self.step(self.state, batch)
        jax.block_until_ready(metrics)
        before = round_trip() if round_trip else None
        step_s, faults, system_s, user_s = self.run_steps()
        after = round_trip() if round_trip else None
        attention_s = timed(*self.attention_args, repeats=3) * self.cfg.num_layers
        matmul_s = timed(*self.matmul_args, repeats=3)
        result = {
            "step_ms": step_s * 1e3,
            "page_faults": faults,
            "system_ms": system_s * 1e3,
            "user_ms": user_s * 1e3,
            "attention_ms": attention_s * 1e3,
            "matmul_ms": matmul_s * 1e3,
            "round_trip_ns": [before, after],
        }
        self.rounds.append(result)
        return result


CROSSOVER_SHAPES = [
    "16,128,4,32",
    "64,128,4,32",
    "16,256,4,32",
    "32,256,4,32",
    "16,512,4,32",
    "1,512,8,64",
    "2,768,8,64",
    "1,1024,4,64",
    "1,1024,8,64",
    "1,2048,8,64",
]


def crossover(shapes: list[str], rounds: int, bias: str = "alibi") -> None:
    """Attention forward + backward alone per implementation: the measurement behind "auto".
    bias: "alibi" (a position bias, the slopes differentiated too) or "none" (a static causal
    mask alone)."""
    from posattn import positions

    impls = ("chunked", "native", "blockwise", "xla")
    if not native_lib.available():
        impls = tuple(i for i in impls if i != "native")
        print(f"# native kernel unavailable: {native_lib.why_unavailable()}")
    others = [i for i in impls if i != "chunked"]
    print(f"\n# bias: {bias}")
    print(
        "| B, T, N, H | "
        + " | ".join(f"{i} ms" for i in impls)
        + " | "
        + " | ".join(f"{i} / chunked" for i in others)
        + " |"
    )
    print("|---|" + "---|" * (len(impls) + len(others)))
    for shape in shapes:
        B, T, N, H = (int(x) for x in shape.split(","))
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, d_out = (jax.random.normal(key, (B, T, N, H)) for key in keys)
        slopes = positions.alibi_slopes(N)
        inputs = (q, k, v, slopes) if bias == "alibi" else (q, k, v)

        def alibi(slopes, q_pos, k_pos):
            return positions.alibi_bias(q_pos[:, None] - k_pos[None, :], slopes)

        fns = {}
        for impl in impls:

            def loss(q, k, v, *slopes, impl=impl, d_out=d_out):
                position_bias = (alibi, slopes[0]) if slopes else None
                out = attention_lib.attention(
                    q, k, v, bias=position_bias, causal=True, implementation=impl
                )
                return jnp.sum(out * d_out)

            fns[impl] = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(inputs)))))
            timed(fns[impl], *inputs)  # compile
        best = {impl: float("inf") for impl in impls}
        for _ in range(rounds):
            for impl, fn in fns.items():
                best[impl] = min(best[impl], timed(fn, *inputs))
        ms = {impl: t * 1e3 for impl, t in best.items()}
        print(
            f"| {B}, {T}, {N}, {H} | "
            + " | ".join(f"{ms[i]:.1f}" for i in impls)
            + " | "
            + " | ".join(f"{ms[i] / ms['chunked']:.2f}" for i in others)
            + " |",
            flush=True,
        )


def products(rounds: int) -> None:
    """The small config's MLP product [4096, 128] x [128, 512] in each form a step computes it
    (forward x W, backward dY W^T and X^T dY), float32 against bfloat16 operands with a bfloat16
    or a float32 result: which of them the CPU's GEMM library speeds up in bfloat16."""
    M, K, N = 4096, 128, 512
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = [(M, K), (K, N), (M, N)]
    x, w, dy = (jax.random.normal(k, s) for k, s in zip(keys, shapes, strict=True))
    forms = {
        "forward x W": (lambda a, b, out: jnp.dot(a, b, preferred_element_type=out), (x, w)),
        "backward dY W^T": (lambda a, b, out: jnp.dot(a, b.T, preferred_element_type=out), (dy, w)),
        "backward X^T dY": (lambda a, b, out: jnp.dot(a.T, b, preferred_element_type=out), (x, dy)),
    }
    kinds = {
        "float32": (jnp.float32, jnp.float32),
        "bfloat16 -> bfloat16": (jnp.bfloat16, jnp.bfloat16),
        "bfloat16 -> float32": (jnp.bfloat16, jnp.float32),
    }
    print("\n| product | " + " | ".join(f"{k} ms (best)" for k in kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for name, (fn, args) in forms.items():
        cells = []
        for operand, out in kinds.values():
            f = jax.jit(functools.partial(fn, out=out))
            typed = [a.astype(operand) for a in args]
            timed(f, *typed)  # compile
            cells.append(min(timed(f, *typed, repeats=20) for _ in range(rounds)) * 1e3)
        print(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |", flush=True)
    print("\n| square float32 product, n x n by n x n | ms (best) | GFLOP/s |\n|---|---|---|")
    for n in (256, 512, 1024):
        a, b = (jax.random.normal(k, (n, n)) for k in jax.random.split(jax.random.key(1)))
        f = jax.jit(jnp.dot)
        timed(f, a, b)  # compile
        best = min(timed(f, a, b, repeats=10) for _ in range(rounds))
        print(f"| {n} | {best * 1e3:.2f} | {2 * n**3 / best / 1e9:.0f} |", flush=True)


def pieces(rounds: int) -> None:
    """The pieces of a step's "other" share, each alone, at the small config's shape."""
    from posattn import rotary
    from posattn.nn.layers import RMSNorm

    B, T, N, H, D, F, V = 16, 256, 4, 32, 128, 512, 256
    keys = iter(jax.random.split(jax.random.key(0), 8))
    x = jax.random.normal(next(keys), (B, T, N, H))
    h = jax.random.normal(next(keys), (B * T, F))
    r = jax.random.normal(next(keys), (B, T, D))
    logits = jax.random.normal(next(keys), (B, T, V))
    targets = jax.random.randint(next(keys), (B, T), 0, V)
    inv_freq, _ = rotary.rope_frequencies(H)
    positions = jnp.arange(T)
    norm = RMSNorm(D, dtype=jnp.float32)

    def weighted(
        fn, arg
    ):  # forward + backward of sum(fn(arg) * w), w a fixed array like fn's output
        w = jax.random.normal(jax.random.key(9), jax.eval_shape(fn, arg).shape)
        return jax.jit(jax.value_and_grad(lambda a: jnp.sum(fn(a) * w))), arg

    def cross_entropy(z):
        logp = jax.nn.log_softmax(z)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1)

    cases = {
        f"RoPE interleaved, one of q/k {list(x.shape)}": weighted(
            lambda a: rotary.apply_rope(a, positions, inv_freq, layout="interleaved"), x
        ),
        f"RoPE half, one of q/k {list(x.shape)}": weighted(
            lambda a: rotary.apply_rope(a, positions, inv_freq, layout="half"), x
        ),
        f"GELU tanh {list(h.shape)}": weighted(lambda a: jax.nn.gelu(a, approximate=True), h),
        f"GELU exact {list(h.shape)}": weighted(lambda a: jax.nn.gelu(a, approximate=False), h),
        f"ReLU {list(h.shape)}": weighted(jax.nn.relu, h),
        f"RMSNorm {list(r.shape)}": weighted(norm, r),
        f"cross-entropy {list(logits.shape)}": weighted(cross_entropy, logits),
    }
    print("\n| piece (forward + backward) | ms (best) |\n|---|---|")
    for name, (fn, arg) in cases.items():
        timed(fn, arg)  # compile
        best = min(timed(fn, arg, repeats=10) for _ in range(rounds))
        print(f"| {name} | {best * 1e3:.2f} |", flush=True)


def products_arg(rows: int, shapes) -> str:
    """The step's dense products for the baseline's --products: "M:IxO,IxO,..."."""
    return f"{rows}:" + ",".join(f"{i}x{o}" for i, o in shapes)


def baseline_round(python: str, case: Case, *, threads: int, steps_per_round: int) -> dict:
    cfg = case.cfg
    cmd = [
        python,
        str(ROOT / "benchmarks" / "xtransformers_baseline.py"),
        "--d_model",
        str(cfg.d_model),
        "--layers",
        str(cfg.num_layers),
        "--heads",
        str(cfg.num_heads),
        "--seq_len",
        str(case.T),
        "--batch",
        str(case.B),
        "--position",
        case.family,
        "--steps",
        str(steps_per_round),
        "--threads",
        str(threads),
        "--products",
        products_arg(*case.matmul_shapes),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def cases_dtype_first(cases: list[Case], key: tuple[str, str]) -> str:
    """The dtype of the first case of (config, family) `key`: the one that runs its baseline."""
    return next(c.cfg.dtype for c in cases if (c.name, c.family) == key)


SLOW_ROUND = 1.25  # a round this many times the fastest of its series is listed after the table


def slow_rounds(cases: list[Case], baselines: dict, why_no_round_trip: str | None) -> list[str]:
    """Comment lines naming every round over SLOW_ROUND times the fastest of its series (ours per
    case, the baseline's per (config, family)), with the cache line's round trip between the two
    CPUs timed before and after it (ours: its timed window; the baseline's: its subprocess) and,
    for ours, the step's user CPU time a step, each against the fastest round's: a round slowed
    by where the host ran the VM's CPUs (docs/benchmarks.md, "What the slow rounds are") has a
    longer round trip and the same work in more CPU time."""
    series = [
        (f"{c.name} {c.family} {c.cfg.dtype} posattn", "step_ms", c.rounds) for c in cases
    ] + [
        (f"{config} {family} x-transformers", "ms_per_step", rounds)
        for (config, family), rounds in baselines.items()
        if rounds
    ]
    trips = [t for _, _, rounds in series for x in rounds for t in x["round_trip_ns"] if t]
    lines = [
        "# a cache line's round trip between the two CPUs, before and after each round: "
        + (
            f"{min(trips):.0f} ns at best, median {statistics.median(trips):.0f}, worst "
            f"{max(trips):.0f}"
            if trips
            else f"not timed ({why_no_round_trip})"
        )
    ]

    def said(x: dict, key: str) -> tuple[str, str]:  # (ms, user CPU and round trips)
        user = f"{x['user_ms']:.1f}" if "user_ms" in x else None
        trip = " / ".join(f"{t:.0f}" for t in x["round_trip_ns"] if t)
        return f"{x[key]:.1f}", ", ".join(filter(None, (user, trip and f"{trip} ns")))

    for label, key, rounds in series:
        fastest = min(rounds, key=lambda x: x[key])
        for i, x in enumerate(rounds):
            if x[key] > SLOW_ROUND * fastest[key]:
                (ms, more), (fast_ms, fast_more) = said(x, key), said(fastest, key)
                lines.append(
                    f"#   {label} round {i + 1}: {ms} ms ({more}); fastest round {fast_ms} ms "
                    f"({fast_more})".replace(" ()", "")
                )
    if len(lines) == 1:
        lines.append(f"# no round over {SLOW_ROUND}x the fastest of its series")
    else:
        lines.insert(
            1,
            f"# rounds over {SLOW_ROUND}x the fastest of their series: ms a step (our user CPU "
            "time a step, round trips before / after):",
        )
    return lines


def load_average() -> str:
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--families", nargs="+", default=families.names(), choices=families.names())
    parser.add_argument(
        "--rounds", type=int, default=3, help="timed rounds per case (min/median over them)"
    )
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round")
    parser.add_argument(
        "--override",
        nargs="*",
        default=[],
        help="extra config overrides for every case, e.g. model.attention_impl=xla",
    )
    parser.add_argument(
        "--xtransformers",
        metavar="PYTHON",
        help="an interpreter with torch + x-transformers: run the baseline side by side",
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="torch threads for the baseline"
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=None,
        choices=("float32", "bfloat16"),
        help="model.dtype of each case (the compute dtype; parameters stay float32), timed "
        "side by side; default: the config's (float32)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        metavar="OVERRIDES",
        help="override sets timed side by side, each a space-separated list ('' for none), "
        "e.g. '' 'model.attn_logit_softcap=10'",
    )
    parser.add_argument("--json", metavar="PATH", help="also write every round as JSON")
    parser.add_argument(
        "--crossover",
        action="store_true",
        help="time attention alone per implementation at --shapes instead",
    )
    parser.add_argument(
        "--crossover-bias",
        choices=("alibi", "none"),
        default="alibi",
        help="--crossover's bias: ALiBi's (default) or none (a static causal mask alone)",
    )
    parser.add_argument(
        "--pieces",
        action="store_true",
        help="time RoPE, GELU, RMSNorm and the cross-entropy alone instead",
    )
    parser.add_argument(
        "--products",
        action="store_true",
        help="time the MLP's product forms in float32 and bfloat16 alone instead",
    )
    parser.add_argument("--shapes", nargs="+", default=CROSSOVER_SHAPES, metavar="B,T,N,H")
    args = parser.parse_args(argv)

    print(
        f"# {cpu_name()}, {os.cpu_count()} cores; jax {jax.__version__} "
        f"({jax.default_backend()}); load average at start {load_average()}"
    )
    print(f"# GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r} (posattn.hostmem)")
    if args.products:
        products(args.rounds)
        print(f"# load average at the end {load_average()}")
        return
    if args.pieces:
        pieces(args.rounds)
        print(f"# load average at the end {load_average()}")
        return
    if args.crossover:
        crossover(args.shapes, args.rounds, args.crossover_bias)
        print(f"# load average at the end {load_average()}")
        return
    print(f"# overrides: {args.override or 'none'}; {args.rounds} rounds of {args.steps} steps")
    dtypes = args.dtypes or [None]
    variants = args.variants or [""]
    cases = [
        Case(
            c,
            f,
            steps_per_round=args.steps,
            overrides=args.override + ([f"model.dtype={d}"] if d else []) + v.split(),
            label=v if args.variants else "",
        )
        for c in args.configs
        for f in args.families
        for d in dtypes
        for v in variants
    ]
    # One baseline series per (config, family), shared by that pair's dtypes.
    baselines: dict[tuple[str, str], list] = {}
    if args.xtransformers:
        baselines = {
            (c.name, c.family): []
            for c in cases
            if c.family in BASELINE_POSITIONS and c.cfg.num_kv_heads == c.cfg.num_heads
        }
    round_trip = CoreRoundTrip()
    warm_until = time.perf_counter() + WARMUP_SECONDS
    while time.perf_counter() < warm_until:
        for case in cases:
            case.run_steps()
    print(f"# {WARMUP_SECONDS:g} s of untimed steps, every case in turn, before the rounds")
    for r in range(args.rounds):
        for case in cases:
            case.run_round(round_trip)
            key = (case.name, case.family)
            if key in baselines and case.cfg.dtype == cases_dtype_first(cases, key):
                before = round_trip()
                result = baseline_round(
                    args.xtransformers, case, threads=args.threads, steps_per_round=args.steps
                )
                baselines[key].append({**result, "round_trip_ns": [before, round_trip()]})
        print(f"# round {r + 1}/{args.rounds} done, load average {load_average()}", flush=True)

    print(
        "\n| config | family | dtype | attention impl | step ms (min / median) | "
        "tokens/s (median) | page faults a step (system time) | attention alone | "
        "matmuls alone | other | "
        "x-transformers ms (min / median) | its matmuls alone | ratio (median / best) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    records = []
    for case in cases:
        step = [x["step_ms"] for x in case.rounds]
        med = statistics.median(step)
        att = statistics.median(x["attention_ms"] for x in case.rounds)
        mm = statistics.median(x["matmul_ms"] for x in case.rounds)
        tokens = case.B * case.T
        row = (
            f"| {case.name} | {case.family} | {case.cfg.dtype} | {case.attention_impl} | "
            f"{min(step):.1f} / {med:.1f} | "
            f"{tokens / med * 1e3:,.0f} | "
            f"{statistics.median(x['page_faults'] for x in case.rounds):,.0f} "
            f"({statistics.median(x['system_ms'] for x in case.rounds):.1f} ms) | "
            f"{att:.1f} ms ({att / med:.0%}) | "
            f"{mm:.1f} ms ({mm / med:.0%}, "
            f"{case.matmul_flops / (mm * 1e-3) / 1e9:.0f} GFLOP/s) | "
            f"{max(med - att - mm, 0.0) / med:.0%} |"
        )
        record = {
            "config": case.name,
            "family": case.family,
            "dtype": case.cfg.dtype,
            "tokens_per_step": tokens,
            "rounds": case.rounds,
        }
        if baselines.get((case.name, case.family)):
            theirs = [x["ms_per_step"] for x in baselines[(case.name, case.family)]]
            their_med = statistics.median(theirs)
            their_mm = statistics.median(
                x["matmul_ms"] for x in baselines[(case.name, case.family)]
            )
            row += (
                f" {min(theirs):.1f} / {their_med:.1f} | "
                f"{their_mm:.1f} ms ({their_mm / their_med:.0%}, "
                f"{case.matmul_flops / (their_mm * 1e-3) / 1e9:.0f} GFLOP/s) | "
                f"{their_med / med:.2f}x / {min(theirs) / min(step):.2f}x |"
            )
            record["xtransformers"] = baselines[(case.name, case.family)]
        else:
            row += " - | - | - |"
        print(row)
        records.append(record)
    print()
    for line in slow_rounds(cases, baselines, round_trip.why_unavailable):
        print(line)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
