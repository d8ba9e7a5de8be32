"""Generation with a KV cache: the cache pytree, prefill, one-token decode steps, sampling.

Shape legend: B batch, P prompt length (right-padded), S cache capacity, L layers that own keys and
values (`num_layers // kv_share`), K key/value heads, H head dim, V vocabulary.

Every function here is pure and jit-able; the model enters as `(graphdef, params, constants)`, as
in `posattn.train.steps`. A cache row stores the key of position p at index p, so the attention
core's conventions (query positions `q_offset + t`, key positions `arange(S)`, `kv_lengths` hiding
the unwritten rows) give every family its true positions with nothing family-specific here:

  * RoPE: keys are rotated at their own position when written; the query at the row's length.
  * Dynamic NTK: its frequencies depend on the current length L once L > m_l, so everything
    cached at an earlier length is stale: the keys' rotations (Hugging Face's cache keeps them:
    the "known pitfall"), and, from the second layer on, the keys and values themselves, since
    they were computed from hidden states that saw the older frequencies. No cache can be exact
    past m_l. `dynamic_ntk` chooses: "exact" (default) caches up to m_l and past it recomputes the
    whole prefix every step (the cache keeps the tokens for that): equal to a full forward, at
    the cost of no cache; "rerotate" caches un-rotated keys and rotates all of them at each use
    with the current frequencies (exact for one layer, stale values deeper); "hf" keeps the keys
    as written, as Hugging Face does. docs/decoding.md measures the three.
  * Relative biases: the bias function is evaluated at (true query position, cached key
    positions); FIRE's normaliser `psi(max(L, i))` therefore sees the true query position.
  * Absolute embeddings: added at the token's true position; a learned table never serves a
    position past its size (`init_cache` refuses such a capacity).
  * Cross-layer KV sharing: only the `L` owning layers have cache entries.
  * Sliding-window layers (`model.layer_pattern` entries with `window=`): a ring buffer of the
    last `window` keys (posattn.nn.window), memory O(window) per layer, when the capacity
    exceeds the window and the layer's position signal depends on `i - j` only; otherwise
    (FIRE, dynamic NTK, a RoPE remap, kv_share > 1) a full cache with the window applied by the
    mask.
  * FoX layers: the cache also keeps each key's `log f` [B, S, N] (float32), from which the
    attention core forms the cumulative sums `c_j`; the query reads `c` at its own row.
  * PaTH layers: a row holds its key as seen from the sequence's last position (moved through
    every reflection since, not as projected), so each step first moves the whole cache on by
    the new token's reflection (`posattn.attention.path_extend_keys`); the cache also keeps the
    w convolution's last two inputs [B, 2, K*H] (`path_conv`). Always a full cache: a ring's
    renumbering would not move its keys.

Rows may hold prompts of different lengths (`lengths`); each row then decodes at its own position.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posattn import rotary
from posattn.nn import layers
from posattn.nn.config import ModelConfig

__all__ = [
    "DYNAMIC_NTK_MODES",
    "KVCache",
    "cache_bytes",
    "check_generation",
    "decode_loop",
    "decode_step",
    "generate",
    "init_cache",
    "make_generate",
    "prefill",
    "sample",
]

DYNAMIC_NTK_MODES = ("exact", "rerotate", "hf")


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("k", "v", "lengths", "tokens", "log_forget", "gate_keys", "path_conv"),
    meta_fields=("keys_rotated", "recompute_past", "size"),
)
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Pre-allocated keys and values of every layer that owns them.

    Attributes:
      k: L arrays [B, S, K, H]: row p of a sequence holds the key of its position p (a PaTH
        layer's as seen from the sequence's last position).
      v: L arrays [B, S, K, H].
      lengths: int32[B], the number of positions written per sequence (its next position).
      tokens: int32[B, S], the tokens fed so far, kept only when a step may have to recompute the
        prefix (dynamic NTK, "exact"); None otherwise.
      keys_rotated: static. True: RoPE keys are cached rotated at their position. False: cached as
        projected and rotated at every use with the current frequencies (dynamic NTK "rerotate").
      recompute_past: static. A step whose length exceeds it recomputes the whole prefix from
        `tokens` (m_l for dynamic NTK "exact"); None never.
      log_forget: per layer, FoX's log f of the cached keys float32[B, rows, N], or None (a
        layer without forget gates); None for a model without FoX layers.
      gate_keys: per layer, CoPE's separate gate keys [B, rows, K, H] (`model.cope_gates=
        "separate"`), or None (another layer); None for a model without such layers.
      size: static, the capacity S (a sliding-window layer's ring holds fewer rows); None: the
        rows of the first layer.
      path_conv: per layer, a PaTH layer's last two inputs to its w convolution
        float32[B, 2, K*H] (`model.path_conv`), or None; None for a model without such layers.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array
    tokens: jax.Array | None = None
    keys_rotated: bool = True
    recompute_past: int | None = None
    log_forget: tuple[jax.Array | None, ...] | None = None
    size: int | None = None
    gate_keys: tuple[jax.Array | None, ...] | None = None
    path_conv: tuple[jax.Array | None, ...] | None = None

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1] if self.size is None else self.size

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values (and FoX's log f, CoPE's gate keys, PaTH's convolution
        inputs: what grows with batch and context)."""
        extra = tuple(a for layer in self._extras() for a in layer)
        return sum(x.size * x.dtype.itemsize for x in self.k + self.v + extra)

    def _extras(self) -> tuple[tuple[jax.Array, ...], ...]:
        """Per owning layer, its cached tensors beside k and v, in the order of `EXTRAS` (FoX's
        log f, CoPE's gate keys, PaTH's convolution inputs: those the layer has)."""
        fields = [getattr(self, name) or (None,) * len(self.k) for name in EXTRAS]
        return tuple(
            tuple(a for a in layer if a is not None) for layer in zip(*fields, strict=True)
        )

    def entries(self) -> tuple[tuple[jax.Array, ...], ...]:
        """Per owning layer, what `TransformerLM.extend` takes: (k, v) and the layer's extras
        (`_extras`), e.g. (k, v, log f)."""
        return tuple((k, v, *e) for k, v, e in zip(self.k, self.v, self._extras(), strict=True))


EXTRAS = ("log_forget", "gate_keys", "path_conv")  # a layer's entries after k and v, in order


def _dtype(cfg: ModelConfig):
    return jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32


def _dynamic_layout(cfg: ModelConfig, dynamic_ntk: str) -> tuple[bool, int | None]:
    """(keys_rotated, recompute_past) of a cache for this model and dynamic-NTK mode."""
    if dynamic_ntk not in DYNAMIC_NTK_MODES:
        raise ValueError(
            f"dynamic_ntk={dynamic_ntk!r} is not allowed: use one of "
            f"{', '.join(DYNAMIC_NTK_MODES)} "
            "('exact' recomputes the prefix past m_l, 'rerotate' rotates cached keys with the "
            "current frequencies, 'hf' keeps them as written)"
        )
    dynamic = [_dynamic_scaling(spec) for spec in cfg.layers]
    dynamic = [scaling for scaling in dynamic if scaling is not None]
    if not dynamic:
        return True, None  # frequencies independent of the length: caching is exact
    m_l = min(int(scaling["original_max_position_embeddings"]) for scaling in dynamic)
    return dynamic_ntk != "rerotate", (m_l if dynamic_ntk == "exact" else None)


def _dynamic_scaling(spec) -> dict | None:
    """The layer's rope_scaling dict when it is dynamic NTK, else None."""
    scaling = spec.settings.scaling_dict if spec.family.rotary else None
    return scaling if rotary.rope_kind(scaling) == "dynamic" else None


def _cache_rows(cfg: ModelConfig, spec, capacity: int) -> int:
    """Rows of one owning layer's cache: its window (a ring buffer) or the capacity."""
    w = spec.window
    relative = spec.family.bias is None or spec.family.bias.relative
    if spec.family.reflections:  # PaTH's cached keys move with every step: no renumbering
        return capacity
    if w is None or w >= capacity or cfg.kv_share != 1 or not relative:
        return capacity
    if spec.family.rotary and spec.settings.remap is not None:
        return capacity  # keys cached as projected, rotated at their far positions at each use
    return capacity if _dynamic_scaling(spec) is not None else w


def check_generation(cfg: ModelConfig, capacity: int) -> None:
    """Refuses, before any compute, a model or a length that cannot be decoded."""
    if not cfg.causal:
        raise ValueError(
            f"model.kind={cfg.kind!r} cannot generate: a bidirectional encoder's outputs depend on "
            "later tokens; decoding needs model.kind='decoder'"
        )
    if not (isinstance(capacity, int) and capacity >= 1):
        raise ValueError(
            f"cache capacity {capacity!r} must be a positive integer (prompt + new tokens - 1)"
        )
    try:
        cfg.settings.check_length(capacity)  # a learned table has no row past its size
    except ValueError as e:
        raise ValueError(
            f"cannot decode {capacity} positions (prompt + new tokens - 1): {e} (or shorten "
            "the prompt or max_new_tokens, or use a relative family)"
        ) from None


def init_cache(
    cfg: ModelConfig, *, batch_size: int, capacity: int, dynamic_ntk: str = "exact"
) -> KVCache:
    """An empty cache for `batch_size` sequences of up to `capacity` positions.

    Args:
      cfg: the model's configuration (K = num_kv_heads, L = num_layers // kv_share).
      batch_size: B.
      capacity: S, the most positions a sequence may hold (prompt + new tokens - 1).
      dynamic_ntk: "exact" (default), "rerotate" or "hf" (module docstring); matters only for
        RoPE with dynamic NTK scaling.

    Raises:
      ValueError: an encoder, or a learned-embedding model asked for more positions than its table.
    """
    check_generation(cfg, capacity)
    owners = [cfg.layers[i] for i in range(0, cfg.num_layers, cfg.kv_share)]
    rows = [_cache_rows(cfg, spec, capacity) for spec in owners]
    zeros = tuple(
        jnp.zeros((batch_size, r, cfg.num_kv_heads, cfg.head_dim), _dtype(cfg)) for r in rows
    )
    forget = tuple(
        jnp.zeros((batch_size, r, cfg.num_heads), jnp.float32) if s.family.forget else None
        for s, r in zip(owners, rows, strict=True)
    )
    gates = tuple(
        jnp.zeros_like(z) if _separate_gates(s) else None
        for s, z in zip(owners, zeros, strict=True)
    )
    convs = tuple(
        jnp.zeros((batch_size, 2, cfg.num_kv_heads * cfg.head_dim), jnp.float32)
        if _path_conv(s)
        else None
        for s in owners
    )
    keys_rotated, recompute_past = _dynamic_layout(cfg, dynamic_ntk)
    tokens = None if recompute_past is None else jnp.zeros((batch_size, capacity), jnp.int32)
    return KVCache(
        k=zeros,
        v=tuple(jnp.zeros_like(z) for z in zeros),
        lengths=jnp.zeros((batch_size,), jnp.int32),
        tokens=tokens,
        keys_rotated=keys_rotated,
        recompute_past=recompute_past,
        log_forget=forget if any(f is not None for f in forget) else None,
        size=capacity,
        gate_keys=gates if any(g is not None for g in gates) else None,
        path_conv=convs if any(c is not None for c in convs) else None,
    )


def _separate_gates(spec) -> bool:
    """Whether a layer caches CoPE's separate gate keys."""
    return spec.family.contextual and spec.settings.gates == "separate"


def _path_conv(spec) -> bool:
    """Whether a layer caches PaTH's w convolution inputs."""
    return spec.family.reflections and spec.settings.conv


def cache_bytes(cfg: ModelConfig, *, batch_size: int, capacity: int) -> int:
    """Bytes of a cache (no allocation): 2 B S_l K H itemsize per owning layer, S_l its rows
    (the capacity, or a sliding window's ring), plus 4 B S_l N for a FoX layer's log f,
    B S_l K H itemsize for CoPE's separate gate keys and 4 B 2 K H for a PaTH layer's
    convolution inputs."""
    itemsize = jnp.dtype(_dtype(cfg)).itemsize
    total = 0
    for spec in (cfg.layers[i] for i in range(0, cfg.num_layers, cfg.kv_share)):
        rows = _cache_rows(cfg, spec, capacity)
        total += 2 * batch_size * rows * cfg.num_kv_heads * cfg.head_dim * itemsize
        if spec.family.forget is not None:
            total += batch_size * rows * cfg.num_heads * 4
        if _separate_gates(spec):
            total += batch_size * rows * cfg.num_kv_heads * cfg.head_dim * itemsize
        if _path_conv(spec):
            total += batch_size * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    return total


def _concrete(x) -> np.ndarray | None:
    """x as numpy when its value is known (eager call), None under a trace."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _poison(logits: jax.Array, bad: jax.Array) -> jax.Array:
    """NaN logits for rows that are wrong (used only where a traced value cannot raise)."""
    return jnp.where(bad[:, None], jnp.nan, logits)


def prefill(
    graphdef: nnx.GraphDef, params, constants, cache: KVCache, tokens: jax.Array, lengths: jax.Array
) -> tuple[jax.Array, KVCache]:
    """Runs the prompts through the model, filling the cache from position 0.

    Args:
      graphdef, params, constants: the model, split as in `posattn.train.steps.init_model`.
      cache: a cache from `init_cache` (its previous contents are overwritten).
      tokens: int[B, P] right-padded prompts, P <= capacity.
      lengths: int[B] prompt lengths, 1 <= lengths <= P.

    Returns:
      (logits float32[B, V] of each row's last prompt token, the cache with `lengths` positions).
    """
    B, P = tokens.shape
    if P > cache.capacity:
        raise ValueError(
            f"prompt length {P} exceeds the cache capacity {cache.capacity}; make a larger cache"
        )
    lengths = jnp.asarray(lengths, jnp.int32)
    known = _concrete(lengths)
    if known is not None and (known.shape != (B,) or known.min() < 1 or known.max() > P):
        raise ValueError(f"prompt lengths must be int[{B}] in [1, {P}], got {known.tolist()}")
    model = nnx.merge(graphdef, params, constants)
    h, kvs = model.extend(
        tokens,
        cache.entries(),
        q_offset=0,
        kv_lengths=lengths,
        seq_len=lengths,
        keys_rotated=cache.keys_rotated,
        attend_len=P,
    )  # (B, P, D)
    last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]  # (B, D)
    logits = _poison(model.logits(last), (lengths < 1) | (lengths > P))
    kept = (
        None
        if cache.tokens is None
        else layers.write_rows(cache.tokens[..., None], tokens[..., None], 0)[..., 0]
    )
    return logits, _replace(cache, kvs, lengths, kept)


def decode_step(
    graphdef: nnx.GraphDef, params, constants, cache: KVCache, tokens: jax.Array
) -> tuple[jax.Array, KVCache]:
    """Feeds one token per row at the row's next position.

    Args:
      graphdef, params, constants: the model.
      cache: holding `cache.lengths` positions per row.
      tokens: int[B], the token at position `cache.lengths` of each row.

    Returns:
      (logits float32[B, V] predicting the following token, the cache one position longer).
      A row already at capacity raises when called eagerly; under jit its logits are NaN (its key
      is not written: nothing is silently clamped).
    """
    position = cache.lengths  # (B,)
    new_len = position + 1
    known = _concrete(new_len)
    if known is not None and known.max() > cache.capacity:
        raise ValueError(
            f"decoding position {known.max() - 1} overflows the cache capacity {cache.capacity}; "
            "make a larger cache (prompt + new tokens - 1)"
        )
    if cache.recompute_past is None:
        return _cached_step(graphdef, params, constants, cache, tokens)
    # Dynamic NTK, "exact": past m_l every cached key and value is stale, so recompute the prefix.
    kept = layers.write_rows(cache.tokens[..., None], tokens[:, None, None], position)[
        ..., 0
    ]  # (B, S)

    def recompute(cache):
        logits, cache = prefill(graphdef, params, constants, cache, kept, new_len)
        return _poison(logits, new_len > cache.capacity), cache

    def cached(cache):
        logits, cache = _cached_step(graphdef, params, constants, cache, tokens)
        return logits, dataclasses.replace(cache, tokens=kept)

    return jax.lax.cond(jnp.any(new_len > cache.recompute_past), recompute, cached, cache)


def _cached_step(
    graphdef, params, constants, cache: KVCache, tokens: jax.Array
) -> tuple[jax.Array, KVCache]:
    position = cache.lengths  # (B,)
    new_len = position + 1
    model = nnx.merge(graphdef, params, constants)
    h, kvs = model.extend(
        tokens[:, None],
        cache.entries(),
        q_offset=position,
        kv_lengths=new_len,
        seq_len=new_len,
        keys_rotated=cache.keys_rotated,
    )  # (B, 1, D)
    logits = _poison(model.logits(h[:, 0]), new_len > cache.capacity)
    return logits, _replace(cache, kvs, new_len, cache.tokens)


def _replace(cache: KVCache, kvs, lengths, tokens) -> KVCache:
    k = tuple(entry[0] for entry in kvs)
    v = tuple(entry[1] for entry in kvs)
    # Each layer's extras go back where they came from, in the order `entries` gave them.
    extras = {name: getattr(cache, name) for name in EXTRAS}
    updated = {name: [] for name in EXTRAS if extras[name] is not None}
    for i, entry in enumerate(kvs):
        rest = iter(entry[2:])
        for name in updated:
            updated[name].append(None if extras[name][i] is None else next(rest))
    updated = {name: tuple(layers_) for name, layers_ in updated.items()}
    return dataclasses.replace(cache, k=k, v=v, lengths=lengths, tokens=tokens, **updated)


def sample(
    logits: jax.Array, key: jax.Array | None, *, temperature: float = 0.0, top_k: int = 0
) -> jax.Array:
    """Next tokens int32[B] from logits[B, V].

    Args:
      logits: float[B, V].
      key: a PRNG key (unused when greedy).
      temperature: 0 is greedy (argmax); otherwise logits / temperature are sampled.
      top_k: keep the k largest logits per row (0 keeps all); ties at the k-th value are kept.
    """
    _check_sampling(temperature, top_k, logits.shape[-1])
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]  # (B, 1)
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _check_sampling(temperature, top_k, vocab_size) -> None:
    if not (
        isinstance(temperature, (int, float)) and np.isfinite(temperature) and temperature >= 0
    ):
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0 is greedy)")
    if not (isinstance(top_k, int) and 0 <= top_k <= vocab_size):
        raise ValueError(
            f"top_k={top_k!r} must be an integer in [0, {vocab_size}] (0 keeps every token)"
        )


def decode_loop(
    graphdef: nnx.GraphDef,
    params,
    constants,
    cache: KVCache,
    tokens: jax.Array,
    key: jax.Array,
    *,
    steps: int,
    first_step: int = 1,
    temperature: float = 0.0,
    top_k: int = 0,
) -> tuple[jax.Array, KVCache]:
    """`steps` decode steps in one `lax.scan`: feed tokens[B], sample the next, feed it, ...

    Step t (counted from `first_step`) samples with `fold_in(key, t)`, so a generation is a pure
    function of (key, step) however it is split into calls.

    Returns:
      (int32[B, steps] the sampled tokens, the cache).
    """

    def body(carry, t):
        cache, tok = carry
        logits, cache = decode_step(graphdef, params, constants, cache, tok)
        nxt = sample(logits, jax.random.fold_in(key, t), temperature=temperature, top_k=top_k)
        return (cache, nxt), nxt

    (cache, _), out = jax.lax.scan(
        body, (cache, tokens), first_step + jnp.arange(steps, dtype=jnp.int32)
    )
    return out.T, cache  # (B, steps)


def _generate_cached(
    graphdef,
    params,
    constants,
    prompts,
    lengths,
    key,
    *,
    max_new_tokens,
    temperature,
    top_k,
    dynamic_ntk,
    cfg,
):
    B, P = prompts.shape
    cache = init_cache(cfg, batch_size=B, capacity=P + max_new_tokens - 1, dynamic_ntk=dynamic_ntk)
    logits, cache = prefill(graphdef, params, constants, cache, prompts, lengths)
    first = sample(logits, jax.random.fold_in(key, 0), temperature=temperature, top_k=top_k)
    rest, _ = decode_loop(
        graphdef,
        params,
        constants,
        cache,
        first,
        key,
        steps=max_new_tokens - 1,
        temperature=temperature,
        top_k=top_k,
    )
    return jnp.concatenate([first[:, None], rest], axis=1)  # (B, max_new_tokens)


def _generate_uncached(
    graphdef,
    params,
    constants,
    prompts,
    lengths,
    key,
    *,
    max_new_tokens,
    temperature,
    top_k,
    dynamic_ntk,
    cfg,
):
    """The oracle: a full forward over the whole prefix for every new token, no cache."""
    del dynamic_ntk, cfg  # a full forward is exact for every family
    B, P = prompts.shape
    width = P + max_new_tokens - 1  # every position ever fed to the model
    buffer = jnp.zeros((B, width), prompts.dtype).at[:, :P].set(prompts)
    model = nnx.merge(graphdef, params, constants)

    def body(carry, t):
        buffer, length = carry
        logits = model(buffer, kv_lengths=length)  # (B, W, V); a row's padding is hidden from it
        last = jnp.take_along_axis(logits, (length - 1)[:, None, None], axis=1)[:, 0]  # (B, V)
        nxt = sample(last, jax.random.fold_in(key, t), temperature=temperature, top_k=top_k)
        buffer = layers.write_rows(buffer[..., None], nxt[:, None, None], length)[..., 0]
        return (buffer, length + 1), nxt

    _, out = jax.lax.scan(
        body, (buffer, jnp.asarray(lengths, jnp.int32)), jnp.arange(max_new_tokens, dtype=jnp.int32)
    )
    return out.T


def make_generate(
    graphdef: nnx.GraphDef,
    cfg: ModelConfig,
    *,
    prompt_len: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    use_cache: bool = True,
    dynamic_ntk: str = "exact",
):
    """A jitted `(params, constants, prompts int[B, P], lengths int[B], key) ->
    int32[B, max_new_tokens]`.

    Checks every static setting first (model kind, learned table size, sampling settings).
    """
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
    check_generation(cfg, prompt_len + max_new_tokens - 1)
    _check_sampling(temperature, top_k, cfg.vocab_size)
    _dynamic_layout(cfg, dynamic_ntk)
    run = _generate_cached if use_cache else _generate_uncached
    fn = functools.partial(
        run,
        graphdef,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        dynamic_ntk=dynamic_ntk,
        cfg=cfg,
    )
    return jax.jit(fn)


def generate(
    graphdef: nnx.GraphDef,
    params,
    constants,
    cfg: ModelConfig,
    prompts: list[Any],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    key: jax.Array | None = None,
    use_cache: bool = True,
    dynamic_ntk: str = "exact",
) -> np.ndarray:
    """Continues each prompt (a sequence of token ids) by `max_new_tokens` tokens.

    Args:
      graphdef, params, constants: the model; cfg its configuration.
      prompts: B non-empty sequences of token ids, of any lengths (right-padded here).
      max_new_tokens: how many tokens to add to each.
      temperature, top_k: see `sample`; temperature 0 is greedy.
      key: PRNG key for sampling (default `jax.random.key(0)`); step t uses `fold_in(key, t)`.
      use_cache: False recomputes the full forward for every token (the oracle, `--no_cache`).
      dynamic_ntk: "exact", "rerotate" or "hf" (see the module docstring).

    Returns:
      int32[B, max_new_tokens] numpy array of new tokens.
    """
    rows = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    if not rows or any(r.size == 0 for r in rows):
        raise ValueError(
            "generate needs at least one prompt and every prompt needs at least one token"
        )
    if any(r.min() < 0 or r.max() >= cfg.vocab_size for r in rows):
        raise ValueError(f"prompt token ids must lie in [0, {cfg.vocab_size})")
    lengths = np.array([r.size for r in rows], np.int32)
    tokens = np.zeros((len(rows), lengths.max()), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : r.size] = r
    fn = make_generate(
        graphdef,
        cfg,
        prompt_len=tokens.shape[1],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        use_cache=use_cache,
        dynamic_ntk=dynamic_ntk,
    )
    key = jax.random.key(0) if key is None else key
    return np.asarray(fn(params, constants, jnp.asarray(tokens), jnp.asarray(lengths), key))
