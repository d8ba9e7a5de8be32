"""Attention diagnostics per layer and head: entropy, mean attended distance, mass beyond L;
previous-token and induction scores.

Shape legend: B windows, T window length, N query heads, K key/value heads, H head dim,
Y layers.

What a family does past its training length shows in where its heads look. For each layer and
head this computes, from the reference attention probabilities p[i, j] (the full softmax, as
`posattn.attention.reference_attention` writes it) on a few held-out windows:

* `entropy`: -sum_j p log p (nats); log(i + 1) for a uniform head (NoPE-like dilution), 0 for a
  head that looks at one key;
* `distance`: sum_j p[i, j] (i - j), the mean attended distance in tokens;
* `mass_beyond_L`: sum over keys with i - j >= L of p[i, j], the attention on distances no
  training window contained (a causal window of L tokens has offsets 0 .. L - 1).

Each is averaged over the window's last `min(T, L)` queries (positions T - L .. T - 1): the
same number of queries at every length, each with at least T - L keys before it, so a length's
numbers describe queries that have the whole window behind them.

`head_scores` names the heads that copy (Olsson et al. 2022): on a random string written twice,
each head's weight on the previous token and on the token after the query's earlier occurrence
(an induction head's target). The attention evaluator records them at L (`eval.head_strings`
strings, `repeated_strings`); `experiments/seed_table.py --heads` prints them for every seed.

The q/k of each layer are taken from the model's own modules (`Attention.project_q`,
`project_kv`, the layer's `PositionBias`), so every family (RoPE rotation and its scalings,
additive biases, absolute embeddings) is measured as the model computes it; the layers then run
as in `TransformerLM.hidden`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posattn import attention as attention_lib
from posattn.attention import masks
from posattn.eval import lengths as lengths_lib
from posattn.nn import layers

__all__ = [
    "attention_evaluator",
    "attention_probabilities",
    "attention_stats",
    "attention_windows",
    "head_scores",
    "repeated_strings",
]


def _probabilities(
    attn: layers.Attention,
    q: jax.Array,
    k: jax.Array,
    start: int = 0,
    log_forget=None,
    far=None,
    v=None,
    gate_keys=None,
    reflections=None,
) -> jax.Array:
    """Reference softmax probabilities float32[B, N, T - start, S] of one layer for the queries
    q[:, start:] (q at positions 0..T-1; its window, FoX's log f [B, S, N] and a RoPE remap's
    far pairs (`attention.Far`) as the layer's); a stick-breaking layer's weights instead, the
    remainder on the query's own key where the layer gives it its own value; a CoPE layer's
    softmax weights with its contextual positions (its gates from the values v [B, S, K, H] or
    its separate `gate_keys` where the layer's are); a PaTH layer's softmax weights with its
    `reflections` (w [B, S, K, H], beta [B, S, K]) and its scaled forget term."""
    q = q[:, start:]
    if attn.path is not None:
        w, beta = reflections
        return attention_lib.path_weights(
            q,
            k,
            w,
            beta,
            q_offset=start,
            scale=attn.scale,
            window=attn.window,
            log_forget=log_forget,
        )
    if attn.stick_breaking is not None:  # the weights its kernel multiplies the values by
        return attention_lib.stick_breaking_weights(
            q,
            k,
            q_offset=start,
            scale=attn.scale,
            window=attn.window,
            **attn.stick_breaking._asdict(),
        )
    if attn.cope is not None:  # CoPE's softmax weights, its positions read from the table
        return attention_lib.cope_weights(
            q,
            k,
            attn.cope.table[...],
            q_offset=start,
            scale=attn.scale,
            window=attn.window,
            **attn.cope.settings(v, gate_keys),
        )
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    f32 = jnp.float32

    def content(q, k):  # (B, N, T, S)
        k_rep = jnp.repeat(k.astype(f32), N // K, axis=2)  # (B, S, N, H)
        hi = jax.lax.Precision.HIGHEST
        return jnp.einsum("btnh,bsnh->bnts", q.astype(f32), k_rep, precision=hi) * attn.scale

    logits = content(q, k)
    q_pos = jnp.arange(start, start + T, dtype=jnp.int32)[None]  # (1, T)
    if far is not None:  # the pairs at distance >= window score with the far queries and keys
        near = masks.within_window(q_pos, jnp.arange(S), far.window, causal=attn.causal)
        logits = jnp.where(near[:, None], logits, content(far.q[:, start:], far.k))
    if attn.softcap is not None:  # Gemma 2's cap on the content logits, before the bias
        logits = attn.softcap * jnp.tanh(logits / attn.softcap)
    if attn.bias is not None:
        logits = logits + attention_lib.materialize_bias(attn.bias(), q_pos, S)
    if log_forget is not None:
        c = jnp.cumsum(log_forget.astype(f32), axis=1)  # (B, S, N)
        logits = logits + (c[:, start : start + T, None, :] - c[:, None, :, :]).transpose(
            0, 3, 1, 2
        )
    visible = attention_lib.visibility_mask(
        q_pos, S, causal=attn.causal, kv_lengths=None, window=attn.window
    )
    logits = jnp.where(visible[:, None], logits, -jnp.inf)
    return jax.nn.softmax(logits, axis=-1)  # (B, N, T, S); masked keys exactly 0


def attention_probabilities(graphdef, params, constants, tokens: jax.Array) -> list[jax.Array]:
    """Each layer's attention probabilities float32[B, N, T, T] for tokens int[B, T]."""
    return _per_layer(graphdef, params, constants, tokens, start=0, reduce=lambda p: p)


def _per_layer(graphdef, params, constants, tokens, *, start: int, reduce) -> list:
    """`reduce(probabilities of queries start..T-1)` of each layer, layer by layer (only what
    `reduce` returns stays alive, not every layer's [B, N, T, S] probabilities)."""
    model = nnx.merge(graphdef, params, constants)
    T = tokens.shape[1]
    positions = layers.token_positions(0, T)
    x, kv, out = model.embed_tokens(tokens), None, []
    for i, block in enumerate(model.blocks):
        if i % model.cfg.kv_share == 0:
            kv = None
        attn = block.attn
        h = block.attn_norm(x)
        remap = attn.rotary is not None and attn.rotary.remap is not None
        if attn.owns_kv:  # keys of a remapped layer travel as projected (`Attention.__call__`)
            own = attn.project_kv(h, positions, seq_len=T, rotate=not remap)
        else:
            own = kv
        q, k, far = attn.project_q(h, positions, seq_len=T, rotate=not remap), own[0], None
        if remap:
            q, k, far = attn.remapped(q, k, positions, seq_len=T, kv_len=T)
        else:
            q = attn._temper(q, positions, T)
        log_forget = None if attn.forget is None else attn.forget(h)  # (B, T, N)
        gates = attn.project_gate_keys(h)  # CoPE's separate gate keys, or None
        reflections = None if attn.path is None else attn.path(h)  # PaTH's (w, beta)
        probabilities = _probabilities(
            attn, q, k, start, log_forget, far, v=own[1], gate_keys=gates, reflections=reflections
        )
        out.append(reduce(probabilities))
        x, kv = block(x, kv=kv)
    return out


@functools.lru_cache(maxsize=32)
def _compiled(graphdef, train_len: int):
    def stats(params, constants, tokens):
        T = tokens.shape[1]
        q = min(T, train_len)
        i = jnp.arange(T - q, T)[:, None]  # (q, 1) query positions
        j = jnp.arange(T)[None, :]  # (1, S)
        offset = (i - j).astype(jnp.float32)  # (q, S)
        far = (i - j >= train_len).astype(jnp.float32)

        def reduce(p):  # (B, N, q, S): the last q queries only
            ent = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), -1)
            dist = jnp.sum(p * jnp.maximum(offset, 0.0), -1)
            mass = jnp.sum(p * far, -1)
            return jnp.stack([x.mean(axis=(0, 2)) for x in (ent, dist, mass)])  # (3, N)

        rows = _per_layer(graphdef, params, constants, tokens, start=T - q, reduce=reduce)
        return jnp.stack(rows)  # (Y, 3, N)

    return jax.jit(stats)


def attention_stats(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    constants: nnx.State,
    windows: np.ndarray,
    *,
    train_len: int,
) -> dict[str, list[list[float]]]:
    """Per layer and head, averaged over `windows` int[B, T] (see the module docstring).

    Returns:
      {"entropy", "distance", "mass_beyond_L"}: each a list (layers) of lists (heads) of floats.
    """
    if train_len < 1:
        raise ValueError(f"train_len={train_len!r} must be >= 1")
    values = np.asarray(
        _compiled(graphdef, int(train_len))(params, constants, jnp.asarray(windows, jnp.int32)),
        np.float64,
    )  # (Y, 3, N)
    names = ("entropy", "distance", "mass_beyond_L")
    return {name: values[:, n].tolist() for n, name in enumerate(names)}


# Floats of one layer's probabilities [B, N, T, T] that `head_scores` holds at once: strings are
# scored in chunks of at most this many (128 MiB), so a long-context model's scores fit in memory.
_HEAD_CHUNK_FLOATS = 1 << 25


@functools.lru_cache(maxsize=16)
def _compiled_scores(graphdef, period: int, start: int):
    def scores(params, constants, tokens):
        def reduce(p):  # (B, N, T, T)
            # p[i, i - 1] for i > start (element k of the diagonal is query k + 1)
            prev = jnp.diagonal(p, offset=-1, axis1=-2, axis2=-1)[..., start:]
            # p[i, i - period + 1] for i >= start + period: the key after the query's earlier
            # occurrence (element k is query k + period - 1)
            ind = jnp.diagonal(p, offset=1 - period, axis1=-2, axis2=-1)[..., start + 1 :]
            # the weight of the second copy's queries on the keys before `start`
            early = p[..., start + period :, :start].sum(-1)  # (B, N, T - start - period)
            return jnp.stack([prev.mean(-1), ind.mean(-1), early.mean(-1)])  # (3, B, N)

        rows = _per_layer(graphdef, params, constants, tokens, start=0, reduce=reduce)
        return jnp.stack(rows)  # (Y, 3, B, N)

    return jax.jit(scores)


def head_scores(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    constants: nnx.State,
    tokens: np.ndarray,
    *,
    period: int,
    start: int = 0,
) -> dict[str, list[list[float]]]:
    """Previous-token and induction scores per layer and head (Olsson et al. 2022, "In-context
    Learning and Induction Heads", on repeated random tokens).

    Args:
      tokens: int[B, T] that repeat with `period` from `start` on (tokens[:, i] ==
        tokens[:, i - period] for i >= start + period), e.g. a random string of `period`
        letters written twice, after `start` tokens of anything (text, to read the heads in a
        window longer than the string).
      period: 2 <= period and start + period < T.
      start: where the repeated part begins (0: the whole window).

    Returns:
      {"previous_token": mean over queries i > start of p[i, i - 1],
       "induction": mean over queries i >= start + period of p[i, i - period + 1], the weight on
       the token that followed the query's token where it occurred before (what an induction
       head attends to)}: each a list (layers) of lists (heads) of floats in [0, 1], the mean
       over the B strings (scored a chunk at a time: `_HEAD_CHUNK_FLOATS`); with start > 0 also
       "before_start": mean over the same queries as "induction" of their weight on the keys
       before `start` (where the repeat looks outside the string).
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not (2 <= period and 0 <= start and start + period < tokens.shape[1]):
        raise ValueError(
            f"head_scores needs tokens [B, T], 2 <= period and start + period < T; got shape "
            f"{tokens.shape}, period={period!r}, start={start!r}"
        )
    if not np.array_equal(tokens[:, start + period :], tokens[:, start:-period]):
        raise ValueError(
            f"tokens do not repeat with period {period} from {start} on: build them as a random "
            f"string of {period} tokens written twice (np.tile(string, (1, 2))) after {start} "
            "tokens"
        )
    B, T = tokens.shape
    heads = lengths_lib.model_config_of(graphdef, params, constants).num_heads
    chunk = max(1, min(B, _HEAD_CHUNK_FLOATS // (heads * T * T)))
    padded = np.concatenate([tokens, tokens[: -B % chunk]])  # whole chunks: one program
    run = _compiled_scores(graphdef, int(period), int(start))
    parts = [
        np.asarray(run(params, constants, jnp.asarray(padded[i : i + chunk], jnp.int32)))
        for i in range(0, padded.shape[0], chunk)
    ]  # each (Y, 2, chunk, N)
    values = np.concatenate(parts, axis=2)[:, :, :B].astype(np.float64).mean(axis=2)  # (Y, 3, N)
    out = {"previous_token": values[:, 0].tolist(), "induction": values[:, 1].tolist()}
    if start > 0:
        out["before_start"] = values[:, 2].tolist()
    return out


def attention_windows(text, length: int, count: int) -> np.ndarray:
    """`count` windows of `length` inputs int32[count, length] from distinct chunks of the
    evaluation text's plan (`posattn.eval.heldout.EvalText`; the first window of each chunk)."""
    windows, _ = text.plan.windows(text.val, length)
    per_chunk = text.plan.max_len // length
    return windows[::per_chunk][:count, :-1]


def repeated_strings(rng: np.random.Generator, count: int, period: int, vocab_size: int):
    """int32[count, 2 * period]: `count` random strings of `period` tokens, each written twice;
    lowercase letters for a byte-level model (vocabulary 256: the induction probe's alphabet),
    else token ids drawn uniformly from the vocabulary."""
    if vocab_size == 256:
        string = rng.integers(ord("a"), ord("z") + 1, size=(count, period))
    else:
        string = rng.integers(0, vocab_size, size=(count, period))
    return np.tile(string, (1, 2)).astype(np.int32)


def attention_evaluator(model, text, length: int, settings: Mapping[str, Any]) -> dict | None:
    """The "attention" evaluator (`posattn.eval.registry`) at one length: `attention_stats` on
    `attention_windows` windows of the text, None where the model cannot read the length; at
    the training length L also `head_scores` ("previous_token", "induction") on `head_strings`
    random strings of L // 2 tokens written twice (`repeated_strings`, drawn from `seed`)."""
    cfg = lengths_lib.model_config_of(*model)
    if not lengths_lib.can_read(cfg, int(length)):
        return None
    L = int(settings["train_len"])
    windows = attention_windows(text, int(length), int(settings["attention_windows"]))
    out = attention_stats(*model, windows, train_len=L)
    count = int(settings.get("head_strings", 0))
    if int(length) == L and count > 0 and L >= 4:
        rng = np.random.default_rng(int(settings["seed"]))
        tokens = repeated_strings(rng, count, L // 2, cfg.vocab_size)
        out.update(head_scores(*model, tokens, period=L // 2))
    return out
