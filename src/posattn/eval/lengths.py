"""The forward pass every evaluator reads a model with, RoPE's eval-time scalings (one graph per
length for all of a model's scalings: `rope_row_model`) and an eval-time sliding window
(`windowed`).

Shape legend: W windows, B batch (windows per forward pass), T window length, V vocabulary.

Every function takes the model split at the jit boundary, `(graphdef, params, constants)` (as
`posattn.train.steps.init_model` returns it and checkpoints restore it), plus NumPy tokens, and
returns NumPy/Python numbers. One jitted forward pass (`token_stats`) serves every evaluator
(`posattn.eval.registry`): per-token negative log-likelihood and argmax prediction, with the output
projection computed in chunks of positions so that a [B, T, V] logits array never exists (a
16k-token window of a 50k-token vocabulary would be 3 GiB per row). `forward` runs it over many
windows in batches of one shape. Long windows run through `posattn.attention` with the model's
`attention_impl`; "auto" takes the blockwise kernel, linear in T, once the logits get large.

A model that cannot read a window of some length gives None there, decided from its config before
any compute (`max_length`, `can_read`): learned absolute embeddings have no row past their table
(docs/conventions.md), and a number computed from a clamped or NaN lookup would be a lie.

Which held-out text is scored, and how the loss is summarised, is the one loss protocol of
`posattn.eval.heldout`, `scoring` and `summary`
(docs/conventions.md#evaluating-length-extrapolation).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posattn import rotary
from posattn.nn import layers
from posattn.nn import pattern as pattern_lib
from posattn.nn.config import ModelConfig
from posattn.nn.model import TransformerLM

__all__ = [
    "can_read",
    "forward",
    "max_length",
    "model_config_of",
    "predict",
    "rope_remap_row",
    "rope_row_model",
    "rope_scaling_row",
    "token_stats",
    "windowed",
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
    return cfg.max_positions


def can_read(cfg: ModelConfig, length: int) -> bool:
    """Whether the model of `cfg` can read a window of `length` positions (see `max_length`)."""
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
    return jax.jit(
        functools.partial(_token_stats, graphdef, chunk=chunk),
        compiler_options=forward_compiler_options(),
    )


def forward_compiler_options(platform: str | None = None) -> dict[str, str] | None:
    """XLA options of the evaluation's forward programs: on a CPU, matrix products are handed to
    the GEMM library one by one (`LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT`) rather than in fused
    graphs with their elementwise neighbours, which XLA:CPU fed with scalar constants broadcast
    to the whole activation (four [B, T, F] arrays written per forward pass for GELU's
    polynomial): `benchmarks/eval_forward.py` measures the forward pass 1.4-1.7x faster. A
    training step is slower this way, so it keeps XLA's default. Other backends: None."""
    if (platform or jax.default_backend()) != "cpu":
        return None
    return {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


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


def forward(graphdef, params, constants, windows: np.ndarray, batch_size: int):
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
        for _, pred in forward(
            graphdef, params, constants, np.asarray(sequences, np.int32), batch_size
        )
    ]
    return np.concatenate(preds)


# ----------------------------------------------------------------------------------------------
# An eval-time sliding window: the same trained parameters, keys at most `window - 1` back.


def windowed(cfg: ModelConfig, window: int, layers=None) -> ModelConfig:
    """`cfg` with its layers' attention limited to a sliding window: query i sees key j only if
    i - j < window (a layer with a smaller window of its own keeps it); `layers` names the
    layers so limited (indices from 0; None: every layer).

    A window is a static setting of each layer (`model.layer_pattern`'s `window`), not a
    parameter: the model of the result has the tree of `cfg`'s, so a trained model's params and
    constants read it as they are. With `window` = the training length L every query past L sees
    exactly the distances 0 .. L - 1 it saw in training (what a sliding window of L at inference
    does, Beltagy et al. 2020; Han et al. 2023 (LM-Infinite) and Xiao et al. 2023 (StreamingLLM)
    add the first tokens back, which this does not).
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r} must be an integer >= 1")
    n = cfg.num_layers
    chosen = set(range(n)) if layers is None else set(layers)
    if not chosen or any(isinstance(i, bool) or i not in range(n) for i in chosen):
        raise ValueError(f"layers={layers!r} must be indices of the {n} layers, 0 .. {n - 1}")
    entries = cfg.layer_pattern or (cfg.position,)
    if layers is not None:  # one entry a layer, so that each can take its own window
        entries = tuple(entries[i % len(entries)] for i in range(n))
    pattern = []
    for i, entry in enumerate(entries):
        name, values = pattern_lib.parse_entry(entry)
        if layers is None or i in chosen:
            values["window"] = min(values.get("window") or window, window)
        items = ",".join(f"{k}={v!r}" for k, v in values.items())
        pattern.append(f"{name}:{items}" if items else name)
    new = cfg.replace(layer_pattern=tuple(pattern))
    want = tuple(
        dataclasses.replace(s, window=min(s.window or window, window)) if i in chosen else s
        for i, s in enumerate(cfg.layers)
    )
    if new.layers != want:  # the entries' round trip through their text must be exact
        raise ValueError(f"windowed: {cfg.layer_pattern!r} does not round-trip: {new.layers}")
    return new


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


def rope_remap_row(
    kind: str,
    *,
    train_len: int,
    eval_len: int,
    window_multiple: float = 0.5,
    group: float = 0,
    leak: float = 0,
    log_scale: float = 0,
) -> dict[str, Any] | None:
    """The eval-time RoPE remap (`rotary.validate_rope_remap`) of kind "rerope" or "self_extend"
    that reads a model trained at L = `train_len` at T = `eval_len`: None at T <= L (the trained
    model itself), else the remap with window w = round(window_multiple * L), 1 <= w < L, and
    for SelfExtend the group g: `group` when it is > 0 (it must divide w), else the smallest
    divisor of w that keeps every far distance i // g - j // g + w - w / g below L at T (as
    SelfExtend's authors pick g for the target length). `leak` k > 0 makes ReRoPE Leaky ReRoPE
    (an integer >= 2; far distances w + (i - j - w) / k). `log_scale` 1 adds the log-n query
    scale max(1, log(i + 1) / log L) (`log_scale_base` = L). ValueError when no group fits.
    """
    if eval_len <= train_len:
        return None
    L, T = int(train_len), int(eval_len)
    w = round(window_multiple * L)
    if not 1 <= w < L:
        raise ValueError(
            f"window_multiple={window_multiple} gives a window of {w} tokens at L = {L}; it "
            f"must give 1 .. {L - 1} (the near pairs' distances must be trained ones)"
        )
    remap: dict[str, Any] = {"type": kind, "window": w}
    if kind == "self_extend":
        if group:
            g = int(group)
            if g != group or g < 1 or w % g:
                raise ValueError(f"group={group} must be a positive integer dividing window {w}")
        else:
            fits = [g for g in range(1, w + 1) if w % g == 0 and (T - 1) // g + w - w // g < L]
            if not fits:
                raise ValueError(
                    f"no SelfExtend group keeps the far distances below L = {L} at T = {T} "
                    f"with a window of {w} (the largest, g = {w}, reaches "
                    f"{(T - 1) // w + w - 1}); use a smaller window_multiple"
                )
            g = fits[0]
        remap["group"] = g
    elif group:
        raise ValueError(f"group={group}: a {kind!r} remap has no group")
    if leak and kind != "rerope":
        raise ValueError(f"leak={leak}: a {kind!r} remap has no leak (ReRoPE's option)")
    if leak:
        if leak != int(leak) or leak < 2:
            raise ValueError(f"leak={leak} must be an integer >= 2 (0: plain ReRoPE)")
        remap["leak"] = int(leak)
    if log_scale not in (0, 1):
        raise ValueError(f"log_scale={log_scale} must be 0 (off) or 1 (log-n query scale, base L)")
    if log_scale:
        remap["log_scale_base"] = L
    return rotary.validate_rope_remap(remap)


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


class TableRotary(nnx.Module):
    """RoPE whose frequencies and attention factor are arrays (constants), for windows of one
    length: what a `layers.Rotary` computes there, with nothing of its scaling in the graph.

    Every scaling of one model read at one length (eval-time linear, NTK, dynamic NTK, YaRN, ...,
    and the fine-tunes' fixed scalings) then has one graphdef, so all of those rows run the same
    compiled programs at that length, their tables and parameters passed as arguments. Dynamic NTK
    (and LongRoPE) recompute their frequencies from the current length; at a fixed window length
    that is one table, computed here as `Rotary` would compute it. Called at another length (or
    with per-row lengths, as a KV cache would) it refuses instead of rotating wrongly.
    """

    def __init__(self, source: layers.Rotary, length: int):
        inv_freq, factor = source.inv_freq[...], source.attention_factor
        if source.dynamic:
            inv_freq, factor = rotary.rope_frequencies(
                source.head_dim, base=source.base, scaling=dict(source.scaling), seq_len=length
            )
        self.inv_freq = layers.Constant(jnp.asarray(inv_freq, jnp.float32))
        self.attention_factor = layers.Constant(jnp.asarray(factor, jnp.float32))
        self.layout, self.length = source.layout, int(length)
        # An eval-time remap (ReRoPE, SelfExtend): its window stays in the graph (the attention
        # selects its far pairs by it), its other numbers are arrays (`rotary.remap_numbers`),
        # so every remap of one window read at one length is one graph too.
        self.remap = None
        if source.remap is not None:
            ints, floats = rotary.remap_numbers(dict(source.remap))
            self.remap = (("window", source.remap_window),)
            self.remap_ints = layers.Constant(jnp.asarray(ints, jnp.int32))
            self.remap_floats = layers.Constant(jnp.asarray(floats, jnp.float32))

    def __call__(
        self, x: jax.Array, positions: jax.Array, *, seq_len, frequency_scale: float = 1.0
    ) -> jax.Array:
        if not isinstance(seq_len, int) or seq_len != self.length:
            raise ValueError(
                f"this RoPE table was computed for windows of {self.length} tokens and cannot "
                f"rotate at seq_len={seq_len!r}; build one for that length (rope_row_model)"
            )
        inv_freq = self.inv_freq[...]
        if not (isinstance(frequency_scale, float) and frequency_scale == 1.0):
            inv_freq = inv_freq * frequency_scale  # a remap's far rotation (`remap_far`)
        return rotary.apply_rope(
            x,
            positions,
            inv_freq,
            layout=self.layout,
            attention_factor=self.attention_factor[...],
        )

    @property
    def remap_window(self) -> int:
        return int(dict(self.remap)["window"])

    def remap_far(self, positions: jax.Array, k_pos: jax.Array):
        """`layers.Rotary.remap_far` from the arrays: the same integers, the same float32
        frequency scale, and the query scale divided by the same float32 log base (by an
        infinite one, a scale of exactly 1, where the remap has none)."""
        ints = tuple(self.remap_ints[...][i] for i in range(4))
        frequency_scale, log_base = self.remap_floats[...][0], self.remap_floats[...][1]
        far_q, far_k = rotary.far_positions(ints, positions, k_pos)
        return far_q, far_k, frequency_scale, rotary.log_n_scale(positions, log_base)


def _tabulate(model: TransformerLM, base: ModelConfig, length: int) -> TransformerLM:
    """`model` with every `layers.Rotary` (shared ones stay shared) replaced by its `TableRotary`
    at `length`, and its config replaced by `base`: the graph no longer holds the scaling."""
    tables: dict[int, TableRotary] = {}
    for _, module in list(nnx.iter_modules(model)):
        for name, value in list(vars(module).items()):
            if isinstance(value, layers.Rotary):
                if id(value) not in tables:
                    tables[id(value)] = TableRotary(value, length)
                setattr(module, name, tables[id(value)])
    model.cfg = base
    return model


def rope_row_model(
    cfg: ModelConfig,
    scaling: Mapping[str, Any] | None,
    length: int,
    remap: Mapping[str, Any] | None = None,
) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, constants) that read windows of `length` tokens with the parameters of the RoPE
    model `cfg` under `scaling` (None: its own rope_scaling, if any; a dict replaces it, as in
    `with_rope_scaling`), with one graphdef for every scaling at that length (`TableRotary`): the
    eval-time rows and fine-tunes of one trained model share their compiled programs length by
    length. `remap` (`rope_remap_row`; None: none) adds an eval-time ReRoPE or SelfExtend, which
    stays in the graph (its attention scores two query/key pairs).

    The numbers are those of `with_rope_scaling`: the same frequencies and attention factor, as
    arrays instead of graph constants. `model_config_of` of the result is `cfg` itself.
    """
    if not cfg.family.rotary:
        raise ValueError(f"rope scaling needs a RoPE model; model.position={cfg.position!r}")
    if scaling is not None:
        rotary.validate_rope_scaling(dict(scaling), cfg.head_dim)
    new = cfg if scaling is None else cfg.replace(rope_scaling=dict(scaling))
    if remap is not None:
        new = new.replace(rope_remap=rotary.validate_rope_remap(remap))
    length = int(length)

    def build():
        return _tabulate(TransformerLM(new, rngs=nnx.Rngs(params=0)), cfg, length)

    graphdef, _, _ = nnx.split(nnx.eval_shape(build), nnx.Param, ...)
    constants = jax.jit(lambda: nnx.split(build(), nnx.Param, ...)[2])()
    return graphdef, constants
