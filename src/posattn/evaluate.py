"""Any evaluator on any trained workdir, at any lengths, beside the workdir's own results.

    python -m posattn.eval --workdir W [--lengths 64,100,2048] [--evaluators loss,passkey] \
        [--max_tokens N] [--batch_size B] [--seed S] [--window W] [--rope_remap DICT]

W is a `posattn.train` workdir (an experiment's `WORKDIR/<entry>/` is one): its `config.json`
and latest checkpoint are read, the checkpoint restored read-only (nothing is created, cleaned up
or moved under `checkpoints/`). The evaluators are those of `posattn.eval.registry` (default:
every one enabled by its defaults), with their default settings; the text is the one loss
protocol's (`posattn.eval.heldout.eval_text`: `max_tokens` target tokens a length, default 32 x
the longest length, sliding blocks of stride min(L, shortest length) for 512 L tokens, seed
1234 as the experiment's). The output goes to `W/eval/<settings hash>.json` (the settings,
the checkpoint's step, each evaluator's values per length and the loss summarised with 95%
intervals), never over an existing file of other settings; a table of the loss is printed.
`--window W` reads the trained model with every layer's attention limited to a sliding window of
W keys (`posattn.eval.lengths.windowed`: a layer's own smaller window is kept), the experiment's
window rows for any workdir and any W. `--rope_remap "{'type': 'rerope', 'window': 32}"` (or a
SelfExtend dict, `rotary.validate_rope_remap`) reads a RoPE model under that eval-time remap at
every length (unlike the experiment's remap rows, which read the trained model itself up to L
and choose SelfExtend's group per length; docs/rope.md, "Position remaps").

An entry point (like `posattn.generate`): it imports `posattn.train`, which restores the
checkpoint; the evaluators in `posattn.eval` never do (`python -m posattn.eval` runs this module's
`main` through `posattn/eval/__main__.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys

from posattn import cli, rotary
from posattn import config as config_lib
from posattn import data as data_lib
from posattn.eval import heldout, intervals, registry, summary
from posattn.eval import lengths as lengths_lib
from posattn.nn.model import TransformerLM

COMMAND = cli.Command(
    "python -m posattn.eval",
    "Runs evaluators (posattn.eval.registry) on the latest checkpoint of a trained workdir; "
    "writes WORKDIR/eval/<settings hash>.json.",
    flags=(
        cli.Flag(
            "workdir", "a trained posattn.train workdir (config.json, checkpoints/)", metavar="DIR"
        ),
        cli.Flag("lengths", "eval lengths, comma-separated (default: 1, 2, 4, 8, 16 x L)", ""),
        cli.Flag("evaluators", "comma-separated names (default: every enabled one)", ""),
        cli.Flag("max_tokens", "target tokens a length (default 32 x the longest)", 0, int),
        cli.Flag("batch_size", "windows of the longest length per forward pass", 8, int),
        cli.Flag("seed", "draws the evaluation text and every probe sample", 1234, int),
        cli.Flag("bootstrap", "replicates of the bootstrap over held-out files", 1000, int),
        cli.Flag(
            "window",
            "read every layer under a sliding window of this many keys (0: as trained)",
            0,
            int,
        ),
        cli.ROPE_REMAP,
    ),
    takes_config=False,
)


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise config_lib.ConfigError(f"--lengths={text!r} must be integers, e.g. 64,128") from None


def evaluate_workdir(
    workdir: pathlib.Path,
    *,
    lengths: list[int] | None = None,
    evaluators: list[str] | None = None,
    max_tokens: int = 0,
    batch_size: int = 8,
    seed: int = 1234,
    bootstrap: int = 1000,
    window: int = 0,
    rope_remap: dict | None = None,
) -> tuple[pathlib.Path, dict]:
    """Evaluates the latest checkpoint of `workdir`; returns (the file written, its content)."""

    from flax import nnx

    from posattn.train import restore_trained  # the entry point restores; evaluators never do
    from posattn.train import workdir as workdir_lib

    workdir = pathlib.Path(workdir)
    config = workdir_lib.read_config(workdir)  # with its plugins' families registered
    L = int(config.data.seq_len)
    lengths = sorted(set(lengths or [m * L for m in (1, 2, 4, 8, 16)]))
    if lengths[0] < 2:
        raise config_lib.ConfigError(f"--lengths={lengths} must be >= 2")
    names = evaluators or [
        n for n in registry.names() if registry.settings_of(registry.get(n), None) is not None
    ]
    chosen = []
    for name in names:
        try:
            chosen.append(registry.get(name))
        except KeyError as e:
            raise config_lib.ConfigError(f"--evaluators: {e.args[0]}") from None
    corpus = data_lib.load_corpus(config.data.corpus)
    stride = min(L, lengths[0])
    settings = {
        "lengths": lengths,
        "max_tokens": int(max_tokens or 32 * lengths[-1]),
        "sliding_tokens": 512 * L,
        "stride": stride,
        "seed": int(seed),
        "bootstrap": int(bootstrap),
        "evaluators": {e.name: {**e.defaults, "enabled": True} for e in chosen},
    }
    for e in chosen:
        if e.name == "loss" or "sliding_max_tokens" in e.defaults:
            settings["evaluators"][e.name]["sliding_max_tokens"] = 512 * L
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise config_lib.ConfigError(
            f"--window={window!r} must be 0 (the model as trained) or a positive number of keys"
        )
    if window:
        settings["window"] = window  # only when set: earlier files keep their settings hash
    if rope_remap is not None:
        try:
            settings["rope_remap"] = rotary.validate_rope_remap(rope_remap)
        except ValueError as e:
            raise config_lib.ConfigError(f"--rope_remap: {e}") from None
        cli.with_rope_remap(config_lib.validate(config), rope_remap, str(workdir))  # before compute
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    out = workdir / "eval" / f"{key}.json"
    try:
        text = heldout.eval_text(
            corpus,
            lengths=lengths,
            max_tokens=settings["max_tokens"],
            sliding_tokens=settings["sliding_tokens"],
            stride=stride,
            seed=seed,
        )
    except ValueError as e:
        raise config_lib.ConfigError(f"--lengths={lengths}: {e}") from None
    restored = restore_trained(config, workdir / "checkpoints")
    if restored is None:
        raise config_lib.ConfigError(f"{workdir / 'checkpoints'} holds no checkpoint to restore")
    cfg, state, step = restored
    if window:
        cfg = lengths_lib.windowed(cfg, window)  # a static setting: the same params read it
    cfg = cli.with_rope_remap(cfg, settings.get("rope_remap"), str(workdir))  # likewise
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(params=0))))
    model = (graphdef, state["params"], state["constants"])
    shared = {"train_len": L, "lengths": lengths, "batch_tokens": batch_size * lengths[-1]}
    shared["seed"] = int(seed)
    values = {}
    for e in chosen:
        own = {k: v for k, v in settings["evaluators"][e.name].items() if k in e.defaults}
        values[e.name] = [e.run(model, text, n, {**own, **shared}) for n in lengths]
    found = {
        "workdir": str(workdir),
        "step": int(step),
        "settings": settings,
        "plan": text.plan.fingerprint,
        "unit": text.unit,
        "evaluators": values,
    }
    if "loss" in values:
        weights = intervals.bootstrap_weights(text.plan.num_units, replicates=bootstrap, seed=seed)
        scores = [
            None if s is None else {k: v for k, v in s.items() if k != "curve"}
            for s in values["loss"]
        ]
        found["loss"] = summary.summarize_row(
            [None if s is None else [s] for s in scores], weights, block_units=text.plan.block_units
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(found, indent=1) + "\n")
    os.replace(tmp, out)
    return out, found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return cli.report_errors(
        "posattn.eval", argv, lambda: _main(argv), user_errors=(data_lib.DataError,)
    )


def _main(argv: list[str]) -> int:
    args = cli.parse(COMMAND, argv)
    out, found = evaluate_workdir(
        pathlib.Path(args.workdir),
        lengths=_ints(args.lengths) if args.lengths else None,
        evaluators=[x for x in args.evaluators.split(",") if x] or None,
        max_tokens=args.max_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
        bootstrap=args.bootstrap,
        window=args.window,
        rope_remap=cli.rope_remap(args.rope_remap),
    )
    if "loss" in found:
        print("length  loss     95% interval        sliding")
        loss = found["loss"]
        for i, n in enumerate(found["settings"]["lengths"]):
            ci = loss["loss_ci"][i]
            cells = "null" if loss["loss"][i] is None else f"{loss['loss'][i]:.4f}"
            cells += "" if ci is None else f"  [{ci[0]:.4f}, {ci[1]:.4f}]"
            slide = loss["loss_sliding"][i]
            cells += "" if slide is None else f"  {slide:.4f}"
            print(f"{n:>6}  {cells}")
    print(f"posattn.eval: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
