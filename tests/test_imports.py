"""The import rules of docs/architecture.md, read from the source's syntax trees, and what
importing the lower layers pulls in."""

import ast
import pathlib

import pytest
from conftest import ROOT, run_python

SRC = ROOT / "src" / "posattn"


def _imports(path: pathlib.Path) -> set[str]:
    """Every module a file imports (absolute names; `from posattn import data` gives
    `posattn.data`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _files(*parts: str) -> list[pathlib.Path]:
    found = []
    for part in parts:
        path = SRC / part
        found += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return found


def _offenders(files, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in files:
        for name in sorted(_imports(path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(SRC)}: {name}")
    return bad


UPPER = ("posattn.train", "posattn.sweep", "posattn.generate", "posattn.evaluate", "posattn.cli")


@pytest.mark.parametrize(
    "where, forbidden",
    [
        (
            ("positions.py", "rotary.py", "families.py", "attention"),
            (
                "flax",
                "optax",
                "orbax",
                "ml_collections",
                "posattn.config",
                "posattn.nn",
                "posattn.data",
                "posattn.eval",
                *UPPER,
            ),
        ),
        (
            ("data",),
            (
                "jax",
                "flax",
                "optax",
                "orbax",
                "posattn.nn",
                "posattn.eval",
                "posattn.config",
                *UPPER,
            ),
        ),
        (("eval",), ("optax", "orbax", *UPPER)),
        (
            ("nn",),
            (
                "optax",
                "orbax",
                "ml_collections",
                "posattn.config",
                "posattn.data",
                "posattn.eval",
                *UPPER,
            ),
        ),
    ],
)
def test_layers_import_only_from_below(where, forbidden):
    # `eval/__main__.py` only runs the entry point `posattn.evaluate` (`python -m posattn.eval`).
    files = [f for f in _files(*where) if f.relative_to(SRC).as_posix() != "eval/__main__.py"]
    assert _offenders(files, forbidden) == []


@pytest.mark.parametrize(
    "library, owner", [("orbax", "train/checkpoint.py"), ("optax", "train/steps.py")]
)
def test_one_module_owns_each_library(library, owner):
    users = [p.relative_to(SRC).as_posix() for p in _files(".") if _offenders([p], (library,))]
    assert users == [owner]


def test_importing_data_and_eval_pulls_in_no_training_stack():
    out = run_python(
        """
        import sys
        import posattn.data, posattn.eval.heldout, posattn.eval.intervals, posattn.eval.summary
        light = sorted(m for m in sys.modules if m.split(".")[0] in ("flax", "optax", "orbax"))
        import posattn.eval.lengths, posattn.eval.retrieval, posattn.eval.attention_stats
        import posattn.eval.registry
        upper = sorted(m for m in sys.modules
                       if m.startswith(("orbax", "posattn.train", "posattn.sweep")))
        print(light, upper)
        """
    )
    assert out.split() == ["[]", "[]"]
