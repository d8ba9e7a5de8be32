"""KV-cache decoding: prefill + cached steps equal the full forward for every family (past the
training length, ragged prompts, GQA/MQA, cross-layer sharing), dynamic NTK exact where Hugging
Face's cache is stale, generation with and without cache, sampling, and the loud failures.

Compilation dominates the cost on CPU, so each check compiles one program (all families together).
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config
from flax import nnx

from posattn import config as config_lib
from posattn import families, generate
from posattn.nn import decode, layers
from posattn.train import steps
from posattn.train.checkpoint import Checkpointer

TRAIN_LEN = 32  # small_config's data.seq_len
TOTAL = 48  # tokens of the test sequences: decoding runs past TRAIN_LEN
PROMPTS = (10, 7)  # ragged prompt lengths of the two rows


def make_cfg(position, **model):
    base = dict(model__position=position, model__d_model=16, model__num_layers=2, model__max_len=64)
    base.update({f"model__{k}": v for k, v in model.items()})
    return config_lib.validate(small_config(**base))


def model_parts(cfg, seed=0):
    return steps.init_model(cfg, jax.random.key(seed))


def _shares(name):
    """Whether the family's layers may share keys/values (FoX's gates and PaTH's moved keys
    belong to their own layer)."""
    family = families.get(name)
    return family.forget is None and not family.reflections


# Every family, each with another grouping of key/value heads and cross-layer sharing, plus RoPE
# with a static scaling and the other pair layout.
SWEEP = [
    (name, dict(num_kv_heads=(4, 2, 1)[i % 3], kv_share=(1, 2)[i % 2] if _shares(name) else 1))
    for i, name in enumerate(families.names())
]
SWEEP.append(
    (
        "rope",
        dict(
            rope_layout="half",
            num_kv_heads=1,
            kv_share=2,
            rope_scaling=(
                "{'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 16}"
            ),
        ),
    )
)
SWEEP_IDS = [
    f"{name}-K{m['num_kv_heads']}-share{m['kv_share']}"
    + ("-yarn-half" if "rope_scaling" in m else "")
    for name, m in SWEEP
]


def _teacher_forced(graphdef, params, constants, cache, tokens, prompt_lengths, steps_):
    """Cached logits [B, steps_ + 1, V]: prefill (prompts padded to the longest), then feed each
    row its own next tokens. `prompt_lengths` is a concrete int[B]."""
    prompt = tokens[:, : int(np.max(prompt_lengths))]  # (B, P)
    P = prompt.shape[1]
    # Garbage in the padding: a row must never read past its own prompt.
    pad = jnp.arange(P)[None, :] >= prompt_lengths[:, None]
    prompt = jnp.where(pad, (prompt + 101) % 256, prompt)
    logits, cache = decode.prefill(graphdef, params, constants, cache, prompt, prompt_lengths)
    feed = jnp.take_along_axis(
        tokens, prompt_lengths[:, None] + jnp.arange(steps_)[None], axis=1
    )  # (B, steps)

    def body(cache, tok):
        out, cache = decode.decode_step(graphdef, params, constants, cache, tok)
        return cache, out

    cache, outs = jax.lax.scan(body, cache, feed.T)
    return jnp.concatenate([logits[:, None], outs.transpose(1, 0, 2)], axis=1), cache


OVERFLOW = (0, len(SWEEP) - 1)  # entries that also take one step past the capacity


@pytest.fixture(scope="module")
def sweep():
    """For each SWEEP entry: (cached logits, full-forward logits at the same positions[, overflow
    step])."""
    cfgs = [make_cfg(name, **m) for name, m in SWEEP]
    models = [(cfg, *model_parts(cfg)) for cfg in cfgs]
    tokens = jax.random.randint(jax.random.key(1), (2, TOTAL), 0, 256)
    lengths = np.array(PROMPTS, np.int32)
    steps_ = TOTAL - 1 - max(PROMPTS)  # row 0 ends exactly at the cache capacity TOTAL - 1
    want_pos = lengths[:, None] - 1 + jnp.arange(steps_ + 1)[None]  # (B, steps + 1)

    def run(states, tokens):
        results = []
        for i, ((cfg, graphdef, _, _), (params, constants)) in enumerate(
            zip(models, states, strict=True)
        ):
            full = nnx.merge(graphdef, params, constants)(tokens)  # (B, TOTAL, V)
            cache = decode.init_cache(cfg, batch_size=2, capacity=TOTAL - 1)
            got, cache = _teacher_forced(
                graphdef, params, constants, cache, tokens, lengths, steps_
            )
            want = jnp.take_along_axis(full, want_pos[..., None], axis=1)
            results.append((got, want))
            if (
                i in OVERFLOW
            ):  # one step more: row 0 is full (its logits must be NaN), row 1 has room
                feed = tokens[jnp.arange(2), cache.lengths % TOTAL]
                results[-1] += (
                    decode.decode_step(graphdef, params, constants, cache, feed)[0],
                    full[1, cache.lengths[1]],
                )
        return results

    return jax.device_get(jax.jit(run)([(p, c) for _, _, p, c in models], tokens))


@pytest.mark.parametrize("index", range(len(SWEEP)), ids=SWEEP_IDS)
def test_cached_logits_equal_the_full_forward(sweep, index):
    got, want = sweep[index][:2]
    assert got.shape == (2, TOTAL - max(PROMPTS), 256)
    assert max(PROMPTS) - 1 + got.shape[1] > TRAIN_LEN  # the check reaches past the training length
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("index", OVERFLOW, ids=[SWEEP_IDS[i] for i in OVERFLOW])
def test_a_full_row_gives_nan_under_jit_and_other_rows_go_on(sweep, index):
    _, _, over, row1_want = sweep[index]
    assert np.all(np.isnan(over[0]))
    np.testing.assert_allclose(over[1], row1_want, rtol=1e-5, atol=2e-5)


# ----------------------------------------------------------------------------------------------
# Dynamic NTK: past m_l its frequencies follow the current length, so whatever was cached at an
# earlier length is stale (Hugging Face's pitfall). "exact" must equal a full forward over each
# prefix.

M_L = 16


def dynamic_cfg(**model):
    scaling = (
        f"{{'rope_type': 'dynamic', 'factor': 2.0, 'original_max_position_embeddings': {M_L}}}"
    )
    return make_cfg("rope", rope_scaling=scaling, **model)


def _dynamic_errors(cfg, modes):
    """Max |cached - oracle| logit error per (row, step) for each mode, and each step's prefix
    length."""
    graphdef, params, constants = model_parts(cfg)
    total, prompts = 40, np.array([6, 4], np.int32)
    tokens = jax.random.randint(jax.random.key(2), (2, total), 0, 256)
    steps_ = total - 1 - 6

    def run(params, constants, tokens):
        model = nnx.merge(graphdef, params, constants)
        # The oracle: the full forward of each row's prefix alone. A padded forward with kv_lengths
        # gives each row its own length's frequencies; checked here against unpadded prefixes.
        unpadded = [model(tokens[:, :n])[:, -1] for n in (12, 30)]
        padded = [model(tokens, kv_lengths=jnp.array([n, n]))[:, n - 1] for n in (12, 30)]
        oracle = jax.lax.map(
            lambda s: jnp.take_along_axis(
                model(tokens, kv_lengths=prompts + s), (prompts + s - 1)[:, None, None], axis=1
            )[:, 0],
            jnp.arange(steps_ + 1),
        ).transpose(1, 0, 2)  # (B, steps + 1, V)
        errors = {}
        for mode in modes:
            cache = decode.init_cache(cfg, batch_size=2, capacity=total - 1, dynamic_ntk=mode)
            got, _ = _teacher_forced(graphdef, params, constants, cache, tokens, prompts, steps_)
            errors[mode] = jnp.max(jnp.abs(got - oracle) / (1.0 + jnp.abs(oracle)), axis=-1)
        return unpadded, padded, errors

    unpadded, padded, errors = jax.device_get(jax.jit(run)(params, constants, tokens))
    for a, b in zip(unpadded, padded, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=2e-5)
    return errors, np.asarray(prompts)[:, None] + np.arange(steps_ + 1)[None]


def test_dynamic_ntk_exact_matches_every_prefix_and_the_caching_shortcuts_go_stale_past_m_l():
    errors, length = _dynamic_errors(dynamic_cfg(num_kv_heads=2), decode.DYNAMIC_NTK_MODES)
    assert errors["exact"].max() < 2e-5  # past m_l and past the training length too
    assert length.max() > TRAIN_LEN
    for mode in ("rerotate", "hf"):
        # Identical while the prefix fits m_l (no rescaling yet), wrong after.
        assert errors[mode][length <= M_L].max() < 2e-5, mode
        assert errors[mode][length > M_L + 4].min() > 1e-4, mode


def test_dynamic_ntk_rerotated_keys_are_exact_for_one_layer():
    """Re-rotation repairs the attention logits; only deeper layers' stale values remain."""
    errors, _ = _dynamic_errors(
        dynamic_cfg(num_kv_heads=2, num_layers=1, kv_share=1), ("rerotate",)
    )
    assert errors["rerotate"].max() < 2e-5


# ----------------------------------------------------------------------------------------------
# Generation: greedy and sampled, with and without the cache; the command line.


def test_sampled_generation_with_and_without_cache_agree_for_ragged_prompts():
    cfg = make_cfg("fire", num_kv_heads=1)
    graphdef, params, constants = model_parts(cfg, seed=3)
    prompts = jnp.array([[0, 7, 14, 21, 28, 0, 0, 0, 0], list(range(0, 117, 13))], jnp.int32)
    lengths = jnp.array([5, 9], jnp.int32)
    settings = dict(prompt_len=9, max_new_tokens=30, temperature=0.9, top_k=8)
    cached = decode.make_generate(graphdef, cfg, **settings)
    oracle = decode.make_generate(graphdef, cfg, use_cache=False, **settings)
    got = np.asarray(cached(params, constants, prompts, lengths, jax.random.key(5)))
    assert got.shape == (2, 30)
    np.testing.assert_array_equal(
        got, oracle(params, constants, prompts, lengths, jax.random.key(5))
    )
    assert not np.array_equal(
        got, cached(params, constants, prompts, lengths, jax.random.key(6))
    )  # it samples


@pytest.fixture
def workdir(tmp_path):
    """A workdir as posattn.train leaves it (config.json + a checkpoint), without training."""
    scaling = (
        f"{{'rope_type': 'dynamic', 'factor': 2.0, 'original_max_position_embeddings': {M_L}}}"
    )
    config = small_config(
        model__position="rope", model__d_model=16, model__kv_share=2, model__rope_scaling=scaling
    )
    cfg = config_lib.validate(config)
    (tmp_path / "config.json").write_text(config_lib.to_json(config))
    tx = steps.make_optimizer(steps.OptimConfig.from_config(config.train))
    state = jax.jit(functools.partial(steps.init_train_state, cfg, tx))(
        jax.random.key(0)
    )  # as train.py does
    ckpt = Checkpointer(tmp_path / "checkpoints")
    ckpt.save(7, state, {"step": 7, "config": json.loads(config_lib.to_json(config))})
    ckpt.close()
    return tmp_path


def test_command_line_greedy_text_is_the_same_with_and_without_cache(workdir, capsys):
    argv = ["--workdir", str(workdir), "--prompt", "def main():", "--max_new_tokens", "30"]
    assert generate.main(argv) == 0
    cached = capsys.readouterr()
    assert generate.main(argv + ["--no_cache"]) == 0
    oracle = capsys.readouterr()
    assert "step 7" in cached.err
    assert cached.out == oracle.out and cached.out.startswith("def main():")
    assert (
        len("def main():") + 30 > TRAIN_LEN and len("def main():") + 30 > M_L
    )  # past both lengths


def test_command_line_rope_remap_reads_the_model_under_it_with_and_without_cache(workdir, capsys):
    """--rope_remap: SelfExtend on the workdir's RoPE (dynamic NTK, keys shared across layers):
    the cached greedy text is the full forward's; a bad dict is refused by name."""
    argv = ["--workdir", str(workdir), "--prompt", "def main():", "--max_new_tokens", "30"]
    argv += ["--rope_remap", "{'type': 'self_extend', 'window': 8, 'group': 4}"]
    assert generate.main(argv) == 0
    cached = capsys.readouterr()
    assert "step 7 under the RoPE remap {'type': 'self_extend', 'window': 8, 'group': 4}" in (
        cached.err
    )
    assert generate.main(argv + ["--no_cache"]) == 0
    assert capsys.readouterr().out == cached.out and cached.out.startswith("def main():")
    bad = ["--workdir", str(workdir), "--prompt", "x", "--rope_remap", "{'type': 'rerope'}"]
    assert generate.main(bad) == 2
    assert "--rope_remap: rope remap {'type': 'rerope'}" in capsys.readouterr().err


def test_command_line_errors_name_the_fix(tmp_path, capsys):
    assert generate.main(["--workdir", str(tmp_path), "--prompt", "x"]) == 2
    assert "config.json" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Sampling.


def test_sampling_greedy_top_k_and_temperature():
    logits = jnp.array([[0.0, 2.0, 1.0, -1.0, 1.5], [3.0, 0.0, 0.0, 0.0, 0.0]])
    keys = jax.random.split(jax.random.key(0), 2000)
    draw = jax.jit(
        jax.vmap(lambda k, t, n: decode.sample(logits, k, temperature=t, top_k=n), (0, None, None)),
        static_argnums=(1, 2),
    )
    np.testing.assert_array_equal(decode.sample(logits, None, temperature=0.0), [1, 0])
    np.testing.assert_array_equal(
        np.unique(draw(keys[:50], 1.0, 1), axis=0), [[1, 0]]
    )  # top-1 is greedy
    top3 = np.asarray(draw(keys, 1.0, 3))[:, 0]
    assert set(np.unique(top3)) == {1, 2, 4}
    # Row 0 within its top 3: p(1) = e^2 / (e^2 + e^1 + e^1.5).
    p1 = np.exp(2) / (np.exp(2) + np.exp(1) + np.exp(1.5))
    assert abs(np.mean(top3 == 1) - p1) < 0.04
    hot = np.asarray(draw(keys, 100.0, 0))[
        :, 1
    ]  # a high temperature flattens row 1 towards uniform
    assert abs(np.mean(hot == 0) - 0.2) < 0.04
    for bad in (
        dict(temperature=-1.0),
        dict(temperature=float("nan")),
        dict(top_k=6),
        dict(top_k=-1),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            decode.sample(logits, keys[0], **{"temperature": 1.0, **bad})


# ----------------------------------------------------------------------------------------------
# The cache's size and the loud failures.


def test_cache_bytes_shrink_with_grouped_heads_and_kv_sharing():
    def nbytes(**model):
        cfg = make_cfg("alibi", **model)
        cache = decode.init_cache(cfg, batch_size=3, capacity=20)
        assert cache.nbytes == decode.cache_bytes(cfg, batch_size=3, capacity=20)
        assert len(cache.k) == cfg.num_layers // cfg.kv_share
        assert cache.k[0].shape == (3, 20, cfg.num_kv_heads, cfg.head_dim)
        return cache.nbytes

    mha = nbytes(num_kv_heads=4)
    assert mha == 2 * 2 * 3 * 20 * 4 * 4 * 4  # (k, v) x layers x B x S x K x H x float32
    assert nbytes(num_kv_heads=2) * 2 == mha and nbytes(num_kv_heads=1) * 4 == mha
    assert nbytes(num_kv_heads=4, kv_share=2) * 2 == mha
    assert (
        decode.cache_bytes(make_cfg("alibi", dtype="bfloat16"), batch_size=3, capacity=20) * 2
        == nbytes()
    )


def test_copes_separate_gate_keys_are_cached_and_counted():
    """A third [B, S, K, H] tensor per layer: a third more bytes than the keys and values."""
    cfg = make_cfg("cope", num_kv_heads=2, cope_gates="separate")
    cache = decode.init_cache(cfg, batch_size=3, capacity=20)
    assert [g.shape for g in cache.gate_keys] == [(3, 20, 2, 4)] * 2 and cache.log_forget is None
    assert all(len(entry) == 3 for entry in cache.entries())
    keys_only = decode.cache_bytes(make_cfg("cope", num_kv_heads=2), batch_size=3, capacity=20)
    assert cache.nbytes == decode.cache_bytes(cfg, batch_size=3, capacity=20) == keys_only * 3 // 2


def test_learned_positions_past_the_table_raise_instead_of_clamping():
    cfg = make_cfg("learned", max_len=40)
    graphdef, _, _ = model_parts(cfg)
    decode.init_cache(cfg, batch_size=1, capacity=40)
    with pytest.raises(ValueError, match="max_len=40"):
        decode.init_cache(cfg, batch_size=1, capacity=41)
    for use_cache in (True, False):  # prompt 30 + 12 new tokens feeds positions 0..40
        with pytest.raises(ValueError, match="max_len=40"):
            decode.make_generate(
                graphdef, cfg, prompt_len=30, max_new_tokens=12, use_cache=use_cache
            )
    decode.make_generate(graphdef, cfg, prompt_len=30, max_new_tokens=11)


def test_encoders_and_full_caches_refuse_to_decode():
    with pytest.raises(ValueError, match="kind='decoder'"):
        decode.init_cache(make_cfg("alibi", kind="encoder"), batch_size=1, capacity=8)
    with pytest.raises(ValueError, match="dynamic_ntk"):
        decode.init_cache(make_cfg("rope"), batch_size=1, capacity=8, dynamic_ntk="stale")
    cfg = make_cfg("alibi")
    graphdef, params, constants = model_parts(cfg)
    cache = decode.init_cache(cfg, batch_size=2, capacity=8)
    full = type(cache)(k=cache.k, v=cache.v, lengths=jnp.array([3, 8], jnp.int32))
    with pytest.raises(ValueError, match="capacity 8"):
        decode.decode_step(graphdef, params, constants, full, jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="capacity 8"):
        decode.prefill(
            graphdef, params, constants, cache, jnp.zeros((2, 9), jnp.int32), jnp.array([9, 9])
        )


def test_cache_writes_drop_rows_past_capacity_instead_of_shifting():
    cache = jnp.zeros((2, 4, 1))
    chunk = jnp.ones((2, 2, 1))
    out = layers.write_rows(cache, chunk, jnp.array([1, 3]))
    np.testing.assert_array_equal(out[..., 0], [[0, 1, 1, 0], [0, 0, 0, 1]])
    # What lax.dynamic_update_slice would have done to row 1: shifted back over live row 2.
    shifted = jax.lax.dynamic_update_slice(cache[1], chunk[1], (3, 0))
    np.testing.assert_array_equal(shifted[..., 0], [0, 0, 1, 1])
