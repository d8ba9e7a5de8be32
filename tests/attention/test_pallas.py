"""The Pallas kernels (interpret mode on CPU) equal the reference: forward and every gradient (q, k,
v, bias parameters), for no bias and every bias family of the registry.

Each family runs once, on its own combination of the cases (grouped / multi-query heads, causal or
not, ragged kv_lengths, per-row offsets, rows that see no key); T and S are not multiples of the
16-tiles, so padding, diagonal tiles and skipped tiles are all exercised. Interpret mode compiles
slowly, so the default tests are a handful of small programs; larger shapes are marked slow.
"""

import functools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posattn import families
from posattn.attention import attention
from posattn.attention import pallas as pallas_mod
from posattn.attention.pallas import pallas_attention

B, N, H = 2, 4, 8


TILES = dict(block_q=16, block_k=16)


def family_bias(name, key, *, num_heads=N, head_dim=H, bidirectional=False):
    """(BiasFn, params) of a registry family, or None for "none"."""
    if name == "none":
        return None
    family = families.get(name)
    ctx = families.Context(num_heads=num_heads, head_dim=head_dim, bidirectional=bidirectional)
    small = {"fire": dict(mlp_width=8), "t5": dict(num_buckets=16, max_distance=32)}
    settings = family.settings(**small.get(name, {}))
    return family.bias.bind(ctx, settings), family.bias.init(key, ctx, settings)


def _inputs(K, key, T, S, dtype=jnp.float32, n=N, h=H):
    kq, kk, kv, kd = jax.random.split(key, 4)
    q = jax.random.normal(kq, (B, T, n, h), dtype)
    k = jax.random.normal(kk, (B, S, K, h), dtype)
    v = jax.random.normal(kv, (B, S, K, h), dtype)
    d_out = jax.random.normal(kd, (B, T, n, h), dtype)
    return q, k, v, d_out


def _value_and_grads(impl, q, k, v, d_out, bias, tiles=TILES, **kw):
    """Output and d<out, d_out>/d(q, k, v, bias params), jitted."""
    fn, params = bias if bias is not None else (None, ())

    def loss(q, k, v, params):
        b = None if fn is None else (fn, params)
        if impl == "pallas":
            out = pallas_attention(q, k, v, bias=b, **tiles, **kw)
        else:
            out = attention(q, k, v, bias=b, implementation=impl, **kw)
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, params)
    return out, grads


def _assert_close(got, want, rtol, atol, name=""):
    """Every array within rtol of its reference's largest magnitude, plus atol (parameter
    gradients that cancel to ~0, e.g. a per-head constant under softmax)."""
    for path, g, w in zip(
        jax.tree_util.tree_leaves_with_path(want),
        jax.tree.leaves(got),
        jax.tree.leaves(want),
        strict=True,
    ):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert g.shape == w.shape, f"{name}{jax.tree_util.keystr(path[0])}: {g.shape} {w.shape}"
        assert np.isfinite(g).all(), f"{name}{jax.tree_util.keystr(path[0])}: non-finite"
        err = np.max(np.abs(g - w)) if w.size else 0.0
        assert err <= rtol * np.max(np.abs(w), initial=0.0) + atol, (
            f"{name}{jax.tree_util.keystr(path[0])}: max error {err:.3g}, "
            f"reference scale {np.max(np.abs(w)):.3g}"
        )


def _assert_close_params_by_scale(got, want, rtol, atol):
    """Outputs and q/k/v gradients within rtol of their own scale (+ atol); parameter gradients
    within rtol of the largest parameter gradient of the bias. A gradient that is a sum of
    cancelling terms (a per-head constant's, exactly 0 under softmax) keeps the roundoff of its
    many terms: in float32 ~1e-5 at T = 200, and in bfloat16 the rounding of the probabilities in
    P.V, as in FlashAttention; so it is judged on the scale of its neighbours, not its own ~0."""
    (out, grads), (want_out, want_grads) = got, want
    _assert_close((out, grads[:3]), (want_out, want_grads[:3]), rtol=rtol, atol=atol)
    params = [np.asarray(x, np.float32) for x in jax.tree.leaves(want_grads[3])]
    scale = max((np.max(np.abs(x), initial=0.0) for x in params), default=0.0)
    _assert_close(grads[3], want_grads[3], rtol=0.0, atol=rtol * scale + 1e-6, name="params")


ROWS = np.array([0, 8], np.int32)
# family: (K, T, S, keywords). Every family once; between them: MHA (K=4), GQA (K=2), MQA (K=1),
# causal and not, scalar and per-row offsets, ragged lengths, rows with no visible key.
CASES = {
    "none": (4, 24, 40, dict(kv_lengths=np.array([40, 13], np.int32))),
    "alibi": (2, 32, 32, dict(causal=True, q_offset=ROWS)),
    "t5": (1, 24, 40, dict(causal=True, q_offset=5)),
    "kerple_power": (
        2,
        24,
        40,
        dict(causal=True, q_offset=np.array([-20, 3], np.int32), kv_lengths=np.array([30, 0])),
    ),
    "kerple_log": (4, 32, 32, dict(q_offset=ROWS)),
    "sandwich": (1, 32, 32, dict(causal=True)),
    "fire": (2, 24, 40, dict(causal=True, q_offset=ROWS, kv_lengths=np.array([40, 17]))),
}


@functools.cache
def _case(name):
    K, T, S, kw = CASES[name]
    key = jax.random.key(list(CASES).index(name))
    inputs = _inputs(K, key, T, S)
    bias = family_bias(name, jax.random.fold_in(key, 1))
    return inputs, bias, kw


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, monkeypatch):
    inputs, bias, kw = _case(name)
    if name == "t5":  # the GPU/TPU form of its gather, one-hot products (plain: the slow test)
        hoist = pallas_mod._hoist
        monkeypatch.setattr(
            pallas_mod, "_hoist", lambda *a, **kw: hoist(*a, **{**kw, "one_hot_gathers": True})
        )
    want = _value_and_grads("reference", *inputs, bias, **kw)
    got = _value_and_grads("pallas", *inputs, bias, **kw)
    _assert_close(got, want, rtol=2e-5, atol=1e-5)
    if name == "kerple_power":  # positions -20..-1 and a kv length of 0 see no key
        np.testing.assert_array_equal(got[0][0, :20], 0.0)
        np.testing.assert_array_equal(got[0][1], 0.0)


def test_bfloat16_through_attention():
    """bfloat16 inputs through attention(implementation="pallas") (default tiles: one tile):
    bfloat16 output and gradients, equal to the float32 reference on the same values at bfloat16
    resolution."""
    key = jax.random.key(20)
    q, k, v, d_out = _inputs(2, key, 32, 32, jnp.bfloat16)
    bias = family_bias("alibi", key)

    def loss(q, k, v):
        out = attention(q, k, v, bias=bias, causal=True, implementation="pallas")
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    want_out, want_grads = _value_and_grads("reference", *f32, bias, causal=True)
    _assert_close((out, grads), (want_out, want_grads[:3]), rtol=3e-2, atol=1e-2)


def test_tile_bounds():
    """Causal and length skipping: the key tiles a query tile visits and the query tiles a key
    tile visits (tiles of 16, 4 x 4 tiles)."""
    plan = pallas_mod._Plan(
        N=1, G=1, tq=16, tk=16, nq=4, nk=4, Hp=16, causal=True, kv_mask=True, scale=1.0,
        bias_fn=None, treedef=None, is_float=(), leaf_shapes=(), backend="interpret",
    )  # fmt: skip
    end = lambda off, kv, i: int(pallas_mod._key_tile_end(plan, off, kv, i))  # noqa: E731
    start = lambda off, kv, j: int(pallas_mod._query_tile_start(plan, off, kv, j))  # noqa: E731
    assert [end(0, 64, i) for i in range(4)] == [1, 2, 3, 4]
    assert [start(0, 64, j) for j in range(4)] == [0, 1, 2, 3]
    assert [end(-20, 64, i) for i in range(4)] == [0, 1, 2, 3]  # tile 0: positions -20..-5
    assert [start(-20, 64, j) for j in range(4)] == [1, 2, 3, 4]
    assert [end(8, 64, i) for i in range(4)] == [2, 3, 4, 4]
    assert [start(8, 64, j) for j in range(4)] == [0, 0, 1, 2]
    assert [end(100, 20, i) for i in range(4)] == [2, 2, 2, 2]  # length 20: two key tiles
    assert [start(100, 20, j) for j in range(4)] == [0, 0, 4, 4]
    assert [end(0, 0, i) for i in range(4)] == [0, 0, 0, 0]


@pytest.mark.parametrize("name", [n for n in CASES if n != "none"])
def test_head_slices_equal_the_bias_fn(name):
    """What a program evaluates, head h of the bias, equals BiasFn(...)[h] for every h (vmapped
    over h), and no
    [N, t, s]-shaped value is computed on the way (N = 4, t = 16, s = 32; the families' own
    intermediates, FIRE's [t, s, width] and Sandwich's [t, s, H/2], have other sizes)."""
    bias = family_bias(name, jax.random.key(5), head_dim=12)
    q_pos = jnp.arange(16, dtype=jnp.int32) + 9
    k_pos = jnp.arange(32, dtype=jnp.int32)
    for one_hot in (False, True):
        fn, leaves, _ = pallas_mod._hoist(bias, 16, 32, one_hot_gathers=one_hot)
        want = bias[0](bias[1], q_pos, k_pos)  # (N, 16, 32)
        head = jax.vmap(lambda h, fn=fn, leaves=leaves: fn.head(leaves, h, q_pos, k_pos))
        got = jax.jit(head)(jnp.arange(N))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        jaxpr = jax.make_jaxpr(lambda leaves, h, fn=fn: fn.head(leaves, h, q_pos, k_pos))(
            leaves, jnp.int32(0)
        )
        shapes = _value_shapes(jaxpr.jaxpr)
        assert not [x for x in shapes if sorted(x) == sorted((N, 16, 32))], shapes


def _value_shapes(jaxpr):
    """The shapes of every value a jaxpr (and the jaxprs inside it) computes."""
    from jax.extend.core import jaxprs_in_params

    shapes = []
    for eqn in jaxpr.eqns:
        shapes.extend(tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars)
        for sub in jaxprs_in_params(eqn.params):
            shapes.extend(_value_shapes(sub))
    return shapes


@pytest.mark.parametrize("bidirectional", [False, True])
def test_one_hot_gathers_equal_the_bias_fn(bidirectional):
    """What the GPU/TPU kernels evaluate for T5 (its table gather as a one-hot product) equals
    the BiasFn, value and parameter VJP; an out-of-range index keeps jnp.take's NaN fill."""
    bias = family_bias("t5", jax.random.key(3), bidirectional=bidirectional)
    q_pos = jnp.arange(16, dtype=jnp.int32) + 40
    k_pos = jnp.arange(32, dtype=jnp.int32) * 3
    fn, leaves, n_consts = pallas_mod._hoist(bias, 16, 32, one_hot_gathers=True)
    assert n_consts == 0
    cotangent = jax.random.normal(jax.random.key(4), (N, 16, 32))
    want, pull = jax.vjp(lambda p: bias[0](p, q_pos, k_pos), bias[1])
    got, pull_got = jax.vjp(lambda leaves: fn(leaves, q_pos, k_pos), leaves)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        pull_got(cotangent)[0][0], pull(cotangent)[0]["table"], rtol=1e-5, atol=1e-5
    )
    jaxpr = jax.make_jaxpr(lambda leaves: fn(leaves, q_pos, k_pos))(leaves)
    assert "gather" not in str(jaxpr)

    table = jnp.arange(12.0).reshape(3, 4)
    q, k = jnp.array([2, 5], jnp.int32), jnp.array([0, 1, 2], jnp.int32)  # offsets 0..5; 4, 5 out
    for take in (
        lambda t, q, k: jnp.take(t, q[:, None] - k[None, :], axis=1),  # fills NaN
        lambda t, q, k: t[:, q[:, None] - k[None, :]],  # clamps
    ):
        fn, leaves, _ = pallas_mod._hoist((take, table), 2, 3, one_hot_gathers=True)
        np.testing.assert_array_equal(fn(leaves, q, k), take(table, q, k))


def test_gradient_through_a_closed_over_array():
    """A BiasFn that closes over a traced array (its own params empty) still passes its gradient."""
    key = jax.random.key(6)
    q, k, v, _ = _inputs(2, key, 32, 32)
    kw = dict(causal=True, q_offset=ROWS)

    def loss(slopes, impl):
        def closed(params, q_pos, k_pos):
            return family_bias("alibi", key)[0]({"slopes": slopes}, q_pos, k_pos)

        out = attention(q, k, v, bias=(closed, {}), implementation=impl, **kw)
        return jnp.sum(out**2)

    slopes = jnp.array([0.5, 0.25, 0.125, 0.0625])
    got = jax.jit(jax.grad(functools.partial(loss, impl="pallas")))(slopes)
    want = jax.grad(functools.partial(loss, impl="reference"))(slopes)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_bad_arguments():
    q = jnp.zeros((1, 16, 2, 8))
    with pytest.raises(ValueError, match="materialised"):
        pallas_attention(q, q, q, bias=jnp.zeros((2, 16, 16)))
    with pytest.raises(ValueError, match="block_q=24"):
        pallas_attention(q, q, q, block_q=24)
    with pytest.raises(ValueError, match="backend='cuda'"):
        pallas_attention(q, q, q, backend="cuda")
    with pytest.raises(ValueError, match="num_warps=3"):
        pallas_attention(q, q, q, num_warps=3, backend="gpu")
    with pytest.raises(ValueError, match="num_stages=0"):
        pallas_attention(q, q, q, num_stages=0, backend="gpu")
    with pytest.raises(ValueError, match="Triton's settings .* backend='interpret'"):
        pallas_attention(q, q, q, num_warps=4)


def test_triton_warps_and_stages_reach_every_kernel():
    """`num_warps` and `num_stages` go to Triton's compiler parameters of all three kernels (the
    forward, dK/dV and dQ), defaults 4 warps for heads of at most 64 (8 above) and 2 stages."""
    import re

    def lowered(head_dim, **settings):
        def loss(q):
            out = pallas_attention(q, q, q, causal=True, backend="gpu", **settings)
            return jnp.sum(out.astype(jnp.float32))

        spec = jax.ShapeDtypeStruct((1, 128, 2, head_dim), jnp.bfloat16)
        checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
        text = jax.export.export(
            jax.jit(jax.grad(loss)), platforms=["cuda"], disabled_checks=checks
        )(spec).mlir_module()
        calls = re.findall(r'name = "posattn_flash_\w+", num_stages = (\d+) : i32, '
                           r"num_warps = (\d+) : i32", text)  # fmt: skip
        assert len(calls) == 3, calls
        return set(calls)

    assert lowered(64) == {("2", "4")}
    assert lowered(128) == {("2", "8")}
    assert lowered(64, num_warps=8, num_stages=3) == {("3", "8")}


def _export(platform, name, T=256, window=None, forget=False, softcap=None):
    """Lower forward + backward for `platform` ("cuda": Triton, "tpu": Mosaic) without running
    (gradients to q, k, v, the bias parameters and, with `forget`, the log forget gates)."""
    backend = "gpu" if platform == "cuda" else "tpu"
    bias = family_bias(name, jax.random.key(0), num_heads=4, head_dim=64)

    def loss(q, k, v, params, off, lens, log_forget):
        b = None if bias is None else (bias[0], params)
        out = pallas_attention(
            q, k, v, bias=b, causal=True, q_offset=off, kv_lengths=lens, backend=backend,
            window=window, log_forget=log_forget, softcap=softcap,
        )  # fmt: skip
        return jnp.sum(out.astype(jnp.float32))

    bf16 = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
    rows = jax.ShapeDtypeStruct((2,), jnp.int32)
    params = () if bias is None else bias[1]
    log_forget = jax.ShapeDtypeStruct((2, T, 4), jnp.float32) if forget else None
    argnums = (0, 1, 2, 3, 6) if forget else (0, 1, 2, 3)
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    return jax.export.export(
        jax.jit(jax.grad(loss, argnums=argnums)), platforms=[platform], disabled_checks=checks
    )(bf16(2, T, 4, 64), bf16(2, T, 2, 64), bf16(2, T, 2, 64), params, rows, rows, log_forget)


@pytest.fixture
def pretend_tpu(platform):
    """Mosaic asks for the TPU generation while lowering some operations: the abstract mesh's
    device when one is set, else the default device. Outside a TPU (a CPU, or a GPU machine),
    lower inside an abstract mesh whose device is a v5e, JAX's own way to target a TPU from
    elsewhere. The CUDA case needs nothing."""
    if platform != "tpu":
        yield
        return
    device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        yield


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_kernels_lower_for_accelerators(platform, pretend_tpu):
    """The three kernels lower through Triton (GPU) and Mosaic (TPU) with a FIRE bias (hoisted
    constants, an MLP, a parameter VJP inside the kernel). Lowering only: nothing runs, and
    Mosaic's layout checks, which run when a TPU compiles the module, are not reached."""
    exported = _export(platform, "fire")
    text = exported.mlir_module()
    marker = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
    assert text.count(marker) >= 3, text.count(marker)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_window_and_forget_lower_for_accelerators(platform, pretend_tpu):
    """With a sliding window (tile ranges with a start), FoX gates (their rows in, their
    gradients out of both backward kernels) and a soft cap (tanh and its slope in every kernel),
    on top of ALiBi, the three kernels still lower."""
    text = _export(platform, "alibi", window=100, forget=True, softcap=30.0).mlir_module()
    marker = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
    assert text.count(marker) >= 3, text.count(marker)


@pytest.mark.slow
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("name", ["none", "alibi", "kerple_power", "kerple_log", "sandwich", "t5"])
def test_families_lower_for_accelerators(platform, name, pretend_tpu):
    """Every family's bias lowers into the three kernels (forward, dK/dV, dQ) for the platform."""
    text = _export(platform, name).mlir_module()
    marker = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
    assert text.count(marker) >= 3, text.count(marker)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["alibi", "fire", "t5"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_larger_shapes(name, dtype):
    """T = 200, S = 256, tiles 64 x 32, 8 heads of 32 over 2 key/value heads, causal, per-row
    offsets and lengths."""
    key = jax.random.key(30)
    q, k, v, d_out = _inputs(2, key, 200, 256, dtype, n=8, h=32)
    bias = family_bias(name, key, num_heads=8, head_dim=32)
    kw = dict(causal=True, q_offset=np.array([56, 0], np.int32), kv_lengths=np.array([256, 150]))
    got = _value_and_grads("pallas", q, k, v, d_out, bias, tiles=dict(block_q=64, block_k=32), **kw)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    want = _value_and_grads("reference", *f32, bias, **kw)
    if dtype == jnp.float32:
        _assert_close_params_by_scale(got, want, rtol=2e-5, atol=1e-5)
    else:
        _assert_close_params_by_scale(got, want, rtol=3e-2, atol=1e-2)


def test_unsupported_reason_guards_what_auto_may_pick():
    q = jax.ShapeDtypeStruct((2, 64, 4, 64), jnp.bfloat16)
    long_k = jax.ShapeDtypeStruct((2, 65536, 4, 64), jnp.bfloat16)
    fn_bias = (lambda p, qp, kp: -p[:, None, None] * (qp[:, None] - kp[None, :]), jnp.ones(4))
    assert pallas_mod.unsupported_reason(q, q, bias=fn_bias, backend="gpu") is None
    assert pallas_mod.unsupported_reason(q, q, bias=None, backend="tpu") is None
    assert "materialised" in pallas_mod.unsupported_reason(q, q, bias=jnp.zeros((4, 64, 64)))
    odd = (fn_bias[0], jnp.ones(12))
    assert "power-of-two" in pallas_mod.unsupported_reason(q, q, bias=odd, backend="gpu")
    assert "VMEM" in pallas_mod.unsupported_reason(q, long_k, bias=None, backend="tpu")


# ----------------------------------------------------------------------------------------------
# Sliding windows and forgetting attention (FoX) inside the kernels.


def naive_attention(q, k, v, *, bias=None, causal=False, q_offset=0, kv_lengths=None, window=None,
                    log_forget=None):  # fmt: skip
    """The oracle, dense in float32: logits scale q.k + bias + the FoX term, masked by causality,
    the sliding window (Hugging Face's `sliding_window`: i - j < w, and j - i < w when not causal)
    and the key lengths; a row that sees nothing gives 0. The FoX term is written as the sum it
    stands for, sum over l in (j, i] of log_forget[b, l, h] (the kernels use cumulative sums)."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    k, v = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
    q_pos = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (B,))[:, None] + jnp.arange(T)
    k_pos = jnp.arange(S)
    if bias is not None:
        logits = logits + jax.vmap(lambda qp: bias[0](bias[1], qp, k_pos))(q_pos)
    if log_forget is not None:
        ell = jnp.arange(S)
        between = (k_pos[None, None, :, None] < ell) & (ell <= q_pos[:, :, None, None])  # b t j l
        logits = logits + jnp.einsum("btjl,bln->bntj", between.astype(jnp.float32), log_forget)
    d = q_pos[:, :, None] - k_pos  # (B, T, S): i - j
    seen = jnp.ones(d.shape, bool)
    if causal:
        seen &= d >= 0
    if window is not None:
        seen &= d < window
        if not causal:
            seen &= d > -window
    if kv_lengths is not None:
        seen &= k_pos < jnp.asarray(kv_lengths)[:, None, None]
    seen = seen[:, None]  # (B, 1, T, S)
    logits = jnp.where(seen, logits, -jnp.inf)
    m = jnp.max(jnp.where(seen, logits, -1e30), axis=-1, keepdims=True)
    p = jnp.where(seen, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    return jnp.einsum("bnts,bsnh->btnh", p, v)


def _forget_gates(key, S, n=N):
    """log f = log sigmoid(x), x ~ N(3, 1): about -0.06 per step, so that keys 20 positions back
    still weigh e^-1.2 and a key the window or the tile skipping got wrong shows in bfloat16."""
    return jax.nn.log_sigmoid(jax.random.normal(key, (B, S, n)) + 3.0)


def _grads_with_forget(impl, q, k, v, d_out, bias, log_forget, **kw):
    """Output and d<out, d_out>/d(q, k, v, bias params, log_forget), jitted."""
    fn, params = bias if bias is not None else (None, ())

    def loss(q, k, v, params, log_forget):
        b = None if fn is None else (fn, params)
        if impl == "pallas":
            out = pallas_attention(q, k, v, bias=b, log_forget=log_forget, **TILES, **kw)
        else:
            out = naive_attention(q, k, v, bias=b, log_forget=log_forget, **kw)
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), out

    argnums = (0, 1, 2, 3) if log_forget is None else (0, 1, 2, 3, 4)
    grads, out = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(q, k, v, params, log_forget)
    return out, grads


def test_naive_attention_is_the_reference_without_the_new_terms():
    """The oracle agrees with the project's reference where both apply (ALiBi, causal, per-row
    offsets, ragged lengths), and a window >= every distance or log f = 0 changes nothing."""
    q, k, v, _ = _inputs(2, jax.random.key(40), 12, 20)
    bias = family_bias("alibi", jax.random.key(41))
    kw = dict(causal=True, q_offset=np.array([8, -3], np.int32), kv_lengths=np.array([20, 9]))
    want = jax.jit(partial(attention, bias=bias, implementation="reference", **kw))(q, k, v)
    naive = partial(naive_attention, bias=bias, window=40, log_forget=jnp.zeros((B, 20, N)), **kw)
    got = jax.jit(naive)(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_naive_attention_forget_and_window_by_hand():
    """One head, one query at position 3 over keys 0..3, window 3, log f = (a0, a1, a2, a3): the
    logits (zero q.k) are a1 + a2 + a3 (key 0, outside the window), a2 + a3, a3, 0."""
    a = jnp.array([-0.5, -0.25, -1.0, -0.125])
    log_forget = jnp.broadcast_to(a[None, :, None], (B, 4, N))
    v = jnp.broadcast_to(jnp.eye(4)[None, :, None, :], (B, 4, N, 4)).astype(jnp.float32)
    q = jnp.zeros((B, 1, N, 4))
    naive = partial(naive_attention, causal=True, q_offset=3, window=3, log_forget=log_forget)
    out = jax.jit(naive)(q, q.repeat(4, 1), v)
    logits = jnp.array([-jnp.inf, a[2] + a[3], a[3], 0.0])
    np.testing.assert_allclose(out[0, 0, 0], jax.nn.softmax(logits), rtol=1e-6)


# name: (K, T, S, dtype, bias family, keywords). Between them: windows smaller than a 16-tile (5)
# and spanning several (37, 20 with a 40-key row), causal and bidirectional; FoX alone, with ALiBi
# and with a window; MHA, GQA and MQA; scalar and per-row offsets; ragged lengths; float32 and
# bfloat16 (against the float32 oracle on the same values).
WINDOW_CASES = {
    "window5_causal_gqa": (
        2, 24, 40, jnp.float32, "none",
        dict(causal=True, window=5, q_offset=np.array([0, 12], np.int32),
             kv_lengths=np.array([40, 19], np.int32)),
    ),
    "window37_bidirectional_alibi": (
        4, 40, 56, jnp.float32, "alibi",
        dict(window=37, q_offset=np.array([0, 8], np.int32), kv_lengths=np.array([56, 30])),
    ),
    "forget_alibi_mqa": (
        1, 32, 32, jnp.float32, "alibi",
        dict(causal=True, forget=True, q_offset=5, kv_lengths=np.array([32, 21], np.int32)),
    ),
    "forget_window20_bf16": (
        2, 24, 40, jnp.bfloat16, "none",
        dict(causal=True, forget=True, window=20, q_offset=np.array([-4, 16], np.int32)),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(WINDOW_CASES))
def test_window_and_forget_match_the_oracle(name):
    K, T, S, dtype, family, kw = WINDOW_CASES[name]
    kw = dict(kw)
    key = jax.random.key(50 + list(WINDOW_CASES).index(name))
    q, k, v, d_out = _inputs(K, key, T, S, dtype)
    bias = family_bias(family, jax.random.fold_in(key, 1), bidirectional=not kw.get("causal"))
    log_forget = _forget_gates(jax.random.fold_in(key, 2), S) if kw.pop("forget", False) else None
    got = _grads_with_forget("pallas", q, k, v, d_out, bias, log_forget, **kw)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    want = _grads_with_forget("naive", *f32, bias, log_forget, **kw)
    if dtype == jnp.float32:
        _assert_close(got, want, rtol=2e-5, atol=1e-5)
    else:
        assert got[0].dtype == jnp.bfloat16 and all(g.dtype == dtype for g in got[1][:3])
        _assert_close(got, want, rtol=3e-2, atol=1e-2)
    if log_forget is not None:
        assert float(jnp.max(jnp.abs(want[1][4]))) > 1e-2  # the FoX gradient is not trivial


def _tile_plan(*, causal, window, tq=16, tk=16, nq=4, nk=5):
    return pallas_mod._Plan(
        N=1, G=1, tq=tq, tk=tk, nq=nq, nk=nk, Hp=16, causal=causal, kv_mask=True, scale=1.0,
        bias_fn=None, treedef=None, is_float=(), leaf_shapes=(), backend="interpret",
        window=window,
    )  # fmt: skip


def _tile_ranges(plan, offs, lens):
    """(key start, key end)[off, len, i] and (query start, query end)[off, len, j], computed by
    the kernels' own helpers."""

    def one(off, kv_len):
        i, j = jnp.arange(plan.nq), jnp.arange(plan.nk)
        f = lambda fn, t: jax.vmap(lambda x: fn(plan, off, kv_len, x))(t)  # noqa: E731
        return (
            f(pallas_mod._key_tile_start, i),
            f(pallas_mod._key_tile_end, i),
            f(pallas_mod._query_tile_start, j),
            f(pallas_mod._query_tile_end, j),
        )

    grid = jax.vmap(jax.vmap(one, in_axes=(None, 0)), in_axes=(0, None))
    return [np.asarray(x) for x in jax.jit(grid)(jnp.asarray(offs), jnp.asarray(lens))]


@pytest.mark.parametrize("tiles", [(16, 16), (16, 32), (32, 16)])
def test_tile_ranges_are_exact(tiles):
    """For causal or not, with and without windows (1, under a tile, a tile, several tiles), at
    offsets before, at and past the keys and at every kind of kv length, the key tiles a query
    tile visits (forward, dQ) and the query tiles a key tile visits (dK/dV) are exactly the tile
    pairs that hold a visible (query, key) pair, by brute force in numpy: nothing visible is
    skipped, and nothing is visited in vain."""
    tq, tk = tiles
    offs, lens = np.array([0, -20, 8, 37, 100, -70]), np.array([80, 20, 0, 33, 1])
    nq, nk = 4, 80 // tk
    for causal in (True, False):
        for window in (None, 1, 5, 16, 37):
            plan = _tile_plan(causal=causal, window=window, tq=tq, tk=tk, nq=nq, nk=nk)
            k_start, k_end, q_start, q_end = _tile_ranges(plan, offs, lens)
            for a, off in enumerate(offs):
                for c, kv_len in enumerate(lens):
                    q_pos = off + np.arange(nq * tq)
                    k_pos = np.arange(nk * tk)
                    d = q_pos[:, None] - k_pos[None, :]
                    seen = np.broadcast_to(k_pos < kv_len, d.shape)
                    if causal:
                        seen = seen & (d >= 0)
                    if window is not None:
                        seen = seen & (d < window) & (causal | (d > -window))
                    pairs = seen.reshape(nq, tq, nk, tk).any(axis=(1, 3))  # (nq, nk)
                    visit_k = np.arange(nk)[None] >= k_start[a, c][:, None]
                    visit_k &= np.arange(nk)[None] < k_end[a, c][:, None]
                    visit_q = np.arange(nq)[:, None] >= q_start[a, c][None]
                    visit_q &= np.arange(nq)[:, None] < q_end[a, c][None]
                    where = f"causal={causal} window={window} off={off} kv_len={kv_len}"
                    np.testing.assert_array_equal(visit_k, pairs, err_msg="key tiles " + where)
                    np.testing.assert_array_equal(visit_q, pairs, err_msg="query tiles " + where)


def test_windowed_work_grows_as_t_times_w():
    """T = S = 1024, 16-tiles, causal: without a window the kernels visit the 2080 tiles on and
    below the diagonal; with a window of 32 every query tile visits at most 3 key tiles (and every
    key tile at most 3 query tiles), 189 in all, and doubling T doubles it."""
    visited = {}
    for T in (1024, 2048):
        n = T // 16
        for window in (None, 32):
            plan = _tile_plan(causal=True, window=window, nq=n, nk=n)
            k_start, k_end, q_start, q_end = _tile_ranges(plan, [0], [T])
            per_q, per_k = (k_end - k_start)[0, 0], (q_end - q_start)[0, 0]
            assert per_q.sum() == per_k.sum()
            visited[T, window] = int(per_q.sum())
            if window is not None:
                assert per_q.max() <= 3 and per_k.max() <= 3
    assert visited[1024, None] == 64 * 65 // 2
    assert visited[1024, 32] == 64 * 3 - 3  # the first query tile sees 1 key tile, the second 2
    assert visited[2048, 32] == 128 * 3 - 3


def test_window_and_forget_bad_arguments():
    q = jnp.zeros((1, 16, 2, 8))
    with pytest.raises(ValueError, match="causal=False"):
        pallas_attention(q, q, q, log_forget=jnp.zeros((1, 16, 2)))
    with pytest.raises(ValueError, match=r"log_forget has shape \(1, 16, 1\)"):
        pallas_attention(q, q, q, causal=True, log_forget=jnp.zeros((1, 16, 1)))
    for window in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window="):
            pallas_attention(q, q, q, causal=True, window=window)


def test_unsupported_reason_with_window_and_forget():
    """What auto may pick with the new inputs: a window costs nothing anywhere; FoX is refused
    without causality (the kernel raises), and on TPU its float32 rows count against VMEM."""
    q = jax.ShapeDtypeStruct((2, 64, 4, 64), jnp.bfloat16)
    lf = jax.ShapeDtypeStruct((2, 64, 4), jnp.float32)
    reason = pallas_mod.unsupported_reason
    for backend in ("gpu", "tpu", "interpret"):
        kw = dict(bias=None, backend=backend)
        assert reason(q, q, causal=True, window=8, log_forget=lf, **kw) is None
        assert reason(q, q, window=8, **kw) is None
        assert "causal" in reason(q, q, log_forget=lf, **kw)
        assert "window" in reason(q, q, window=0, **kw)
    # 30720 keys of 64 in bfloat16: K and V take 7.5 MiB, under the limit; the keys' FoX row
    # (float32, padded to 8 sublanes) adds 0.94 MiB and goes over it.
    mid = jax.ShapeDtypeStruct((2, 30720, 4, 64), jnp.bfloat16)
    assert reason(q, mid, bias=None, causal=True, backend="tpu") is None
    assert "VMEM" in reason(q, mid, bias=None, causal=True, log_forget=lf, backend="tpu")
    assert "VMEM" in reason(mid, q, bias=None, causal=True, backend="tpu")  # dK/dV: whole Q, dO
    assert reason(q, mid, bias=None, causal=True, log_forget=lf, backend="gpu") is None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["none", "alibi", "fire"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_window_and_forget_larger_shapes(name, dtype):
    """T = 200, S = 256, tiles 64 x 32, 8 heads of 32 over 2 key/value heads, causal, a window of
    72 (several key tiles, band edges inside tiles), FoX gates, per-row offsets and lengths."""
    key = jax.random.key(31)
    q, k, v, d_out = _inputs(2, key, 200, 256, dtype, n=8, h=32)
    bias = family_bias(name, key, num_heads=8, head_dim=32)
    log_forget = _forget_gates(jax.random.fold_in(key, 2), 256, n=8)
    kw = dict(causal=True, window=72, q_offset=np.array([56, 0], np.int32),
              kv_lengths=np.array([256, 150]))  # fmt: skip
    tiles = dict(block_q=64, block_k=32)

    def run(impl, q, k, v, d_out):
        fn, params = bias if bias is not None else (None, ())

        def loss(q, k, v, params, log_forget):
            b = None if fn is None else (fn, params)
            if impl == "pallas":
                out = pallas_attention(q, k, v, bias=b, log_forget=log_forget, **tiles, **kw)
            else:
                out = naive_attention(q, k, v, bias=b, log_forget=log_forget, **kw)
            return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), out

        grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
            q, k, v, params, log_forget
        )
        return out, grads

    got = run("pallas", q, k, v, d_out)
    want = run("naive", *[x.astype(jnp.float32) for x in (q, k, v, d_out)])
    rtol, atol = (2e-5, 1e-5) if dtype == jnp.float32 else (3e-2, 1e-2)
    (out, grads), (want_out, want_grads) = got, want
    _assert_close((out, grads[:3], grads[4]), (want_out, want_grads[:3], want_grads[4]), rtol, atol)
    # bfloat16: FIRE's output-layer gradients (b2, invariant under softmax, and w2) sum dS over
    # rows and keep the rounding of the bfloat16 output in delta = rowsum(dO O); measured at
    # 1.4% / 1.2% of the largest parameter gradient without window or FoX, 5.4% / 5.0% with both
    # (float32: within 2e-5). So they are judged at 7% of that scale here.
    p_rtol = rtol if dtype == jnp.float32 else 7e-2
    _assert_close_params_by_scale((out, grads[:4]), (want_out, want_grads[:4]), p_rtol, atol)
