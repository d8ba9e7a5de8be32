"""Sample from a model trained by `posattn.train`.

    python -m posattn.generate --workdir DIR --prompt TEXT [--max_new_tokens N] [--temperature T]
        [--top_k K] [--seed S] [--no_cache] [--dynamic_ntk exact|rerotate|hf]
    python -m posattn.generate --hf PATH --prompt TEXT ...   (a Hugging Face checkpoint)
    ... --rope_remap "{'type': 'self_extend', 'window': 1024, 'group': 8}"   (past its length)

Loads `DIR/config.json` and the newest checkpoint that restores cleanly, encodes the prompt as
UTF-8 bytes (the byte-level corpora's vocabulary), and prints the prompt followed by its
continuation. `--temperature 0` (the default) is greedy; `--no_cache` recomputes the full forward
for every new token instead of using the KV cache (the oracle: greedy text must not change).
How the cache works: docs/decoding.md.
"""

from __future__ import annotations

import logging
import pathlib
import sys
import time

import jax
import numpy as np
from flax import nnx

from posattn import cli
from posattn.nn import decode
from posattn.nn.model import TransformerLM
from posattn.train import restore_trained
from posattn.train import workdir as workdir_lib

__all__ = ["load_hf", "load_model", "main"]

BYTE_VOCAB = 256


class GenerateError(ValueError):
    """A workdir or request that cannot be served; the message says what to change."""


def load_model(workdir: str | pathlib.Path):
    """(cfg, graphdef, params, constants, step) of the newest good checkpoint in `workdir`.

    The checkpoint is restored against abstract targets built from the workdir's own config
    (`steps.init_train_state`), on one device.
    """
    workdir = pathlib.Path(workdir)
    config = workdir_lib.read_config(workdir)  # keys added since the run take their defaults
    restored = restore_trained(config, workdir / "checkpoints")
    if restored is None:
        raise GenerateError(
            f"{workdir / 'checkpoints'} holds no checkpoint that restores; train first with "
            f"python -m posattn.train --config configs/tiny.py --workdir {workdir}"
        )
    cfg, state, step = restored
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(params=0))))
    return cfg, graphdef, state["params"], state["constants"], step


def load_hf(path: str | pathlib.Path):
    """(cfg, graphdef, params, constants, tokenizer) of a Hugging Face checkpoint directory
    (`posattn.hf.from_pretrained`); tokenizer is its tokenizer.json read by `tokenizers`, or None
    for a byte-level model (vocab_size 256) without one."""
    from posattn import hf

    path = pathlib.Path(path)
    model = hf.from_pretrained(path)
    graphdef, params, constants = nnx.split(model, nnx.Param, ...)
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        import tokenizers

        tokenizer = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    elif model.cfg.vocab_size != BYTE_VOCAB:
        raise GenerateError(
            f"{path} has no tokenizer.json, and the model's vocabulary ({model.cfg.vocab_size}) "
            "is not bytes; add the checkpoint's tokenizer.json"
        )
    return model.cfg, graphdef, params, constants, tokenizer


COMMAND = cli.Command(
    "python -m posattn.generate",
    "Samples from a model trained by posattn.train: loads DIR/config.json and the newest "
    "checkpoint that restores, encodes the prompt as UTF-8 bytes and prints it with its "
    "continuation (the KV cache: docs/decoding.md).",
    flags=(
        cli.Flag("workdir", "a workdir trained by python -m posattn.train", "", metavar="DIR"),
        cli.Flag(
            "hf",
            "instead of --workdir: a Hugging Face checkpoint directory (config.json, "
            "*.safetensors; its tokenizer.json encodes the prompt)",
            "",
            metavar="PATH",
        ),
        cli.Flag("prompt", "text to continue (encoded as UTF-8 bytes)", metavar="TEXT"),
        cli.Flag("max_new_tokens", "tokens to generate", 200, int, metavar="N"),
        cli.Flag("temperature", "sampling temperature; 0 is greedy", 0.0, float, metavar="T"),
        cli.Flag("top_k", "sample among the k most likely tokens (0: all)", 0, int, metavar="K"),
        cli.Flag(
            "seed", "PRNG seed for sampling; step t uses fold_in(key, t)", 0, int, metavar="S"
        ),
        cli.Flag("no_cache", "recompute the full forward for every token (oracle)", False, bool),
        cli.Flag(
            "dynamic_ntk",
            "dynamic-NTK RoPE only: 'exact' recomputes the prefix past m_l, 'rerotate' "
            "re-rotates cached keys, 'hf' keeps them as written (stale); docs/decoding.md",
            "exact",
            choices=decode.DYNAMIC_NTK_MODES,
            metavar="MODE",
        ),
        cli.ROPE_REMAP,
    ),
    takes_config=False,
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return cli.report_errors(
        "posattn.generate", argv, lambda: _main(argv), user_errors=(GenerateError, ValueError)
    )


def _main(argv: list[str]) -> int:
    args = cli.parse(COMMAND, argv)
    if bool(args.workdir) == bool(args.hf):
        raise GenerateError("give exactly one of --workdir DIR and --hf PATH")
    remap = cli.rope_remap(args.rope_remap)
    tokenizer = None
    if args.hf:
        cfg, graphdef, params, constants, tokenizer = load_hf(args.hf)
        step = "hf"
    else:
        cfg, graphdef, params, constants, step = load_model(args.workdir)
    if remap is not None:  # a static setting: the same parameters read it
        cfg = cli.with_rope_remap(cfg, remap, args.hf or args.workdir)
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0))))
    if tokenizer is not None:
        prompt = np.asarray(tokenizer.encode(args.prompt).ids, np.int32)
    elif cfg.vocab_size != BYTE_VOCAB:
        raise GenerateError(
            f"the prompt is encoded as UTF-8 bytes, which needs a byte-level model "
            f"(model.vocab_size={BYTE_VOCAB}); this one has vocab_size={cfg.vocab_size}"
        )
    else:
        prompt = np.frombuffer(args.prompt.encode("utf-8"), np.uint8).astype(np.int32)
    start = time.perf_counter()
    tokens = decode.generate(
        graphdef,
        params,
        constants,
        cfg,
        [prompt],
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        key=jax.random.key(args.seed),
        use_cache=not args.no_cache,
        dynamic_ntk=args.dynamic_ntk,
    )
    seconds = time.perf_counter() - start
    if tokenizer is not None:
        print(tokenizer.decode(np.concatenate([prompt, tokens[0]]).tolist()))
        print("posattn.generate: tokens " + " ".join(map(str, tokens[0].tolist())), file=sys.stderr)
    else:
        text = bytes(tokens[0].astype(np.uint8).tolist()).decode("utf-8", errors="replace")
        print(args.prompt + text)
    under = "" if remap is None else f" under the RoPE remap {remap}"
    print(
        f"posattn.generate: {cfg.position} step {step}{under}, {tokens.shape[1]} tokens in "
        f"{seconds:.2f}s (compile included; cache {'off' if args.no_cache else 'on'})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
