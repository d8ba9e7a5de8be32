"""experiments/figures.py: every file is written, and the numbers it shows are the worked example's.

The worked example is docs/conventions.md's (q = [1, 0.5], k = [0.8, 0.3], 0.5 rad per position):
pairs with the same offset m - n score alike, (0, 0) and (5, 5) give 0.95, (0, 2) and (7, 9) give
0.597434, and +2 differs from -2.
"""

import json
import pathlib

import numpy as np
import pytest
from conftest import experiment_script


@pytest.fixture(scope="module")
def figures():
    return experiment_script("figures")


@pytest.fixture(scope="module")
def written(figures, tmp_path_factory):
    outdir = tmp_path_factory.mktemp("figures")
    return outdir, figures.make_figures(outdir)


def test_every_file_is_written_small_and_inside_outdir(written):
    outdir, paths = written
    expected = {
        "rope_2d_example",
        "rope_2d_example_md",
        "rope_2d_example_json",
        "rope_decay",
        "t5_buckets",
        "t5_vs_alibi",
        "rope_scaling",
        "figure_data",
    }
    assert set(paths) == expected
    for name, path in paths.items():
        path = pathlib.Path(path)
        assert path.parent == outdir and path.is_file() and path.stat().st_size > 0, name
        if path.suffix == ".png":
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
            assert path.stat().st_size < 200_000, f"{name}: {path.stat().st_size} bytes"


def test_worked_example_table_has_its_published_numbers(written):
    _, paths = written
    table = json.loads(pathlib.Path(paths["rope_2d_example_json"]).read_text())
    score = {(r["m"], r["n"]): r["score"] for r in table["rows"]}
    assert score[(0, 0)] == pytest.approx(0.95, abs=1e-6)
    assert score[(5, 5)] == pytest.approx(0.95, abs=1e-6)
    assert score[(0, 2)] == pytest.approx(0.597434, abs=1e-6)
    assert score[(7, 9)] == pytest.approx(0.597434, abs=1e-6)
    assert score[(2, 0)] == pytest.approx(score[(9, 7)], abs=1e-6)
    assert abs(score[(2, 0)] - score[(0, 2)]) > 0.1  # +2 and -2 differ: RoPE is not symmetric
    assert table["max_spread_along_a_diagonal"] < 1e-5
    markdown = pathlib.Path(paths["rope_2d_example_md"]).read_text()
    assert "| 0 | 2 | -2 | 0.597434 |" in markdown and "| 5 | 5 | +0 | 0.950000 |" in markdown


def test_worked_example_grid_matches_the_rotation_in_closed_form(figures):
    # <R(m) q, R(n) k> = Re(q conj(k) e^{i (m - n) theta}) for one complex pair.
    scores = figures.rope_2d_scores(12)
    q, k = complex(*figures.EXAMPLE_Q), complex(*figures.EXAMPLE_K)
    m, n = np.meshgrid(np.arange(12), np.arange(12), indexing="ij")
    expected = np.real(q * np.conj(k) * np.exp(1j * figures.EXAMPLE_THETA * (m - n)))
    np.testing.assert_allclose(scores, expected, atol=2e-6)


def test_figure_data_supports_what_the_captions_say(written):
    _, paths = written
    data = json.loads(pathlib.Path(paths["figure_data"]).read_text())
    ranges = data["t5_buckets"]["ranges"]
    assert ranges[:16] == [[b, b] for b in range(16)]  # exact buckets
    assert ranges[24][0] == 128 and ranges[-1] == [790, None]  # last bucket starts before 1024
    methods = data["rope_scaling"]["methods"]
    assert methods["PI (linear)"]["pairs_outside"] == [] and methods["YaRN"]["pairs_outside"] == []
    assert (
        len(methods["plain RoPE"]["pairs_outside"]) > len(methods["NTK-aware"]["pairs_outside"]) > 0
    )
    assert methods["NTK-aware"]["max_overshoot"] < methods["plain RoPE"]["max_overshoot"]
    means = data["decay"]["mean_bound"]
    assert means["10000.0"][0] == 32.5  # (F + 1) / 2 at offset 0, head dim 128
    assert means["500000.0"][10] > means["10000.0"][10] > means["500.0"][10]  # offsets [512, 1024)
