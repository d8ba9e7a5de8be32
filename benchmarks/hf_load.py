"""Hugging Face checkpoint loading: peak memory and time of `posattn.hf.from_pretrained`.

Question: does loading stream (peak resident memory close to the file's size, not twice it),
and how long does it take next to reading the same file with safetensors alone?

Run (from the repository root):
    PYTHONPATH=src python benchmarks/hf_load.py             # --size small (40 MB): a smoke run
    PYTHONPATH=src python benchmarks/hf_load.py --size 1b   # 886M params, 1.7 GiB (quiet machine)

Writes a synthetic Llama-shaped bfloat16 checkpoint (config.json + model.safetensors, random
values) under --dir, then in two fresh processes: (1) safetensors alone reads every tensor into
numpy (`safe_open(...).get_tensor`), the baseline; (2) `posattn.hf.from_pretrained(dir,
dtype="bfloat16")` builds the model (bfloat16 parameters, so the model's bytes equal the file's).
Each reports its wall time and its peak resident set (`ru_maxrss`) minus its resident set before
the read (after the imports and JAX's start-up). Prints both, the peak over the file's bytes (goal
<= 1.3) and the time ratio (2) / (1). Timing is only meaningful on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

SIZES = {
    # name: (d_model, layers, heads, kv heads, d_ff, vocab)
    "small": (512, 4, 8, 4, 1408, 8192),
    "1b": (2048, 16, 16, 8, 5632, 32000),
}


def write_checkpoint(path: pathlib.Path, size: str) -> int:
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    d, layers, heads, kv, ff, vocab = SIZES[size]
    h = d // heads
    cfg = dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=ff,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        dtype="bfloat16",
    )
    rng = np.random.default_rng(0)

    def t(*shape):
        return (0.02 * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16)

    path.mkdir(parents=True, exist_ok=True)
    tensors = {"model.embed_tokens.weight": t(vocab, d), "lm_head.weight": t(vocab, d)}
    tensors["model.norm.weight"] = t(d)
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": t(d),
                p + "post_attention_layernorm.weight": t(d),
                p + "self_attn.q_proj.weight": t(heads * h, d),
                p + "self_attn.k_proj.weight": t(kv * h, d),
                p + "self_attn.v_proj.weight": t(kv * h, d),
                p + "self_attn.o_proj.weight": t(d, heads * h),
                p + "mlp.gate_proj.weight": t(ff, d),
                p + "mlp.up_proj.weight": t(ff, d),
                p + "mlp.down_proj.weight": t(d, ff),
            }
        )
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg))
    return sum(x.size for x in tensors.values())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(mode: str, path: str) -> None:
    """Runs in a fresh process: prints {"seconds", "peak_bytes"} of one read."""
    import jax
    import jax.numpy as jnp

    jnp.zeros(1).block_until_ready()  # JAX started before the baseline
    if mode == "posattn":
        import posattn.hf as hf
    else:
        from safetensors import safe_open
    before = _rss_bytes()
    start = time.perf_counter()
    if mode == "posattn":
        model = hf.from_pretrained(path, dtype="bfloat16")
        jax.block_until_ready(jax.tree.leaves(jax.tree.map(lambda x: x, model)))
    else:
        with safe_open(pathlib.Path(path) / "model.safetensors", framework="numpy") as f:
            arrays = {k: f.get_tensor(k) for k in f.keys()}
        del arrays
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    print(json.dumps({"seconds": seconds, "peak_bytes": peak}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument(
        "--dir", default=None, help="where to write the checkpoint (default: a temp dir)"
    )
    ap.add_argument("--measure", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        measure(*args.measure)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(args.dir or tmp) / f"llama_{args.size}"
        params = write_checkpoint(path, args.size)
        file_bytes = (path / "model.safetensors").stat().st_size
        out = {}
        for mode in ("safetensors", "posattn"):
            run = subprocess.run(
                [sys.executable, __file__, "--measure", mode, str(path)],
                capture_output=True,
                text=True,
                check=True,
            )
            out[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"size {args.size}: {params / 1e6:.1f}M parameters, file {file_bytes / 2**20:.1f} MiB")
    for mode, r in out.items():
        mib = r["peak_bytes"] / 2**20
        print(
            f"  {mode:12s} {r['seconds']:7.2f} s   peak RSS over the start {mib:8.1f} MiB"
            f" = {r['peak_bytes'] / file_bytes:.2f}x the file"
        )
    ratio = out["posattn"]["seconds"] / out["safetensors"]["seconds"]
    print(f"  posattn / safetensors time: {ratio:.2f}x (meaningful only on a quiet machine)")
    print(f"  peak over file bytes: {out['posattn']['peak_bytes'] / file_bytes:.2f} (goal <= 1.3)")


if __name__ == "__main__":
    main()
