"""benchmarks/accelerator.py in its smoke mode (automatic on CPU): every part runs, end to end,
in a fresh interpreter, and writes its JSON and markdown table."""

import json

from conftest import ROOT, run_python

VARIANTS = ("causal", "window", "forget")


def test_accelerator_benchmark_smoke(tmp_path):
    script = ROOT / "benchmarks" / "accelerator.py"
    run_python(
        f"""
        import runpy, sys
        sys.argv = [{str(script)!r}, "--families", "alibi", "--implementations", "cudnn",
                    "blockwise", "pallas", "--train-families", "alibi", "fox",
                    "rope:window=8/rope", "--repeats", "1",
                    "--train-steps", "1", "--out", {str(tmp_path)!r}]
        runpy.run_path(sys.argv[0], run_name="__main__")
        """,
        timeout=600,
    )
    results = json.loads((tmp_path / "accelerator.json").read_text())
    assert results["smoke"] and results["backend"] == "cpu"
    rows = {(row["variant"], row["implementation"]): row["result"] for row in results["attention"]}
    assert set(rows) == {(v, i) for v in VARIANTS for i in ("cudnn", "blockwise", "pallas")}
    assert results["window"] == 8  # narrower than T = 32 at smoke sizes
    for variant in VARIANTS:
        assert rows[variant, "cudnn"] == {"skipped": "cuDNN attention needs a GPU"}
        for impl in ("blockwise", "pallas"):
            r = rows[variant, impl]
            assert r["forward_ms"] > 0 and r["forward_backward_tflops"] > 0, (variant, impl, r)
            # bfloat16 inputs against the float32 reference (with the same window or gates):
            # bfloat16-sized errors, not wrong answers.
            assert r["max_error_out"] < 3e-2, (variant, impl, r)
            assert r["max_error_dq"] < 3e-2 * r["reference_scale_dq"], (variant, impl, r)
    train = {row["family"]: row["result"] for row in results["training"]}
    assert train["alibi"]["tokens_per_s"] > 0 and train["fox"]["tokens_per_s"] > 0, train
    # A layer-pattern entry reaches the model: two layers, a windowed one and a global one.
    assert train["rope:window=8/rope"]["tokens_per_s"] > 0, train
    # What "auto" picked for each training's attention: on this CPU, the native kernel where it
    # built, else the chunked implementation (docs/attention.md); never empty.
    for name, r in train.items():
        assert r["attention_impl"] and set(r["attention_impl"]) <= {"native", "chunked"}, name
    table = (tmp_path / "accelerator.md").read_text()
    assert "| 32 | alibi | window | pallas |" in table and "| alibi | 2 x 32 |" in table
    assert any(
        line.startswith("| fox | 2 x 32 |") and ("native" in line or "chunked" in line)
        for line in table.splitlines()
    )


def test_a_bad_pattern_entry_fails_before_anything_is_measured(tmp_path):
    """An unknown family inside a --train-families pattern is an error before any compile."""
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "accelerator.py"),
            "--train-families",
            "rope:window=8/ropee",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "unknown family 'ropee'" in proc.stderr, proc.stderr
    assert not (tmp_path / "accelerator.json").exists()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "accelerator.py"), "--train-families", "alibi",
         "fx", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "'fx'" in proc.stderr, proc.stderr
    assert not (tmp_path / "accelerator.json").exists()


def test_the_lease_script_refuses_an_unknown_part_before_doing_anything(tmp_path):
    """benchmarks/accelerator_check.sh names its parts when given another, and creates nothing."""
    import subprocess

    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "accelerator_check.sh"), "tests", "trainig"],
        capture_output=True, text=True, timeout=60, env={"OUT": str(out), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 2, proc
    parts = "tests attention masks long training tiles experiment"
    assert f"unknown part 'trainig'; parts: {parts}" in proc.stderr
    assert not out.exists()


def test_pallas_tiles_smoke(tmp_path):
    """benchmarks/pallas_tiles.py on CPU (interpret mode: tiles only, no warps or stages): the
    defaults first, every setting timed and compared with the defaults' output."""
    run_python(
        f"""
        import runpy, sys
        sys.argv = [{str(ROOT / "benchmarks" / "pallas_tiles.py")!r}, "--families", "none",
                    "alibi", "--out", {str(tmp_path)!r}]
        runpy.run_path(sys.argv[0], run_name="__main__")
        """,
        timeout=600,
    )
    results = json.loads((tmp_path / "pallas_tiles.json").read_text())
    for family in ("none", "alibi"):
        rows = [r for r in results["cases"] if r["family"] == family]
        assert [r["setting"] for r in rows] == ["default", "16x16", "32x32"], rows
        for r in rows:
            assert r["result"]["forward_backward_ms"] > 0 and r["num_warps"] is None, r
        # Another tiling is the same math in another order: bfloat16-sized differences.
        assert all(r["result"]["max_diff_from_default"] < 3e-2 for r in rows[1:]), rows
    assert "| default |" in (tmp_path / "pallas_tiles.md").read_text()


def test_pallas_tiles_refuses_a_bad_tile_before_compiling(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pallas_tiles.py"), "--tiles", "64x48",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "tiles are powers of two >= 16" in proc.stderr, proc.stderr
    assert not (tmp_path / "pallas_tiles.json").exists()
