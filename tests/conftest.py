"""Shared test helpers: small configs, reading metrics, running code under N simulated devices."""

import importlib.metadata
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

# Tests compare against float32 references; keep x64 off (the JAX default) explicitly.
os.environ.setdefault("JAX_ENABLE_X64", "0")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """The suite's code generation (TEST_XLA_FLAGS, below), and one XLA compilation cache for the
    whole run, empty at its start and removed at its end.

    Most of the suite's time is XLA compiling small programs, and many tests compile the same
    one (the same config's train step, a resumed run's step, a rerun's evaluation). With
    JAX's persistent compilation cache in a directory of this run, a program compiled once is
    loaded by every later test, xdist worker and subprocess (they inherit the environment) that
    builds the same one; a cache hit is the executable XLA compiled, so nothing tested changes.
    Programs that compiled in under 0.2 s are not written (JAX's own threshold is 1 s; caching
    every eager op made a test ten times slower, and 0.2 s keeps those out while the many
    0.2-1 s programs, initialisations and evaluation steps, are shared: tests/train and tests/nn
    took 378 s against 415 s with 1 s). A cache directory set by the user
    (JAX_COMPILATION_CACHE_DIR) is left alone; JAX_ENABLE_COMPILATION_CACHE=false turns it off."""
    _use_test_level()
    if hasattr(config, "workerinput") or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return  # an xdist worker inherits the controller's directory
    path = tempfile.mkdtemp(prefix="posattn-tests-xla-cache-")
    config._posattn_xla_cache = path
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    if "jax" in sys.modules:  # imported before this hook (by a plugin): set it there too
        import jax

        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update(
            "jax_persistent_cache_min_compile_time_secs",
            float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
        )


# How XLA:CPU generates code for the programs the suite compiles (XLA's own HLO passes, fusion and
# buffer assignment included, are unchanged). The tests check the math, which no code generation
# changes beyond float rounding inside their tolerances, and the suite is mostly compiling:
# * LLVM at level 0: a small program compiles in about two thirds of the time (tests/nn took 90 s
#   against 135 s at XLA's default, `python -m pytest tests/nn -q`, 2-core AMD EPYC);
# * XLA's older loop emitters for fusions (`xla_cpu_use_fusion_emitters=false`, where this jaxlib
#   has the option): a training step compiles in ~60% of the time; tests/nn with two train-step
#   files took 212 s against 242 s (2-core AVX2 AMD EPYC, jax 0.10.2).
# XLA's defaults are one variable away (POSATTN_TEST_XLA_DEFAULT=1 python -m pytest -q), and are
# kept where XLA_FLAGS names a level already.
TEST_XLA_FLAGS = ["--xla_backend_optimization_level=0"]
# XLA's own defaults (its DebugOptions), for the tests whose claim is about the programs users run
# (bit-for-bit identities that hold in the optimised build): `jax.jit(...,
# compiler_options=XLA_DEFAULT_LEVEL)` compiles with them whatever XLA_FLAGS says;
# XLA_DEFAULT_CODEGEN is the same without the level (for a program compiled at a level of its own).
XLA_DEFAULT_CODEGEN = {}


def _has_fusion_emitter_option() -> bool:
    """Whether this jaxlib's XLA knows `xla_cpu_use_fusion_emitters` (an unknown flag in XLA_FLAGS
    ends the process): the 0.10 releases, where it was measured."""
    try:
        return importlib.metadata.version("jaxlib").startswith("0.10.")
    except importlib.metadata.PackageNotFoundError:
        return False


if _has_fusion_emitter_option():
    TEST_XLA_FLAGS.append("--xla_cpu_use_fusion_emitters=false")
    XLA_DEFAULT_CODEGEN["xla_cpu_use_fusion_emitters"] = True
XLA_DEFAULT_LEVEL = {"xla_backend_optimization_level": 3, **XLA_DEFAULT_CODEGEN}
_ADDED = "POSATTN_TEST_XLA_FLAGS_ADDED"  # the flags of TEST_XLA_FLAGS this suite added to XLA_FLAGS


def _use_test_level():
    """Adds TEST_XLA_FLAGS to this process's XLA_FLAGS (before any backend starts; xdist workers
    and subprocesses inherit them) unless asked not to or a level is named already; a flag the
    user has set is kept."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if os.environ.get("POSATTN_TEST_XLA_DEFAULT", "") not in ("", "0") or _ADDED in os.environ:
        return
    names = {f.split("=")[0] for f in flags}
    if "--xla_backend_optimization_level" not in names:
        added = [f for f in TEST_XLA_FLAGS if f.split("=")[0] not in names]
        os.environ["XLA_FLAGS"] = " ".join([*flags, *added])
        os.environ[_ADDED] = " ".join(added)


def xla_flags(*extra: str, optimised: bool = False) -> str:
    """XLA_FLAGS for a subprocess: this process's, with `extra` in place of its flags of the same
    names; `optimised`: without the suite's code-generation flags (for a subprocess that runs more
    than it compiles: a thousand steps run slower at level 0 and with the older emitters)."""
    names = {f.split("=")[0] for f in extra}
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] not in names]
    if optimised:
        flags = [f for f in flags if f not in os.environ.get(_ADDED, "").split()]
    return " ".join([*flags, *extra])


def pytest_unconfigure(config):
    path = getattr(config, "_posattn_xla_cache", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` run only when the marker expression names them (`-m slow`): every
    file's slow tests, not one file's."""
    if "slow" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _float32_products_off_cpu():
    """The suite's float32 tolerances assume float32 matrix products. A GPU multiplies float32
    matrices in TF32 by default (a 10-bit mantissa: errors near 1e-3 of the scale, seen on an H200
    in every implementation), so off CPU the suite runs at jax_default_matmul_precision="highest"
    (Pallas' Triton dots then multiply in IEEE float32), subprocesses too through the
    environment. On CPU, whose products are float32 already, nothing changes."""
    import jax

    if jax.default_backend() == "cpu":
        yield
        return
    os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(autouse=True)
def _experiment_figures_only_where_read(request, monkeypatch):
    """The length-extrapolation experiment's PNGs (matplotlib, seconds a run) are written only by
    the tests marked `figures`, which read them; every other run writes results.json and
    results.md as usual (tests/experiments and tests/test_cli.py took 224 s against 302 s with
    `-n 0` on a 2-core AVX2 EPYC). Subprocess runs are untouched."""
    module = sys.modules.get("length_extrapolation.plots")
    if module is not None and request.node.get_closest_marker("figures") is None:
        monkeypatch.setattr(module, "plots", lambda results, out_dir: None)


# configs/tiny.py shrunk further (key=value overrides): the small model most tests train.
SMALL_OVERRIDES = (
    "model.d_model=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "data.seq_len=32",
    "train.steps=20",
    "train.batch_size=8",
    "train.warmup_steps=2",
    "train.checkpoint_every=10",
    "train.eval_every=0",
    "train.log_every=5",
)


def script_module(path: pathlib.Path):
    """The script at `path` imported as a module named after its file (scripts are not a
    package)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def experiment_script(name: str):
    """experiments/<name>.py imported as a module."""
    return script_module(ROOT / "experiments" / f"{name}.py")


def small_config(**overrides):
    """configs/tiny.py shrunk further, with `section.key=value` overrides (dots as double
    underscores)."""
    from posattn import config as config_lib

    base = list(SMALL_OVERRIDES)
    extra = [f"{k.replace('__', '.')}={v}" for k, v in overrides.items()]
    return config_lib.load_config(ROOT / "configs" / "tiny.py", base + extra)


def read_metrics(workdir):
    lines = [
        json.loads(x) for x in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    ]
    return [x for x in lines if "loss" in x], [x for x in lines if "eval_loss" in x]


def losses(workdir):
    return [x["loss"] for x in read_metrics(workdir)[0]]


def run_python(code: str, *, devices: int = 1, env: dict | None = None, timeout: int = 300):
    """Runs `code` in a fresh interpreter with `devices` simulated CPU devices; returns stdout."""
    full_env = dict(
        os.environ,
        XLA_FLAGS=xla_flags(f"--xla_force_host_platform_device_count={devices}"),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT / "tests") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"subprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc.stdout


@pytest.fixture
def config_factory():
    return small_config


def primitive_input_dtypes(fn, *args, primitive: str = "exp") -> list[str]:
    """The dtype of the first input of every `primitive` in `fn`'s jaxpr, nested jaxprs (jit,
    scan, cond, custom_vjp) included: how a test asserts that a softmax runs in float32."""
    import jax

    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == primitive:
                found.append(str(eqn.invars[0].aval.dtype))
            for value in eqn.params.values():
                for x in value if isinstance(value, (tuple, list)) else (value,):
                    if hasattr(x, "eqns"):
                        walk(x)
                    elif hasattr(getattr(x, "jaxpr", None), "eqns"):
                        walk(x.jaxpr)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found
