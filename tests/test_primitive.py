"""dma_jax.attention: the primitive under jit, vmap and grad, and input validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dma_jax
from dma_jax import DMAConfig, attention, reference_attention

import oracle


def qkv(key, b, lq, lk, hq, hkv, d, dtype=jnp.bfloat16):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(key), 3)
    q = jax.random.normal(kq, (b, lq, hq, d)).astype(dtype)
    k = (jax.random.normal(kk, (b, lk, hkv, d)) + 1.5).astype(dtype)
    v = jax.random.normal(kv, (b, lk, hkv, d)).astype(dtype)
    return q, k, v


def close(a, b, tol):
    return oracle.rel_l2(np.asarray(a, np.float32), np.asarray(b, np.float32)) < tol


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_eager_and_jit_match_reference(dtype):
    q, k, v = qkv(0, 2, 190, 190, 4, 2, 64, dtype)
    ref = reference_attention(q, k, v)
    eager = attention(q, k, v)
    jitted = jax.jit(attention)(q, k, v)
    assert eager.dtype == jitted.dtype == dtype and eager.shape == q.shape
    # XLA may fuse the two programs differently: equal up to one output rounding.
    tol = 1e-5 if dtype == jnp.float32 else 5e-3
    assert close(eager, ref, tol) and close(jitted, ref, tol)


def test_jit_with_static_options():
    q, k, v = qkv(1, 1, 100, 300, 2, 1, 128)
    cfg = DMAConfig(diag_tiles=2, low="mxfp4")
    f = jax.jit(lambda q, k, v: attention(q, k, v, causal=False, config=cfg, q_offset=7))
    ref = reference_attention(q, k, v, causal=False, config=cfg, q_offset=7)
    assert close(f(q, k, v), ref, 5e-3)


def test_vmap_folds_into_batch():
    q, k, v = qkv(2, 6, 130, 130, 2, 2, 64)
    q, k, v = (x.reshape(2, 3, *x.shape[1:]) for x in (q, k, v))
    out = jax.vmap(attention)(q, k, v)
    flat = reference_attention(*(x.reshape(6, *x.shape[2:]) for x in (q, k, v)))
    assert out.shape == q.shape
    assert close(out.reshape(flat.shape), flat, 5e-3)


def test_vmap_over_queries_only_and_nonzero_axis():
    q, k, v = qkv(3, 1, 130, 130, 2, 2, 64)
    qs = jnp.stack([q, -q, 2 * q], axis=2)  # vmapped axis in the middle
    out = jax.vmap(attention, in_axes=(2, None, None), out_axes=1)(qs, k, v)
    assert out.shape == (1, 3, 130, 2, 64)
    for i in range(3):
        assert close(out[:, i], reference_attention(qs[:, :, i], k, v), 5e-3)


def test_nested_vmap_under_jit():
    q, k, v = qkv(4, 4, 70, 70, 2, 1, 64)
    q, k, v = (x.reshape(2, 2, 1, *x.shape[1:]) for x in (q, k, v))
    out = jax.jit(jax.vmap(jax.vmap(attention)))(q, k, v)
    flat = reference_attention(*(x.reshape(4, *x.shape[3:]) for x in (q, k, v)))
    assert close(out.reshape(flat.shape), flat, 5e-3)


@pytest.mark.parametrize("transform", ["grad", "jvp", "vjp"])
def test_differentiation_is_an_inference_only_error(transform):
    q, k, v = qkv(5, 1, 16, 16, 1, 1, 64, jnp.float32)
    f = lambda q: attention(q, k, v).sum()
    with pytest.raises(NotImplementedError, match="inference-only"):
        if transform == "grad":
            jax.grad(f)(q)
        elif transform == "jvp":
            jax.jvp(f, (q,), (q,))
        else:
            jax.vjp(f, q)


def test_primitive_appears_in_jaxpr():
    q, k, v = qkv(6, 1, 16, 16, 1, 1, 64)
    jaxpr = jax.make_jaxpr(attention)(q, k, v)
    assert "dma_attention" in str(jaxpr)


BAD = [
    (dict(q=(1, 16, 2, 64, 1)), ValueError, r"q must have rank 4 .* got shape \(1, 16, 2, 64, 1\)"),
    (dict(dtype=jnp.int32), TypeError, r"dtype in \('bfloat16', 'float16', 'float32'\); got int32"),
    (dict(k_dtype=jnp.float16), TypeError, r"share one dtype; got bfloat16, float16, bfloat16"),
    (dict(q=(1, 16, 2, 96), k=(1, 16, 2, 96), v=(1, 16, 2, 96)), ValueError, r"head_dim must be one of \(64, 128\); got 96"),
    (dict(q=(1, 16, 6, 64), k=(1, 16, 4, 64), v=(1, 16, 4, 64)), ValueError, r"q_heads \(6\) must be a multiple of kv_heads \(4\)"),
    (dict(q=(2, 16, 2, 64)), ValueError, r"batch size of q \(2\) and k/v \(1\) differ"),
    (dict(q=(1, 16, 2, 128)), ValueError, r"head_dim of q \(128\) and k/v \(64\) differ"),
    (dict(v=(1, 17, 2, 64)), ValueError, r"k and v must have the same shape"),
    (dict(q=(1, 32, 2, 64)), ValueError, r"q_len \(32\) > kv_len \(16\) needs an explicit q_offset"),
    (dict(causal=1), TypeError, r"causal must be a bool"),
    (dict(config="nvfp4"), TypeError, r"config must be a DMAConfig"),
    (dict(q_offset=1.5), TypeError, r"q_offset must be a Python int"),
    (dict(q=(1, 0, 2, 64)), ValueError, r"q_len and kv_len must be >= 1"),
]


@pytest.mark.parametrize("bad,exc,message", BAD)
@pytest.mark.parametrize("fn", [attention, reference_attention])
def test_bad_inputs_are_explained(fn, bad, exc, message):
    bad = dict(bad)
    dtype = bad.pop("dtype", jnp.bfloat16)
    shapes = {n: bad.pop(n, s) for n, s in (("q", (1, 16, 2, 64)), ("k", (1, 16, 2, 64)), ("v", (1, 16, 2, 64)))}
    arrays = {n: jnp.zeros(s, dtype) for n, s in shapes.items()}
    if "k_dtype" in bad:
        arrays["k"] = arrays["k"].astype(bad.pop("k_dtype"))
    with pytest.raises(exc, match=message):
        fn(arrays["q"], arrays["k"], arrays["v"], **bad)


def test_non_array_input():
    with pytest.raises(TypeError, match="q must be an array; got list"):
        attention([[1.0]], jnp.zeros((1, 1, 1, 64)), jnp.zeros((1, 1, 1, 64)))


def test_causal_offsets_must_keep_every_query_at_a_key():
    """Causal attention needs each query's own key: a negative q_offset (rows before key
    0, which would see no key) or one past kv_len - q_len is an error; non-causal calls
    take any offset (it only places the high-precision band)."""
    q, k, v = qkv(7, 1, 40, 20, 1, 1, 64)
    for offset in (-20, -1):
        with pytest.raises(ValueError, match=rf"0 <= q_offset <= kv_len - q_len = -20; got {offset}"):
            attention(q, k, v, q_offset=offset)
    q, k, v = qkv(7, 1, 20, 40, 1, 1, 64)
    with pytest.raises(ValueError, match=r"0 <= q_offset <= kv_len - q_len = 20; got 21"):
        reference_attention(q, k, v, q_offset=21)
    assert close(attention(q, k, v, causal=False, q_offset=-20),
                 reference_attention(q, k, v, causal=False, q_offset=-20), 5e-3)
    with pytest.raises(ValueError, match=r"q_offset must be within ±1073741824; got 1073741825"):
        attention(q, k, v, causal=False, q_offset=2**30 + 1)


@pytest.mark.slow
@settings(max_examples=3, deadline=None)
@given(
    lq=st.integers(1, 300),
    extra=st.integers(0, 150),
    kv_heads=st.sampled_from([1, 2]),
    ratio=st.sampled_from([1, 3, 8]),
    head_dim=st.sampled_from([64, 128]),
    causal=st.booleans(),
    diag=st.integers(0, 3),
    sink=st.integers(0, 2),
)
def test_property_jit_and_vmap_match_reference(lq, extra, kv_heads, ratio, head_dim, causal, diag, sink):
    lk = lq + extra
    q, k, v = qkv(lq * 7 + extra, 2, lq, lk, kv_heads * ratio, kv_heads, head_dim)
    cfg = DMAConfig(diag_tiles=diag, sink_tiles=sink)
    ref = reference_attention(q, k, v, causal=causal, config=cfg)
    f = jax.jit(lambda q, k, v: attention(q, k, v, causal=causal, config=cfg))
    assert close(f(q, k, v), ref, 5e-3)
    vm = jax.vmap(lambda q, k, v: attention(q[None], k[None], v[None], causal=causal, config=cfg)[0])
    assert close(vm(q, k, v), ref, 5e-3)


def test_options_under_jit():
    """A config passes through jax.jit as a static value; causal and q_offset traced
    by jax.jit get an error that says how to pass them statically, and that works."""
    import functools

    q, k, v = qkv(12, 1, 40, 40, 2, 1, 64)
    cfg = DMAConfig(diag_tiles=0, sink_tiles=0)
    assert close(jax.jit(attention)(q, k, v, config=cfg), reference_attention(q, k, v, config=cfg), 5e-3)
    for option, value in (("causal", False), ("q_offset", 0)):
        with pytest.raises(TypeError, match=rf"{option} must be a static Python value, but it is traced .*"
                                            rf"jax.jit\(functools.partial\(dma_jax.attention, {option}=...\)\)"):
            jax.jit(attention)(q, k, v, **{option: value})
    want = reference_attention(q, k, v, causal=False)
    assert close(jax.jit(functools.partial(attention, causal=False))(q, k, v), want, 5e-3)
    assert close(jax.jit(attention, static_argnames=("causal",))(q, k, v, causal=False), want, 5e-3)


@pytest.mark.parametrize("fn", [attention, reference_attention, dma_jax.exact_attention])
def test_an_empty_batch_gives_an_empty_result(fn):
    q, k, v = (jnp.zeros((0, n, 2, 64), jnp.bfloat16) for n in (5, 9, 9))
    for f in (fn, jax.jit(fn)):
        out = f(q, k, v)
        assert out.shape == (0, 5, 2, 64)
        assert out.dtype == (jnp.float32 if fn is dma_jax.exact_attention else jnp.bfloat16)


def test_public_names():
    for name in ("attention", "reference_attention", "exact_attention", "quantize",
                 "dequantize", "DMAConfig", "Quantized", "FORMATS"):
        assert hasattr(dma_jax, name)
