"""Evaluating a trained language model at any length: loss, per-position loss and memory probes.

Shape legend: W windows, B batch (windows per forward pass), T window length, V vocabulary.

Every function takes the model split at the jit boundary, `(graphdef, params, constants)` (as
`posattn.train.steps.init_model` returns it and checkpoints restore it), plus NumPy tokens, and
returns NumPy/Python numbers. One jitted forward pass (`token_stats`) serves them all: per-token
negative log-likelihood and argmax prediction, with the output projection computed in chunks of
positions so that a [B, T, V] logits array never exists (a 16k-token window of a 50k-token
vocabulary would be 3 GiB per row). Long windows run through `posattn.attention` with the model's
`attention_impl`; "auto" takes the blockwise kernel, linear in T, once the logits get large.

A model that cannot read a window of some length gives None there, decided from its config before
any compute (`max_length`): learned absolute embeddings have no row past their table
(docs/conventions.md), and a number computed from a clamped or NaN lookup would be a lie.

Evaluation protocol (docs/conventions.md; Press et al. 2022 §4): non-overlapping windows from the
start of the held-out tokens, every token of a window predicted from the window's earlier tokens
only, so at length T the first positions of each window have little context; the mean is over all
of them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posattn import rotary
from posattn.data import eval_windows, probes
from posattn.nn.config import ModelConfig
from posattn.nn.model import TransformerLM

__all__ = [
    "copy_accuracy",
    "loss_at_lengths",
    "max_length",
    "model_config_of",
    "nll_by_position",
    "passkey_accuracy",
    "predict",
    "rope_scaling_row",
    "token_stats",
    "with_rope_scaling",
]

# Logits of at most this many elements (float32) exist at once: 64 Mi elements = 256 MiB.
_LOGITS_BUDGET = 64 * 1024 * 1024


def model_config_of(graphdef: nnx.GraphDef, params: nnx.State, constants: nnx.State) -> ModelConfig:
    """The static `ModelConfig` a split model was built from (no compute: arrays are not
    touched)."""
    return nnx.merge(graphdef, params, constants).cfg


def max_length(cfg: ModelConfig) -> int | None:
    """The longest window the model can read, or None when any length works.

    Learned absolute embeddings stop at their table (`model.max_len`); every other family computes
    its position signal for any position (whether it is any good there is what we measure).
    """
    return cfg.max_len if cfg.family.embedding == "learned" else None


def _can_read(cfg: ModelConfig, length: int) -> bool:
    limit = max_length(cfg)
    return limit is None or length <= limit


def token_stats(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    constants: nnx.State,
    inputs: jax.Array,
    targets: jax.Array,
    *,
    chunk: int,
) -> tuple[jax.Array, jax.Array]:
    """Per-token NLL (nats) and argmax prediction of a causal LM, jitted once per (graphdef, chunk)
    and shape (see `_token_stats`)."""
    return _compiled(graphdef, chunk)(params, constants, inputs, targets)


@functools.lru_cache(maxsize=64)
def _compiled(graphdef: nnx.GraphDef, chunk: int):
    # Graphdefs of equal configs compare and hash equal, so each model shape compiles once.
    return jax.jit(functools.partial(_token_stats, graphdef, chunk=chunk))


def _token_stats(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    constants: nnx.State,
    inputs: jax.Array,
    targets: jax.Array,
    *,
    chunk: int,
) -> tuple[jax.Array, jax.Array]:
    """Per-token NLL (nats) and argmax prediction of a causal LM.

    Args:
      graphdef, params, constants: the split model.
      inputs, targets: int[B, T]; targets[:, t] is the token after inputs[:, t].
      chunk: positions per slice of the output projection (T is padded to a multiple of it).

    Returns:
      (nll float32[B, T], prediction int32[B, T]).
    """
    model = nnx.merge(graphdef, params, constants)
    h = model.hidden(inputs)  # (B, T, D) float32
    B, T, D = h.shape
    n = -(-T // chunk)
    pad = n * chunk - T
    h = (
        jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, D).swapaxes(0, 1)
    )  # (n, B, c, D)
    t = jnp.pad(targets, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)  # (n, B, c)

    def one_chunk(xs):
        h_c, t_c = xs
        logits = model.logits(h_c)  # (B, c, V)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, t_c[..., None].astype(jnp.int32), axis=-1)[
            ..., 0
        ]  # (B, c)
        return nll, jnp.argmax(logits, axis=-1).astype(jnp.int32)

    nll, pred = jax.lax.map(one_chunk, (h, t))  # (n, B, c) each

    def unchunk(x):
        return x.swapaxes(0, 1).reshape(B, n * chunk)[:, :T]  # (B, T)

    return unchunk(nll), unchunk(pred)


def _run(graphdef, params, constants, windows: np.ndarray, batch_size: int):
    """Yields (nll, pred) NumPy arrays [b, T] for consecutive batches of windows int[W, T+1].

    Every call has the same shape [batch_size, T] (the last batch is padded with repeats of its
    first row, dropped from the result), so one compiled program serves the whole length.
    """
    cfg = model_config_of(graphdef, params, constants)
    T = windows.shape[1] - 1
    chunk = max(1, min(T, _LOGITS_BUDGET // max(1, batch_size * cfg.vocab_size)))
    for start in range(0, len(windows), batch_size):
        rows = windows[start : start + batch_size]
        real = len(rows)
        if real < batch_size:
            rows = np.concatenate([rows, np.repeat(rows[:1], batch_size - real, axis=0)])
        nll, pred = token_stats(
            graphdef,
            params,
            constants,
            jnp.asarray(rows[:, :-1]),
            jnp.asarray(rows[:, 1:]),
            chunk=chunk,
        )
        yield np.asarray(nll, np.float64)[:real], np.asarray(pred)[:real]


def nll_by_position(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    constants: nnx.State,
    tokens: np.ndarray,
    *,
    length: int,
    max_tokens: int,
    batch_size: int,
) -> np.ndarray | None:
    """Mean NLL (nats) at each position of non-overlapping windows of `length` tokens.

    Position t is the prediction of a window's token t + 1 from its tokens 0..t. The windows are
    the first `max_tokens // length` (at least one) of `tokens`.

    Returns:
      float64[length], or None when the model cannot read `length` positions.
    """
    cfg = model_config_of(graphdef, params, constants)
    if not _can_read(cfg, length):
        return None
    windows = eval_windows(tokens, seq_len=length, max_windows=max(1, max_tokens // length))
    if len(windows) == 0:
        raise ValueError(
            f"cannot cut one window of {length} + 1 tokens from {tokens.size} evaluation tokens; "
            "use shorter eval lengths or a larger held-out split"
        )
    total = np.zeros(length)
    for nll, _ in _run(graphdef, params, constants, windows, batch_size):
        total += nll.sum(axis=0)
    return total / len(windows)


def loss_at_lengths(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    constants: nnx.State,
    tokens: np.ndarray,
    *,
    lengths: Sequence[int],
    max_tokens: int,
    batch_size: int,
) -> list[float | None]:
    """Mean next-token NLL (nats per token) over non-overlapping windows of each length.

    Args:
      graphdef, params, constants: the split model (a causal LM).
      tokens: int[N] held-out tokens (e.g. `corpus.val`); windows are cut from its start.
      lengths: window lengths T; each predicts T tokens per window.
      max_tokens: at most this many predicted tokens per length (`max_tokens // T` windows, at
        least one). A multiple of the longest length makes every length score the same tokens.
      batch_size: windows per forward pass (memory: B * T activations; logits are chunked).

    Returns:
      One mean per length, None where the model cannot read that length (see `max_length`).
    """
    out = []
    for length in lengths:
        curve = nll_by_position(
            graphdef,
            params,
            constants,
            tokens,
            length=int(length),
            max_tokens=max_tokens,
            batch_size=batch_size,
        )
        out.append(None if curve is None else float(curve.mean()))
    return out


def predict(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    constants: nnx.State,
    sequences: np.ndarray,
    *,
    batch_size: int,
) -> np.ndarray:
    """Teacher-forced argmax predictions int32[W, n - 1] for sequences int[W, n] (the model reads
    sequences[:, :-1]; prediction t is its guess for sequences[:, t + 1])."""
    preds = [
        pred
        for _, pred in _run(
            graphdef, params, constants, np.asarray(sequences, np.int32), batch_size
        )
    ]
    return np.concatenate(preds)


def passkey_accuracy(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    constants: nnx.State,
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    samples: int,
    digits: int,
    seed: int,
    batch_size: int,
) -> np.ndarray:
    """Exact-match passkey accuracy float64[len(lengths), len(depths)], NaN where the model cannot
    read the length. Sample s of cell (length, depth) is drawn from (seed, length, depth index, s),
    so every model sees the same probes."""
    cfg = model_config_of(graphdef, params, constants)
    acc = np.full((len(lengths), len(depths)), np.nan)
    for a, length in enumerate(lengths):
        if not _can_read(cfg, length):
            continue
        cells = [(d, s) for d in range(len(depths)) for s in range(samples)]
        made = [
            probes.passkey_sample(
                np.random.default_rng([seed, length, d, s]),
                length=length + 1,
                depth=float(depths[d]),
                digits=digits,
            )
            for d, s in cells
        ]
        pred = predict(
            graphdef, params, constants, np.stack([m.tokens for m in made]), batch_size=batch_size
        )
        hits = np.array(
            [probes.score_passkey(m, p) for m, p in zip(made, pred, strict=True)]
        ).reshape(len(depths), samples)
        acc[a] = hits.mean(axis=1)
    return acc


def copy_accuracy(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    constants: nnx.State,
    tokens: np.ndarray,
    *,
    lengths: Sequence[int],
    samples: int,
    segment: int,
    seed: int,
    batch_size: int,
) -> list[float | None]:
    """Copy-task accuracy per length: the share of a repeated random-letter segment's letters
    (all but the first) predicted correctly; the background is real text, window w of sample w
    cut from `tokens` at a position drawn from (seed, length, w). None where the model cannot
    read the length."""
    cfg = model_config_of(graphdef, params, constants)
    out: list[float | None] = []
    for length in lengths:
        if not _can_read(cfg, length):
            out.append(None)
            continue
        made = []
        for s in range(samples):
            rng = np.random.default_rng([seed, length, s, 0xC0])
            start = int(rng.integers(0, tokens.size - length - 1))
            made.append(
                probes.copy_sample(
                    rng, np.asarray(tokens[start : start + length + 1], np.uint8), segment=segment
                )
            )
        pred = predict(
            graphdef, params, constants, np.stack([m.tokens for m in made]), batch_size=batch_size
        )
        scores = np.array(
            [probes.score_copy(m, p) for m, p in zip(made, pred, strict=True)]
        )  # (samples, 2)
        out.append(float(scores[:, 0].sum() / scores[:, 1].sum()))
    return out


# ----------------------------------------------------------------------------------------------
# RoPE with eval-time scaling: the same trained parameters, new frequencies.


def rope_scaling_row(
    kind: str, *, train_len: int, eval_len: int, **extra: Any
) -> dict[str, Any] | None:
    """The Hugging Face `rope_scaling` dict that stretches a model trained at `train_len` to
    `eval_len`: factor s = eval_len / train_len, original_max_position_embeddings = train_len.

    At eval_len <= train_len it is None (plain RoPE: nothing to stretch; HF requires factor >= 1).
    `extra` adds keys or overrides them: "dynamic" keeps Hugging Face's meaning when its configured
    factor is passed here (`factor=2.0`): the model then recomputes the base from the window it
    reads (`posattn.nn.layers.Rotary`), b (s T / L - (s - 1))^(d/(d-2)) at T > L. Without it the
    factor is the extension ratio too, which stretches by s^2 - s + 1 at T = s L.
    """
    if eval_len <= train_len:
        return None
    return {
        "rope_type": kind,
        "factor": eval_len / train_len,
        "original_max_position_embeddings": train_len,
        **extra,
    }


def with_rope_scaling(
    cfg: ModelConfig, scaling: Mapping[str, Any] | None
) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, constants) of the model `cfg` with `scaling` instead of its own rope_scaling.

    Trained parameters do not depend on the scaling (it only changes the RoPE frequencies and the
    YaRN attention factor, which live in the graph and in the constants), so pairing these with a
    trained model's params evaluates that model under eval-time scaling, as HF does when a
    `rope_scaling` is added to a released checkpoint's config.
    """
    if not cfg.family.rotary:
        raise ValueError(f"rope scaling needs a RoPE model; model.position={cfg.position!r}")
    if scaling is not None:
        rotary.validate_rope_scaling(dict(scaling), cfg.head_dim)
    new = cfg.replace(rope_scaling=None if scaling is None else dict(scaling))
    abstract = nnx.eval_shape(lambda: TransformerLM(new, rngs=nnx.Rngs(params=0)))
    graphdef, _, _ = nnx.split(abstract, nnx.Param, ...)
    # The constants (RoPE frequencies) computed for real; XLA drops the unused parameter init.
    constants = jax.jit(
        lambda: nnx.split(TransformerLM(new, rngs=nnx.Rngs(params=0)), nnx.Param, ...)[2]
    )()
    return graphdef, constants
