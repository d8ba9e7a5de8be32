"""Attention benchmark: blockwise vs `jax.nn.dot_product_attention` (materialised bias) vs
reference.

Question: is `implementation="blockwise"` faster and linear in memory where it matters, and how
close does it get to the machine's matmul throughput?

Run (from the repository root):
    python benchmarks/attention.py --rss --repeats 5                 # docs/attention.md, run 1
    python benchmarks/attention.py --lengths 4096 --repeats 7 --rss  # docs/attention.md, runs 2, 3
    python benchmarks/attention.py --lengths 1024                    # one length, quick
    python benchmarks/attention.py --crossover      # the rule before "chunked" (docs/attention.md)
    python benchmarks/attention.py --lengths 4096 --repeats 5 --tiles 256x256 512x512  # tile sweep
    python benchmarks/attention.py --window 512 --lengths 8192   # sliding window vs full causal
    python benchmarks/attention.py --window 128 --lengths 1024 --smoke  # a run check only
    python benchmarks/attention.py --far 512 --lengths 4096     # two-score attention vs one
    python benchmarks/attention.py --stick_breaking 256 --lengths 1024  # vs softmax attention
    python benchmarks/attention.py --cope 256 --lengths 1024            # the same for CoPE
    python benchmarks/attention.py --path --lengths 256 --repeats 5     # PaTH vs softmax

Stick-breaking section (--stick_breaking C): at T = the first --lengths value, causal, no bias,
`stick_breaking_attention` with queries in blocks of C (`jax.lax.map` over the blocks) and in
one block, against softmax attention (`attention(..., causal=True)`, "auto": the native
kernel on CPU), forward and forward + backward, same process, and the ratios; then the blocked
forward's compiled memory at T/2 .. 4T (its weights are materialised a block at a time,
[B, N, C, T]: linear in T for a fixed C). The CoPE section (--cope C) is the same for
`cope_attention` with a table of T + 1 positions (the reference's default at a block of T): the
memory table's programs hold the table of the first length.

PaTH section (--path): `path_attention` (by chunks of 64 positions, or of each --path-chunks
size: a triangular system per chunk, then one scan over the distance between chunks,
docs/attention.md "PaTH"; unit w, beta in (0, 2)) against softmax attention at T = the first
--lengths value, forward and forward + backward, same process, and the ratios; then the compiled
temporary memory of both PaTH programs (the first chunk size) at T/2, T and 2T (the scores are
materialised: quadratic in T). --shape B,N,H sets the inputs' batch, heads and head dim.

Far section (--far W): blockwise forward and forward + backward at T = the first --lengths
value, no bias, causal, with two-score attention (`far=Far(q_far, k_far, W)`, the far pair
q and k with their head dims reversed) vs without, in the same process, and the ratios; each
tile computes both content products, so about 2x the products is the expected cost. Then the
two-score program's compiled memory at T/4, T/2, T and 2T: linear in T like the plain one.

Window section (--window W): blockwise forward + backward at T = the first --lengths value, ALiBi,
causal, with a sliding window of W vs without (full causal), in the same process, and the ratio;
the windowed tiles outside the band are skipped, so the ideal ratio is the ratio of the tiles
visited (printed). Then the windowed program's compiled memory (`memory_analysis()`) at T/4,
T/2, T and 2T (compiled, not run): it should grow linearly in T.

Setup: batch 1, 8 heads, head dim 64, float32, causal self-attention (T = S), ALiBi and T5
biases from `posattn.positions` evaluated from positions. Implementations, all in one process:
  blockwise  `posattn.attention.blockwise.blockwise_attention`, bias as (BiasFn, params),
             default tiles;
  jax.nn     `jax.nn.dot_product_attention(q, k, v, bias=materialised [1, N, T, S],
             is_causal=True)`, the bias materialised inside the same jit;
  reference  `attention(..., implementation="reference")`.
Time: best of up to --repeats runs after one warm-up run, wall clock, `block_until_ready`.
FLOPs: forward 4 * N * T * S * H, halved for causal (only the visible half is counted);
forward + backward counted as 3.5x forward (FlashAttention-2's convention: 2 + 5 matmuls).
Matmul reference: a 4096^3 float32 `jnp.dot` timed in the same process before every blockwise
repeat; "% matmul" is given against the best matmul of that same window (both saw the same
contention on a shared machine) and against the best matmul of the whole run (a ceiling).
Memory: `compiled.memory_analysis()`, arguments + outputs + XLA temporaries - aliased bytes: the
buffers XLA assigns for the program, known before it runs. A configuration whose assignment
exceeds --mem-budget-gib (or 80% of the available memory) is skipped and reported as such.
With --rss, each forward also runs in a fresh subprocess and its peak RSS (VmHWM) is
reported: everything the process held, the JAX runtime, compiler and inputs included; the peak of
the same subprocess that compiles but does not run is printed once as the floor.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from _machine import cpu_name  # benchmarks/_machine.py, beside this script

from posattn import positions
from posattn.attention import Far, attention
from posattn.attention.blockwise import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, blockwise_attention

B, N, H = 1, 8, 64
GIB = 2**30


# ----------------------------------------------------------------------------------------------
# Biases, as BiasFns of positions (the families' own functions).


def alibi_fn(slopes, q_pos, k_pos):
    return positions.alibi_bias(q_pos[:, None] - k_pos[None, :], slopes)  # (N, t, s)


def t5_fn(table, q_pos, k_pos):
    bucket = positions.t5_bucket(q_pos[:, None] - k_pos[None, :], bidirectional=False)
    return table[:, bucket]  # (N, t, s)


def make_bias(name):
    match name:
        case "alibi":
            return alibi_fn, positions.alibi_slopes(N), None  # default scale 1/sqrt(H)
        case "t5":
            return t5_fn, jax.random.normal(jax.random.key(1), (N, 32)) * 0.1, 1.0  # T5: scale 1
        case "none":
            return None, None, None
    raise ValueError(f"unknown bias {name!r}; allowed: alibi, t5, none")


# ----------------------------------------------------------------------------------------------
# The programs being compared.


def make_fn(impl, bias_name, grad, tiles=(DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K), window=None, far=None):
    fn, params, scale = make_bias(bias_name)

    def forward(q, k, v, params):
        bias = None if fn is None else (fn, params)
        match impl:
            case "blockwise":
                two = None if far is None else Far(q[..., ::-1], k[..., ::-1], far)
                return blockwise_attention(
                    q,
                    k,
                    v,
                    bias=bias,
                    causal=True,
                    scale=scale,
                    window=window,
                    far=two,
                    block_q=tiles[0],
                    block_k=tiles[1],
                )
            case "xla":  # posattn's own "xla" path (explicit mask, fully-masked rows zeroed)
                return attention(q, k, v, bias=bias, causal=True, scale=scale, implementation="xla")
            case "jax.nn":
                T, S = q.shape[1], k.shape[1]
                full = None
                if fn is not None:
                    full = fn(params, jnp.arange(T), jnp.arange(S))[None]  # (1, N, T, S)
                return jax.nn.dot_product_attention(q, k, v, bias=full, is_causal=True, scale=scale)
            case "reference":
                return attention(
                    q, k, v, bias=bias, causal=True, scale=scale, implementation="reference"
                )
        raise ValueError(impl)

    if not grad:
        return jax.jit(forward), params
    argnums = (0, 1, 2) if params is None else (0, 1, 2, 3)
    return jax.jit(jax.grad(lambda *a: forward(*a).sum(), argnums=argnums)), params


def inputs(T):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    return tuple(jax.random.normal(key, (B, T, N, H), jnp.float32) for key in (kq, kk, kv))


def attention_flops(T, grad):
    fwd = 4 * B * N * T * T * H / 2  # causal: the visible half only
    return fwd * (3.5 if grad else 1.0)


def xla_bytes(compiled):
    m = compiled.memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def available_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def best_time(run, repeats, max_seconds=60.0, warmup=True, before_each=None):
    """Best wall-clock seconds of `repeats` calls of run() (stopping early past max_seconds);
    `before_each()`, if given, runs untimed before every call."""
    if warmup:  # first-run allocations and page faults
        jax.block_until_ready(run())
    best, spent = float("inf"), 0.0
    for _ in range(repeats):
        if before_each is not None:
            before_each()
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
        if spent > max_seconds:
            break
    return best


class MatmulCeiling:
    """Best FLOP/s of a float32 n^3 `jnp.dot`, sampled between the attention timings."""

    def __init__(self, n=4096):
        a = jax.random.normal(jax.random.key(2), (n, n), jnp.float32)
        b = jax.random.normal(jax.random.key(3), (n, n), jnp.float32)
        mm = jax.jit(jnp.dot)
        self.run = lambda: mm(a, b)
        self.flops = 2 * n**3
        self.best = 0.0
        jax.block_until_ready(self.run())  # compile and warm up

    def sample(self, repeats=1):
        """Times `repeats` matmuls; returns their best FLOP/s and updates the run's best."""
        rate = self.flops / best_time(self.run, repeats, warmup=False)
        self.best = max(self.best, rate)
        return rate


def paired_best_time(run, ceiling, repeats, max_seconds=60.0):
    """best_time, with one matmul timed before every repeat: (best time, best matmul FLOP/s of
    the same window), so both see the same contention on a shared machine."""
    rates = []
    best = best_time(run, repeats, max_seconds, before_each=lambda: rates.append(ceiling.sample()))
    return best, max(rates)


# ----------------------------------------------------------------------------------------------
# Peak RSS of one forward in a fresh process (--rss).


def child_rss(impl, bias_name, T, run_it):
    """Runs in a subprocess: builds inputs, compiles, optionally runs once; prints ru_maxrss."""
    f, params = make_fn(impl, bias_name, grad=False)
    q, k, v = inputs(T)
    compiled = f.lower(q, k, v, params).compile()
    if run_it:
        jax.block_until_ready(compiled(q, k, v, params))
    # VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across fork + exec, so a child
    # would report at least the parent's RSS; VmHWM belongs to this process's own address space.
    with open("/proc/self/status") as f:
        hwm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(hwm_kib * 1024)


def rss_peak(impl, bias_name, T, run_it=True):
    """Peak RSS of a fresh process that builds the inputs, compiles and (if run_it) runs once."""
    out = subprocess.run(
        [sys.executable, __file__, "--_child", f"{impl},{bias_name},{T},{int(run_it)}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------


def fmt_gib(x):
    return "-" if x is None else (f"{x / GIB:.3f}" if x < GIB else f"{x / GIB:.2f}")


def run_table(args):
    impls = ["blockwise", "jax.nn", "reference"]
    budget = min(args.mem_budget_gib * GIB, 0.8 * available_bytes())
    print(
        f"memory budget for one program: {budget / GIB:.1f} GiB "
        f"(--mem-budget-gib {args.mem_budget_gib}, 80% of MemAvailable)\n"
    )
    if args.rss:
        floor = rss_peak("blockwise", args.biases[0], args.lengths[0], run_it=False)
        print(
            f"RSS floor (a subprocess that compiles the T={args.lengths[0]} blockwise forward "
            f"but does not run it): {fmt_gib(floor)} GiB"
        )
    ceiling = MatmulCeiling()
    print(f"matmul 4096^3 float32: {ceiling.sample(3) / 1e9:.1f} GFLOP/s (first samples)")
    rows = []
    for T in args.lengths:
        q, k, v = inputs(T)
        for bias_name in args.biases:
            for grad in (False, True):
                if grad and T > args.max_grad_len:
                    continue
                for impl in impls:
                    f, params = make_fn(impl, bias_name, grad)
                    compiled = f.lower(q, k, v, params).compile()
                    need = xla_bytes(compiled)
                    row = dict(
                        T=T,
                        bias=bias_name,
                        grad=grad,
                        impl=impl,
                        mem=need,
                        time=None,
                        rss=None,
                        mm=None,
                    )
                    run = functools.partial(compiled, q, k, v, params)  # bound now, run below
                    if need > budget:
                        row["skip"] = f"needs {need / GIB:.1f} GiB > budget"
                    elif impl == "blockwise":
                        row["time"], row["mm"] = paired_best_time(run, ceiling, args.repeats)
                    else:
                        row["time"] = best_time(run, args.repeats)
                    if args.rss and not grad and row["time"] is not None:
                        row["rss"] = rss_peak(impl, bias_name, T)
                    rows.append(row)
                    print(_row_text(row), flush=True)
                    del compiled, run  # free the executable before the next compile
    ceiling.sample(3)
    mm = ceiling.best
    print(f"matmul 4096^3 float32: best {mm / 1e9:.1f} GFLOP/s over the run")
    print_summary(rows, mm, args)


def _row_text(r):
    mode = "fwd+bwd" if r["grad"] else "fwd"
    head = f"T={r['T']:>6} {r['bias']:>5} {mode:>7} {r['impl']:>9}:"
    if r["time"] is None:
        return f"{head} skipped ({r['skip']})"
    gf = attention_flops(r["T"], r["grad"]) / r["time"] / 1e9
    rss = "" if r["rss"] is None else f", peak RSS {fmt_gib(r['rss'])} GiB"
    if r["mm"]:
        rss += (
            f", {100 * gf * 1e9 / r['mm']:.0f}% of the same window's matmul "
            f"({r['mm'] / 1e9:.0f} GFLOP/s)"
        )
    return (
        f"{head} {r['time'] * 1e3:10.1f} ms  {gf:6.1f} GFLOP/s  "
        f"XLA buffers {fmt_gib(r['mem'])} GiB{rss}"
    )


def print_summary(rows, mm, args):
    print(
        f"\n## Summary (matmul ceiling {mm / 1e9:.1f} GFLOP/s; tiles "
        f"{DEFAULT_BLOCK_Q}x{DEFAULT_BLOCK_K}; causal; load average {os.getloadavg()[0]:.1f})"
    )
    print(
        "\n| T | bias | pass | blockwise ms | % matmul (window / run best) | jax.nn ms "
        "| speed-up vs jax.nn | reference ms | speed-up vs ref | blockwise GiB | jax.nn GiB "
        "| reference GiB |" + (" blockwise peak RSS GiB |" if args.rss else "")
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.rss else ""))
    index = {(r["T"], r["bias"], r["grad"], r["impl"]): r for r in rows}
    for (T, bias_name, grad, impl), bw in index.items():
        if impl != "blockwise":
            continue
        nn, ref = (
            index.get((T, bias_name, grad, "jax.nn")),
            index.get((T, bias_name, grad, "reference")),
        )

        def ms(r):
            return "skipped" if r is None or r["time"] is None else f"{r['time'] * 1e3:.0f}"

        def speedup(r, bw=bw):
            if r is None or r["time"] is None or bw["time"] is None:
                return "-"
            return f"{r['time'] / bw['time']:.1f}x"

        pct = "-"
        if bw["time"] is not None:
            rate = attention_flops(T, grad) / bw["time"]
            pct = f"{100 * rate / bw['mm']:.0f}% / {100 * rate / mm:.0f}%"

        def mem(r):
            return "-" if r is None else fmt_gib(r["mem"]) + ("" if r["time"] else " (skip)")

        line = (
            f"| {T} | {bias_name} | {'fwd+bwd' if grad else 'fwd'} | {ms(bw)} | {pct} | "
            f"{ms(nn)} | {speedup(nn)} | {ms(ref)} | {speedup(ref)} | {mem(bw)} | "
            f"{mem(nn)} | {mem(ref)} |"
        )
        if args.rss:
            line += f" {fmt_gib(bw['rss'])} |"
        print(line)
    # Linear memory: blockwise bytes per token across lengths.
    for bias_name in args.biases:
        for grad in (False, True):
            pts = [
                (r["T"], r["mem"])
                for r in rows
                if r["impl"] == "blockwise" and r["bias"] == bias_name and r["grad"] == grad
            ]
            if len(pts) > 1:
                per_token = ", ".join(f"T={t}: {m / t / 1024:.1f} KiB/token" for t, m in pts)
                print(f"blockwise {bias_name} {'fwd+bwd' if grad else 'fwd'} memory: {per_token}")


def run_crossover(args):
    """blockwise vs posattn's "xla" path at small T: where "auto" switches."""
    print("| T | bias | pass | xla ms | blockwise ms | xla / blockwise |")
    print("|---|---|---|---|---|---|")
    for T in (128, 256, 512, 1024, 2048):
        q, k, v = inputs(T)
        for bias_name in ("none", "alibi", "t5"):
            for grad in (False, True):
                times = {}
                for impl in ("xla", "blockwise"):
                    f, params = make_fn(impl, bias_name, grad)
                    compiled = f.lower(q, k, v, params).compile()
                    run = functools.partial(compiled, q, k, v, params)
                    times[impl] = best_time(run, args.repeats)
                print(
                    f"| {T} | {bias_name} | {'fwd+bwd' if grad else 'fwd'} | "
                    f"{times['xla'] * 1e3:.2f} | {times['blockwise'] * 1e3:.2f} | "
                    f"{times['xla'] / times['blockwise']:.2f} |",
                    flush=True,
                )


def run_tiles(args):
    """Blockwise tile sizes at the first --lengths value, ALiBi: where the defaults come from."""
    T = args.lengths[0]
    q, k, v = inputs(T)
    print(f"| tiles (q x k) | T={T} fwd ms | fwd+bwd ms |\n|---|---|---|")
    for tile in args.tiles:
        tiles = tuple(int(x) for x in tile.split("x"))
        times = []
        for grad in (False, True):
            f, params = make_fn("blockwise", "alibi", grad, tiles)
            compiled = f.lower(q, k, v, params).compile()
            times.append(best_time(functools.partial(compiled, q, k, v, params), args.repeats))
        print(f"| {tile} | {times[0] * 1e3:.0f} | {times[1] * 1e3:.0f} |", flush=True)


def run_window(args):
    """Windowed vs full causal blockwise, forward + backward, same process; memory vs T."""
    T, w = args.lengths[0], args.window
    q, k, v = inputs(T)
    times = {}
    for name, window in (("full causal", None), (f"window {w}", w)):
        f, params = make_fn("blockwise", "alibi", True, window=window)
        compiled = f.lower(q, k, v, params).compile()
        times[name] = best_time(functools.partial(compiled, q, k, v, params), args.repeats)
    full, windowed = times["full causal"], times[f"window {w}"]
    print(f"| blockwise fwd+bwd, T={T}, ALiBi | ms |\n|---|---|")
    for name, t in times.items():
        print(f"| {name} | {t * 1e3:.0f} |")
    # Tiles visited: query tile i sees key tiles [max(0, i*tq - w + 1) // tk, (i+1)*tq / tk).
    tq = tk = min(DEFAULT_BLOCK_Q, T)
    spans = [((i + 1) * tq + tk - 1) // tk - max(0, i * tq - w + 1) // tk for i in range(T // tq)]
    causal_tiles = sum(((i + 1) * tq + tk - 1) // tk for i in range(T // tq))
    print(
        f"\nwindow / full causal = {windowed / full:.3f} (goal <= 0.25; tiles visited "
        f"{sum(spans)} / {causal_tiles} = {sum(spans) / causal_tiles:.3f})\n"
    )
    memory_table("windowed", T, lambda: make_fn("blockwise", "alibi", True, window=w))


def memory_table(name, T, make):
    """The compiled memory of the forward + backward program `make()` at T/4, T/2, T and 2T."""
    print(f"| T | {name} fwd+bwd compiled bytes (args + out + temp) | temp | temp / T |")
    print("|---|---|---|---|")
    for t in (T // 4, T // 2, T, 2 * T):
        spec = jax.ShapeDtypeStruct((B, t, N, H), jnp.float32)
        f, params = make()
        compiled = f.lower(spec, spec, spec, params).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        print(f"| {t} | {xla_bytes(compiled)} | {temp} | {temp / t:.0f} |", flush=True)


def run_far(args):
    """Two-score vs plain blockwise attention, forward and forward + backward, same process;
    the two-score program's memory vs T."""
    T, w = args.lengths[0], args.far
    q, k, v = inputs(T)
    print(f"| blockwise, T={T}, causal, no bias | fwd ms | fwd+bwd ms |\n|---|---|---|")
    times = {}
    for name, far in (("one pair", None), (f"two pairs, far from {w}", w)):
        row = []
        for grad in (False, True):
            f, params = make_fn("blockwise", "none", grad, far=far)
            compiled = f.lower(q, k, v, params).compile()
            row.append(best_time(functools.partial(compiled, q, k, v, params), args.repeats))
        times[name] = row
        print(f"| {name} | {row[0] * 1e3:.0f} | {row[1] * 1e3:.0f} |", flush=True)
    one, two = times.values()
    print(f"\ntwo / one: forward {two[0] / one[0]:.2f}, forward + backward {two[1] / one[1]:.2f}\n")
    memory_table("two-score", T, lambda: make_fn("blockwise", "none", True, far=w))


def fwd_bwd_table(T, rows, program, arrays, repeats, *, digits):
    """Prints each row's forward and forward + backward time (best of `repeats`) and its forward's
    compile time, as a markdown table; returns {label: [fwd s, compile s, fwd + bwd s]}.
    `program(fn, grad)` is the jitted function of `arrays`."""
    print(f"| causal, T={T}, no bias | fwd ms | fwd+bwd ms | compile s (fwd) |\n|---|---|---|---|")
    times = {}
    for label, fn in rows.items():
        row = []
        for grad in (False, True):
            start = time.perf_counter()
            compiled = program(fn, grad).lower(*arrays).compile()
            compile_s = time.perf_counter() - start
            row.append(best_time(functools.partial(compiled, *arrays), repeats))
            if not grad:
                row.append(compile_s)
        times[label] = row
        fwd, both = f"{row[0] * 1e3:.{digits}f}", f"{row[2] * 1e3:.{digits}f}"
        print(f"| {label} | {fwd} | {both} | {row[1]:.2f} |", flush=True)
    return times


def run_rowwise(args):
    """Stick-breaking attention or CoPE (queries in blocks of C, and unblocked) against softmax
    attention ("auto"), forward and forward + backward, same process; the blocked program's
    memory vs T."""
    from posattn.attention import attention, cope_attention, stick_breaking_attention

    T = args.lengths[0]
    q, k, v = inputs(T)
    d_out = jax.random.normal(jax.random.key(3), q.shape)
    if args.stick_breaking:
        c, name = args.stick_breaking, "stick-breaking"

        def rowwise(q, k, v, chunk=None):
            return stick_breaking_attention(q, k, v, query_chunk=chunk)

    else:
        c, name = args.cope, f"CoPE (P = {T + 1})"
        table = 0.1 * jax.random.normal(jax.random.key(4), (H, T + 1))  # the reference's T + 1

        def rowwise(q, k, v, chunk=None):
            return cope_attention(q, k, v, table, query_chunk=chunk)

    def program(fn, grad):
        if not grad:
            return jax.jit(fn)
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * d_out), (0, 1, 2)))

    rows = {
        "softmax (auto)": lambda q, k, v: attention(q, k, v, causal=True),
        f"{name}, blocks of {c}": functools.partial(rowwise, chunk=c),
        f"{name}, one block": rowwise,
    }
    times = fwd_bwd_table(T, rows, program, (q, k, v), args.repeats, digits=0)
    base, blocked, whole = times.values()
    print(
        f"\nblocks / softmax: forward {blocked[0] / base[0]:.1f}, forward + backward "
        f"{blocked[2] / base[2]:.1f}; one block / blocks: forward {whole[0] / blocked[0]:.2f}, "
        f"forward + backward {whole[2] / blocked[2]:.2f}\n"
    )
    print(f"| T | blocks of {c}: fwd compiled bytes (args + out + temp) | temp | temp / T |")
    print("|---|---|---|---|")
    for t in (T // 2, T, 2 * T, 4 * T):
        spec = jax.ShapeDtypeStruct((B, t, N, H), jnp.float32)
        compiled = program(rows[f"{name}, blocks of {c}"], False).lower(spec, spec, spec)
        compiled = compiled.compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        print(f"| {t} | {xla_bytes(compiled)} | {temp} | {temp / t:.0f} |", flush=True)


def run_path(args):
    """PaTH attention against softmax attention ("auto"): forward and forward + backward, same
    process; the compiled memory of both PaTH programs vs T."""
    from posattn.attention import attention, path_attention

    def reflections(t):
        kw, kb = jax.random.split(jax.random.key(5))
        w = jax.random.normal(kw, (B, t, N, H))
        w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
        return w, 2 * jax.nn.sigmoid(jax.random.normal(kb, (B, t, N)))

    T = args.lengths[0]
    q, k, v = inputs(T)
    w, beta = reflections(T)
    d_out = jax.random.normal(jax.random.key(3), q.shape)

    def program(fn, grad, weigh=True):
        if not grad:
            return jax.jit(fn)
        return jax.jit(
            jax.grad(lambda *a: jnp.sum(fn(*a) * (d_out if weigh else 1.0)), (0, 1, 2, 3, 4))
        )

    rows = {"softmax (auto)": lambda q, k, v, w, beta: attention(q, k, v, causal=True)}
    for c in args.path_chunks:
        rows[f"PaTH, chunks of {c}"] = functools.partial(path_attention, chunk=c)
    times = fwd_bwd_table(T, rows, program, (q, k, v, w, beta), args.repeats, digits=1)
    base, *paths = times.values()
    print()
    for c, path in zip(args.path_chunks, paths, strict=True):
        print(
            f"PaTH, chunks of {c} / softmax: forward {path[0] / base[0]:.1f}, forward + "
            f"backward {path[2] / base[2]:.1f}"
        )
    print()
    first = functools.partial(path_attention, chunk=args.path_chunks[0])
    print(
        f"| T | PaTH (chunks of {args.path_chunks[0]}) fwd temp bytes | fwd + bwd temp bytes | "
        "fwd + bwd temp / T^2 |"
    )
    print("|---|---|---|---|")
    for t in (T // 2, T, 2 * T):
        spec = jax.ShapeDtypeStruct((B, t, N, H), jnp.float32)
        beta_spec = jax.ShapeDtypeStruct((B, t, N), jnp.float32)
        temps = []
        for grad in (False, True):
            compiled = program(first, grad, weigh=False)
            compiled = compiled.lower(spec, spec, spec, spec, beta_spec)
            temps.append(compiled.compile().memory_analysis().temp_size_in_bytes)
        print(f"| {t} | {temps[0]} | {temps[1]} | {temps[1] / t**2:.0f} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--biases", nargs="+", default=["alibi", "t5"])
    parser.add_argument(
        "--max-grad-len",
        type=int,
        default=16384,
        help="forward+backward only up to this length (32k is forward only)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mem-budget-gib", type=float, default=16.0)
    parser.add_argument("--rss", action="store_true", help="also peak RSS of a subprocess")
    parser.add_argument("--crossover", action="store_true")
    parser.add_argument("--tiles", nargs="+", help="sweep blockwise tile sizes, e.g. 512x256")
    parser.add_argument("--window", type=int, help="sliding-window section with this window")
    parser.add_argument("--far", type=int, help="two-score attention section, far from this")
    parser.add_argument(
        "--stick_breaking", type=int, help="stick-breaking section, queries in blocks of this"
    )
    parser.add_argument("--cope", type=int, help="CoPE section, queries in blocks of this")
    parser.add_argument("--path", action="store_true", help="PaTH section")
    parser.add_argument(
        "--path-chunks", type=int, nargs="+", default=[64], help="PaTH rows: chunk sizes"
    )
    parser.add_argument(
        "--shape", help="batch,heads,head_dim of the inputs (default 1,8,64), e.g. 32,4,16"
    )
    parser.add_argument("--smoke", action="store_true", help="one repeat (a quick check)")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        impl, bias_name, T, run_it = args._child.split(",")
        return child_rss(impl, bias_name, int(T), run_it == "1")
    cpu = cpu_name()
    print(
        f"# posattn attention benchmark\n{cpu}, {os.cpu_count()} cores; jax {jax.__version__}, "
        f"{jax.devices()[0].platform}; load average {os.getloadavg()[0]:.1f}\n"
    )
    if args.smoke:
        args.repeats = 1
    if args.shape:
        global B, N, H
        B, N, H = (int(x) for x in args.shape.split(","))
        print(f"inputs: batch {B}, {N} heads of {H}\n")
    if args.window:
        return run_window(args)
    if args.far:
        return run_far(args)
    if args.stick_breaking or args.cope:
        return run_rowwise(args)
    if args.path:
        return run_path(args)
    if args.crossover:
        return run_crossover(args)
    if args.tiles:
        return run_tiles(args)
    run_table(args)


if __name__ == "__main__":
    main()
