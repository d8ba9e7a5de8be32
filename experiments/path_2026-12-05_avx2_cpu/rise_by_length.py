"""PaTH's rise past L, trained at L = 64 and at L = 128, at the same eval lengths.

    python experiments/path_2026-12-05_avx2_cpu/rise_by_length.py

Reads the `loss_seeds` of this record's results.json files (L = 64: three seeds, the convolution's
row from `no_conv/`; L = 128: seeds 0-1 and 2-3, four models) and prints, per row and training
length, each eval length's mean change from that model's loss at L, with its standard error over
the seeds. Each seed is one trained model, whichever CPU rounded it. Then, for PaTH, each run's
`attention_stats` (its first seed's model): the mean distance from query to key that each layer's
heads attend over, averaged over the heads, at each eval length.
"""

import json
import pathlib
import statistics
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from length_extrapolation.results import mean_over_seeds, se_over_seeds  # noqa: E402

RUNS = {
    64: {"path": ["results.json"], "path:path_conv=False": ["no_conv/results.json"]},
    128: {
        row: ["L128/results.json", "L128/seeds_2-3_xeon/results.json"]
        for row in ("path", "path:path_conv=False")
    },
}
LENGTHS = (64, 128, 256, 512, 1024, 2048)


def main() -> None:
    print("| row | L | seeds | " + " | ".join(f"{e}" for e in LENGTHS) + " |")
    print("|---|---|---|" + "---|" * len(LENGTHS))
    for row in ("path", "path:path_conv=False"):
        for L, files in RUNS.items():
            losses: dict[int, list[float]] = {}  # eval length -> one loss per seed
            for name in files[row]:
                family = json.loads((HERE / name).read_text())["families"][row]
                for length, seeds in zip(family["eval_len"], family["loss_seeds"], strict=True):
                    losses.setdefault(length, []).extend(seeds)
            cells = []
            for length in LENGTHS:
                if length not in losses or length == L:
                    cells.append("L" if length == L else "")
                    continue
                rise = [x - x_at_l for x, x_at_l in zip(losses[length], losses[L], strict=True)]
                mean, error = mean_over_seeds(rise), se_over_seeds(rise)
                cells.append(f"{mean:+.3f} ({error:.3f}), {length // L}L")
            print(f"| {row} | {L} | {len(losses[L])} | " + " | ".join(cells) + " |")
    print("\n| PaTH run | L | layer | " + " | ".join(f"{e}" for e in LENGTHS) + " |")
    print("|---|---|---|" + "---|" * len(LENGTHS))
    for L, files in RUNS.items():
        for name in files["path"]:
            results = json.loads((HERE / name).read_text())
            lengths = results["families"]["path"]["eval_len"]
            stats = dict(zip(lengths, results["attention_stats"]["rows"]["path"], strict=True))
            for layer in range(len(stats[L]["distance"])):
                cells = [
                    f"{statistics.mean(stats[e]['distance'][layer]):.0f}" if e in stats else ""
                    for e in LENGTHS
                ]
                print(f"| {name} | {L} | {layer + 1} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
