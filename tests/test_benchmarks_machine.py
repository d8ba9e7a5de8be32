"""benchmarks/_machine.py's cache-line round trip; how benchmarks/train_throughput.py names the
rounds it timed slowly and hands its products to the x-transformers baseline; step_ab.py's
arguments."""

import os
import shutil
import sys
import types

import pytest
from conftest import ROOT, script_module

sys.path.insert(0, str(ROOT / "benchmarks"))
import _machine  # noqa: E402


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2 or not any(shutil.which(c) for c in ("cc", "gcc", "clang")),
    reason="needs two CPUs and a C compiler",
)
def test_round_trip_between_two_cpus():
    probe = _machine.CoreRoundTrip()
    assert probe.why_unavailable is None, probe.why_unavailable
    ns = probe(round_trips=2000)
    # Two cache-line transfers: tens to hundreds of nanoseconds on any machine, never zero.
    assert 1.0 < ns < 100_000.0, ns
    # Both threads on one CPU cannot pass the line back and forth at speed: the timing gives up
    # after a second, with the reason, rather than taking minutes.
    same = _machine.CoreRoundTrip()
    same.cpus = [probe.cpus[0]] * 2
    assert same(round_trips=20000) is None
    assert same.why_unavailable == f"threads on CPUs {same.cpus} do not run at once"
    # A CPU outside the process's set cannot be pinned: None and the reason, not a hang.
    outside = max(os.sched_getaffinity(0)) + 1
    if outside < 1024:
        probe.cpus = [probe.cpus[0], outside]
        assert probe(round_trips=2000) is None
        assert probe.why_unavailable == f"threads on CPUs {probe.cpus} cannot be pinned"


def test_round_trip_without_a_compiler_says_so(monkeypatch):
    monkeypatch.setenv("CC", "")
    monkeypatch.setattr(_machine.shutil, "which", lambda name: None)
    probe = _machine.CoreRoundTrip()
    assert probe() is None
    if len(os.sched_getaffinity(0)) >= 2:
        assert probe.why_unavailable == "no C compiler (set CC, or install gcc)"


def test_slow_rounds_are_named_with_their_round_trips():
    tt = script_module(ROOT / "benchmarks" / "train_throughput.py")
    case = types.SimpleNamespace(
        name="tiny",
        family="alibi",
        cfg=types.SimpleNamespace(dtype="float32"),
        rounds=[
            {"step_ms": 14.5, "user_ms": 26.0, "round_trip_ns": [150.0, 52.0]},
            {"step_ms": 22.0, "user_ms": 38.0, "round_trip_ns": [390.0, 380.0]},
            {"step_ms": 15.0, "user_ms": 27.0, "round_trip_ns": [160.0, 55.0]},
        ],
    )
    baselines = {
        ("tiny", "alibi"): [
            {"ms_per_step": 24.0, "round_trip_ns": [155.0, 54.0]},
            {"ms_per_step": 25.0, "round_trip_ns": [380.0, 53.0]},
            {"ms_per_step": 36.0, "round_trip_ns": [385.0, 340.0]},
        ]
    }
    lines = tt.slow_rounds([case], baselines, None)
    assert lines[0].endswith("before and after each round: 52 ns at best, median 158, worst 390")
    assert lines[1].startswith("# rounds over 1.25x the fastest of their series:")
    assert lines[2] == (
        "#   tiny alibi float32 posattn round 2: 22.0 ms (38.0, 390 / 380 ns); fastest round "
        "14.5 ms (26.0, 150 / 52 ns)"
    )
    assert lines[3] == (
        "#   tiny alibi x-transformers round 3: 36.0 ms (385 / 340 ns); fastest round 24.0 ms "
        "(155 / 54 ns)"
    )
    assert len(lines) == 4  # 25.0 is within 1.25x of 24.0; 15.0 within 1.25x of 14.5

    # Without the probe: the reason, and slow rounds still named by their times alone.
    case.rounds = [dict(r, round_trip_ns=[None, None]) for r in case.rounds]
    lines = tt.slow_rounds([case], {}, "no C compiler (set CC, or install gcc)")
    assert lines == [
        "# a cache line's round trip between the two CPUs, before and after each round: not "
        "timed (no C compiler (set CC, or install gcc))",
        "# rounds over 1.25x the fastest of their series: ms a step (our user CPU time a step, "
        "round trips before / after):",
        "#   tiny alibi float32 posattn round 2: 22.0 ms (38.0); fastest round 14.5 ms (26.0)",
    ]
    case.rounds = case.rounds[::2]
    assert tt.slow_rounds([case], {}, "why")[1] == (
        "# no round over 1.25x the fastest of its series"
    )


def test_the_baseline_times_the_steps_own_products():
    tt = script_module(ROOT / "benchmarks" / "train_throughput.py")
    spec = tt.products_arg(64, [(8, 16), (16, 8)])
    assert spec == "64:8x16,16x8"
    pytest.importorskip("torch")
    pytest.importorskip("x_transformers")
    baseline = script_module(ROOT / "benchmarks" / "xtransformers_baseline.py")
    assert baseline.products_ms(spec) > 0


def test_step_ab_needs_a_commit_or_xla_flags(capsys):
    ab = script_module(ROOT / "benchmarks" / "step_ab.py")
    with pytest.raises(SystemExit):
        ab.main([])
    assert "--against REV (or --xla-flags FLAGS" in capsys.readouterr().err


def test_native_kernel_against_runs_each_kernel_under_its_own_name(tmp_path):
    """native_kernel.py --against REV: each side's programs call their own FFI targets (the check
    in `_compare` raises otherwise), and the same library under two names gives the same bits; a
    commit without the kernel is a clear error."""
    import ctypes

    from posattn.attention import native

    if not native.available():
        pytest.skip(f"the native library did not build here: {native.why_unavailable()}")
    nk = script_module(ROOT / "benchmarks" / "native_kernel.py")
    library = ctypes.CDLL(str(native._build(native._compiler())))
    for name, symbol in (
        (native._FORWARD, library.PosattnAttentionForward),
        (native._BACKWARD, library.PosattnAttentionBackward),
    ):
        nk.jax.ffi.register_ffi_target(f"{name}@copy", nk.jax.ffi.pycapsule(symbol), platform="cpu")
    results = nk._compare("tiny", "yes", "copy", repeats=2)
    assert set(results) == {"forward", "forward + backward"}
    for (best0, median0, sha0), (best1, median1, sha1) in results.values():
        assert sha0 == sha1 and 0 < best0 <= median0 and 0 < best1 <= median1
    assert (native._FORWARD, native._BACKWARD) == (
        "posattn_attention_forward", "posattn_attention_backward"
    )  # fmt: skip
    with pytest.raises(SystemExit, match="pass --against a commit that has it"):
        nk.build_revision("no-such-commit", tmp_path)
