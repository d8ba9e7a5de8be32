"""Pallas attention's tile sizes, warps and pipelining stages on a GPU, side by side.

Question: on this GPU, which (block_q, block_k, num_warps, num_stages) makes the fused kernel
(`posattn.attention.pallas.pallas_attention`: the forward and its dK/dV and dQ kernels, all with
the same settings) fastest, forward and forward + backward, against the defaults? The first H200
lease measured the defaults (64 x 64 tiles, 8 warps for heads of 128, 2 stages) at 3.9x cuDNN's
forward + backward time with no bias (benchmarks/records/accelerator_h200_2026-12-04/).

Run (from the repository root):
    python benchmarks/pallas_tiles.py                         # T 8k, no bias and ALiBi, the grid
    python benchmarks/pallas_tiles.py --families alibi --tiles 64x64 128x64 --warps 4 8

Per family and setting: the best of --repeats wall-clock times of the jitted forward and of the
jitted forward + backward (value_and_grad over q, k, v and the bias parameters, a weighted sum of
the output as loss), B 4, 16 heads of 128, bfloat16, causal, as benchmarks/accelerator.py times
them (TFLOP/s from T^2 / 2 visible pairs; forward + backward 3.5x the forward's FLOPs); and the
largest difference of the output from the default setting's (the same math in another order:
bfloat16-sized at most). A setting Triton refuses (too much shared memory, say) is recorded as
skipped with the reason. The defaults run first, so every ratio has its baseline from the same
process. Writes --out/pallas_tiles.json after every case and prints a table per family, fastest
forward + backward first.

On CPU the kernel runs in interpret mode, which has no warps or stages: the smoke size (T 64,
1 x 2 heads of 16, tiles 16 x 16 and 32 x 32) checks the script end to end.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import accelerator  # noqa: E402  (benchmarks/accelerator.py: family_bias, best_time)

from posattn.attention import pallas  # noqa: E402


def tile_pair(text: str) -> tuple[int, int]:
    try:
        q, k = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a tile is QxK, e.g. 64x128") from None
    for n in (q, k):
        if n < 16 or n & (n - 1):
            raise argparse.ArgumentTypeError(f"{text!r}: tiles are powers of two >= 16")
    return q, k


def settings_grid(tiles, warps, stages, gpu: bool) -> list[dict]:
    """Every setting to time, the defaults (all None) first."""
    grid = [{"block_q": None, "block_k": None, "num_warps": None, "num_stages": None}]
    for bq, bk in tiles:
        for w in warps if gpu else [None]:
            for st in stages if gpu else [None]:
                grid.append({"block_q": bq, "block_k": bk, "num_warps": w, "num_stages": st})
    return grid


def case(family, setting, *, B, T, N, H, repeats, reference):
    """One setting's times (and its output, to compare with the defaults')."""
    bias, scale = accelerator.family_bias(family, N, H)
    fn, params = bias if bias is not None else (None, {})
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, d_out = (jax.random.normal(key, (B, T, N, H), jnp.bfloat16) for key in keys)
    given = {name: value for name, value in setting.items() if value is not None}

    def run(q, k, v, params):
        b = None if fn is None else (fn, params)
        return pallas.pallas_attention(q, k, v, bias=b, causal=True, scale=scale, **given)

    def loss(q, k, v, params):
        return jnp.sum(run(q, k, v, params).astype(jnp.float32) * d_out.astype(jnp.float32))

    try:
        forward = jax.jit(run).lower(q, k, v, params).compile()
        grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
        grads = grads.lower(q, k, v, params).compile()
        out = jax.block_until_ready(forward(q, k, v, params))
        fwd_s = accelerator.best_time(forward, q, k, v, params, repeats=repeats)
        jax.block_until_ready(grads(q, k, v, params))
        bwd_s = accelerator.best_time(grads, q, k, v, params, repeats=repeats)
    except Exception as err:  # a setting Triton refuses is a result, not a crash
        return {"skipped": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}, None
    flops = 2.0 * B * N * T * T * H  # causal: half of 4 B N T S H
    result = {
        "forward_ms": fwd_s * 1e3,
        "forward_backward_ms": bwd_s * 1e3,
        "forward_tflops": flops / fwd_s / 1e12,
        "forward_backward_tflops": 3.5 * flops / bwd_s / 1e12,
    }
    if reference is not None:
        diff = jnp.abs(out.astype(jnp.float32) - reference.astype(jnp.float32))
        result["max_diff_from_default"] = float(jnp.max(diff))
    return result, out


def name(setting) -> str:
    if setting["block_q"] is None:
        return "default"
    text = f"{setting['block_q']}x{setting['block_k']}"
    if setting["num_warps"] is not None:
        text += f" w{setting['num_warps']} s{setting['num_stages']}"
    return text


def table(results) -> str:
    lines = [f"Device: {results['device']}; command: `{results['command']}`"]
    for family in results["families"]:
        rows = [r for r in results["cases"] if r["family"] == family]
        base = next((r["result"] for r in rows if r["setting"] == "default"), {})
        done = [r for r in rows if "skipped" not in r["result"]]
        done.sort(key=lambda r: r["result"]["forward_backward_ms"])
        lines += [
            "",
            f"{family}, T {results['T']}:",
            "",
            "| setting | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | default / this "
            "(fwd+bwd) | max diff from default |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in done:
            x = r["result"]
            ratio = base.get("forward_backward_ms", float("nan")) / x["forward_backward_ms"]
            diff = x.get("max_diff_from_default")
            lines.append(
                f"| {r['setting']} | {x['forward_ms']:.4g} | {x['forward_tflops']:.3g} | "
                f"{x['forward_backward_ms']:.4g} | {x['forward_backward_tflops']:.3g} | "
                f"{ratio:.2f} | {'' if diff is None else format(diff, '.2e')} |"
            )
        lines += [f"| {r['setting']} | skipped: {r['result']['skipped']} ||||||" for r in rows
                  if "skipped" in r["result"]]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--families", nargs="+", default=["none", "alibi"])
    parser.add_argument(
        "--tiles", nargs="+", type=tile_pair, default=[(64, 64), (128, 64), (64, 128), (128, 128)]
    )
    parser.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "runs" / "pallas_tiles"))
    args = parser.parse_args(argv)
    for family in args.families:
        accelerator.family_bias(family, 2, 16)  # an unknown family fails before any compile
    for w in args.warps:
        if w not in (1, 2, 4, 8, 16):
            parser.error(f"--warps {w}: Triton takes 1, 2, 4, 8 or 16")
    if any(s < 1 for s in args.stages):
        parser.error("--stages: at least 1")

    gpu = pallas.default_backend() == "gpu"
    if gpu:
        B, T, N, H, repeats = args.batch, args.length, args.heads, args.head_dim, args.repeats
        tiles = args.tiles
    else:  # interpret mode: no warps or stages; tiny sizes
        B, T, N, H, repeats = 1, 64, 2, 16, 1
        tiles = [(16, 16), (32, 32)]
    device = jax.devices()[0]
    results = {
        "device": getattr(device, "device_kind", device.platform),
        "jax": jax.__version__,
        "command": " ".join([pathlib.Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "T": T,
        "shape": {"B": B, "N": N, "H": H, "dtype": "bfloat16", "causal": True},
        "families": list(args.families),
        "cases": [],
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for family in args.families:
        reference = None
        for setting in settings_grid(tiles, args.warps, args.stages, gpu):
            start = time.perf_counter()
            result, output = case(
                family, setting, B=B, T=T, N=N, H=H, repeats=repeats, reference=reference
            )
            if reference is None:
                if output is None:  # the defaults failed: nothing to compare with
                    raise SystemExit(f"{family}: the default setting failed: {result['skipped']}")
                reference = output
            result["seconds"] = time.perf_counter() - start
            row = {"family": family, "setting": name(setting), **setting, "result": result}
            results["cases"].append(row)
            print(json.dumps(row), flush=True)
            (out / "pallas_tiles.json").write_text(json.dumps(results, indent=1) + "\n")
    text = table(results)
    (out / "pallas_tiles.md").write_text(text)
    print(text)
    return results


if __name__ == "__main__":
    main()
