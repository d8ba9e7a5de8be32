"""The native CPU kernel ("native", posattn.attention.native) equals the reference: forward and
every gradient (q, k, v, bias parameters, log_forget) over the kernel grid and the window/forget
grid of the other implementations, plus what is its own: the key ranges of a static causal offset
(negative offsets, rows that see no key, windows), a single query row, bias gradients shared by
the batch rows or the heads, results independent of the thread count, dtypes, vmap, and the build
that falls back. And the library's other product, a dense layer's weight gradient x^T dy.
"""

import functools
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    GRID,
    WINDOW_GRID,
    _assert_close,
    _inputs,
    _oracle_case,
    _reference_case,
    _value_and_grads,
    alibi_like,
    window_case,
)

from posattn.attention import attention, native

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"native kernel unavailable: {native.why_unavailable()}"
)


@pytest.mark.parametrize("bias_kind, case", GRID)
def test_matches_reference(bias_kind, case):
    inputs, bias, kw, want = _reference_case(bias_kind, case)
    got = _value_and_grads("native", *inputs, bias, **kw)
    _assert_close(got, want, rtol=1e-5)
    if case == "fully_masked_rows":
        np.testing.assert_array_equal(got[0][0, :20], 0.0)  # positions -20..-1 see no key
        np.testing.assert_array_equal(got[0][1], 0.0)  # kv_lengths 0


@pytest.mark.parametrize("bias_kind, case", WINDOW_GRID)
def test_windows_and_forget_gates_match_the_oracle(bias_kind, case):
    inputs, bias, kw = window_case(bias_kind, case)
    got = _value_and_grads("native", *inputs, bias, **kw)
    _assert_close(got, _oracle_case(bias_kind, case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "H, q_offset, window",
    [
        (16, 0, None),
        (16, -20, None),
        (16, 9, None),
        (16, 0, 5),
        (32, -3, 17),
        (8, -20, None),
        (64, 9, None),
        (128, -3, 17),
    ],
)
def test_static_causal_key_ranges(H, q_offset, window):
    """A static causal offset hands the kernel key ranges instead of a mask: every head dim it
    is built for, offsets that leave the first rows without keys, windows; ALiBi's bias (shared
    by the batch rows, so its gradient is summed over them) and no bias."""
    key = jax.random.key(H)
    kq, kk, kv, kd = jax.random.split(key, 4)
    B, T, S, N, K = 3, 29, 33, 4, 2
    q = jax.random.normal(kq, (B, T, N, H))
    k, v = (jax.random.normal(x, (B, S, K, H)) for x in (kk, kv))
    d_out = jax.random.normal(kd, (B, T, N, H))
    kw = dict(causal=True, q_offset=q_offset, window=window)
    for bias in (None, (alibi_like, jnp.array([0.5, 0.25, 0.125, 0.0625]))):
        want = _value_and_grads("reference", q, k, v, d_out, bias, **kw)
        got = _value_and_grads("native", q, k, v, d_out, bias, **kw)
        _assert_close(got, want, rtol=1e-5, name=f"H={H} bias={bias is not None} ")
        if q_offset < 0:
            np.testing.assert_array_equal(got[0][:, :-q_offset], 0.0)


@pytest.mark.parametrize("H", [16, 64, 128])
@pytest.mark.parametrize("window", [None, 7])
def test_a_single_query_gives_the_last_row_of_a_chunk(H, window):
    """One query row (a decoding step at position S - 1) runs alone, a four-query chunk as one block
    of four rows: the single query's output is bitwise the chunk's last row, and it and its
    gradients equal the reference's."""
    kq, kk, kv, kd = jax.random.split(jax.random.key(H), 4)
    B, S, N, K = 2, 37, 4, 2
    q = jax.random.normal(kq, (B, 4, N, H))
    k, v = (jax.random.normal(x, (B, S, K, H)) for x in (kk, kv))
    d_out = jax.random.normal(kd, (B, 1, N, H))
    for bias in (None, (alibi_like, jnp.array([0.5, 0.25, 0.125, 0.0625]))):
        name = f"H={H} window={window} bias={bias is not None} "
        kw = dict(causal=True, window=window, bias=bias, implementation="native")
        chunk = attention(q, k, v, q_offset=S - 4, **kw)
        alone = attention(q[:, -1:], k, v, q_offset=S - 1, **kw)
        np.testing.assert_array_equal(alone, chunk[:, -1:], err_msg=name)
        kw = dict(causal=True, window=window, q_offset=S - 1)
        want = _value_and_grads("reference", q[:, -1:], k, v, d_out, bias, **kw)
        got = _value_and_grads("native", q[:, -1:], k, v, d_out, bias, **kw)
        _assert_close(got, want, rtol=1e-5, name=name)


def test_bias_gradient_shared_by_heads():
    """A logit bias of one head slice [B, 1, T, S] (broadcast over the heads) gets the sum over
    heads as its gradient, and one of [1, N, T, S] the sum over the batch rows."""
    q, k, v, d_out = _inputs(2, jax.random.key(3), T=45)
    B, T, N, _ = q.shape
    S = k.shape[1]
    for shape in ((B, 1, T, S), (1, N, T, S), (B, N, T, S)):
        bias = jax.random.normal(jax.random.key(len(shape) + shape[0] + shape[1]), shape)

        def loss(fn, q, k, v, bias):
            return jnp.sum(fn(q, k, v, bias) * d_out)

        def native_fn(q, k, v, bias):
            return native.native_attention(q, k, v, bias, scale=0.3, bias_grad=True)

        def reference_fn(q, k, v, bias, heads=2 if shape[1] == N else 1):
            s = jnp.einsum("btkgh,bskh->bkgts", q.reshape(B, T, 2, 2, -1), k) * 0.3
            s = s + bias.reshape(bias.shape[0], -1, heads, T, S)
            p = jax.nn.softmax(s, axis=-1)
            return jnp.einsum("bkgts,bskh->btkgh", p, v).reshape(q.shape)

        got = jax.jit(jax.value_and_grad(lambda *a: loss(native_fn, *a), (0, 1, 2, 3)))(
            q, k, v, bias
        )
        want = jax.value_and_grad(lambda *a: loss(reference_fn, *a), (0, 1, 2, 3))(q, k, v, bias)
        _assert_close(got, want, rtol=1e-5, name=f"{shape} ")


def test_the_bias_gradient_is_computed_only_where_the_bias_is_differentiated():
    """bias_grad=True allows the bias gradient; the backward computes it only when the bias
    carries a tangent (a bias built from constants, as ALiBi's slopes are, needs none), and the
    other gradients are the same either way."""
    q, k, v, d_out = _inputs(2, jax.random.key(4), T=24)
    bias = jax.random.normal(jax.random.key(6), (1, q.shape[2], q.shape[1], k.shape[1]))

    def loss(q, k, v, bias):
        out = native.native_attention(q, k, v, bias, scale=0.3, bias_grad=True, causal_offset=0)
        return jnp.sum(out * d_out)

    def bias_grad_shapes(argnums):
        text = jax.jit(jax.grad(loss, argnums)).lower(q, k, v, bias).compile().as_text()
        calls = [line for line in text.splitlines() if "posattn_attention_backward" in line]
        return [line.split(") custom-call(")[0].rsplit(", ", 1)[1] for line in calls]

    assert bias_grad_shapes((0, 1, 2)) == ["f32[0]{0}"]
    assert bias_grad_shapes((0, 1, 2, 3)) == [f"f32{list(bias.shape)}{{3,2,1,0}}".replace(" ", "")]
    with_bias = jax.jit(jax.grad(loss, (0, 1, 2, 3)))(q, k, v, bias)
    without = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v, bias)
    for got, want in zip(without, with_bias[:3], strict=True):
        np.testing.assert_array_equal(got, want)
    assert float(jnp.abs(with_bias[3]).max()) > 0


def test_bfloat16_inputs_keep_their_dtype():
    q, k, v, d_out = (x.astype(jnp.bfloat16) for x in _inputs(2, jax.random.key(5)))
    got = _value_and_grads("native", q, k, v, d_out, None, causal=True)
    assert got[0].dtype == jnp.bfloat16 and got[1][0].dtype == jnp.bfloat16
    f32 = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    _assert_close(got, _value_and_grads("reference", *f32, None, causal=True), rtol=2e-2)


def test_jit_vmap_and_a_traced_scale():
    """Under vmap (a sweep's members) and with a traced scale (its gradient through q)."""
    q, k, v, d_out = _inputs(2, jax.random.key(6))

    def run(impl, q, k, v, scale):
        return attention(q, k, v, causal=True, scale=scale, implementation=impl)

    members = jnp.stack([q, 2 * q])
    scales = jnp.array([0.25, 0.5])
    got = jax.jit(jax.vmap(lambda q, s: run("native", q, k, v, s)))(members, scales)
    want = jax.vmap(lambda q, s: run("reference", q, k, v, s))(members, scales)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda s, impl: jnp.sum(run(impl, q, k, v, s) * d_out))
    np.testing.assert_allclose(
        jax.jit(grad, static_argnums=1)(0.3, "native"), grad(0.3, "reference"), rtol=1e-4
    )


_THREADS_SCRIPT = textwrap.dedent(
    """
    import os, sys
    if sys.argv[2] == "one":
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # XLA then runs one thread
    import jax, jax.numpy as jnp, numpy as np
    from posattn.attention import attention
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, d = (jax.random.normal(x, (8, 64, 4, 16)) for x in keys)
    slopes = jnp.array([0.5, 0.25, 0.125, 0.0625])
    def loss(q, k, v, slopes):
        bias = -slopes[:, None, None] * (jnp.arange(64)[:, None] - jnp.arange(64)).astype(float)
        out = attention(q, k, v, bias=bias, causal=True, implementation="native")
        return jnp.sum(out * d)
    grads = jax.jit(jax.grad(loss, (0, 1, 2, 3)))(q, k, v, slopes)
    from posattn.attention import native
    x, dy = (jax.random.normal(key, (300, n)) for key, n in zip(keys[:2], (70, 130)))
    dw = jax.jit(native.weight_gradient)(x, dy)
    y = jax.jit(native.product)(jax.random.normal(keys[2], (1000, 70)), dw)
    np.save(sys.argv[1], np.concatenate([np.ravel(g) for g in (*grads, dw, y)]))
    """
)


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs to compare one thread against several",
)
def test_results_do_not_depend_on_the_thread_count(tmp_path):
    """The kernel splits its work so that no sum depends on which thread did what: one CPU and
    all of them give bitwise the same gradients (the bias gradient sums over batch rows), and the
    same weight gradient."""
    outputs = []
    for name in ("one", "all"):
        path = tmp_path / f"{name}.npy"
        subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, str(path), name], check=True)
        outputs.append(np.load(path))
    np.testing.assert_array_equal(outputs[0], outputs[1])


_WIDTH_SCRIPT = textwrap.dedent(
    """
    import os, sys
    if sys.argv[2] == "narrow":  # the kernel built without AVX-512: 8-float vectors
        os.environ["POSATTN_CACHE_DIR"] = sys.argv[3]
        from posattn.attention import native
        native._FLAGS = (*native._FLAGS, "-mno-avx512f")
    import jax, jax.numpy as jnp, numpy as np
    from posattn.attention import native
    assert native.available(), native.why_unavailable()
    out = []
    for i, (H, T, S, causal, window, softcap, bias_grad) in enumerate([
        (8, 33, 33, 0, None, None, True),
        (16, 64, 64, 0, None, None, False),
        (16, 20, 45, 25, 7, None, True),
        (32, 33, 33, 0, None, 5.0, True),
        (32, 15, 15, 0, None, None, True),
        (64, 24, 40, None, None, None, True),
        (128, 13, 29, 16, 9, None, False),
    ]):
        q, k, v, b, d = (
            jax.random.normal(jax.random.key(10 * i + j), shape)
            for j, shape in enumerate(
                [(2, T, 4, H), (2, S, 2, H), (2, S, 2, H), (1, 4, T, S), (2, T, 4, H)]
            )
        )
        def loss(q, k, v, b):
            o = native.native_attention(q, k, v, b, scale=H ** -0.5, bias_grad=bias_grad,
                                        causal_offset=causal, window=window, softcap=softcap)
            return jnp.sum(o * d), o
        (_, o), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(q, k, v, b)
        out += [np.ravel(x) for x in (o, *grads)]
    x, dy = (jax.random.normal(jax.random.key(99 + j), (300, n)) for j, n in enumerate((70, 130)))
    out.append(np.ravel(jax.jit(native.weight_gradient)(x, dy)))
    out.append(np.ravel(jax.jit(native.product)(x, dy[:70])))
    np.save(sys.argv[1], np.concatenate(out))
    """
)


@pytest.mark.skipif(
    "avx512f" not in native._cpu_flags().split(),
    reason="no AVX-512 here: the kernel runs 8-float vectors only",
)
def test_results_do_not_depend_on_the_vector_width(tmp_path):
    """Built for AVX-512 the kernel runs 16-float vectors, elsewhere 8-float ones, and keeps each
    row's sums in the 8-float order; for heads of 32 and more it takes blocks of eight query rows
    there (then four, then one), of four elsewhere (then one). Both builds give bitwise the same
    outputs and gradients (head dims 8-128, GQA, S not a multiple of 16, T = 13 and 15 where the
    blockings differ, a window, a soft cap, a trained bias), and the weight gradient the same
    bits."""
    outputs = []
    for name in ("wide", "narrow"):
        path = tmp_path / f"{name}.npy"
        subprocess.run(
            [sys.executable, "-c", _WIDTH_SCRIPT, str(path), name, str(tmp_path / "cache")],
            check=True,
        )
        outputs.append(np.load(path))
    np.testing.assert_array_equal(outputs[0], outputs[1])


def test_build_falls_back_with_the_reason(tmp_path):
    """With no compiler (or POSATTN_NATIVE=0) the kernel says why, "auto" keeps "chunked", and
    asking for "native" by name is a clear error."""
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        from posattn import attention as attn
        from posattn.attention import native
        assert not native.available()
        print("REASON", native.why_unavailable())
        q = jnp.ones((1, 8, 2, 16))
        spec = jax.ShapeDtypeStruct(q.shape, q.dtype)
        print("AUTO", attn.choose_implementation(spec, spec, None, causal=True))
        try:
            attn.attention(q, q, q, causal=True, implementation="native")
        except ValueError as e:
            print("ERROR", e)
        from posattn import config as config_lib
        try:
            config = config_lib.load_config(
                "configs/tiny.py", ["--config.model.attention_impl=native"]
            )
            config_lib.validate(config)
        except config_lib.ConfigError as e:
            print("CONFIG", e)
        """
    )
    for env_change, reason in (
        ({"POSATTN_NATIVE": "0"}, "POSATTN_NATIVE=0"),
        ({"CXX": "", "PATH": str(tmp_path)}, "no C++ compiler"),
    ):
        env = {**os.environ, **env_change, "POSATTN_CACHE_DIR": str(tmp_path / "cache")}
        out = subprocess.run(
            [sys.executable, "-c", script],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert f"REASON {reason}" in out
        assert "AUTO chunked" in out
        assert "ERROR attention: implementation='native' cannot run here" in out
        assert (
            f"CONFIG config.model.attention_impl='native' is invalid: cannot run here: {reason}"
            in out
        )


def test_auto_takes_native_where_what_it_materialises_fits():
    """On a CPU "auto" takes the kernel wherever the logit bias it materialises (none for a
    static causal mask without a bias: it skips hidden keys itself) stays within
    AUTO_BLOCKWISE_MIN_LOGITS elements, and "blockwise" past it."""
    from posattn import attention as attn_lib

    def spec(B, T, H=16):
        return jax.ShapeDtypeStruct((B, T, 8, H), jnp.float32)

    choose = functools.partial(attn_lib.choose_implementation, backend="cpu", causal=True)
    fn_bias = (alibi_like, jnp.ones(8))
    assert choose(spec(1, 128), spec(1, 128), None) == "native"
    assert choose(spec(1, 4096, H=16), spec(1, 4096, H=16), fn_bias) == "blockwise"
    # No bias and a static causal mask: nothing materialised, whatever the length.
    assert choose(spec(1, 16384, H=32), spec(1, 16384, H=32), None) == "native"
    # A bias of [1, N, T, S]: 8 Mi elements at T = S = 1024, over it at 1025.
    assert choose(spec(4, 1024), spec(4, 1024), fn_bias) == "native"
    assert choose(spec(4, 1025), spec(4, 1025), fn_bias) == "blockwise"
    # Per-row offsets or lengths: one mask per row [B, 1, T, S] (a bias: [B, N, T, S]).
    assert choose(spec(8, 1024), spec(8, 1024), None, per_row=True) == "native"
    assert choose(spec(9, 1024), spec(9, 1024), None, per_row=True) == "blockwise"
    assert choose(spec(2, 1024), spec(2, 1024), fn_bias, per_row=True) == "blockwise"
    # A traced offset: the causal mask is materialised (one slice for the batch).
    assert choose(spec(1, 4096), spec(1, 4096), None, static_offset=None) == "blockwise"
    # A head dim the kernel is not built for.
    assert choose(spec(1, 128, H=48), spec(1, 128, H=48), None) == "chunked"
    # Heads of 64 and 128 by the same rule: with a bias, up to the limit (8 heads at T = S =
    # 1024, docs/attention.md, "Heads of 64 and 128, where native runs"); without, at any length.
    for H in (64, 128):
        assert choose(spec(1, 1024, H=H), spec(1, 1024, H=H), fn_bias) == "native"
        assert choose(spec(1, 1025, H=H), spec(1, 1025, H=H), fn_bias) == "blockwise"
        assert choose(spec(1, 4096, H=H), spec(1, 4096, H=H), None) == "native"


def test_a_config_asking_for_native_where_it_cannot_run_fails_before_compute():
    from posattn import config as config_lib

    with pytest.raises(config_lib.ConfigError, match="native kernel takes head dims"):
        config_lib.load_config(
            ROOT / "configs" / "tiny.py",
            ["--config.model.attention_impl=native", "--config.model.head_dim=24"],
        )
    config = config_lib.load_config(
        ROOT / "configs" / "tiny.py", ["--config.model.attention_impl=native"]
    )
    config_lib.validate(config)  # head dim 16: fine


def test_build_in_background_builds_the_cached_library_once_without_loading_it(
    tmp_path, monkeypatch
):
    """`build_in_background` (the experiment's parent, before its workers start) builds the
    library where the workers look for it, registering nothing; a failed build is left for the
    loading process to report; with the kernel switched off it starts nothing."""
    fake = tmp_path / "fake-c++"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "fake 1.0"; exit 0; fi\n'
        'while [ "$#" -gt 0 ]; do if [ "$1" = "-o" ]; then echo built > "$2"; fi; shift; done\n'
        '[ -z "$FAIL" ]\n'
    )
    fake.chmod(0o755)
    monkeypatch.setattr(native, "_compiler", lambda: str(fake))
    monkeypatch.setenv("POSATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FAIL", "1")
    native.build_in_background().join()
    assert not list((tmp_path / "cache").glob("*.so"))
    monkeypatch.delenv("FAIL")
    native.build_in_background().join()
    (built,) = (tmp_path / "cache").glob("attention-*.so")
    assert built.read_text() == "built\n" and native._build(str(fake)) == built
    monkeypatch.setenv("POSATTN_NATIVE", "0")
    assert native.build_in_background() is None


@pytest.mark.parametrize(
    "m, a, b",
    [(1, 1, 1), (5, 7, 15), (128, 6, 64), (129, 12, 65), (300, 70, 130), (2048, 64, 256),
     (4096, 512, 128), (257, 130, 200)],
)  # fmt: skip
def test_weight_gradient_is_x_transposed_dy(m, a, b):
    """native.weight_gradient(x, dy) = x^T dy, within the rounding bound of an m-term float32
    dot product (summed in chunks of 128 rows, in order), against float64; tile edges (rows not a
    multiple of 6, columns not of 64, chunks not of 128) included."""
    x = jax.random.normal(jax.random.key(m), (m, a))
    dy = jax.random.normal(jax.random.key(a + b), (m, b))
    got = np.asarray(jax.jit(native.weight_gradient)(x, dy), np.float64)
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    bound = 2 * m * np.finfo(np.float32).eps * (np.abs(x64).T @ np.abs(dy64))
    assert got.shape == (a, b)
    assert np.all(np.abs(got - x64.T @ dy64) <= bound + 1e-30)


def test_weight_gradient_edges_vmap_and_the_dense_layer():
    """No rows: zeros. Under vmap (a sweep's members): each member's own product, the same bits.
    A dense layer's float32 weight gradient on this CPU is the library's product, bit for bit
    (a tall weight's as the wide product transposed)."""
    np.testing.assert_array_equal(native.weight_gradient(jnp.ones((0, 3)), jnp.ones((0, 5))), 0.0)
    x = jax.random.normal(jax.random.key(0), (3, 200, 40))
    dy = jax.random.normal(jax.random.key(1), (3, 200, 72))
    members = jax.jit(jax.vmap(native.weight_gradient))(x, dy)
    for i in range(3):
        np.testing.assert_array_equal(members[i], native.weight_gradient(x[i], dy[i]))
    from posattn.nn import layers

    w = jax.random.normal(jax.random.key(2), (40, 72))
    dw = jax.jit(jax.grad(lambda w: jnp.sum(layers.dense(x[0], w) * dy[0])))(w)
    np.testing.assert_array_equal(dw, native.weight_gradient(x[0], dy[0]))
    # A tall weight's gradient is computed wide, (dy^T x)^T: the same dot products.
    dw = jax.jit(jax.grad(lambda w: jnp.sum(layers.dense(dy[0], w) * x[0])))(w.T)
    np.testing.assert_array_equal(dw, native.weight_gradient(x[0], dy[0]).T)


@pytest.mark.parametrize(
    "m, k, n",
    [(1, 1, 1), (5, 7, 15), (96, 64, 64), (97, 130, 65), (300, 70, 130), (2048, 64, 256),
     (4096, 512, 128), (1000, 1024, 200)],
)  # fmt: skip
def test_product_is_x_w(m, k, n):
    """native.product(x, w) = x w, within the rounding bound of a k-term float32 dot product,
    against float64, for w given [k, n] or transposed [n, k] (the same bits); tile edges (rows not
    a multiple of 6 or of an item's 96, columns not of 64) included."""
    x = jax.random.normal(jax.random.key(m), (m, k))
    w = jax.random.normal(jax.random.key(k + n), (k, n))
    got = np.asarray(jax.jit(native.product)(x, w))
    transposed = jax.jit(functools.partial(native.product, transposed=True))(x, w.T)
    np.testing.assert_array_equal(got, transposed)
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    bound = 2 * k * np.finfo(np.float32).eps * (np.abs(x64) @ np.abs(w64))
    assert got.shape == (m, n)
    assert np.all(np.abs(got - x64 @ w64) <= bound + 1e-30)


def test_product_edges_vmap_and_the_dense_layer():
    """No rows, no terms, no columns: the empty or zero product. Under vmap (a sweep's members):
    each member's own product, the same bits. With AVX-512, a dense layer's float32 forward and
    input gradient at 256 rows or more are the library's product, bit for bit; below, XLA's;
    without AVX-512, XLA's at every size."""
    assert native.product(jnp.ones((0, 3)), jnp.ones((3, 5))).shape == (0, 5)
    np.testing.assert_array_equal(native.product(jnp.ones((4, 0)), jnp.ones((0, 5))), 0.0)
    assert native.product(jnp.ones((4, 3)), jnp.ones((3, 0))).shape == (4, 0)
    x = jax.random.normal(jax.random.key(0), (3, 300, 40))
    w = jax.random.normal(jax.random.key(1), (3, 40, 72))
    members = jax.jit(jax.vmap(native.product))(x, w)
    for i in range(3):
        np.testing.assert_array_equal(members[i], native.product(x[i], w[i]))
    from posattn.nn import layers

    text = jax.jit(layers.dense).lower(x[0, :255], w[0]).compile().as_text()
    assert "posattn_product" not in text  # 255 rows: XLA's product
    text = jax.jit(layers.dense).lower(x[0, :256], w[0]).compile().as_text()
    assert ("posattn_product" in text) == native.wide_vectors()
    if native.wide_vectors():
        dy = jax.random.normal(jax.random.key(2), (300, 72))
        y, pullback = jax.vjp(layers.dense, x[0], w[0])
        np.testing.assert_array_equal(y, native.product(x[0], w[0]))
        np.testing.assert_array_equal(pullback(dy)[0], native.product(dy, w[0], transposed=True))
    with pytest.raises(Exception, match="w \\[K, N\\]"):
        jax.jit(native.product)(x[0], w[0].T)
