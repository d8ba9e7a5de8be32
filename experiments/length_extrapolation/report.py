"""results.md and the plots (`plots.py`), from results.json alone (`write(results, out_dir)`)."""

from __future__ import annotations

import pathlib

import numpy as np

from . import plots
from .results import se_over_seeds

__all__ = ["markdown", "md_name", "write"]


def write(results: dict, out_dir: pathlib.Path) -> None:
    """results.md and the PNGs of `results` in `out_dir`."""
    (out_dir / "results.md").write_text(markdown(results))
    plots.plots(results, out_dir)


def md_name(name: str) -> str:
    """A row's name as a markdown table cell: a layer pattern's '|' ("rope:window=32|nope")
    escaped, so that it does not split the cell."""
    return str(name).replace("|", "\\|")


def _table(title: str, lengths, rows: dict[str, list], fmt: str) -> list[str]:
    lines = [
        f"### {title}",
        "",
        "| row | " + " | ".join(str(x) for x in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for name, values in rows.items():
        lines.append(
            f"| {md_name(name)} | "
            + " | ".join("null" if v is None else format(v, fmt) for v in values)
            + " |"
        )
    return lines + [""]


def _cell(value, ci=None, fmt=".4f", se=None) -> str:
    if value is None:
        return "null"
    text = format(value, fmt) + ("" if se is None else f" ± {se:.4f}")
    return text if ci is None else f"{text} [{ci[0]:{fmt}}, {ci[1]:{fmt}}]"


def _ci_table(title: str, lengths, rows: dict[str, tuple[list, list]], fmt=".4f") -> list[str]:
    """A table of value [± seed standard error] [low, high] per length (rows: name -> (values,
    intervals[, standard errors]))."""
    lines = [
        f"### {title}",
        "",
        "| row | " + " | ".join(str(x) for x in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for name, (values, cis, *ses) in rows.items():
        cis = cis or [None] * len(values)
        ses = (ses[0] if ses else None) or [None] * len(values)
        cells = [_cell(v, c, fmt, e) for v, c, e in zip(values, cis, ses, strict=True)]
        lines.append(f"| {md_name(name)} | " + " | ".join(cells) + " |")
    return lines + [""]


def _seed_note(fams: dict) -> str:
    seeds = {len(s) for f in fams.values() for s in f.get("loss_seeds", []) if s}
    if seeds == {1}:
        return "One training seed per row: no seed interval (the bracket is over text only)."
    return (
        f"{'/'.join(str(x) for x in sorted(seeds))} training seeds per row: each loss is the "
        "mean over seeds ± its standard error over seeds, then the interval over text; paired "
        "differences pair seed k of one row with seed k of the other; `loss_seeds` in "
        "results.json."
    )


def _probe_note(seeds: dict, samples: dict) -> str:
    if seeds:
        n = sorted({len(v) for v in seeds.values()})
        return (
            f"; {'/'.join(map(str, n))} training seeds: mean ± standard error over seeds, each "
            "seed's in `loss_seeds`"
        )
    return "; ± standard error over the samples" if any(samples.values()) else ""


def markdown(results: dict) -> str:
    """results.md: loss with intervals under both protocols, positions >= L, paired differences,
    the probes, training and provenance."""
    fams, lengths = results["families"], next(iter(results["families"].values()))["eval_len"]
    prov, L, ev = results["provenance"], results["train_len"], results["evaluation"]

    def per_length(key):  # the first row that reads each length
        return [
            next((f[key][i] for f in fams.values() if f.get(key) and f[key][i] is not None), None)
            for i in range(len(lengths))
        ]

    scored, sliding = per_length("eval_bytes"), per_length("eval_bytes_sliding")
    out = [
        f"# Length extrapolation: trained at L = {L}, corpus {results['corpus']}",
        "",
        f"Commit {prov['commit']}"
        f"{' (with uncommitted changes)' if prov['uncommitted_changes'] else ''}, "
        f"{prov['date']}, {prov['machine']}, {prov['cpu_count']} CPUs, "
        f"{', '.join(prov['devices'])}; "
        f"total {results['timing']['total_seconds']:.0f} s.",
        "",
        f"Loss: mean next-token cross-entropy, {results['loss_unit']}; `null`: the model cannot "
        f"read that length (learned table). Text: {ev['chunks']} chunks of {lengths[-1]} tokens "
        f"from {ev['units_scored']} of the {ev['units']} held-out units ({ev['unit']}), the same "
        f"tokens at every length; scored tokens per length {scored}. Brackets: 95% intervals, "
        f"bootstrap over units ({ev['bootstrap']['replicates']} replicates). {_seed_note(fams)}",
        "",
        corpus_sentence(results),
        "",
    ]
    if any(n.endswith("+window") for n in fams):
        layers = results["config"].get("window_layers") or []
        named = f"layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))}"
        which = f"{named} (counting from 0)" if layers else "every layer"
        out += [
            f"Rows `<entry>+window`: the entry's trained model read with the attention of {which} "
            f"limited to a sliding window of L = {L} (query i sees key j iff i - j < {L}); at "
            "lengths <= L it is the model itself.",
            "",
        ]
    out += _other_code_lines(results)
    out += _pretrained_lines(results, lengths)
    out += _ci_table(
        "Loss (nats), non-overlapping windows (every position of a window read from scratch)",
        lengths,
        {n: (f["loss"], f.get("loss_ci"), f.get("loss_se")) for n, f in fams.items()},
    )
    out += _ci_table(
        "Change from L (paired: same units, same replicates)",
        lengths,
        {n: (f["delta_L"], f["delta_L_ci"]) for n, f in fams.items() if "delta_L" in f},
        "+.4f",
    )
    out += _ci_table(
        "Change from L, sliding windows (paired on the blocks both lengths scored)",
        lengths,
        {
            n: (f["delta_L_sliding"], f["delta_L_sliding_ci"])
            for n, f in fams.items()
            if "delta_L" in f
        },
        "+.4f",
    )
    out += _ci_table(
        f"Loss over positions >= L = {L} only (non-overlapping windows)",
        lengths,
        {
            n: (f["loss_beyond_L"], f["loss_beyond_L_ci"])
            for n, f in fams.items()
            if "loss_beyond_L" in f
        },
    )
    if any(v is not None for f in fams.values() for v in f.get("loss_sliding", [])):
        out += _ci_table(
            f"Loss, sliding windows (stride {ev['sliding_stride']}: each scored token has "
            f"T - {ev['sliding_stride']} .. T - 1 tokens of context; at most "
            f"{ev['sliding_max_tokens'] or 'all'} tokens read a length, so a long length scores "
            "the "
            f"first of the {ev['sliding_blocks']} blocks from {ev['units_scored_sliding']} units; "
            f"scored tokens per length {sliding}; changes between lengths are paired on the "
            "blocks both scored)",
            lengths,
            {n: (f["loss_sliding"], f["loss_sliding_ci"]) for n, f in fams.items()},
        )
    paired = ev["paired"]
    if paired["reference"]:
        out += _ci_table(
            f"Paired difference from {paired['reference']} (non-overlapping; negative: lower loss)",
            lengths,
            {n: (d["all"]["delta"], d["all"]["ci"]) for n, d in paired["minus_reference"].items()},
            "+.4f",
        )
    if results["passkey"]:
        pk = results["passkey"]

        def mean(grid):
            return [None if any(x is None for x in r) else float(np.mean(r)) for r in grid]

        out += _table(
            f"Passkey exact match ({pk['digits']} digits, distractors {pk['distractors']}, "
            f"mean over depths {pk['depths']}, {pk['samples']} samples a cell)",
            lengths,
            {n: f["passkey_acc"] for n, f in fams.items()},
            ".2f",
        )
        seeds, samples = pk.get("loss_seeds") or {}, pk.get("se") or {}

        def digit_se(n):  # over seeds; one seed: over the samples (depths independent)
            if n in seeds:
                return se_over_seeds([mean(s) for s in seeds[n]])
            return [
                None
                if not r or any(x is None for x in r)
                else float(np.sqrt(np.sum(np.square(r))) / len(r))
                for r in samples.get(n) or []
            ] or None

        out += _ci_table(
            f"Passkey loss per digit (nats, mean over depths; chance ln 10 = "
            f"{pk['chance_loss']:.2f})" + _probe_note(seeds, samples),
            lengths,
            {n: (mean(g), None, digit_se(n)) for n, g in pk["loss"].items()},
            ".3f",
        )
    if results["induction"]:
        ind = results["induction"]
        seeds, samples = ind.get("loss_seeds") or {}, ind.get("se") or {}

        def letter_se(n, at):  # over seeds; one seed: over the samples
            if n in seeds:
                return ind["loss_seed_se"][n][at]
            return (samples.get(n) or [None] * len(lengths))[at]

        for at in sorted({0, len(lengths) - 1}):
            out += _ci_table(
                f"Induction loss per letter (nats; chance ln 26 = {ind['chance_loss']:.2f}) at "
                f"length {lengths[at]}, by gap (bytes between the copies; {ind['span']} letters, "
                f"{ind['samples']} samples a cell)" + _probe_note(seeds, samples),
                ind["gaps"],
                {n: (g[at], None, letter_se(n, at)) for n, g in ind["loss"].items()},
                ".3f",
            )
    if results["copy_acc"]:
        out += _table(
            "Copy accuracy (repeated random-letter segment)", lengths, results["copy_acc"], ".2f"
        )
    out += _attention_table(results, lengths)
    out += _heads_table(results)
    if not results["training"]:  # rows of published checkpoints: nothing trained here
        return "\n".join(out) + "\n"
    out += [
        "### Training",
        "",
        "Train loss: the last step's batch (passkey rows included).",
        "",
        "| family | steps | train loss | seconds |",
        "|---|---:|---:|---:|",
    ]
    out += [
        f"| {md_name(n)} | {t['steps']} | {t['final_train_loss']:.4f} | {t['seconds']} |"
        for n, t in results["training"].items()
        if n != "finetune"
    ]
    tuned = results["training"].get("finetune")
    if tuned:
        out += [
            "",
            "Position-interpolation fine-tunes (rows `<entry>+<kind>+ft`): a trained RoPE model at "
            "multiple x L under the scaling of factor = multiple, which the rows keep at every "
            "length; train loss: the last step's batch (mean over seeds).",
            "",
            "| row | steps | length | train loss | seconds |",
            "|---|---:|---:|---:|---:|",
        ]
        out += [
            f"| {md_name(t.get('row', kind))} | {t['steps']} | {t['multiple'] * L} | "
            f"{t['final_train_loss']:.4f} | {t['seconds']} |"
            for kind, t in tuned.items()
        ]
    return "\n".join(out) + "\n"


def _pretrained_lines(results: dict, lengths) -> list[str]:
    """The checkpoint of `pretrained` rows: where it came from, its training length, tokenizer
    and BOS rule, the evaluators skipped, and the loss in bits per byte."""
    info = results.get("pretrained")
    if not info:
        return []
    fams, text = results["families"], info["text"]
    bos = "no BOS" if info["bos"] is None else f"BOS {info['bos_token']!r} (id {info['bos']})"
    out = [
        f"Checkpoint `{info['path']}` ({info['model_type']}, {info['position']} positions, "
        f"{info['dtype']}), L = {info['train_len']} from {info['train_len_from']}; its tokenizer "
        f"reads the {text['files']} held-out files as {text['tokens']} tokens of "
        f"{text['bytes']} UTF-8 bytes ({text['bytes_per_token']:.2f} bytes a token); windows "
        f"start with {bos}: {info['bos_rule']}.",
        "",
    ]
    for name, why in info["skipped"].items():
        out += [f"- `{name}` skipped: {why}."]
    if info["skipped"]:
        out += [""]
    out += _ci_table(
        "Bits per byte, non-overlapping windows (summed NLL / (ln 2 x UTF-8 bytes of the scored "
        "tokens' text); compares across tokenizers)",
        lengths,
        {n: (f["bits_per_byte"], f["bits_per_byte_ci"]) for n, f in fams.items()},
    )
    out += _ci_table(
        "Bits per byte, sliding windows",
        lengths,
        {n: (f["bits_per_byte_sliding"], f["bits_per_byte_sliding_ci"]) for n, f in fams.items()},
    )
    return out


def _heads_table(results: dict) -> list[str]:
    """Per row at L: the head with the largest induction weight and the one with the largest
    previous-token weight (layer.head, first seed), from `attention_stats.rows[row][0]`."""
    block = results.get("attention_stats") or {}
    found = {
        n: per_length[0]
        for n, per_length in block.get("rows", {}).items()
        if per_length and per_length[0] and "induction" in per_length[0]
    }
    if not found:
        return []

    def top(grid):  # (weight, "layer.head") of the largest entry of [layer][head]
        return max((w, f"{y}.{h}") for y, heads in enumerate(grid) for h, w in enumerate(heads))

    out = [
        "### Heads at L",
        "",
        f"Each head's attention {block['heads']}. Per row, the largest of any head and which "
        "(layer.head), for the first seed.",
        "",
        "| row | induction weight | head | previous-token weight | head |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, at_L in found.items():
        (ind, ind_at), (prev, prev_at) = top(at_L["induction"]), top(at_L["previous_token"])
        out.append(f"| {md_name(name)} | {ind:.2f} | {ind_at} | {prev:.2f} | {prev_at} |")
    return out + [""]


def _attention_table(results: dict, lengths) -> list[str]:
    """Per row and layer, at L and at the longest length: attention entropy, mean attended
    distance (means over heads) and the mass on keys >= L away (mean over heads, and its largest
    head)."""
    block = results.get("attention_stats")
    if not block:
        return []
    first, last = lengths[0], lengths[-1]
    out = [
        f"### Attention per layer at {first} and {last} (the last min(T, L) queries of "
        f"{block['windows']} windows; means over heads, the largest head in brackets)",
        "",
        f"| row | layer | entropy {first} | entropy {last} | distance {first} | "
        f"distance {last} | mass >= L at {last} |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, per_length in block["rows"].items():
        if not per_length or per_length[0] is None or per_length[-1] is None:
            continue
        at_first, at_last = per_length[0], per_length[-1]
        for layer in range(len(at_last["entropy"])):

            def mean(stats, key, layer=layer):
                return float(np.mean(stats[key][layer]))

            mass = at_last["mass_beyond_L"][layer]
            out.append(
                f"| {md_name(name)} | {layer} | {mean(at_first, 'entropy'):.2f} | "
                f"{mean(at_last, 'entropy'):.2f} | {mean(at_first, 'distance'):.1f} | "
                f"{mean(at_last, 'distance'):.1f} | {float(np.mean(mass)):.2f} "
                f"[{float(np.max(mass)):.2f}] |"
            )
    return out + [""]


def corpus_sentence(results: dict) -> str:
    """Which corpus the numbers compare with (its content hash; for `stdlib`, the Python too)."""
    sha = results.get("corpus_sha256") or "unknown"
    python = results.get("python_version") or results["provenance"].get("python")
    where = (
        f", the standard library of Python {python}: another Python version is another corpus"
        if results["corpus"] == "stdlib"
        else ""
    )
    return (
        f"Corpus `{results['corpus']}` (sha256 `{sha[:16]}`{where}). These numbers compare only "
        "with results whose corpus has this hash."
    )


def _other_code_lines(results: dict) -> list[str]:
    """A note naming the rows trained or evaluated by other code than this run's (--reuse)."""
    prov = results["provenance"]
    evaluators = prov.get("evaluator_code_sha256") or {}
    lines = []
    for name, origin in (results.get("row_provenance") or {}).items():
        for stage in ("trained", "evaluated"):
            who = origin.get(stage) or {}
            # A training record carries the training code's hash, an evaluation record its
            # evaluator's (the run's own are in the top-level provenance).
            mine = evaluators.get(who.get("evaluator")) if stage == "evaluated" else None
            if who.get("code_sha256") != (mine or prov.get("code_sha256")):
                commit = str(who.get("commit"))[:12] if who else "unrecorded"
                clean = "" if who.get("clean", True) else " with uncommitted changes"
                lines.append(f"- `{name}` {stage} by commit {commit}{clean} (reused)")
    if not lines:
        return []
    return ["Rows produced by other code than this run's:", "", *lines, ""]
