"""reference_attention and exact_attention against the float64 numpy oracle."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dma_jax import DMAConfig, exact_attention, reference_attention
from dma_jax.config import ALL_TILES
from dma_jax.reference import dma_reference, high_pair_fraction, smoothing_mean

import oracle


def make_qkv(seed, b, lq, lk, hq, hkv, d, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, lq, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, lk, hkv, d)).astype(np.float32) + 2.0 * rng.standard_normal((1, 1, hkv, d))
    v = rng.standard_normal((b, lk, hkv, d)).astype(np.float32)
    q[..., :3] *= 6.0  # outlier channels
    return tuple(np.asarray(a, np.float32).astype(dtype) for a in (q, k, v))


CASES = [
    # (b, lq, lk, hq, hkv, d, causal, diag, sink, q_offset)
    (1, 300, 300, 2, 2, 64, True, 1, 1, None),
    (2, 200, 300, 6, 2, 128, True, 1, 1, None),
    (1, 300, 300, 3, 1, 64, False, 1, 1, None),
    (1, 257, 257, 2, 1, 64, True, 0, 0, None),
    (1, 257, 257, 2, 1, 64, True, 2, 1, None),
    (1, 257, 257, 2, 1, 64, True, 1, 0, None),
    (1, 257, 257, 2, 1, 64, True, 0, 1, None),
    (1, 300, 400, 8, 1, 64, False, 1, 1, 50),
    (1, 1, 385, 2, 2, 64, True, 1, 1, None),
    (1, 129, 130, 2, 2, 128, True, ALL_TILES, 1, None),
]


@pytest.mark.parametrize("b,lq,lk,hq,hkv,d,causal,diag,sink,q_offset", CASES)
def test_reference_matches_float64_oracle(b, lq, lk, hq, hkv, d, causal, diag, sink, q_offset):
    q, k, v = make_qkv(0, b, lq, lk, hq, hkv, d)
    # Without smoothing the float32 pre-processing is identical in both, so the
    # only differences left are float32 vs float64 sums.
    cfg = DMAConfig(diag_tiles=diag, sink_tiles=sink, smooth_k=False)
    got = reference_attention(q, k, v, causal=causal, config=cfg, q_offset=q_offset)
    want = oracle.dma_attention(q, k, v, causal=causal, diag=diag, sink=sink,
                                smooth_k=False, q_offset=q_offset)
    assert got.dtype == jnp.float32 and got.shape == q.shape
    assert oracle.rel_l2(got, want) < 1e-5


@pytest.mark.parametrize("high,low", [("mxfp8_e5m2", "mxfp4"), ("mxfp8_e4m3", "mxfp4"),
                                      ("mxfp8_e5m2", "nvfp4")])
def test_other_formats_smoothing_and_scale(high, low):
    q, k, v = make_qkv(1, 1, 300, 300, 4, 2, 128)
    cfg = DMAConfig(high=high, low=low, sm_scale=0.05)
    got = reference_attention(q, k, v, config=cfg)
    want = oracle.dma_attention(q, k, v, high=high, low=low, sm_scale=0.05)
    # The smoothing mean is summed in a different order by numpy: an occasional
    # element may round to its other neighbour.
    assert oracle.rel_l2(got, want) < 2e-3


@pytest.mark.parametrize("low", ["nvfp4", "mxfp4"])
def test_bf16_high_pairs_match_float64_oracle(low):
    """``high="bf16"``: the sink and band pairs from Q and K rounded to bf16 (after
    smoothing, rotation and Q's fold), the rest in the low format."""
    q, k, v = make_qkv(3, 1, 300, 400, 4, 2, 64)
    cfg = DMAConfig(high="bf16", low=low, diag_tiles=1, sink_tiles=1)
    got = reference_attention(q, k, v, config=cfg, q_offset=100)
    want = oracle.dma_attention(q, k, v, high="bf16", low=low, q_offset=100)
    assert oracle.rel_l2(got, want) < 2e-3


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_inputs_round_p_before_pv(dtype):
    np_dtype = ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float16
    q, k, v = make_qkv(2, 1, 260, 260, 2, 2, 64, dtype=np_dtype)
    got = reference_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    assert got.dtype == dtype
    want = oracle.dma_attention(q, k, v, p_dtype=np_dtype)
    unrounded = oracle.dma_attention(q, k, v)
    err = oracle.rel_l2(got, want)
    assert err < 5e-3
    # Rounding P to the input dtype is visible: the oracle that rounds is closer.
    assert err < oracle.rel_l2(got, unrounded)


def test_rows_without_valid_keys_are_zero():
    q, k, v = make_qkv(3, 1, 20, 40, 2, 2, 64)
    # Below the public API (which rejects causal offsets < 0): the masking the kernels share.
    got = np.asarray(dma_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True, config=DMAConfig(),
                                   q_offset=-5))
    assert (got[:, :5] == 0).all()
    assert np.abs(got[:, 5:]).min(axis=-1).max() > 0
    want = oracle.dma_attention(q, k, v, causal=True, q_offset=-5)
    assert oracle.rel_l2(got, want) < 2e-3


def test_nan_propagates_to_its_rows():
    q, k, v = make_qkv(4, 2, 130, 130, 4, 2, 64)
    q[0, 7, 1, 3] = np.nan
    k[1, 9, 0, 0] = np.inf
    got = np.asarray(reference_attention(q, k, v, causal=True))
    assert np.isnan(got[0, 7, 1]).all()
    # The Inf key poisons exactly the rows that see it (causal: positions >= 9) of the
    # query heads sharing its kv head: smooth-K's mean is over the finite keys only.
    nan_rows = np.zeros(got.shape[:3], bool)
    nan_rows[0, 7, 1] = True
    nan_rows[1, 9:, :2] = True
    assert np.isnan(got[nan_rows]).all()
    assert np.isfinite(got[~nan_rows]).all()
    want = oracle.dma_attention(np.where(np.isnan(q), 0, q), np.where(np.isinf(k), 0, k), v, causal=True)
    # Rows that see no bad input match the oracle run on the same keys minus the bad
    # one's influence on the mean: exactly the finite-key mean.
    assert oracle.rel_l2(got[1, :9], oracle.dma_attention(q, k, v, causal=True)[1, :9]) < 2e-3
    assert np.isfinite(want).all()


def test_gqa_equals_repeated_heads():
    q, k, v = make_qkv(5, 1, 140, 140, 6, 2, 64)
    grouped = reference_attention(q, k, v)
    repeated = reference_attention(q, np.repeat(k, 3, axis=2), np.repeat(v, 3, axis=2))
    np.testing.assert_allclose(np.asarray(grouped), np.asarray(repeated), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal,q_offset", [(True, None), (False, None), (True, 30)])
def test_exact_attention_matches_float64(causal, q_offset):
    q, k, v = make_qkv(6, 2, 100, 180, 4, 1, 128)
    got = exact_attention(q, k, v, causal=causal, q_offset=q_offset)
    want = oracle.dma_attention(q, k, v, causal=causal, diag=None, q_offset=q_offset)
    assert got.dtype == jnp.float32
    assert oracle.rel_l2(got, want) < 1e-5


def test_memory_is_bounded_at_8k_32_heads():
    """q_len = kv_len = 8192, 32 heads, head_dim 128 must fit the 24 GB CPU machine:
    XLA's buffer assignment of the compiled reference says how much it needs."""
    shape = jax.ShapeDtypeStruct((1, 8192, 32, 128), jnp.bfloat16)
    compiled = jax.jit(reference_attention).lower(shape, shape, shape).compile()
    stats = compiled.memory_analysis()
    total = stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes
    assert total < 8 * 2**30, f"needs {total / 2**30:.1f} GiB"


@pytest.mark.parametrize("low,causal", [("nvfp4", True), ("mxfp4", False)])
def test_fp8_operands_and_fp8_pv_match_float64_oracle(low, causal):
    """The Hopper numerics (FP8 Q·Kᵀ operands, Q per token and K per tile, NVFP4 rounded to
    E4M3 by the opt-in; FP8 P·V) in the reference against the same rules written
    independently in numpy."""
    q, k, v = make_qkv(5, 1, 300, 300, 4, 2, 64)
    for pv in ("input", "fp8"):
        cfg = DMAConfig(low=low, smooth_k=False, pv=pv, nvfp4_copy="e4m3", rotate="none")
        got = reference_attention(q, k, v, causal=causal, config=cfg, operands="fp8")
        want = oracle.dma_attention(q, k, v, causal=causal, low=low, smooth_k=False,
                                    operands="fp8", pv=pv, rotate="none")
        assert oracle.rel_l2(got, want) < 1e-4
    exact = oracle.dma_attention(q, k, v, causal=causal, low=low, smooth_k=False, rotate="none")
    assert oracle.rel_l2(got, exact) > 1e-3  # the FP8 P·V is a different computation


def test_fp8_operands_are_exact_by_default():
    """By default sm_90 reads NVFP4 tiles from exact bf16 copies and MX tiles from exact
    E4M3 copies: its operands give the reference's own numbers."""
    q, k, v = make_qkv(7, 1, 300, 300, 4, 2, 64)
    for cfg in (DMAConfig(), DMAConfig(low="mxfp4")):
        fp8 = reference_attention(q, k, v, config=cfg, operands="fp8")
        assert oracle.rel_l2(fp8, reference_attention(q, k, v, config=cfg)) < 1e-4


def test_unknown_operands_are_rejected():
    q, k, v = make_qkv(6, 1, 8, 8, 2, 2, 64)
    with pytest.raises(ValueError, match="operands must be one of"):
        reference_attention(q, k, v, operands="bf16")


def _high_pairs_by_intervals(seq, causal, diag, sink, tile=128):
    """High pairs counted per query as a union of key intervals (the sink run and
    the diagonal band), over the unmasked pairs."""
    high = valid = 0
    for q in range(seq):
        end = q + 1 if causal else seq
        block = q // tile
        band = range(max(0, (block - diag + 1) * tile), min(end, (block + diag) * tile if not causal else end))
        sink_run = range(0, min(end, sink * tile))
        high += len(set(band) | set(sink_run))
        valid += end
    return high / valid


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq, diag, sink", [(1000, 1, 1), (700, 2, 0), (300, 0, 1), (129, 1, 0), (2000, 3, 2)])
def test_high_pair_fraction_counts_the_high_pairs(seq, diag, sink, causal):
    got = high_pair_fraction(DMAConfig(diag_tiles=diag, sink_tiles=sink), seq, causal=causal)
    assert got == pytest.approx(_high_pairs_by_intervals(seq, causal, diag, sink), rel=1e-12)


def test_a_fixed_smooth_k_mean():
    """``k_mean`` replaces the mean of k (as a decode over a cache fixed at prefill would):
    k's own mean gives the same bits as the default, another mean gives DMA on k minus
    that mean (the float64 oracle without smoothing), and bad means are refused."""
    q, k, v = make_qkv(21, 2, 60, 300, 4, 2, 64)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    cfg = DMAConfig()
    own = np.asarray(smoothing_mean(k.astype(jnp.float32))[:, 0])
    np.testing.assert_array_equal(np.asarray(reference_attention(q, k, v, config=cfg, k_mean=own)),
                                  np.asarray(reference_attention(q, k, v, config=cfg)))
    prefix = np.asarray(k[:, :128].astype(jnp.float32).mean(axis=1))  # the mean of a 128-token prompt
    got = np.asarray(reference_attention(q, k, v, config=cfg, k_mean=prefix), np.float64)
    shifted = (np.asarray(k, np.float32) - prefix[:, None]).astype(np.float32)
    want = oracle.dma_attention(np.asarray(q), shifted, np.asarray(v), smooth_k=False)
    assert oracle.rel_l2(got, want) < 2e-3
    with pytest.raises(ValueError, match=r"k_mean must have shape \[batch, kv_heads, head_dim\] = \(2, 2, 64\); "
                                         r"got \(2, 64\)"):
        reference_attention(q, k, v, k_mean=prefix[0])
    with pytest.raises(ValueError, match=r"needs DMAConfig\(smooth_k=True\)"):
        reference_attention(q, k, v, config=DMAConfig(smooth_k=False), k_mean=prefix)
