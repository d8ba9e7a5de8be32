"""Accelerator benchmark: attention implementations with position biases, then GPT-2 small training.

Question: on this device, how fast is each attention implementation (forward, forward + backward)
for causal bfloat16 attention with a position bias, how much memory does it need, how far is it
from the float32 reference, and what training throughput does `configs/gpt2_small.py` reach per
position family with implementation "auto"?

Run (from the repository root; needs nothing but the project):
    python benchmarks/accelerator.py                      # full sizes (GPU or TPU)
    python benchmarks/accelerator.py --smoke              # tiny sizes (automatic on CPU)
    python benchmarks/accelerator.py --lengths 8192 --families alibi fire \
        --implementations cudnn pallas --skip-training              # one goal, quickly
    python benchmarks/accelerator.py --variants window forget softcap far --skip-training  # terms
    python benchmarks/accelerator.py --skip-attention \
        --train-families rope fox "rope:window=256/rope"            # per-layer patterns

Part 1, attention alone: for T = S in --lengths (default 1k, 2k, 4k, 8k, 16k, 64k), B 4, 16 query
heads and 16 key/value heads of 128, bfloat16, causal, bias families none / alibi / t5 /
kerple_power / fire as `(BiasFn, params)` pairs from `posattn.families` (implementations that take
a materialised bias get it materialised by `posattn.attention`), for each of --variants: "causal"
(the plain causal mask), "window" (causal with a sliding window of --window keys, Hugging Face's
`sliding_window`), "forget" (causal with FoX's per-row log forget gates, float32[B, T, N]
log-sigmoid values, differentiated too), "softcap" (causal with Gemma 2's soft cap of
--softcap on the content logits; not a default variant) and "far" (causal two-score attention,
`far=Far(q_far, k_far, --window)`, the far pair q and k with their head dims reversed, what a
ReRoPE or SelfExtend remap runs; its TFLOP/s count one pair's products, though it computes two;
not a default variant), for every implementation in
--implementations the backend has ("cudnn" only on GPU and only where posattn offers it; "pallas"
in interpret mode on CPU). Per case: the best of --repeats wall-clock times of the jitted forward
and of the jitted forward + backward (value_and_grad over q, k, v and the bias parameters, a
weighted sum of the output as loss); TFLOP/s from the visible pairs (forward 4 B N H P for P pairs:
T^2 / 2 causal, i.e. half of the two [T, S, H] products, and T w - w^2 / 2 with a window w < T;
forward + backward 3.5x the forward, the FlashAttention-2 count);
memory: the compiled forward + backward's arguments + outputs + temporaries
(`compiled.memory_analysis()`) and, where the device reports it, the process's peak bytes in use
so far (`device.memory_stats()["peak_bytes_in_use"]`, a high-water mark that only grows); at the
smallest T, the largest absolute error of the output and of dq against implementation
"reference" in float32 on the same (bfloat16-valued) inputs. A case that would not fit (the
materialised logits or bias above the device's memory) or fails to compile is recorded as
skipped with its reason.

Part 2, training: `configs/gpt2_small.py` (bfloat16, d_model 768, 12 layers, 12 heads of 64,
T 1024, batch --train-batch) per family in --train-families with model.attention_impl=auto:
`posattn.train.steps.train_step` jitted with donated state (as `python -m posattn.train` runs it
and benchmarks/train_throughput.py times it), --train-steps steps after a warm-up. A
--train-families entry is a family name, or layer-pattern entries joined by "/" (the syntax of
`model.layer_pattern`, docs/families.md#per-layer-settings), e.g. "rope:window=256/rope" for
local layers with a window and a global layer, cycled over the 12 layers. Per entry: tokens/s and
MFU = model FLOP/s over the device's dense bfloat16 peak (model FLOPs per token 6 P + 6 L T D for
P parameters, L layers, context T, width D: the causal attention products counted once at half
size), the peak from the table below (None when the device is not in it), and the
implementations "auto" picked for the step's attention (read from the line `posattn.attention`
logs for each choice).

Writes --out/accelerator.json (every case, the device, the command) and --out/accelerator.md (the
tables), both rewritten after every case (a run stopped early keeps what it measured), and prints
the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import math
import pathlib
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from posattn import attention as attention_lib
from posattn import families
from posattn.nn import pattern as pattern_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]

FULL_LENGTHS = (1024, 2048, 4096, 8192, 16384, 65536)
FAMILIES = ("none", "alibi", "t5", "kerple_power", "fire")
VARIANTS = ("causal", "window", "forget", "softcap", "far")
IMPLEMENTATIONS = ("xla", "cudnn", "blockwise", "pallas")
# Dense bfloat16 peak FLOP/s per device kind (vendor datasheets; no sparsity).
PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
}


def device_peak(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    for name, peak in sorted(PEAK_BF16.items(), key=lambda kv: -len(kv[0])):
        if name.lower() in kind.lower():
            return peak
    return None


def best_time(fn, *args, repeats: int) -> float:
    """Best wall-clock seconds of `repeats` calls of the compiled fn(*args)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def memory_limit(device) -> int | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return None if not stats else stats.get("bytes_limit")


def peak_in_use(device) -> int | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return None if not stats else stats.get("peak_bytes_in_use")


def family_bias(name: str, num_heads: int, head_dim: int):
    """((BiasFn, params) or None, scale) for a registry family."""
    if name == "none":
        return None, None
    family = families.get(name)
    ctx = families.Context(num_heads=num_heads, head_dim=head_dim)
    settings = family.settings()
    spec = family.bias
    bias = (spec.bind(ctx, settings), spec.init(jax.random.key(1), ctx, settings))
    return bias, (1.0 if family.scale_free else None)


def available(impl: str, backend: str) -> str | None:
    """None when `impl` can run on this backend, else the reason it is skipped."""
    if impl == "cudnn" and backend != "gpu":
        return "cuDNN attention needs a GPU"
    if impl not in attention_lib.IMPLEMENTATIONS:
        return f"posattn.attention has no implementation {impl!r} in this build"
    return None


def materialised_bytes(impl: str, B: int, N: int, T: int, bias: bool, per_row: bool) -> int:
    """A lower bound on what an implementation that materialises [B, N, T, T] needs."""
    if impl in ("blockwise", "pallas"):
        return 0
    logits = B * N * T * T * 2 * 2  # bfloat16 logits and probabilities, forward
    rows = B if per_row else 1  # forget gates make the bias per batch row
    return logits + (rows * N * T * T * 4 if bias else 0)  # the float32 [rows, N, T, T] bias


def visible_pairs(T: int, window: int | None) -> float:
    """Query-key pairs a causal mask (with a sliding window) leaves: T^2 / 2, or T w - w^2 / 2."""
    if window is None or window >= T:
        return T * T / 2
    return T * window - window * window / 2


def attention_case(
    impl,
    family,
    *,
    B,
    T,
    N,
    H,
    repeats,
    with_error,
    device,
    window,
    forget,
    softcap=None,
    far_window=None,
):
    """One (implementation, family, T, variant) measurement as a dict: `window` None or the
    sliding window, `forget` whether FoX's log forget gates are added, `softcap` None or the soft
    cap of the content logits, `far_window` None or the window of two-score attention (the far
    pair: q and k with their head dims reversed)."""
    bias, scale = family_bias(family, N, H)
    limit = memory_limit(device)
    need = materialised_bytes(impl, B, N, T, bias is not None or forget, forget)
    if limit is not None and need > 0.9 * limit:
        return {
            "skipped": f"materialises >= {need / 2**30:.1f} GiB, device has {limit / 2**30:.1f}"
        }
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (B, T, N, H), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, T, N, H), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, T, N, H), jnp.bfloat16)
    d_out = jax.random.normal(keys[3], (B, T, N, H), jnp.bfloat16)
    # FoX's gates as a model makes them: log sigmoid of a logit, here near 0 (forget rate ~5%).
    log_forget = (
        jax.nn.log_sigmoid(3.0 + jax.random.normal(keys[4], (B, T, N), jnp.float32))
        if forget
        else None
    )
    fn, params = bias if bias is not None else (None, {})

    def far_of(q, k):
        return (
            None
            if far_window is None
            else attention_lib.Far(q[..., ::-1], k[..., ::-1], far_window)
        )

    def run(q, k, v, params, log_forget, impl=impl):
        b = None if fn is None else (fn, params)
        return attention_lib.attention(
            q,
            k,
            v,
            bias=b,
            causal=True,
            scale=scale,
            window=window,
            log_forget=log_forget,
            softcap=softcap,
            far=far_of(q, k),
            implementation=impl,
        )

    def loss(q, k, v, params, log_forget):
        out = run(q, k, v, params, log_forget)
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))

    args = (q, k, v, params, log_forget)
    forward = jax.jit(run)
    grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4) if forget else (0, 1, 2, 3)))
    try:
        forward = forward.lower(*args).compile()
        grads = grads.lower(*args).compile()
        analysis = grads.memory_analysis()
        jax.block_until_ready(forward(*args))  # warm up
        fwd_s = best_time(forward, *args, repeats=repeats)
        jax.block_until_ready(grads(*args))
        bwd_s = best_time(grads, *args, repeats=repeats)
    except Exception as err:  # a compile or resource failure is a result, not a crash
        return {"skipped": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    flops_fwd = 4.0 * B * N * H * visible_pairs(T, window)
    result = {
        "forward_ms": fwd_s * 1e3,
        "forward_backward_ms": bwd_s * 1e3,
        "forward_tflops": flops_fwd / fwd_s / 1e12,
        "forward_backward_tflops": 3.5 * flops_fwd / bwd_s / 1e12,
        "compiled_bytes": None
        if analysis is None
        else int(
            analysis.argument_size_in_bytes
            + analysis.output_size_in_bytes
            + analysis.temp_size_in_bytes
        ),
        "device_peak_bytes": peak_in_use(device),
    }
    reference_bytes = 3 * B * N * T * T * 4  # float32 logits, probabilities and their gradient
    if with_error and limit is not None and reference_bytes > 0.9 * limit:
        with_error = False
        result["error_skipped"] = (
            f"the float32 reference needs >= {reference_bytes / 2**30:.0f} GiB, "
            f"the device has {limit / 2**30:.0f}"
        )
    if with_error:
        f32 = [x.astype(jnp.float32) for x in (q, k, v, d_out)]

        def ref_out_dq(q, k, v, d_out, log_forget):
            def ref_loss(q):
                out = attention_lib.attention(
                    q,
                    k,
                    v,
                    bias=None if fn is None else (fn, params),
                    causal=True,
                    scale=scale,
                    window=window,
                    log_forget=log_forget,
                    softcap=softcap,
                    far=far_of(q, k),
                    implementation="reference",
                )
                return jnp.sum(out * d_out), out

            return jax.grad(ref_loss, has_aux=True)(q)

        with jax.default_matmul_precision("highest"):  # no TF32 in the reference on a GPU
            want_dq, want_out = jax.jit(ref_out_dq)(*f32, log_forget)
        got_out = forward(*args).astype(jnp.float32)
        got_dq = grads(*args)[1][0].astype(jnp.float32)
        result["max_error_out"] = float(jnp.max(jnp.abs(got_out - want_out)))
        result["max_error_dq"] = float(jnp.max(jnp.abs(got_dq - want_dq)))
        result["reference_scale_dq"] = float(jnp.max(jnp.abs(want_dq)))
    return result


def position_overrides(entry: str) -> list[str]:
    """Config overrides for a --train-families entry: a family name ("none" for NoPE), or
    layer-pattern entries joined by "/" ("rope:window=256/rope": local layers, then a global one).
    """
    if entry == "none":
        return ["model.position=nope"]
    if ":" not in entry and "/" not in entry:
        families.get(entry)  # an unknown family is an error listing the known ones
        return [f"model.position={entry}"]
    layers = tuple(entry.split("/"))
    first = pattern_lib.parse_entry(layers[0], where="--train-families")[0]
    for layer in layers[1:]:
        pattern_lib.parse_entry(layer, where="--train-families")
    return [f"model.position={first}", f"model.layer_pattern={layers!r}"]


@contextlib.contextmanager
def chosen_implementations():
    """The set of implementations `attention(implementation="auto")` picks inside the block, read
    from the line `posattn.attention` logs for each choice (its once-per-input-kind memory is
    emptied first, so that every choice of the block is logged)."""
    chosen: set[str] = set()

    class Collect(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if "implementation='auto'" in message:
                chosen.add(message.rsplit("-> ", 1)[1].strip("'"))

    logger = logging.getLogger(attention_lib.__name__)
    handler, level = Collect(), logger.level
    attention_lib._logged_choices.clear()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield chosen
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def training_case(entry, *, overrides, steps_count, device):
    """tokens/s and MFU of configs/gpt2_small.py for one --train-families entry with
    attention_impl=auto."""
    from flax import nnx

    from posattn import config as config_lib
    from posattn import data
    from posattn.nn.model import TransformerLM
    from posattn.train import steps

    args = [f"--config.{o}" for o in overrides + position_overrides(entry)]
    args.append("--config.model.attention_impl=auto")
    config = config_lib.load_config(ROOT / "configs" / "gpt2_small.py", args)
    cfg = config_lib.validate(config)
    B, T = int(config.train.batch_size), int(config.data.seq_len)
    optim = steps.OptimConfig.from_config(config.train)
    tx = steps.make_optimizer(optim)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(params=0))))
    state = steps.jit_init_train_state(cfg, tx)(jax.random.key(0))
    step = jax.jit(functools.partial(steps.train_step, graphdef, optim), donate_argnums=0)
    corpus = data.load_corpus(config.data.corpus)
    options = data.batch_options(config.data, causal=cfg.causal, vocab_size=cfg.vocab_size)
    batches = [
        data.train_batch(corpus, seed=0, step=s, batch_size=B, seq_len=T, **options)
        for s in range(steps_count + 1)
    ]
    params = sum(x.size for x in jax.tree.leaves(state["params"]))
    with chosen_implementations() as chosen:  # what "auto" picks while the step is traced
        state, metrics = step(state, batches[0])  # compile and warm up
        jax.block_until_ready(metrics)
    start = time.perf_counter()
    for batch in batches[1:]:
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    seconds = (time.perf_counter() - start) / steps_count
    tokens = B * T / seconds
    flops_per_token = 6 * params + 6 * cfg.num_layers * T * cfg.d_model
    peak = device_peak(device)
    return {
        "batch": B,
        "seq_len": T,
        "params": int(params),
        "step_ms": seconds * 1e3,
        "tokens_per_s": tokens,
        "mfu": None if peak is None else tokens * flops_per_token / peak,
        "loss": float(metrics["loss"]),
        "attention_impl": sorted(chosen),
    }


def markdown(results) -> str:
    lines = [
        f"Device: {results['device']} ({results['backend']}); command: `{results['command']}`",
    ]
    if results["attention"]:
        lines += [
            "",
            "| T | family | variant | implementation | fwd ms | fwd TFLOP/s | fwd+bwd ms "
            "| fwd+bwd TFLOP/s | compiled GiB | peak GiB | max err out | max err dq |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]

    def num(x, fmt):
        return "" if x is None else format(x, fmt)

    for row in results["attention"]:
        r = row["result"]
        head = f"| {row['T']} | {row['family']} | {row['variant']} | {row['implementation']} |"
        if "skipped" in r:
            lines.append(f"{head} skipped: {r['skipped']} ||||||||||")
            continue
        gib = lambda b: None if b is None else b / 2**30  # noqa: E731
        lines.append(
            f"{head} {r['forward_ms']:.4g} | {r['forward_tflops']:.3g} | "
            f"{r['forward_backward_ms']:.4g} | {r['forward_backward_tflops']:.3g} | "
            f"{num(gib(r['compiled_bytes']), '.3f')} | {num(gib(r['device_peak_bytes']), '.3f')} | "
            f"{num(r.get('max_error_out'), '.2e')} | {num(r.get('max_error_dq'), '.2e')} |"
        )
    if results["training"]:
        lines += [
            "",
            "| family | batch x T | step ms | tokens/s | MFU | attention |",
            "|---|---|---|---|---|---|",
        ]
        for row in results["training"]:
            r = row["result"]
            if "skipped" in r:
                lines.append(f"| {row['family']} | skipped: {r['skipped']} |||||")
                continue
            mfu = "" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
            lines.append(
                f"| {row['family']} | {r['batch']} x {r['seq_len']} | {r['step_ms']:.1f} | "
                f"{r['tokens_per_s']:.0f} | {mfu} | {', '.join(r.get('attention_impl', []))} |"
            )
    return "\n".join(lines) + "\n"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(
            line.split(":", 1)[1].strip()
            for line in out.splitlines()
            if line.startswith("Model name")
        )
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


# Smoke sizes (CPU, interpret mode): everything runs, in seconds rather than hours.
SMOKE = dict(lengths=(32,), B=1, N=2, H=16)
SMOKE_TRAIN = [
    "model.d_model=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.max_len=32",
    "data.seq_len=32",
    "train.batch_size=2",
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=None)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS[:3]))
    parser.add_argument(
        "--softcap", type=float, default=50.0, help="the cap of variant softcap (Gemma 2's 50)"
    )
    parser.add_argument("--window", type=int, default=1024, help="the window of variant window")
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--train-families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--train-batch", type=int, default=32)
    parser.add_argument("--train-steps", type=int, default=10)
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, pallas in interpret mode (automatic on CPU)",
    )
    parser.add_argument("--out", default=str(ROOT / "runs" / "accelerator"))
    args = parser.parse_args(argv)

    for name in args.families:
        if name != "none":
            families.get(name)  # an unknown family is an error listing the known ones
    for entry in args.train_families:
        position_overrides(entry)  # likewise, before anything is measured
    if args.window < 1:
        parser.error(f"--window {args.window}: a window is at least one key")
    if not (math.isfinite(args.softcap) and args.softcap > 0):
        parser.error(f"--softcap {args.softcap}: a cap is a finite number > 0")
    device = jax.devices()[0]
    backend = jax.default_backend()
    backend = "gpu" if backend in ("cuda", "rocm") else backend
    smoke = args.smoke or backend == "cpu"
    if smoke:
        lengths = tuple(args.lengths or SMOKE["lengths"])
        B, N, H = SMOKE["B"], SMOKE["N"], SMOKE["H"]
        repeats = min(args.repeats, 2)
        train_overrides = SMOKE_TRAIN
        train_steps = min(args.train_steps, 2)
        window = max(1, min(args.window, max(lengths) // 4))  # narrower than T at smoke sizes
    else:
        lengths = tuple(args.lengths or FULL_LENGTHS)
        B, N, H = args.batch, args.heads, args.head_dim
        repeats = args.repeats
        train_overrides = [f"train.batch_size={args.train_batch}"]
        train_steps = args.train_steps
        window = args.window
    results = {
        "device": f"{getattr(device, 'device_kind', device.platform)}"
        + (f" / {cpu_model()}" if backend == "cpu" else ""),
        "backend": backend,
        "jax": jax.__version__,
        "command": " ".join([pathlib.Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "smoke": smoke,
        "shape": {"B": B, "N": N, "K": N, "H": H, "dtype": "bfloat16", "causal": True},
        "window": window,
        "attention": [],
        "training": [],
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def record(part, row):
        results[part].append(row)
        print(json.dumps(row), flush=True)
        (out / "accelerator.json").write_text(json.dumps(results, indent=1) + "\n")
        (out / "accelerator.md").write_text(markdown(results))

    for T in () if args.skip_attention else lengths:
        for family in args.families:
            for variant in args.variants:
                for impl in args.implementations:
                    reason = available(impl, backend)
                    if variant == "softcap" and impl not in attention_lib.SOFTCAP_IMPLEMENTATIONS:
                        reason = f"{impl!r} does not compute soft-capped logits"
                    if variant == "far" and impl not in attention_lib.FAR_IMPLEMENTATIONS:
                        reason = f"{impl!r} does not compute two-score attention"
                    result = (
                        {"skipped": reason}
                        if reason
                        else attention_case(
                            impl,
                            family,
                            B=B,
                            T=T,
                            N=N,
                            H=H,
                            repeats=repeats,
                            with_error=T == min(lengths),
                            device=device,
                            window=window if variant == "window" else None,
                            forget=variant == "forget",
                            softcap=args.softcap if variant == "softcap" else None,
                            far_window=window if variant == "far" else None,
                        )
                    )
                    row = {"T": T, "family": family, "variant": variant, "implementation": impl}
                    record("attention", {**row, "result": result})
    for entry in () if args.skip_training else args.train_families:
        try:
            result = training_case(
                entry, overrides=train_overrides, steps_count=train_steps, device=device
            )
        except Exception as err:
            result = {"skipped": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
        record("training", {"family": entry, "result": result})
    (out / "accelerator.json").write_text(json.dumps(results, indent=1) + "\n")
    table = markdown(results)
    (out / "accelerator.md").write_text(table)
    print(table)
    return results


if __name__ == "__main__":
    main()
