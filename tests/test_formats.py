"""dma_jax.formats against the numpy + ml_dtypes oracle, element by element."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dma_jax import FORMATS, dequantize, quantize
from dma_jax.formats import fp8_per_channel, fp8_per_tile, fp8_per_token, get_format, pack_nibbles, unpack_nibbles

import oracle

ALL = sorted(FORMATS)


@pytest.fixture(autouse=True)
def on_xla_cpu():
    """The bit-exact contract holds on XLA's CPU backend. XLA's GPU backend does
    not round float32 divisions correctly, so there NVFP4 scales can differ by an
    ulp (measured on an H200); GPUs run the Triton kernels instead."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


FORMAT_RULES = [(f, r) for f in ALL for r in oracle.RULES[f]]


def check_against_oracle(x, fmt, rule=None):
    codes, scales, token, deq = oracle.quantize(x, fmt, rule)
    got = quantize(jnp.asarray(x), fmt, rule)
    np.testing.assert_array_equal(np.asarray(got.codes), codes)
    np.testing.assert_array_equal(np.asarray(got.scales), scales)
    if token is None:
        assert got.token_scale is None
    else:
        np.testing.assert_array_equal(np.asarray(got.token_scale), token)
    np.testing.assert_array_equal(np.asarray(dequantize(got, fmt), np.float64), deq)
    return np.asarray(dequantize(got, fmt), np.float64)


def grid(block, values):
    """Rows of one block each: a leading anchor that fixes the scale, then values."""
    values = np.asarray(values, np.float32)
    n = block - 1
    rows = [values[i:i + n] for i in range(0, len(values), n)]
    rows[-1] = np.pad(rows[-1], (0, n - len(rows[-1])))
    return np.stack(rows)


@pytest.mark.parametrize("fmt", ALL)
def test_random_normal_matches_oracle(fmt):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 5, 128)).astype(np.float32) * rng.uniform(1e-3, 1e3, (7, 5, 1))
    check_against_oracle(x.astype(np.float32), fmt)


@pytest.mark.parametrize("fmt", ALL)
def test_bf16_values_times_folded_scale(fmt):
    """bf16 values have short mantissas, so (x / s2) / sb often lands exactly on a
    rounding tie: a fused x / (s2 * sb) would round it the other way."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 37, 3, 64)).astype(np.float32)
    x[..., 5] *= 100
    x = x.astype(ml_dtypes.bfloat16).astype(np.float32) * np.float32(0.3)
    check_against_oracle(x, fmt)


@pytest.mark.parametrize("fmt", ALL)
def test_outliers_and_bf16_inputs(fmt):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 64)).astype(np.float32)
    x[:, [3, 17, 40]] *= 300.0
    xb = x.astype(ml_dtypes.bfloat16)
    codes, scales, token, deq = oracle.quantize(xb.astype(np.float32), fmt)
    got = quantize(jnp.asarray(xb), fmt)
    np.testing.assert_array_equal(np.asarray(got.codes), codes)
    np.testing.assert_array_equal(np.asarray(got.scales), scales)
    np.testing.assert_array_equal(np.asarray(dequantize(got, fmt), np.float64), deq)


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4"])
def test_every_element_value_ties_and_subnormals(fmt):
    """Scale 1 blocks (anchor = element max), then every representable value,
    every midpoint between neighbours (ties) and points just off the midpoints.
    (NVFP4 scales per token: see test_nvfp4_ties_with_unit_scales.)"""
    dtype, vmax, _, block = oracle.ELEMENT[fmt]
    reps = np.unique(np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
                     if dtype != ml_dtypes.float4_e2m1fn
                     else np.arange(16, dtype=np.uint8).view(dtype).astype(np.float32))
    reps = reps[np.isfinite(reps) & (reps >= 0)]
    mids = (reps[:-1] + reps[1:]) / 2
    vals = np.concatenate([reps, mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf)])
    vals = np.concatenate([vals, -vals])
    body = grid(block, vals)
    x = np.concatenate([np.full((len(body), 1), vmax, np.float32), body], axis=1)
    check_against_oracle(x, fmt)
    # Scale 1 really holds: codes decode to the values themselves on the grid.
    got = dequantize(quantize(jnp.asarray(x), fmt), fmt)
    np.testing.assert_array_equal(np.asarray(got)[:, 0], vmax)


def test_nvfp4_ties_with_unit_scales():
    """Tokens whose amax is 2688 give s2 = 1; blocks whose amax is 6 give sb = 1."""
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, 5.5, -2.9],
                    np.float32)
    x = np.zeros((1, 64), np.float32)
    x[0, 0] = 2688.0
    x[0, 16] = 6.0
    x[0, 17:17 + len(ties)] = ties
    check_against_oracle(x, "nvfp4")
    q = quantize(jnp.asarray(x), "nvfp4")
    assert float(q.token_scale[0]) == 1.0
    expected = np.clip(ties, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(dequantize(q, "nvfp4"))[0, 17:17 + len(ties)],
                                  expected)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8_e4m3"])
def test_mx_floor_rule_saturates_the_block_max(fmt):
    """OCP's scale rule can map a block max above the element max: it saturates."""
    vmax = oracle.ELEMENT[fmt][1]
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 7.0 if fmt == "mxfp4" else 500.0
    x[0, 1] = -x[0, 0]
    deq = check_against_oracle(x, fmt, "floor")
    assert deq[0, 0] == vmax and deq[0, 1] == -vmax


@pytest.mark.parametrize("fmt, rule", FORMAT_RULES)
def test_every_rule_matches_oracle(fmt, rule):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 9, 128)).astype(np.float32) * rng.uniform(1e-3, 1e3, (6, 9, 1))
    x[:, :, [3, 70]] *= 40.0  # outlier channels
    x[0, 0] = 0.0
    x[1, 1, 5] = np.nan
    x[2, 2, 100] = -np.inf
    check_against_oracle(x, fmt, rule)
    check_against_oracle(x.astype(ml_dtypes.bfloat16).astype(np.float32), fmt, rule)


@pytest.mark.parametrize("fmt, rule", [fr for fr in FORMAT_RULES if fr[0] != "nvfp4"])
def test_mx_rules_at_their_thresholds(fmt, rule):
    """Block maxima swept over one binade: the element max, the rounding midpoint
    above it and their float32 neighbours, where the three rules part."""
    _, vmax, emax, block = oracle.ELEMENT[fmt]
    step = {"mxfp8_e4m3": 32.0, "mxfp8_e5m2": 8192.0, "mxfp4": 2.0}[fmt]
    tops = np.float32([vmax, vmax + step / 2, 2.0 ** (emax + 1) - step / 4, 2.0 ** emax, 1.5 * 2.0 ** emax])
    tops = np.concatenate([tops, np.nextafter(tops, 0), np.nextafter(tops, np.inf)])
    x = np.zeros((len(tops), block), np.float32)
    x[:, 0] = tops * np.float32(2.0**-3)
    x[:, 1] = -np.float32(0.3) * tops
    check_against_oracle(x, fmt, rule)


@pytest.mark.parametrize("fmt, rule", [("mxfp8_e4m3", "up"), ("mxfp8_e5m2", "up"), ("mxfp4", "up"),
                                       ("nvfp4", "up")])
def test_up_rules_never_saturate(fmt, rule):
    """Rounded-up scales: a block's largest element moves by at most half an element
    step (relative 2^-(man + 1)), however it sits against the element max."""
    man = {"mxfp8_e4m3": 3, "mxfp8_e5m2": 2, "mxfp4": 1, "nvfp4": 1}[fmt]
    rng = np.random.default_rng(5)
    block = oracle.ELEMENT[fmt][3]
    x = rng.uniform(-1, 1, (4096, block)).astype(np.float32) * np.exp2(rng.uniform(-8, 8, (4096, 1))).astype(np.float32)
    deq = check_against_oracle(x, fmt, rule).reshape(x.shape)
    top = np.argmax(np.abs(x), axis=1)
    xt, dt = x[np.arange(len(x)), top].astype(np.float64), deq[np.arange(len(x)), top]
    assert (np.abs(dt - xt) <= np.abs(xt) * 2.0 ** -(man + 1) * (1 + 1e-6)).all()


def test_four_over_six_never_reconstructs_worse():
    """4/6 keeps whichever of its two scales reconstructs a block better, so its
    per-block error never exceeds the nearest rule's (both from the oracle, float64)."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((512, 128)).astype(np.float32) * np.exp2(rng.uniform(-4, 4, (512, 1))).astype(np.float32)
    deq6 = check_against_oracle(x, "nvfp4", "nearest")
    deq46 = check_against_oracle(x, "nvfp4", "4/6")
    err = lambda d: np.abs(d - x).reshape(512, 8, 16).sum(-1)  # noqa: E731
    assert (err(deq46) <= err(deq6) * (1 + 1e-5) + 1e-30).all()
    assert (deq46 != deq6).any(), "some blocks take the scale to 4"
    assert err(deq46).sum() < err(deq6).sum()


@pytest.mark.parametrize("fmt", ALL)
def test_zero_blocks_negative_zero_and_tiny(fmt):
    block = get_format(fmt).block
    x = np.zeros((4, 2 * block), np.float32)
    x[1, :] = -0.0
    x[2, 0] = 1.0
    x[2, 1] = -1e-9  # rounds to a negative zero element
    x[3, :] = 1e-40  # float32 subnormals are flushed to zero
    q = quantize(jnp.asarray(x), fmt)
    deq = np.asarray(dequantize(q, fmt))
    assert not np.isnan(deq).any()
    assert (deq[[0, 1, 3]] == 0).all()
    assert np.signbit(deq[1]).all(), "negative zeros keep their sign"
    if get_format(fmt).scale == "e8m0":
        assert (np.asarray(q.scales)[0] == 0).all(), "zero blocks get the smallest scale"
    check_against_oracle(x, fmt)


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 5, 15])
def test_nan_and_inf_propagate(fmt, bad, where):
    f = get_format(fmt)
    x = np.ones((2, 64), np.float32)
    x[0, :16] = np.linspace(-3, 3, 16)
    x[0, where] = bad
    q = quantize(jnp.asarray(x), fmt)
    deq = np.asarray(dequantize(q, fmt))
    assert np.isnan(deq[0, :f.block]).all(), "the block holding NaN/Inf decodes to NaN"
    np.testing.assert_array_equal(deq[1], 1.0)
    if f.scale == "e8m0":
        assert np.asarray(q.scales)[0, 0] == 0xFF
        np.testing.assert_array_equal(deq[0, f.block:], 1.0)
    check_against_oracle(x, fmt)


def test_e2m1_packing_order():
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [6.0, 0.5, -1.0, 3.0]  # codes 7, 1, 0xA, 5
    codes = np.asarray(quantize(jnp.asarray(x), "mxfp4").codes)
    assert codes.shape == (1, 16)
    assert codes[0, 0] == 0x17 and codes[0, 1] == 0x5A
    np.testing.assert_array_equal(np.asarray(unpack_nibbles(pack_nibbles(jnp.arange(16, dtype=jnp.uint8).reshape(2, 8)))),
                                  np.arange(16).reshape(2, 8))


@pytest.mark.parametrize("fmt", ALL)
def test_shapes_and_dtypes(fmt):
    f = get_format(fmt)
    q = quantize(jnp.ones((2, 3, 128), jnp.bfloat16), fmt)
    assert q.codes.dtype == jnp.uint8 and q.scales.dtype == jnp.uint8
    assert q.codes.shape == (2, 3, 64 if f.packed else 128)
    assert q.scales.shape == (2, 3, 128 // f.block)
    if f.scale == "e8m0":
        assert q.token_scale is None
    else:
        assert q.token_scale.shape == (2, 3) and q.token_scale.dtype == jnp.float32


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown format 'fp4'.*mxfp4"):
        quantize(jnp.ones((32,)), "fp4")
    with pytest.raises(ValueError, match="blocks of 32; got shape \\(2, 48\\)"):
        quantize(jnp.ones((2, 48)), "mxfp8_e4m3")
    with pytest.raises(TypeError, match="floating-point"):
        quantize(jnp.ones((32,), jnp.int32), "mxfp4")
    with pytest.raises(ValueError, match=r"mxfp4 block scales accept the rules \('up', 'floor', 'nearest'\); got '4/6'"):
        quantize(jnp.ones((32,)), "mxfp4", "4/6")


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("value", [2e-38, 1.7690853e-37, 1e-36, 3e-35])
def test_tiny_normal_blocks(fmt, value):
    """Blocks near the bottom of float32's normal range: an E8M0 scale of 2^-127
    is itself subnormal, and NVFP4's s2 = amax / 2688 underflows (such tokens
    encode as zeros). Found by the property test below."""
    x = np.full((2, 64), value, np.float32)
    x[1, ::3] *= -3.0
    check_against_oracle(x, fmt)


@settings(max_examples=60, deadline=None)
@given(
    fr=st.sampled_from(FORMAT_RULES),
    x=hnp.arrays(np.float32, (3, 64), elements=st.floats(-1e6, 1e6, width=32)),
)
def test_property_matches_oracle(fr, x):
    check_against_oracle(x, *fr)


def check_fp8_copy(x, fmt):
    want_vals, want_scale = oracle.fp8_per_token(x, fmt)
    vals, scale = fp8_per_token(quantize(jnp.asarray(x), fmt), fmt)
    np.testing.assert_array_equal(np.asarray(vals, np.float64), want_vals)
    np.testing.assert_array_equal(np.asarray(scale, np.float64), want_scale)
    return np.asarray(vals, np.float64) * np.asarray(scale, np.float64)[..., None]


@pytest.mark.parametrize("fmt", ALL)
def test_fp8_per_token_copy_matches_oracle(fmt):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((6, 9, 128)).astype(np.float32) * rng.uniform(1e-3, 1e3, (6, 9, 1))
    x[0, 0] = 0.0  # an all-zero token
    x[0, 1, :32] *= 2.0**-12  # a block far below the token's largest
    x[1, 2, 5] = np.nan
    x[1, 3, 70] = -np.inf
    check_fp8_copy(x, fmt)


@pytest.mark.parametrize("fmt", ALL)
def test_fp8_per_token_copy_is_exact_for_mx_and_bounded_for_nvfp4(fmt):
    """MX blocks shift exactly into a per-token E4M3 scale unless an element falls
    below E4M3's normal range; NVFP4's e·sb moves by at most 2^-4 of itself."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    got = check_fp8_copy(x, fmt)
    deq = np.asarray(dequantize(quantize(jnp.asarray(x), fmt), fmt), np.float64)
    _, scale = oracle.fp8_per_token(x, fmt)
    normal = np.abs(deq) >= 2.0**-6 * scale[:, None]
    assert normal.mean() > 0.9
    if fmt == "nvfp4":
        assert (np.abs(got - deq)[normal] <= 2.0**-4 * np.abs(deq)[normal]).all()
        assert (got != deq).any()  # the bound is needed: some products are inexact
    else:
        np.testing.assert_array_equal(got[normal], deq[normal])


@pytest.mark.parametrize("fmt", ALL)
def test_fp8_per_tile_copy_matches_oracle(fmt):
    """K's copy with one scale per 128 tokens, bit for bit against the numpy oracle:
    a short last tile, tokens 2^±12 apart, a zero token and a tile of zeros (NVFP4's
    s2 = 1 for zero tokens must not become the tile's scale), tiny tokens, NaN and Inf
    tokens (NaN values, the tile's scale from the finite ones)."""
    rng = np.random.default_rng(14)
    x = rng.standard_normal((2, 300, 3, 64)).astype(np.float32)
    x *= np.exp2(rng.integers(-12, 12, (2, 300, 3, 1))).astype(np.float32)
    x[0, 3] = 0.0
    x[1, 128:256, 2] = 0.0
    x[0, 140, 1] *= 1e-36
    x[0, 7, 0, 3] = np.nan
    x[1, 290, 1, 60] = -np.inf
    want_vals, want_scale = oracle.fp8_per_tile(x, fmt)
    vals, scale = fp8_per_tile(quantize(jnp.asarray(x), fmt), fmt)
    np.testing.assert_array_equal(np.asarray(vals, np.float64), want_vals)
    np.testing.assert_array_equal(np.asarray(scale, np.float64), want_scale)
    assert scale.shape == (2, 3, 3) and np.isnan(vals[0, 7, 0]).all() and np.isfinite(scale).all()
    # The same along another axis of the token grid.
    got_t, scale_t = fp8_per_tile(quantize(jnp.asarray(x.transpose(1, 0, 2, 3)), fmt), fmt, axis=0)
    np.testing.assert_array_equal(np.asarray(got_t).transpose(1, 0, 2, 3), np.asarray(vals))
    np.testing.assert_array_equal(np.asarray(scale_t).transpose(1, 0, 2), np.asarray(scale))


@pytest.mark.parametrize("fmt", ALL)
def test_fp8_per_tile_copy_is_exact_for_mx_and_bounded_for_nvfp4(fmt):
    """Tokens of one magnitude: MX values shift exactly into the tile's power-of-two
    scale wherever they stay in E4M3's normal range; NVFP4 moves by at most 2^-4."""
    rng = np.random.default_rng(15)
    x = rng.standard_normal((1, 256, 2, 128)).astype(np.float32)
    deq = np.asarray(dequantize(quantize(jnp.asarray(x), fmt), fmt), np.float64)
    vals, scale = oracle.fp8_per_tile(x, fmt)
    got = vals * np.repeat(scale, 128, axis=1)[..., None]
    normal = np.abs(deq) >= 2.0**-6 * np.repeat(scale, 128, axis=1)[..., None]
    assert normal.mean() > 0.9
    if fmt == "nvfp4":
        assert (np.abs(got - deq)[normal] <= 2.0**-4 * np.abs(deq)[normal]).all()
    else:
        np.testing.assert_array_equal(got[normal], deq[normal])


def test_fp8_per_tile_rejects_a_bad_axis():
    q = quantize(jnp.ones((2, 8, 64)), "mxfp4")
    with pytest.raises(ValueError, match="axis must index the token grid"):
        fp8_per_tile(q, "mxfp4", axis=2)


# Formats whose Quantized layouts differ (e4m3 and e5m2 share one: their codes are
# told apart only by the format name the caller passes).
MISMATCHED = [(a, b) for a in ALL for b in ALL if a != b and {a, b} != {"mxfp8_e4m3", "mxfp8_e5m2"}]


@pytest.mark.parametrize("made, read", MISMATCHED)
@pytest.mark.parametrize("reader", [dequantize, fp8_per_token, fp8_per_tile])
def test_readers_reject_another_formats_layout(made, read, reader):
    q = quantize(jnp.ones((2, 3, 64)), made)
    with pytest.raises(ValueError, match=f"{read} expects Quantized.*got codes uint8"):
        reader(q, read)


@pytest.mark.parametrize("fmt", ALL)
def test_readers_reject_malformed_quantized(fmt):
    q = quantize(jnp.ones((2, 64)), fmt)
    bad = [q._replace(codes=q.codes.astype(jnp.float32)),
           q._replace(scales=q.scales[:, :1]),
           q._replace(codes=q.codes[0])]
    bad.append(q._replace(token_scale=None if fmt == "nvfp4" else jnp.ones(2)))
    if fmt == "nvfp4":
        bad.append(q._replace(token_scale=q.token_scale.astype(jnp.bfloat16)))
    for b in bad:
        with pytest.raises(ValueError, match=f"{fmt} expects"):
            dequantize(b, fmt)
    # Under jit the layout is checked on the traced shapes.
    with pytest.raises(ValueError, match=f"{fmt} expects"):
        jax.jit(lambda c: dequantize(q._replace(codes=c), fmt))(q.codes[:, :8])


def test_fp8_per_channel_matches_oracle():
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 50, 3, 64)).astype(np.float32) * rng.uniform(1e-2, 1e2, (1, 1, 3, 64))
    x[0, :, 1, 7] = 0.0  # an all-zero channel
    x[1, 4, 2, 9] = np.nan
    want_vals, want_scale = oracle.fp8_per_channel(x, axis=1)
    vals, scale = fp8_per_channel(jnp.asarray(x), axis=1)
    np.testing.assert_array_equal(np.asarray(vals, np.float64), want_vals)
    np.testing.assert_array_equal(np.asarray(scale, np.float64), want_scale)
    assert np.isnan(scale[1, 2, 9]) and np.abs(np.asarray(vals)).max() <= 256  # never saturates
