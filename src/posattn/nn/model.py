"""Language models: a decoder-only LM and a bidirectional encoder (tied embeddings by default).

Shape legend: B batch, T length, D d_model, V vocabulary.

`TransformerLM(cfg, rngs=...)` builds either, by `cfg.kind`:
  * "decoder": causal attention, next-token logits;
  * "encoder": bidirectional attention (T5's bidirectional buckets are used for real here),
    trained to recover masked bytes; its input vocabulary has one extra `[MASK]` id = V.
Sizes go from `configs/tiny.py` to GPT-2 small (`configs/gpt2_small.py`).

One forward, `TransformerLM.forward(tokens, cache=None, ...)`: without a cache (training,
evaluation: `hidden`, `__call__`) or with one (decoding: `extend`, posattn.nn.decode). Its layer
loop has one body for the scanned and the unrolled stacks (remat and cross-layer KV sharing are
handled there), and each block runs the one attention path of `layers.Attention`.

Settings for large models, none of which changes the function computed:
  * `cfg.remat`: "full" recomputes each block in the backward pass (`jax.checkpoint`, saving only
    its input), "dots" keeps the outputs of its matrix products without batch dimensions (the
    projections and the MLP: `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`) and
    recomputes the rest (attention, norms, activations).
  * `cfg.scan_layers`: the blocks' parameters are stacked on a leading layer axis and run by one
    `lax.scan`, so the program holds one block whatever the depth. The parameter paths differ
    from the default layout ("blocks/attn/wq" [L, D, N, H] instead of "blocks/<i>/attn/wq"
    [D, N, H]); `convert_layout` moves states between the two. Modules shared by every layer
    (RoPE frequencies, T5's table) live on the model (`rotary`, `shared_bias`). The stack is made
    of the per-layer blocks, drawn in the unrolled order, so a seed gives the same model in both
    layouts: `convert_layout` of the unrolled init is the scanned init.
  * `cfg.param_dtype`: the storage dtype of the embeddings, projections and norm scales.
  * `nll_sums`, the training and evaluation loss, never holds the logits of the whole batch: it
    projects and scores a slice of positions at a time (recomputing each slice in the backward).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from posattn import positions
from posattn.attention import StickBreaking
from posattn.nn import contextual, layers
from posattn.nn import forget as forget_lib
from posattn.nn import path as path_lib
from posattn.nn import temperature as temperature_lib
from posattn.nn.config import ModelConfig

__all__ = ["TransformerLM", "convert_layout", "cross_entropy", "mask_token_id"]

# Largest number of float32 logits a slice of `TransformerLM.nll_sums` holds (128 MiB; the global
# batch's, so a device holds at most its share).
LOSS_LOGITS_BUDGET = 32 * 1024 * 1024

_REMAT_POLICIES = {
    "full": None,  # save nothing but the block's input
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _maybe_remat(fn, remat: str, *, after_cotangent: bool = False):
    """`fn` rematerialised as `model.remat` asks ("none" leaves it as is).

    `after_cotangent` makes the recomputation wait for the cotangent of `fn`'s output: its
    residuals pass through one `lax.optimization_barrier` together with that cotangent, and take a
    data dependency on it. Without the gate, nothing stops a scheduler from recomputing the blocks
    of an unrolled stack early in the backward pass and holding every result, as XLA:CPU does:
    `compiled.memory_analysis()` of a 4-layer training step reported the same temporaries with and
    without `jax.checkpoint` (benchmarks/scaling_model.py measures it with the gate). A scan needs
    no gate: its backward loop only sees one layer's residuals at a time. Every value `fn` is
    differentiated with respect to must be an argument (a closure over one would be a constant).
    """
    if remat == "none":
        return fn
    inner = jax.checkpoint(fn, policy=_REMAT_POLICIES[remat])
    if not after_cotangent:
        return inner

    @jax.custom_vjp
    def gated(*args):
        return fn(*args)

    def forward(*args):
        return jax.vjp(inner, *args)  # (output, the pullback holding the saved residuals)

    def backward(pullback, cotangent):
        pullback, cotangent = jax.lax.optimization_barrier((pullback, cotangent))
        # XLA:CPU drops optimization barriers before scheduling; a data dependency stays. `* 0`
        # is kept by XLA for floats (inf * 0 is NaN), so the residuals now depend on the cotangent.
        floats = [c for c in jax.tree.leaves(cotangent) if jnp.issubdtype(c.dtype, jnp.floating)]
        anchor = sum(c.reshape(-1)[0].astype(jnp.float32) for c in floats if c.size) * 0.0
        pullback = jax.tree.map(
            lambda r: r + anchor.astype(r.dtype) if jnp.issubdtype(r.dtype, jnp.floating) else r,
            pullback,
        )
        return pullback(cotangent)

    gated.defvjp(forward, backward)
    return gated


# The layers run through JAX's own transforms (jax.checkpoint, lax.scan) on split module states,
# not through nnx.remat / nnx.scan: those refuse modules whose variables were made at another
# trace level, which is how a model merged from non-differentiated arguments (the constants)
# reaches them under `jax.grad`.


def mask_token_id(cfg: ModelConfig) -> int:
    """The encoder's `[MASK]` input id (one past the output vocabulary)."""
    return cfg.vocab_size


class TransformerLM(nnx.Module):
    """Decoder-only LM (or bidirectional encoder) composed from the family registry."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        family = cfg.family
        D = cfg.d_model
        self.cfg = cfg
        vocab_in = cfg.vocab_size + (0 if cfg.causal else 1)
        # fairseq's transformer_lm (the ALiBi paper's code): embeddings ~ N(0, D^-1/2) multiplied
        # by sqrt(D) at the input, learned positions ~ N(0, D^-1/2) added unscaled.
        pdt = layers.compute_dtype(cfg.param_dtype)
        self.embed = nnx.Param(
            (
                cfg.init_scale / math.sqrt(D) * jax.random.normal(rngs.params(), (vocab_in, D))
            ).astype(pdt)
        )
        if family.embedding == "learned":  # a table of the family's max_positions rows
            self.pos_embed = nnx.Param(
                (
                    cfg.init_scale
                    / math.sqrt(D)
                    * jax.random.normal(rngs.params(), (cfg.max_positions, D))
                ).astype(pdt)
            )
        # The family's modules get the family's own settings; the blocks get plain sizes. Each
        # layer's family comes from `cfg.layers` (model.layer_pattern, or model.position for
        # all): layers of equal settings share one Rotary, and one bias where the family's spec
        # shares it across layers (T5, Kerple by default), as with a single family.
        specs = cfg.layers
        rotaries, shared_biases = {}, {}
        for spec in dict.fromkeys(specs):
            fam = spec.family
            if fam.rotary:
                rotaries.setdefault(spec.settings, layers.Rotary(cfg.head_dim, spec.settings))
            key = (spec.position, spec.settings)
            if fam.bias is not None and fam.bias.shared(spec.settings) and key not in shared_biases:
                shared_biases[key] = layers.PositionBias(
                    fam.bias, cfg.context, spec.settings, rngs=rngs
                )

        if cfg.embed_norm:  # BLOOM's word_embeddings_layernorm
            self.embed_norm = layers.make_norm(D, cfg.arch, param_dtype=pdt)
        # Both layouts draw the blocks' initial values in the same order, layer by layer (a
        # scanned stack is the per-layer blocks stacked), so a seed gives one model in either.
        blocks = _blocks(cfg, rotaries, shared_biases, scanned=cfg.scan_layers, rngs=rngs)
        if cfg.scan_layers:  # identical layers (validated): the first spec is every layer's
            self.rotary = rotaries.get(specs[0].settings)
            self.shared_bias = shared_biases.get((specs[0].position, specs[0].settings))
            self.blocks = _stack(blocks)
        else:
            self.blocks = nnx.List(blocks)
        self.final_norm = layers.make_norm(D, cfg.arch, param_dtype=pdt)
        self._init_head(rngs)

    def _init_head(self, rngs: nnx.Rngs) -> None:
        """A separate output table `head` [V, D] when the logits are not tied to `embed`."""
        cfg = self.cfg
        if not cfg.tie_embeddings:
            std = cfg.init_scale / math.sqrt(cfg.d_model)
            table = std * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model))
            self.head = nnx.Param(table.astype(layers.compute_dtype(cfg.param_dtype)))

    def output_table(self) -> jax.Array:
        """The output projection's table float32[V, D]: `embed`'s first V rows, or `head`."""
        table = self.embed[...] if self.cfg.tie_embeddings else self.head[...]
        return table[: self.cfg.vocab_size].astype(jnp.float32)

    def embed_tokens(self, tokens: jax.Array, *, q_offset=0) -> jax.Array:
        """Token embeddings plus the absolute position embedding, if the family has one."""
        cfg, family = self.cfg, self.cfg.family
        rows = jnp.take(self.embed[...], tokens, axis=0).astype(jnp.float32)  # (B, T, D)
        x = rows * math.sqrt(cfg.d_model) if cfg.embed_scale == "sqrt_d" else rows
        pos = layers.token_positions(q_offset, tokens.shape[1])  # (T,) or (B, T)
        if family.embedding == "sinusoidal":
            x = x + _sinusoidal(pos, cfg.d_model)
        elif family.embedding == "learned":
            x = x + positions.learned_embedding(self.pos_embed[...].astype(jnp.float32), pos)
        if cfg.embed_norm:
            x = self.embed_norm(x)
        return x.astype(layers.compute_dtype(cfg.dtype))

    def forward(
        self,
        tokens: jax.Array,
        cache=None,
        *,
        q_offset=0,
        kv_lengths=None,
        seq_len=None,
        keys_rotated: bool = True,
        attend_len: int | None = None,
    ):
        """The one forward pass: final normalised hidden states of tokens at positions
        q_offset + t, with or without a KV cache. `hidden` (training, evaluation) and `extend`
        (decoding) are this function.

        Args:
          tokens: int[B, T].
          cache: None (nothing kept: positions 0..T-1), or one entry per layer that owns its
            keys/values (`num_layers // kv_share` of them: the layers of a sharing group read
            their owner's): (k, v), [B, S, K, H] each; a FoX layer's (k, v, log f [B, S, N]); a
            PaTH layer's keys moved through its reflections, its log f, its convolution inputs
            (`Attention._path_call`); a sliding-window layer's may be a ring buffer of `window`
            rows (posattn.nn.window).
          q_offset, kv_lengths, seq_len, keys_rotated, attend_len: as `layers.Attention`.

        Returns:
          (hidden float32[B, T, D], the updated cache entries, or None without a cache).
        """
        x = self.embed_tokens(tokens, q_offset=q_offset)
        step = dict(q_offset=q_offset, kv_lengths=kv_lengths, seq_len=seq_len)
        if cache is not None:
            step.update(keys_rotated=keys_rotated, attend_len=attend_len)
        x, cache = self._layers(x, cache, step)
        return self.final_norm(x).astype(jnp.float32), cache

    def _layers(self, x: jax.Array, cache, step: dict):
        """The blocks on x[B, T, D], scanned or unrolled: one layer body for both layouts.

        The body runs one block with its group's entry: without a cache, the keys/values of the
        group's owner for the layers that share them (None at an owner); with a cache, the
        group's cache. Remat wraps the body for training (a cached forward is decoding, never
        differentiated).
        """
        cfg = self.cfg
        cached = cache is not None
        shared = (self.rotary, self.shared_bias) if cfg.scan_layers else None

        def body(block, x, entry):
            kv = dict(cache=entry) if cached else dict(kv=entry)
            return block(x, shared=shared, **kv, **step)

        def split_body(state, x, entry, graphdef):
            return body(nnx.merge(graphdef, state), x, entry)

        remat = "none" if cached else cfg.remat
        if cfg.scan_layers:  # kv_share is 1: every layer owns its entry, stacked for the scan
            graphdef, stacked = nnx.split(self.blocks)
            layer = _maybe_remat(functools.partial(split_body, graphdef=graphdef), remat)

            def scan_body(x, xs):
                state, entry = xs
                x, entry = layer(state, x, entry)
                return x, entry if cached else None

            # Stacked for the scan and unstacked after it: a copy of the cache per call.
            entries = (
                tuple(jnp.stack(parts) for parts in zip(*cache, strict=True)) if cached else None
            )
            x, out = jax.lax.scan(scan_body, x, (stacked, entries))  # (k, v[, log f]) stacked
            if cached:
                out = tuple(tuple(part[i] for part in out) for i in range(cfg.num_layers))
            return x, out
        entries = list(cache) if cached else [None] * (cfg.num_layers // cfg.kv_share)
        for i, block in enumerate(self.blocks):
            group = i // cfg.kv_share  # the first layer of a group owns its keys/values
            if remat == "none":
                x, entries[group] = body(block, x, entries[group])
                continue
            graphdef, state = nnx.split(block)
            layer = _maybe_remat(
                functools.partial(split_body, graphdef=graphdef), remat, after_cotangent=True
            )
            x, entries[group] = layer(state, x, entries[group])
        return x, tuple(entries) if cached else None

    def hidden(self, tokens: jax.Array, *, kv_lengths=None) -> jax.Array:
        """Final normalised hidden states [B, T, D] (float32) of tokens at positions 0..T-1
        (`forward` without a cache)."""
        return self.forward(tokens, kv_lengths=kv_lengths)[0]

    def extend(
        self,
        tokens: jax.Array,
        kvs,
        *,
        q_offset,
        kv_lengths,
        seq_len,
        keys_rotated: bool = True,
        attend_len: int | None = None,
    ):
        """Hidden states of a chunk of tokens at positions q_offset + t, reading and writing a KV
        cache (`forward` with a cache; the cache itself and its bookkeeping live in
        `posattn.nn.decode`).

        Args:
          tokens: int[B, T], the chunk (a prompt, or one new token per row).
          kvs: the cache entries, one per layer that owns its keys/values (`forward`'s `cache`).
          q_offset, kv_lengths, seq_len, keys_rotated, attend_len: as `layers.Attention`.

        Returns:
          (hidden float32[B, T, D], the updated kvs).
        """
        return self.forward(
            tokens,
            tuple(kvs),
            q_offset=q_offset,
            kv_lengths=kv_lengths,
            seq_len=seq_len,
            keys_rotated=keys_rotated,
            attend_len=attend_len,
        )

    def logits(self, h: jax.Array) -> jax.Array:
        """Output projection (tied or `head`): h[B, T, D] -> logits[B, T, V] in float32, soft-capped
        when `model.final_logit_softcap` is set."""
        return self._project(h, self.output_table())

    def _project(self, h: jax.Array, table: jax.Array) -> jax.Array:
        """h[..., D] times table[V, D]^T in float32, then c tanh(z / c) with
        `final_logit_softcap` c (Gemma 2)."""
        z = layers.dense(h.astype(jnp.float32), table.T)
        cap = self.cfg.final_logit_softcap
        return cap * jnp.tanh(z / cap) if cap else z

    def __call__(self, tokens: jax.Array, *, kv_lengths=None) -> jax.Array:
        """Logits float32[B, T, V] for tokens int[B, T] at positions 0..T-1."""
        return self.logits(self.hidden(tokens, kv_lengths=kv_lengths))

    def nll_sums(
        self,
        h: jax.Array,
        targets: jax.Array,
        weights: jax.Array | None = None,
        *,
        chunk: int | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """(sum of weighted target NLL in nats, sum of weights) of hidden states h[B, T, D].

        The logits float32[B, T, V] are never held at once: positions go through the output
        projection and the log-softmax `chunk` at a time (a `lax.scan` over slices [B, chunk, V]),
        and each slice is recomputed in the backward pass (`jax.checkpoint`), so the gradient
        holds one slice too. Slicing positions (not rows) keeps every slice split over the batch's
        devices. By default `chunk` keeps a slice within `LOSS_LOGITS_BUDGET` logits; when the
        whole batch fits, it is one slice, computed directly.

        Args:
          h: final hidden states (`hidden`).
          targets: int[B, T] next tokens (or masked bytes).
          weights: optional [B, T]; positions of weight 0 do not count.
          chunk: positions per slice (T is padded to a multiple of it with weight 0).
        """
        B, T, D = h.shape
        weights = jnp.ones((B, T), jnp.float32) if weights is None else weights.astype(jnp.float32)
        targets = targets.astype(jnp.int32)
        if chunk is None:
            chunk = max(1, LOSS_LOGITS_BUDGET // (B * self.cfg.vocab_size))
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk={chunk!r} must be a positive number of positions")
        table = self.output_table()  # (V, D)

        def sums(h_c, t_c, w_c, table):  # [B, c, D], [B, c], [B, c]
            logits = self._project(h_c, table)  # (B, c, V)
            nll = (
                jax.nn.logsumexp(logits, axis=-1)
                - jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0]
            )  # (B, c)
            return jnp.sum(nll * w_c), jnp.sum(w_c)

        if chunk >= T:
            return sums(h, targets, weights, table)
        n = -(-T // chunk)
        pad = n * chunk - T

        def slices(x):  # [B, T, ...] -> [n, B, chunk, ...]
            x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
            return x.reshape(B, n, chunk, *x.shape[2:]).swapaxes(0, 1)

        recomputed = jax.checkpoint(sums)

        def step(carry, xs):
            s, c = recomputed(*xs, table)
            return (carry[0] + s, carry[1] + c), None

        zero = jnp.zeros((), jnp.float32)
        (total, count), _ = jax.lax.scan(
            step, (zero, zero), (slices(h), slices(targets), slices(weights))
        )
        return total, count


def _sinusoidal(pos: jax.Array, dim: int) -> jax.Array:
    if pos.ndim == 1:
        return positions.sinusoidal(pos, dim)  # (T, D)
    return jax.vmap(lambda p: positions.sinusoidal(p, dim))(pos)  # (B, T, D)


def cross_entropy(
    logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None
) -> jax.Array:
    """Mean next-token cross-entropy in nats over the positions with nonzero weight."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[
        ..., 0
    ]  # (B, T)
    if weights is None:
        return jnp.mean(nll)
    weights = weights.astype(jnp.float32)
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def _block(
    cfg: ModelConfig, spec=None, *, owns_kv, rotary_module, bias_module, rngs
) -> layers.Block:
    """One transformer block of `cfg` with the position settings `spec` (a
    `pattern.LayerSpec`; None: the first layer's), from plain sizes (the layers never read a
    ModelConfig)."""
    spec = cfg.layers[0] if spec is None else spec
    return layers.Block(
        cfg.d_model,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.ff_dim,
        num_layers=cfg.num_layers,
        causal=cfg.causal,
        scale_free=spec.family.scale_free,
        init_scale=cfg.init_scale,
        implementation=cfg.attention_impl,
        dtype=layers.compute_dtype(cfg.dtype),
        param_dtype=layers.compute_dtype(cfg.param_dtype),
        owns_kv=owns_kv,
        rotary_module=rotary_module,
        bias_module=bias_module,
        rngs=rngs,
        **_position_layer(cfg, spec, rngs),
        head_dim=cfg.head_dim,
        arch=cfg.arch,
    )


def _position_layer(cfg: ModelConfig, spec, rngs) -> dict:
    """The per-layer position modules of `spec` (none by default: the default tree is today's)."""
    out = {}
    if spec.window is not None:
        out["window"] = spec.window
    if spec.temperature:
        out["temperature"] = temperature_lib.QueryTemperature(
            cfg.num_heads,
            attn_scale=spec.attn_scale,
            floor_scale=spec.floor_scale,
            ssmax=spec.ssmax,
            window=spec.window,
            causal=cfg.causal,
        )
    if spec.family.normalizer == "stick_breaking":
        out["stick_breaking"] = StickBreaking(
            spec.settings.remainder, float(spec.settings.logit_bias)
        )
    if spec.family.contextual:
        out["cope"] = contextual.CopeTable(
            cfg.head_dim,
            spec.settings.table_size,
            scale_positions=spec.settings.scale_positions,
            gates=spec.settings.gates,
            param_dtype=layers.compute_dtype(cfg.param_dtype),
        )
    if spec.family.reflections:
        out["path"] = path_lib.Reflections(
            cfg.d_model,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            rank=spec.settings.w_rank,
            conv=spec.settings.conv,
            init_scale=cfg.init_scale,
            param_dtype=layers.compute_dtype(cfg.param_dtype),
            rngs=rngs,
        )
    if spec.family.forget is not None:
        out["forget"] = forget_lib.ForgetGate(
            cfg.d_model,
            cfg.num_heads,
            init_scale=cfg.init_scale,
            bias_init=spec.family.forget.bias_init,
            param_dtype=layers.compute_dtype(cfg.param_dtype),
            rngs=rngs,
        )
    return out


def _blocks(cfg: ModelConfig, rotaries, shared_biases, *, scanned: bool, rngs) -> list:
    """The blocks of `cfg`, layer by layer, each drawing its initial values from `rngs` in turn.

    A layer's own bias (FIRE, Kerple per layer) is drawn before its block. The modules shared by
    several layers (`rotaries`, `shared_biases`, made before) are handed to the per-layer blocks;
    a block of a scanned stack holds neither (the model hands them to each call), so that the
    blocks can be stacked.
    """
    out = []
    for i, spec in enumerate(cfg.layers):
        fam = spec.family
        own_bias = fam.bias is not None and not fam.bias.shared(spec.settings)
        if own_bias:
            bias = layers.PositionBias(fam.bias, cfg.context, spec.settings, rngs=rngs)
        else:
            bias = None if scanned else shared_biases.get((spec.position, spec.settings))
        rotary_module = None if scanned or not fam.rotary else rotaries.get(spec.settings)
        out.append(
            _block(
                cfg,
                spec,
                owns_kv=i % cfg.kv_share == 0,
                rotary_module=rotary_module,
                bias_module=bias,
                rngs=rngs,
            )
        )
    return out


def _stack(blocks: list) -> layers.Block:
    """Identical blocks as one Block whose variables have a leading layer axis."""
    split = [nnx.split(block) for block in blocks]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(state for _, state in split))
    return nnx.merge(split[0][0], stacked)


def convert_layout(tree, cfg: ModelConfig, *, scan_layers: bool):
    """Every `nnx.State` in `tree` (parameters, constants, AdamW's moments) in the layer layout
    `scan_layers` asks for: stacked on a leading layer axis (True) or one entry per layer (False).

    A train state written with one `model.scan_layers` setting restores under the other after
    this conversion (of the restored state, or of the target's abstract state in reverse). The
    values are unchanged, so both layouts compute the same losses.

    Args:
      tree: a pytree holding `nnx.State`s of a `TransformerLM` built from `cfg` (with either
        `scan_layers`; the other fields of `cfg` must match).
      cfg: the model's configuration (its `scan_layers` field is ignored).
      scan_layers: the layout to produce.
    """
    if scan_layers and cfg.kv_share != 1:
        raise ValueError(
            f"model.kv_share={cfg.kv_share} has no scanned layout "
            "(model.scan_layers needs kv_share=1)"
        )
    if scan_layers and len(set(cfg.layers)) > 1:
        raise ValueError(
            f"model.layer_pattern={cfg.layer_pattern!r} gives different layers, which have no "
            "scanned layout (model.scan_layers needs identical layers)"
        )
    layer = cfg.layers[0]  # a scanned layout exists only for identical layers
    spec = layer.family.bias
    shared_bias = spec is not None and spec.shared(layer.settings)
    L = cfg.num_layers

    def value(v):
        return v.get_value() if isinstance(v, nnx.Variable) else v

    def like(v, new):
        return v.replace(new) if isinstance(v, nnx.Variable) else new

    def stack(state: nnx.State) -> nnx.State:
        out, layers_of = [], {}
        for path, v in nnx.to_flat_state(state):
            if path[0] != "blocks":
                out.append((path, v))
                continue
            if not isinstance(path[1], int):
                raise ValueError(
                    f"state entry {'/'.join(map(str, path))} is already stacked "
                    "(model.scan_layers=True layout); nothing to convert"
                )
            i, rest = path[1], path[2:]
            if rest[:2] == ("attn", "rotary"):
                out.append((("rotary", *rest[2:]), v))
            elif shared_bias and rest[:2] == ("attn", "bias"):
                out.append((("shared_bias", *rest[2:]), v))
            else:
                layers_of.setdefault(rest, {})[i] = v
        for rest, per_layer in layers_of.items():
            if sorted(per_layer) != list(range(L)):
                raise ValueError(
                    f"state entry blocks/<i>/{'/'.join(map(str, rest))} exists for layers "
                    f"{sorted(per_layer)}, not for each of the {L} layers (model.num_layers={L})"
                )
            stacked = jnp.stack([jnp.asarray(value(per_layer[i])) for i in range(L)])
            out.append((("blocks", *rest), like(per_layer[0], stacked)))
        return nnx.from_flat_state(out)

    def unstack(state: nnx.State) -> nnx.State:
        out = []
        for path, v in nnx.to_flat_state(state):
            if path[0] == "rotary":
                out.append((("blocks", 0, "attn", "rotary", *path[1:]), v))
            elif path[0] == "shared_bias":
                out.append((("blocks", 0, "attn", "bias", *path[1:]), v))
            elif path[0] == "blocks":
                if isinstance(path[1], int):
                    raise ValueError(
                        f"state entry {'/'.join(map(str, path))} is already per layer "
                        "(model.scan_layers=False layout); nothing to convert"
                    )
                x = value(v)
                if x.shape[:1] != (L,):
                    raise ValueError(
                        f"state entry {'/'.join(map(str, path))} has shape {x.shape}, not a "
                        f"leading layer axis of model.num_layers={L}"
                    )
                out.extend((("blocks", i, *path[1:]), like(v, x[i])) for i in range(L))
            else:
                out.append((path, v))
        return nnx.from_flat_state(out)

    convert = stack if scan_layers else unstack
    return jax.tree.map(
        lambda x: convert(x) if isinstance(x, nnx.State) else x,
        tree,
        is_leaf=lambda x: isinstance(x, nnx.State),
    )
