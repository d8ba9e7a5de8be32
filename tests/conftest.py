"""Shared test helpers: small configs, reading metrics, running code under N simulated devices."""

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
    """One XLA compilation cache for the whole run, empty at its start and removed at its end.

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
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
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
