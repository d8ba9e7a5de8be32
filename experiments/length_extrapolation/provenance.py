"""Who produced a number: the commit, the tree's state, and a hash of the code that computes it.

The code hash is taken over each Python file's syntax tree with docstrings and comments removed
(`ast.parse`, docstrings stripped, `ast.dump`), so an edit of a docstring, a comment or the
layout leaves every cache valid, and an edit of the code invalidates it. Configs are not hashed:
a run's config is compared as settings (trained.json holds it), so a change of a config file that
leaves a run's settings alone leaves its cache alone too.

Which files: `TRAINING_CODE` for a training (and a fine-tune), `EVALUATION_CODE` plus the file
that defines an evaluator's `run` for that evaluator's numbers.
"""

from __future__ import annotations

import ast
import datetime
import functools
import hashlib
import inspect
import os
import pathlib
import platform
import subprocess
from collections.abc import Iterable
from typing import Any

import jax

__all__ = [
    "ROOT",
    "ProducedByOtherCode",
    "code_files",
    "code_record",
    "code_sha256",
    "describe_origin",
    "evaluator_code_sha256",
    "provenance",
    "same_origin",
    "source_sha256",
]

ROOT = pathlib.Path(__file__).resolve().parents[2]
_PACKAGE = ROOT / "src" / "posattn"
_HERE = pathlib.Path(__file__).resolve().parent

# What a trained model depends on: the package minus what only evaluates, sweeps or reads
# command lines, plus the experiment's training module (the fine-tune).
_NOT_TRAINING = ("eval", "sweep", "generate.py", "cli.py", "__main__.py")
# What an evaluator's number depends on besides its own file: the forward pass and everything
# below it, the held-out text, and the experiment's own evaluation modules.
_NOT_EVALUATION = ("sweep", "generate.py", "cli.py", "__main__.py", "optax", "train")


class ProducedByOtherCode(RuntimeError):
    """A finished run in the workdir was trained by other code or on another corpus."""


# The package's sources: Python, and the C++ it compiles on first use (the native attention
# kernel), which computes the training step and the forward pass as much as the Python does.
_SOURCES = ("*.py", "*.cc")


def _files(skip: tuple[str, ...], extra: Iterable[pathlib.Path]) -> list[pathlib.Path]:
    out = []
    for path in (p for pattern in _SOURCES for p in _PACKAGE.rglob(pattern)):
        parts = path.relative_to(_PACKAGE).parts
        if parts[0] in skip or path.name in skip:
            continue
        out.append(path)
    return sorted({*out, *(p.resolve() for p in extra)})


def code_files(stage: str = "training") -> list[pathlib.Path]:
    """The files whose code a stage's numbers depend on ("training" or "evaluation")."""
    if stage == "training":
        return _files(_NOT_TRAINING, [_HERE / "training.py"])
    if stage == "evaluation":
        # train/checkpoint.py restores the parameters evaluated; train/steps.py is the fine-tune's
        # (a fine-tuned row's parameters are keyed by their content hash, not by this code).
        return _files(_NOT_EVALUATION, [_PACKAGE / "train" / "checkpoint.py", _HERE / "rows.py"])
    raise ValueError(f"stage={stage!r}; allowed: training, evaluation")


@functools.lru_cache(maxsize=512)
def _normalised(source: str) -> bytes:
    """The syntax tree of Python source without docstrings (comments never reach it)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, annotate_fields=False).encode()


def source_sha256(files: Iterable[pathlib.Path]) -> str:
    """sha256 over (path relative to the repository, normalised syntax tree) of `files`; a file
    that is not Python (the kernel's C++) by its bytes, so that any edit of it counts."""
    digest = hashlib.sha256()
    for path in sorted({pathlib.Path(f).resolve() for f in files}):
        try:
            name = str(path.relative_to(ROOT))
        except ValueError:  # an evaluator defined outside the repository (a test's)
            name = path.name
        digest.update(name.encode() + b"\0")
        source = _normalised(path.read_text()) if path.suffix == ".py" else path.read_bytes()
        digest.update(source + b"\0")
    return digest.hexdigest()


def code_sha256(stage: str = "training") -> str:
    """The hash of `code_files(stage)`: equal for code that differs only in docstrings,
    comments or layout."""
    return source_sha256(code_files(stage))


def evaluator_code_sha256(evaluator) -> str:
    """The hash of the code behind one evaluator's numbers: `code_files("evaluation")` and the
    file that defines its `run`."""
    own = inspect.getsourcefile(evaluator.run)
    return source_sha256([*code_files("evaluation"), *([own] if own else [])])


def _git(*args) -> str | None:
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def provenance() -> dict[str, Any]:
    """The run's commit, tree state, code hash (training code), date and machine."""
    status = _git("status", "--porcelain")
    return {
        "commit": _git("rev-parse", "HEAD") or None,
        "uncommitted_changes": bool(status) if status is not None else None,
        "code_sha256": code_sha256("training"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu_count": os.cpu_count(),
        "devices": [str(d) for d in jax.devices()],
        "python": platform.python_version(),
        "jax": jax.__version__,
    }


def code_record(prov: dict, corpus_sha256: str, code_sha: str | None = None) -> dict:
    """What a cache record says about its producer: commit, clean, code hash, corpus hash."""
    changes = prov["uncommitted_changes"]
    return {
        "commit": prov["commit"],
        "clean": None if changes is None else not changes,
        "code_sha256": code_sha or prov["code_sha256"],
        "corpus_sha256": corpus_sha256,
    }


def same_origin(saved: dict, code: dict) -> bool:
    """Whether a record was produced by this code on this corpus."""
    keys = ("code_sha256", "corpus_sha256")
    return all(saved.get("code", {}).get(k) == code[k] for k in keys)


def describe_origin(saved: dict) -> str:
    origin = saved.get("code") or {}
    if not origin:
        return "code that did not record its commit"
    clean = {True: "clean", False: "with uncommitted changes", None: "tree state unknown"}
    return (
        f"commit {str(origin.get('commit'))[:12]} ({clean[origin.get('clean')]}), code sha256 "
        f"{str(origin.get('code_sha256'))[:12]}, "
        f"corpus sha256 {str(origin.get('corpus_sha256'))[:12]}"
    )
