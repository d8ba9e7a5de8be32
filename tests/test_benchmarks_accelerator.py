"""benchmarks/accelerator.py in its smoke mode (automatic on CPU): every part runs, end to end,
in a fresh interpreter, and writes its JSON and markdown table."""

import json

from conftest import ROOT, run_python


def test_accelerator_benchmark_smoke(tmp_path):
    script = ROOT / "benchmarks" / "accelerator.py"
    run_python(
        f"""
        import runpy, sys
        sys.argv = [{str(script)!r}, "--families", "alibi", "--implementations", "cudnn",
                    "blockwise", "pallas", "--train-families", "alibi", "--repeats", "1",
                    "--train-steps", "1", "--out", {str(tmp_path)!r}]
        runpy.run_path(sys.argv[0], run_name="__main__")
        """,
        timeout=600,
    )
    results = json.loads((tmp_path / "accelerator.json").read_text())
    assert results["smoke"] and results["backend"] == "cpu"
    rows = {row["implementation"]: row["result"] for row in results["attention"]}
    assert rows["cudnn"] == {"skipped": "cuDNN attention needs a GPU"}
    for impl in ("blockwise", "pallas"):
        r = rows[impl]
        assert r["forward_ms"] > 0 and r["forward_backward_tflops"] > 0, r
        # bfloat16 inputs against the float32 reference: bfloat16-sized errors, not wrong answers.
        assert r["max_error_out"] < 3e-2 and r["max_error_dq"] < 3e-2 * r["reference_scale_dq"], r
    (train,) = results["training"]
    assert train["family"] == "alibi" and train["result"]["tokens_per_s"] > 0, train
    table = (tmp_path / "accelerator.md").read_text()
    assert "| 32 | alibi | pallas |" in table and "| alibi | 2 x 32 |" in table
