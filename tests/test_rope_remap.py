"""Eval-time RoPE remaps (ReRoPE, SelfExtend) against their reference code, transcribed.

The transcriptions below follow, step by step and in float64 numpy, the attention of
github.com/bojone/rerope (`rerope_patch.py`, `forward_with_rerope`; `leaky_rerope_patch.py`,
`forward_with_leaky_rerope`) and of
github.com/datamllab/LongLM (`self_extend_patch/Llama.py`: `self_extend_forward` for a prompt,
`flash_self_extend_forward`'s decode step for one new token), with Hugging Face's `rotate_half`
rotation: the near and far logit matrices, their selection by the references' own masks, and
their decode steps, which rotate the keys backwards by the (clipped or grouped) distance and
leave the query unrotated. posattn computes the same thing with one rotation per position
(`rotary.remap_positions`) and two-score attention (`posattn.attention.Far`); these tests hold
the two to each other, prompt and decode, with and without the log-n query scale.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from posattn import rotary
from posattn.attention import Far, attention

B, T, N, K, H = 2, 40, 4, 2, 8
BASE = 10000.0


def _rot(x, pos, sign=1.0, scaling=1.0):
    """HF: x * cos + rotate_half(x) * sign * sin at float positions pos (x [B, N, T, H]), the
    frequencies divided by `scaling` (HF's LlamaLinearScalingRotaryEmbedding)."""
    inv_freq = 1.0 / BASE ** (np.arange(0, H, 2) / H) / scaling
    freqs = np.asarray(pos, np.float64)[..., None] * inv_freq  # (T, H/2)
    emb = np.concatenate([freqs, freqs], -1)
    half = np.concatenate([-x[..., H // 2 :], x[..., : H // 2]], -1)
    return x * np.cos(emb) + half * sign * np.sin(emb)


def _repeat_kv(x):
    return np.repeat(x, N // K, axis=1)


def _softmax_out(weights, v):
    w = weights - weights.max(-1, keepdims=True)
    p = np.exp(w)
    p /= p.sum(-1, keepdims=True)
    return p @ v


def _causal(weights):
    t, s = weights.shape[-2:]
    upper = np.triu(np.ones((t, s), bool), k=1 + s - t)
    return np.where(upper, np.finfo(np.float64).min, weights)


def rerope_prompt(q, k, v, window, training_length=None):
    """`forward_with_rerope`, q_len > 1: q [B, N, T, H], k, v [B, K, T, H]."""
    pos = np.arange(q.shape[2])
    if training_length:
        q = q * np.clip(np.log(pos + 1) / np.log(training_length), 1, None)[:, None]
    q1, k1 = _rot(q, pos), _rot(k, pos)
    q2 = _rot(q, pos * 0 + window)
    k1, k2, v = _repeat_kv(k1), _repeat_kv(k), _repeat_kv(v)
    w1 = q1 @ np.swapaxes(k1, -1, -2) / np.sqrt(H)
    w2 = q2 @ np.swapaxes(k2, -1, -2) / np.sqrt(H)
    rectified = np.abs(pos[:, None] - pos[None]) < window
    return _softmax_out(_causal(np.where(rectified, w1, w2)), v)


def rerope_decode(q, k, v, window, training_length=None):
    """`forward_with_rerope`, q_len == 1: q [B, N, 1, H] at position S - 1, k, v [B, K, S, H]."""
    S = k.shape[2]
    pos = np.arange(S)
    if training_length:
        q = q * max(1.0, np.log(S) / np.log(training_length))
    rel = np.clip(pos[-1] - pos, None, window)
    k = _repeat_kv(_rot(k, rel, sign=-1.0))
    return _softmax_out(q @ np.swapaxes(k, -1, -2) / np.sqrt(H), _repeat_kv(v))


def leaky_rerope_prompt(q, k, v, window, leak, training_length=None):
    """`forward_with_leaky_rerope`, q_len > 1 (scaling_factor = leak)."""
    pos = np.arange(q.shape[2])
    if training_length:
        q = q * np.clip(np.log(pos + 1) / np.log(training_length), 1, None)[:, None]
    offset = window * (leak - 1)
    q1, k1 = _rot(q, pos), _rot(k, pos)
    q2 = _rot(q, pos + offset, scaling=leak)
    k2 = _rot(k, pos, scaling=leak)
    k1, k2, v = _repeat_kv(k1), _repeat_kv(k2), _repeat_kv(v)
    w1 = q1 @ np.swapaxes(k1, -1, -2) / np.sqrt(H)
    w2 = q2 @ np.swapaxes(k2, -1, -2) / np.sqrt(H)
    rectified = np.abs(pos[:, None] - pos[None]) < window
    return _softmax_out(_causal(np.where(rectified, w1, w2)), v)


def leaky_rerope_decode(q, k, v, window, leak, training_length=None):
    """`forward_with_leaky_rerope`, q_len == 1: keys rotated back by the relative position p
    from the table cat(cos[:window], cos2[window + offset:]), i.e. p at the plain frequencies
    below the window and p + offset at the frequencies / leak from it on."""
    S = k.shape[2]
    pos = np.arange(S)
    if training_length:
        q = q * max(1.0, np.log(S) / np.log(training_length))
    rel = pos[-1] - pos
    offset = window * (leak - 1)
    near = _rot(k, rel, sign=-1.0)
    far = _rot(k, rel + offset, sign=-1.0, scaling=leak)
    k = _repeat_kv(np.where((rel < window)[:, None], near, far))
    return _softmax_out(q @ np.swapaxes(k, -1, -2) / np.sqrt(H), _repeat_kv(v))


def self_extend_prompt(q, k, v, group, window, scale_base=-1):
    """`self_extend_forward`, q_len == kv_seq_len."""
    t = q.shape[2]
    pos = np.arange(t)
    if scale_base > 0:
        q = q * np.clip(np.log(pos + 1) / np.log(scale_base), 1, None)[:, None]
    nq, nk = _rot(q, pos), _rot(k, pos)
    re = 0 if pos.max() < window else window
    gq = _rot(q, pos // group + re - re / group)
    gk = _rot(k, pos // group)
    nk, gk, v = _repeat_kv(nk), _repeat_kv(gk), _repeat_kv(v)
    nw = _causal(nq @ np.swapaxes(nk, -1, -2) / np.sqrt(H))
    gw = _causal(gq @ np.swapaxes(gk, -1, -2) / np.sqrt(H))
    neighbor = np.tril(np.ones((t, t)))
    if t - window > 0:
        neighbor[window:, :-window] -= np.tril(np.ones((t - window, t - window)))
    return _softmax_out(np.where(neighbor.astype(bool), nw, gw), v)


def self_extend_decode(q, k, v, group, window, scale_base=-1):
    """`flash_self_extend_forward`, q_len == 1 (one new token at position S - 1)."""
    S = k.shape[2]
    key_pos = np.arange(S)
    i = S - 1
    if scale_base > 0:
        q = q * max(1.0, np.log(i + 1) / np.log(scale_base))
    neighbor_pos = i - key_pos
    re = 0 if i < window else window
    group_pos = i // group - key_pos // group + (re - re // group)
    decode_pos = np.concatenate([group_pos[:-window], neighbor_pos[-window:]])
    k = _repeat_kv(_rot(k, decode_pos, sign=-1.0))
    return _softmax_out(q @ np.swapaxes(k, -1, -2) / np.sqrt(H), _repeat_kv(v))


def posattn_remap(q, k, v, remap, *, q_offset=0, implementation="reference"):
    """The same attention by posattn: q [B, T, N, H], k, v [B, S, K, H] as projected."""
    inv_freq, _ = rotary.rope_frequencies(H, base=BASE)
    S, t = k.shape[1], q.shape[1]
    q_pos = q_offset + jnp.arange(t)
    k_pos = jnp.arange(S)
    scale = rotary.remap_query_scale(remap, q_pos)
    if scale is not None:
        q = q * scale[:, None, None]
    far_q, far_k = rotary.remap_positions(remap, q_pos, k_pos)
    scale = rotary.remap_frequency_scale(remap)

    def rope(x, p, scale=1.0):
        return rotary.apply_rope(x, p, inv_freq * scale, layout="half")

    far = Far(rope(q, far_q, scale), rope(k, far_k, scale), remap["window"])
    return attention(
        rope(q, q_pos),
        rope(k, k_pos),
        v,
        far=far,
        causal=True,
        q_offset=q_offset,
        implementation=implementation,
    )


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k = rng.standard_normal((B, T, K, H)).astype(np.float32)
    v = rng.standard_normal((B, T, K, H)).astype(np.float32)
    return q, k, v


def _heads_first(x):  # [B, T, heads, H] -> [B, heads, T, H], float64
    return np.swapaxes(np.asarray(x, np.float64), 1, 2)


REMAPS = [
    {"type": "rerope", "window": 12},
    {"type": "rerope", "window": 7, "log_scale_base": 16},
    {"type": "rerope", "window": 6, "leak": 4},
    {"type": "rerope", "window": 9, "leak": 16, "log_scale_base": 16},
    {"type": "self_extend", "window": 8, "group": 4},
    {"type": "self_extend", "window": 6, "group": 3, "log_scale_base": 10},
]
IDS = ["-".join(f"{k}={v}" for k, v in r.items()) for r in REMAPS]


def _reference(remap):
    """(prompt, decode, keyword arguments) of the transcription of `remap`'s reference, its
    arguments named as the reference names them."""
    w, base = remap["window"], remap.get("log_scale_base")
    if remap["type"] == "self_extend":
        kw = dict(group=remap["group"], window=w, scale_base=base or -1)
        return self_extend_prompt, self_extend_decode, kw
    if remap.get("leak"):
        kw = dict(window=w, leak=remap["leak"], training_length=base)
        return leaky_rerope_prompt, leaky_rerope_decode, kw
    return rerope_prompt, rerope_decode, dict(window=w, training_length=base)


@pytest.mark.parametrize("remap", REMAPS, ids=IDS)
@pytest.mark.parametrize("implementation", ["reference", "chunked", "blockwise"])
def test_a_prompt_matches_the_reference(remap, implementation):
    prompt, _, kw = _reference(remap)
    q, k, v = _inputs()
    want = prompt(*map(_heads_first, (q, k, v)), **kw)  # (B, N, T, H)
    got = posattn_remap(q, k, v, remap, implementation=implementation)
    np.testing.assert_allclose(_heads_first(got), want, rtol=2e-5, atol=2e-5)
    # the remap matters here: plain RoPE attention is far from it
    plain = posattn_remap(q, k, v, {"type": "rerope", "window": T})
    assert np.max(np.abs(_heads_first(plain) - want)) > 0.05


@pytest.mark.parametrize("remap", REMAPS, ids=IDS)
def test_a_decode_step_matches_the_references_decode_step(remap):
    _, decode, kw = _reference(remap)
    q, k, v = _inputs(1)
    for S in (T, remap["window"] - 1, remap["window"]):  # with far keys, and all neighbours
        q1 = q[:, S - 1 : S]
        want = decode(*map(_heads_first, (q1, k[:, :S], v[:, :S])), **kw)
        got = posattn_remap(q1, k[:, :S], v[:, :S], remap, q_offset=S - 1)
        np.testing.assert_allclose(_heads_first(got), want, rtol=2e-5, atol=2e-5, err_msg=str(S))


def test_positions_by_hand():
    q_pos, k_pos = jnp.arange(12), jnp.arange(12)
    fq, fk = rotary.remap_positions({"type": "rerope", "window": 5}, q_pos, k_pos)
    assert fq.tolist() == [5] * 12 and fk.tolist() == [0] * 12
    fq, fk = rotary.remap_positions({"type": "self_extend", "window": 4, "group": 2}, q_pos, k_pos)
    assert fq.tolist() == [i // 2 + 2 for i in range(12)]
    assert fk.tolist() == [j // 2 for j in range(12)]
    # far pair (11, 0): distance 11 // 2 - 0 + 4 - 2 = 7; the neighbours' last, (11, 8): 3
    assert int(fq[11] - fk[0]) == 7
    scale = rotary.remap_query_scale({"type": "rerope", "window": 5, "log_scale_base": 4}, q_pos)
    np.testing.assert_allclose(scale, np.maximum(1, np.log(np.arange(12) + 1) / np.log(4)))
    assert rotary.remap_query_scale({"type": "rerope", "window": 5}, q_pos) is None
    # Leaky ReRoPE: far queries at i + w (k - 1), keys at j, frequencies / k: far pair (11, 0)
    # at w + (11 - w) / k = 5 + 6 / 3 = 7
    leaky = {"type": "rerope", "window": 5, "leak": 3}
    fq, fk = rotary.remap_positions(leaky, q_pos, k_pos)
    assert fq.tolist() == [i + 10 for i in range(12)] and fk.tolist() == list(range(12))
    assert rotary.remap_frequency_scale(leaky) * int(fq[11] - fk[0]) == 7
    assert rotary.remap_frequency_scale({"type": "rerope", "window": 5}) == 1.0


def test_self_extend_with_group_one_and_rerope_past_every_distance_are_plain_rope():
    q, k, v = _inputs(2)
    plain = posattn_remap(q, k, v, {"type": "rerope", "window": T})
    same = posattn_remap(q, k, v, {"type": "self_extend", "window": 5, "group": 1})
    np.testing.assert_allclose(same, plain, atol=2e-6)


@pytest.mark.parametrize(
    "remap, match",
    [
        ({"type": "yarn", "window": 4}, "type 'yarn' is not allowed"),
        ({"type": "rerope"}, "has the keys type, window"),
        ({"type": "rerope", "window": 4, "group": 2}, "has the keys type, window"),
        ({"type": "rerope", "window": 0}, "window=0 must be an integer >= 1"),
        ({"type": "rerope", "window": 4.0}, "window=4.0 must be an integer >= 1"),
        ({"type": "self_extend", "window": 6, "group": 4}, "group=4 must divide window=6"),
        ({"type": "rerope", "window": 4, "log_scale_base": 1}, "must be an integer >= 2"),
        ({"type": "rerope", "window": 4, "leak": 1}, "leak=1 must be an integer >= 2"),
        ({"type": "self_extend", "window": 4, "group": 2, "leak": 2}, "optionally log_scale"),
        ("rerope", "must be None or a dict"),
    ],
)
def test_bad_remaps_are_refused(remap, match):
    with pytest.raises(ValueError, match=match):
        rotary.validate_rope_remap(remap)
