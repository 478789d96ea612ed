"""triton_kernels.quantize (run by the torch executor): byte-for-byte equal to dma_jax.formats.

Runs under TRITON_INTERPRET=1 on CPU (conftest) and natively on a GPU.
"""

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from dma_jax import quantize
from dma_jax.formats import fp8_per_channel, fp8_per_tile, fp8_per_token
from dma_jax.rotation import hadamard
from triton_kernels.format_table import FORMATS
from triton_kernels.mx import div_by, e4m3_bytes, e4m3_bytes_on_grid_or_small, mul_flushed, round_e2m1, round_e4m3
from triton_kernels import plan as plans
from triton_kernels.plan import Buffer, channel_mean_plan, ftz_multiplier, quantize_plan
from triton_kernels.quantize import _nvfp4_s2
from triton_kernels.target import Target, interpreting
from triton_kernels.torch_executor import channel_mean, dual_quantize, fp8_transpose, target_of
from triton_kernels.tuning import K_TILE_MIN_PROGRAMS, MEAN_MIN_PROGRAMS, k_tile_tokens, mean_chunk

from conftest import HAS_CUDA, TRITON_39, compiler_env

DEVICE = "cuda" if HAS_CUDA else "cpu"


def inputs(kind, shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "outliers":
        x[..., [1, 9, 33]] *= 500.0
        x += 3.0 * rng.standard_normal((1, 1, shape[2], shape[3]))
    elif kind == "tiny":
        x *= 1e-30
        x[0, 0] *= 1e-6  # NVFP4 scales below float32's normal range
        x[-1, -1] = 1.7690853e-37
    elif kind == "zero":
        x[:] = 0.0
        x[0, 0, 0, :5] = -0.0
    elif kind == "nan":
        x[0, 1, 0, 3] = np.nan
        x[0, 2, 0, 40] = np.inf
        x[-1, -1, -1, -1] = -np.inf
    return x


def expected(x32, fmt, rule=None):
    # The oracle is dma_jax.formats on XLA's CPU backend, also on a GPU machine.
    with jax.default_device(jax.devices("cpu")[0]):
        q = quantize(jnp.asarray(x32), fmt, rule)
        return [np.asarray(a) for a in q if a is not None]


def prepared(xt, *, fold, mean=None, rotate=False):
    """The float32 pre-processing of the kernels in jnp: (x - mean), rotated, times fold."""
    x32 = xt.float().cpu().numpy()
    if mean is not None:
        x32 = (x32 - mean.cpu().numpy()[:, None]).astype(np.float32)
    if rotate:
        with jax.default_device(jax.devices("cpu")[0]):
            x32 = np.asarray(hadamard(jnp.asarray(x32)))
    return (x32 * np.float32(fold)).astype(np.float32)


def check(x, *, high, low, fold=1.0, smooth=False, dtype=torch.bfloat16, high_rule=None, low_rule=None,
          rotate=False):
    xt = torch.from_numpy(x).to(dtype).to(DEVICE)
    mean = channel_mean(xt) if smooth else None
    got = dual_quantize(xt, high=high, low=low, fold=fold, mean=mean, high_rule=high_rule, low_rule=low_rule,
                        rotate=rotate)
    # The same float32 pre-processing, then dma_jax.formats.
    x32 = prepared(xt, fold=fold, mean=mean, rotate=rotate)
    hi = [got.hi_codes, got.hi_scales]
    lo = [got.lo_codes, got.lo_scales] + ([got.lo_token_scale] if low == "nvfp4" else [])
    for fmt, rule, tensors in ((high, high_rule, hi), (low, low_rule, lo)):
        for name, g, w in zip(("codes", "scales", "token_scale"), tensors, expected(x32, fmt, rule)):
            g = g.cpu().numpy()
            assert g.shape == w.shape, (fmt, name)
            if name == "token_scale":
                np.testing.assert_array_equal(g.view(np.uint32)[np.isfinite(w)], w.view(np.uint32)[np.isfinite(w)])
                np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
            else:
                np.testing.assert_array_equal(g, w, err_msg=f"{fmt} {name}")


@pytest.mark.parametrize("kind", ["random", "outliers", "tiny", "zero", "nan"])
@pytest.mark.parametrize("high,low", [("mxfp8_e4m3", "nvfp4"), ("mxfp8_e5m2", "mxfp4")])
def test_bytes_equal_formats(kind, high, low):
    check(inputs(kind, (2, 37, 3, 64)), high=high, low=low, fold=0.3)


RULE_CASES = [("mxfp8_e4m3", "nvfp4", "floor", "4/6", False), ("mxfp8_e4m3", "nvfp4", "nearest", "up", True),
              ("mxfp8_e4m3", "nvfp4", "up", "floor", False), ("mxfp8_e4m3", "nvfp4", "up", "4/6", True),
              ("mxfp8_e5m2", "mxfp4", "floor", "nearest", True), ("mxfp8_e4m3", "mxfp4", "nearest", "up", False)]


@pytest.mark.parametrize("kind", ["outliers", "nan"])
@pytest.mark.parametrize("high, low, high_rule, low_rule, rotate", RULE_CASES)
def test_scale_rules_and_rotation_bytes_equal_formats(kind, high, low, high_rule, low_rule, rotate):
    """Every block-scale rule, with and without the Hadamard rotation (smoothed first,
    folded after), gives dma_jax.formats' bytes."""
    x = inputs(kind, (1, 45, 2, 64), seed=4)
    check(x, high=high, low=low, fold=0.3, smooth=kind == "outliers", high_rule=high_rule, low_rule=low_rule,
          rotate=rotate)


@pytest.mark.parametrize("low", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_head_dim_128_smooth_k_and_half_dtypes(low, dtype):
    check(inputs("outliers", (1, 70, 2, 128), seed=3), high="mxfp8_e4m3", low=low, smooth=True, dtype=dtype)


@pytest.mark.parametrize("high,low", [("mxfp8_e4m3", "nvfp4"), ("mxfp8_e5m2", "mxfp4")])
def test_fp8_copies_equal_formats(high, low):
    """The per-token E4M3 copies (what the sm_90 kernel reads for Q) equal
    dma_jax.formats.fp8_per_token byte for byte, with the same token scales."""
    x = inputs("nan", (2, 37, 3, 128), seed=8)
    x[1, 5, 2, :32] *= 2.0**-14  # a block far below its token's largest
    xt = torch.from_numpy(x).to(torch.bfloat16).to(DEVICE)
    got = dual_quantize(xt, high=high, low=low, fold=0.7, codes=False, fp8=True)
    assert got.hi_codes is None and got.lo_codes is None and got.lo_token_scale is None
    x32 = (xt.float().cpu().numpy() * np.float32(0.7)).astype(np.float32)
    with jax.default_device(jax.devices("cpu")[0]):
        for fmt, f8, ts in ((high, got.hi_f8, got.hi_ts), (low, got.lo_f8, got.lo_ts)):
            values, scale = fp8_per_token(quantize(jnp.asarray(x32), fmt), fmt)
            want = np.asarray(values).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
            np.testing.assert_array_equal(f8.cpu().numpy(), want, err_msg=fmt)
            np.testing.assert_array_equal(ts.cpu().numpy(), np.asarray(scale), err_msg=fmt)


@pytest.mark.parametrize("kind,tile_t,fold", [("smooth", 128, 1.0), pytest.param("nan", 128, 1.0, marks=pytest.mark.slow),
                                              pytest.param("smooth", 32, 1.0, marks=pytest.mark.slow),
                                              ("nan", 64, -0.37),
                                              pytest.param("tiny", 128, 0.3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("high,low", [("mxfp8_e4m3", "nvfp4"), ("mxfp8_e5m2", "mxfp4")])
def test_per_tile_fp8_copies_equal_formats(kind, tile_t, fold, high, low):
    """K's per-tile E4M3 copies (one scale per 128 tokens) equal
    dma_jax.formats.fp8_per_tile byte for byte: a tile ending at kv_len, tokens
    2^±10 apart in one tile, a tile of zeros; with smooth-K, or with NaN and Inf
    tokens (E4M3 NaN rows; smooth-K would make the whole head NaN), or a tile whose
    largest element the fold makes subnormal (flushed: a zero tile); a negative
    fold; each tile's copies split over 128 / tile_t programs."""
    x = inputs(kind if kind == "nan" else "random", (2, 300, 2, 64), seed=9)
    x[:, :256] *= np.exp2(np.random.default_rng(9).integers(-10, 10, (2, 256, 2, 1)))
    x[1, 128:256, 1] = 0.0
    if kind == "smooth":
        x += 20.0  # a bias that smooth-K removes; tokens past kv_len must not see -mean
    if kind == "tiny":
        x[0, 128:256, 0] *= 2.0**-130 / np.abs(x[0, 128:256, 0]).max()
    xt = torch.from_numpy(x).to(torch.bfloat16).to(DEVICE)
    mean = channel_mean(xt) if kind == "smooth" else None
    got = dual_quantize(xt, high=high, low=low, mean=mean, fold=fold, codes=False, fp8=True, per_tile=True,
                        tile_t=tile_t)
    assert got.hi_ts.shape == got.lo_ts.shape == (2, 3, 2)
    x32 = xt.float().cpu().numpy()
    if mean is not None:
        x32 = (x32 - mean.cpu().numpy()[:, None]).astype(np.float32)
    x32 = (x32 * np.float32(fold)).astype(np.float32)
    if kind == "tiny":
        assert 0 < np.abs(x32[0, 128:256, 0]).max() < 2.0**-126
    with jax.default_device(jax.devices("cpu")[0]):
        for fmt, f8, ts in ((high, got.hi_f8, got.hi_ts), (low, got.lo_f8, got.lo_ts)):
            values, scale = fp8_per_tile(quantize(jnp.asarray(x32), fmt), fmt)
            values = np.asarray(values)
            nan_rows = np.isnan(values).any(axis=-1)
            assert nan_rows.sum() == (3 if kind == "nan" else 0) and np.isnan(values[nan_rows]).all()
            want = np.where(np.isnan(values), 0x7F, values.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
            np.testing.assert_array_equal(f8.cpu().numpy(), want, err_msg=fmt)
            np.testing.assert_array_equal(ts.cpu().numpy(), np.asarray(scale), err_msg=fmt)


@pytest.mark.parametrize("per_tile", [False, True])
@pytest.mark.parametrize("fold", [0.7, -3.0])
def test_fold_products_flush_like_formats(fold, per_tile):
    """Products of the fold below 2^-126 are zeros in Q's and K's FP8 copies, as in
    dma_jax.formats, through either flush a GPU takes (``mx.mul_flushed``: |fold| <= 1
    or not): a tile whose largest element is subnormal before the fold (-3 lifts it
    and part of its elements above 2^-126) and one that is normal but partly
    subnormal after a fold of 0.7. Float32 input: Triton 3.9's interpreter converts
    bf16 subnormals wrongly (1.19e-39 becomes 7.3e-39)."""
    x = inputs("random", (1, 256, 2, 64), seed=13)
    x[0, 128:, 0] *= 2.0**-127 / np.abs(x[0, 128:, 0]).max()
    x[0, :128, 1] *= 2.0**-125 / np.abs(x[0, :128, 1]).max()
    got = dual_quantize(torch.from_numpy(x).to(DEVICE), fold=fold, codes=False, fp8=True, per_tile=per_tile)
    x32 = (x * np.float32(fold)).astype(np.float32)
    small = (x32 != 0) & (np.abs(x32) < 2.0**-126)
    assert small[0, 128:, 0].any() and small[0, :128, 1].any()
    copy = fp8_per_tile if per_tile else fp8_per_token
    with jax.default_device(jax.devices("cpu")[0]):
        for fmt, f8, ts in (("mxfp8_e4m3", got.hi_f8, got.hi_ts), ("nvfp4", got.lo_f8, got.lo_ts)):
            values, scale = copy(quantize(jnp.asarray(x32), fmt), fmt)
            want = np.asarray(values).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
            # What survives the flush (NVFP4 zeroes tokens below 2688 * 2^-126 anyway).
            assert (want[0, 128:, 0] & 0x7F).any() == (abs(fold) > 1 and fmt != "nvfp4"), fmt
            np.testing.assert_array_equal(f8.cpu().numpy(), want, err_msg=fmt)
            np.testing.assert_array_equal(ts.cpu().numpy(), np.asarray(scale), err_msg=fmt)


@pytest.mark.parametrize("shape, want", [
    ((1, 1024, 8, 128), 32),     # 256 programs of 32: still too few, the smallest
    ((1, 2048, 8, 128), 32),     # 512 programs of 32
    ((1, 4096, 8, 128), 64),     # 512 programs of 64
    ((1, 8192, 8, 128), 128),    # 512 whole tiles
    ((2, 300, 2, 64), 32),
])
def test_k_tile_tokens_keep_the_gpu_busy(shape, want):
    assert K_TILE_MIN_PROGRAMS == 512
    assert k_tile_tokens(shape) == want
    launch = _quantize_launch(Target((9, 0)), shape=shape, codes=False, fp8=True, per_tile=True)
    assert launch.grid == (-(-shape[1] // want), shape[2], shape[0]) and launch.meta["TILE_T"] == want


def _quantize_launch(target, shape=(1, 64, 2, 128), **options):
    """The dual-quantize launch that the plan makes for x of ``shape``."""
    return quantize_plan(Buffer("x", shape, "bfloat16"), target, **options).launches[-1]


def test_per_tile_programs_must_tile_the_tile():
    xt = torch.zeros((1, 200, 2, 64), dtype=torch.bfloat16, device=DEVICE)
    for tile_t in (48, 8, 256):  # not dividing 128, below block_t=16, beyond the tile
        with pytest.raises(ValueError, match=f"multiple of block_t=16 tokens that divides 128, got tile_t={tile_t}"):
            dual_quantize(xt, codes=False, fp8=True, per_tile=True, tile_t=tile_t)


def test_per_tile_needs_the_fp8_copies():
    with pytest.raises(ValueError, match="needs fp8=True"):
        dual_quantize(torch.zeros((1, 8, 1, 64), device=DEVICE), fp8=False, per_tile=True)


def test_write_lo_false_skips_the_low_copy():
    xt = torch.from_numpy(inputs("random", (1, 20, 2, 64), seed=9)).to(torch.bfloat16).to(DEVICE)
    got = dual_quantize(xt, codes=True, fp8=True, write_lo=False)
    assert got.lo_codes is None and got.lo_f8 is None and got.lo_ts is None
    full = dual_quantize(xt, codes=True, fp8=True)
    assert torch.equal(got.hi_f8, full.hi_f8) and torch.equal(got.hi_codes, full.hi_codes)


@pytest.mark.parametrize("length", [1, 70, 300])
def test_fp8_transpose_equals_fp8_per_channel(length):
    x = inputs("outliers", (2, length, 3, 64), seed=10)
    x[1, 0, 2, 5] = np.nan
    x[0, :, 1, 3] *= 2.0**-130  # a channel of subnormals (flushed: zeros)
    x[1, ::2, 0, 10] = -(2.0**-128)  # subnormals in a normal channel
    xt = torch.from_numpy(x).to(torch.bfloat16).to(DEVICE)
    vt, scale = fp8_transpose(xt)
    assert vt.shape == (2, 3, 64, -(-length // 16) * 16) and scale.shape == (2, 3, 64)
    assert not vt[..., length:].any()  # the padding columns are zeros (the kernel loads them)
    vt = vt[..., :length]
    with jax.default_device(jax.devices("cpu")[0]):
        values, want_scale = fp8_per_channel(jnp.asarray(xt.float().cpu().numpy()), axis=1)
    want = np.asarray(values).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).transpose(0, 2, 3, 1)
    np.testing.assert_array_equal(vt.cpu().numpy(), want)
    np.testing.assert_array_equal(scale.cpu().numpy(), np.asarray(want_scale))


@triton.jit
def _e4m3_bytes_kernel(y_ptr, out_ptr, N: tl.constexpr, HW: tl.constexpr):
    y = tl.load(y_ptr + tl.arange(0, N))
    tl.store(out_ptr + tl.arange(0, N), e4m3_bytes_on_grid_or_small(y, HW))


def test_e4m3_helpers_against_ml_dtypes():
    """The FP8 copies' rounding and encoding shortcut, as it runs here (the conversion
    instruction on a GPU, the fixed-quantum rounding in the interpreter), equals
    ml_dtypes' E4M3 rounding (nearest, ties to even, -0 kept) on every finite E4M3 value
    and on values below E4M3's normal range, ties included, the inputs it is used for."""
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = grid[np.isfinite(grid)]
    rng = np.random.default_rng(11)
    ties = (np.arange(-127, 128) + 0.5) * 2.0**-9  # halfway between subnormals
    small = rng.uniform(-(2.0**-6), 2.0**-6, 1500) * np.exp2(-rng.integers(0, 30, 1500))
    y = np.concatenate([grid, ties[np.abs(ties) < 2.0**-6], small, [0.0, -0.0, -1e-30]]).astype(np.float32)
    n = 4096
    y = np.concatenate([y, np.zeros(n - y.size, np.float32)])
    out = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    _e4m3_bytes_kernel[(1,)](torch.from_numpy(y).to(DEVICE), out, N=n, HW=not interpreting())
    np.testing.assert_array_equal(out.cpu().numpy(), y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


@triton.jit
def _round_e4m3_kernel(v_ptr, out_ptr, bytes_ptr, N: tl.constexpr, HW: tl.constexpr):
    v = tl.load(v_ptr + tl.arange(0, N))
    tl.store(out_ptr + tl.arange(0, N), round_e4m3(v, HW))
    tl.store(bytes_ptr + tl.arange(0, N), e4m3_bytes(v, HW))


def test_round_e4m3_against_ml_dtypes():
    """E4M3 rounding as the quantizer does it where it runs (the GPU's conversion
    instruction natively, the integer emulation in the interpreter) equals ml_dtypes'
    nearest-even E4M3 rounding with saturation at 448: random magnitudes over the whole
    range, every midpoint between E4M3 values (ties), subnormals, signed zeros and values
    past 448; and the bytes of that rounding, as the FP8 copies write them."""
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.unique(np.abs(grid[np.isfinite(grid)]))
    mids = (grid[1:] + grid[:-1]) / 2
    rng = np.random.default_rng(12)
    wide = rng.standard_normal(3000) * np.exp2(rng.uniform(-14, 10, 3000))
    v = np.concatenate([grid, -grid, mids, -mids, wide, [0.0, -0.0, 449.0, 463.9, 464.0, 1e6, -1e6, -1e-30]])
    n = 8192
    v = np.concatenate([v, np.zeros(n - v.size)]).astype(np.float32)
    out = torch.empty(n, dtype=torch.float32, device=DEVICE)
    codes = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    _round_e4m3_kernel[(1,)](torch.from_numpy(v).to(DEVICE), out, codes, N=n, HW=not interpreting())
    want = np.clip(v, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(out.cpu().numpy().view(np.uint32), want.astype(np.float32).view(np.uint32))
    np.testing.assert_array_equal(codes.cpu().numpy(), want.view(np.uint8))


@triton.jit
def _round_e2m1_kernel(v_ptr, s_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, round_e2m1(tl.load(v_ptr + offs), tl.load(s_ptr + offs)))


def test_round_e2m1_against_ml_dtypes():
    """E2M1 rounding (NVFP4 and MXFP4 elements) equals ml_dtypes' nearest-even E2M1
    rounding with saturation at 6 in magnitude, signed as the second argument: every
    E2M1 value and every midpoint between two (ties), random values over the range and
    past 6, zeros and values that round to zero, each with either sign imposed."""
    grid = np.unique(np.abs(np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)))
    mids = (grid[1:] + grid[:-1]) / 2
    rng = np.random.default_rng(13)
    wide = rng.uniform(0, 7, 3000) * rng.choice([1.0, 1e-3, 1e-30], 3000)
    mag = np.concatenate([grid, mids, np.nextafter(mids, 0), np.nextafter(mids, 9), wide, [1e-40, 6.5, 1e4]])
    v = np.concatenate([mag, -mag]).astype(np.float32)
    sign = np.where(rng.random(v.size) < 0.5, -1.0, 1.0).astype(np.float32)
    n = 8192
    v, sign = np.pad(v, (0, n - v.size)), np.pad(sign, (0, n - v.size), constant_values=-1.0)
    out = torch.empty(n, dtype=torch.float32, device=DEVICE)
    _round_e2m1_kernel[(1,)](torch.from_numpy(v).to(DEVICE), torch.from_numpy(sign).to(DEVICE), out, N=n)
    want = np.copysign(np.abs(np.clip(v, -6.0, 6.0).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)), sign)
    np.testing.assert_array_equal(out.cpu().numpy().view(np.uint32), want.view(np.uint32))


def test_quantize_plan_picks_the_conversion_instruction_on_gpus():
    """Planned for a GPU, the E4M3 rounding is the conversion instruction; for Triton's
    interpreter, whose conversion does not round to nearest, it is the emulation. The
    torch executor plans for the interpreter exactly when interpreting."""
    assert _quantize_launch(Target((9, 0)), codes=False, fp8=True).meta["HW_CVT"] is True
    assert _quantize_launch(Target.interpreter(), codes=False, fp8=True).meta["HW_CVT"] is False
    assert target_of(torch.device(DEVICE)).interpret == interpreting()


@triton.jit
def _mul_flushed_kernel(x_ptr, f, out_ptr, N: tl.constexpr, HW: tl.constexpr, FTZ_MUL: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, mul_flushed(tl.load(x_ptr + offs), f, HW, FTZ_MUL))


def test_ftz_multiplier():
    assert all(ftz_multiplier(f) for f in (0.0, -0.0, 2.0**-126, 0.1275, -0.5, 1.0, -1.0))
    assert not any(ftz_multiplier(f) for f in (2.0**-127, -(2.0**-149), 1.0000001, -3.0, np.inf, np.nan))
    assert _quantize_launch(Target((9, 0)), codes=False, fp8=True, fold=0.1275).meta["FTZ_FOLD"] is True
    assert _quantize_launch(Target((9, 0)), codes=False, fp8=True, fold=3.0).meta["FTZ_FOLD"] is False


@pytest.mark.parametrize("f", [0.1275, -0.7, 1.0, 1, 0.0, 2.0**-126, 3.0, -2.5, 2.0**-127])
def test_mul_flushed_against_numpy(f):
    """``mx.mul_flushed`` as the quantizer compiles it here (on a GPU: ``mul.ftz`` where
    ``ftz_multiplier(f)``, else a multiply and ``add.ftz``) equals numpy's IEEE product
    with subnormal results replaced by zeros of their sign, bit for bit: subnormal and
    normal x near 2^-126, signed zeros, Inf and NaN. The integer 1 arrives as a
    constant, not a float argument (Triton specialises it; jax-triton 0.3.1 passed
    K's fold of 1.0 that way)."""
    rng = np.random.default_rng(12)
    tiny = np.float32(2.0**-126) * rng.uniform(-4, 4, 2048).astype(np.float32)  # both sides of 2^-126
    wide = rng.standard_normal(2048).astype(np.float32) * np.exp2(rng.integers(-140, 120, 2048)).astype(np.float32)
    x = np.concatenate([tiny, wide, np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 2.0**-149, -(2.0**-149)])])
    x = np.pad(x, (0, 8192 - x.size))  # a power of two for tl.arange, the special values kept
    f32 = np.float32(f)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x * f32
    want = np.where(np.abs(want) < np.float32(2.0**-126), want * np.float32(0.0), want)
    out = torch.empty(x.size, dtype=torch.float32, device=DEVICE)
    _mul_flushed_kernel[(1,)](torch.from_numpy(x).to(DEVICE), f if isinstance(f, int) else float(f32), out,
                              N=x.size, HW=not interpreting(), FTZ_MUL=ftz_multiplier(f))
    got = out.cpu().numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(got.view(np.uint32)[finite], want.view(np.uint32)[finite])


FOLD_ONE_PTX = """
import re
from triton_kernels.aot import compile_launch
from triton_kernels.plan import Buffer, quantize_plan
from triton_kernels.target import Target

plan = quantize_plan(Buffer("x", (1, 256, 2, 128), "bfloat16"), Target((9, 0)), smooth=True, codes=False, fp8=True,
                     per_tile=True, fold=1.0)
ptx = compile_launch(plan, plan.launches[-1], {"x": "bfloat16"}, 90, specialised={"fold": 1})["ptx"]
for reg in sorted(set(re.findall(r"mul[.]ftz[.]f32 %r[0-9]+, %r[0-9]+, (%r[0-9]+);", ptx))):
    print(re.search(rf"mov[.]b32 \\s*{reg}, ([^;]+);", ptx).group(1))
"""


@pytest.mark.skipif(not TRITON_39, reason="AOT compilation for sm_90 needs triton >= 3.9 (the device image has 3.6)")
def test_fold_of_integer_one_multiplies_by_float_one():
    """Without a GPU: jax-triton 0.3.1 passed K's fold of 1.0 as the integer constant 1. The
    ``mul.ftz`` of ``mx.mul_flushed`` must get 1.0f (bits 1065353216), not the bits of
    the integer 1 (the float 1.4e-45, which zeroed K's copies on the H200)."""
    done = subprocess.run([sys.executable, "-c", FOLD_ONE_PTX], cwd=pathlib.Path(__file__).parents[1],
                          env=compiler_env(), capture_output=True, text=True, check=True)
    assert set(done.stdout.split()) == {"1065353216"}


@triton.jit
def _div_by_kernel(a_ptr, b_ptr, out_ptr, BLOCK: tl.constexpr):
    # Blocks of 4096: one program over all 2^20 pairs compiles for ever on a GPU.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(a_ptr + offs)
    b = tl.load(b_ptr + offs)
    tl.store(out_ptr + offs, div_by(a, b, tl.math.div_rn(tl.full((BLOCK,), 1.0, tl.float32), b)))


def test_div_by_equals_correctly_rounded_division():
    """NVFP4's divisions by reciprocal and correction equal IEEE division (numpy's)
    bit for bit where the quotient is a normal float, and are at most 2^-126 in magnitude
    elsewhere (the quantizer rounds those to zero and signs them by the dividend), on
    pairs shaped like x / s2 (s2 = amax / 2688), x / s2 / sb (sb an E4M3 value),
    divisors with all-ones significands, zeros of both signs and tiny quotients."""
    rng = np.random.default_rng(12)
    n = 1 << 18
    amax = (np.exp2(rng.uniform(-100, 100, n)) * rng.uniform(1, 2, n)).astype(np.float32)
    x = (amax * rng.uniform(-1, 1, n)).astype(np.float32)
    x[:1000] = amax[:1000]
    sb = rng.integers(1, 0x7F, n).astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    ones = (np.float32(2) - np.float32(2.0**-23)) * np.exp2(rng.integers(-60, 60, n)).astype(np.float32)
    a = np.concatenate([x, (rng.uniform(-6, 6, n) * sb).astype(np.float32), rng.uniform(-1e3, 1e3, n) * ones,
                        [0.0, -0.0, 1e-37, -1e-37, 3e-38]]).astype(np.float32)
    b = np.concatenate([amax / np.float32(2688), sb, ones, [3.0, 3.0, 1e3, 1e3, 7.0]]).astype(np.float32)
    size = 1 << 20
    a, b = np.pad(a, (0, size - a.size), constant_values=1.0), np.pad(b, (0, size - b.size), constant_values=1.0)
    out = torch.empty(size, dtype=torch.float32, device=DEVICE)
    _div_by_kernel[(size // 4096,)](torch.from_numpy(a).to(DEVICE), torch.from_numpy(b).to(DEVICE), out, BLOCK=4096)
    got, want = out.cpu().numpy(), a / b
    normal = np.abs(want) >= np.finfo(np.float32).tiny
    np.testing.assert_array_equal(got[normal].view(np.uint32), want[normal].view(np.uint32))
    assert (~normal).sum() > 2 and (np.abs(got[~normal]) <= np.finfo(np.float32).tiny).all()


@triton.jit
def _nvfp4_s2_kernel(a_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _nvfp4_s2(tl.load(a_ptr + offs)))


def test_nvfp4_s2_equals_flushed_division():
    """The NVFP4 token scale equals numpy's IEEE amax / 2688 with subnormal quotients
    flushed to +0, bit for bit: across float32's range, on and around the first amax
    with a normal quotient (2688 * 2^-126) and at zero, subnormals, the largest float,
    Inf and NaN."""
    rng = np.random.default_rng(21)
    first = np.float32(2688 * 2.0**-126)
    edges = [first, np.nextafter(first, np.float32(0)), np.nextafter(first, np.float32(np.inf)),
             np.float32(0), np.float32(1e-45), np.float32(1e-39), np.finfo(np.float32).max, np.inf, np.nan]
    near = first * (1 + rng.uniform(-2.0**-10, 2.0**-10, 1 << 12)).astype(np.float32)
    with np.errstate(over="ignore"):  # draws above float32's range become Inf
        wide = (np.exp2(rng.uniform(-149, 128, 1 << 16)) * rng.uniform(1, 2, 1 << 16)).astype(np.float32)
    amax = np.concatenate([np.asarray(edges, np.float32), near, wide])
    size = -(-amax.size // 4096) * 4096
    amax = np.pad(amax, (0, size - amax.size), constant_values=1.0)
    out = torch.empty(size, dtype=torch.float32, device=DEVICE)
    _nvfp4_s2_kernel[(size // 4096,)](torch.from_numpy(amax).to(DEVICE), out, BLOCK=4096)
    with np.errstate(over="ignore", invalid="ignore"):
        want = amax / np.float32(2688)
    want = np.where(np.abs(want) < np.finfo(np.float32).tiny, np.float32(0), want).astype(np.float32)
    np.testing.assert_array_equal(out.cpu().numpy().view(np.uint32), want.view(np.uint32))


def test_single_token():
    check(inputs("random", (1, 1, 1, 64), seed=4), high="mxfp8_e4m3", low="nvfp4", fold=0.125 * 1.4426950408889634)


def test_channel_mean_against_float64():
    x = inputs("outliers", (1, 300, 2, 64), seed=5)
    xt = torch.from_numpy(x).to(torch.bfloat16).to(DEVICE)
    want = xt.double().mean(dim=1).cpu().numpy()
    # Several partial sums, a ragged last chunk, one chunk, the default, and 19 partials
    # (more than one step of _channel_total, the last one partly padding).
    for chunk in (64, 100, 512, None, 16):
        got = channel_mean(xt, chunk=chunk).cpu().numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_channel_mean_skips_non_finite_tokens():
    """Smooth-K's mean is over the tokens whose elements are all finite (zero where
    there is none), so a NaN or Inf key does not reach the other keys' copies."""
    x = inputs("random", (2, 150, 2, 64), seed=6)
    x[0, 3, 0, 7] = np.nan
    x[0, 90, 0, 0] = np.inf
    x[1, 149, 1, 63] = -np.inf
    x[1, :, 0, 5] = np.nan  # every token of one head
    xt = torch.from_numpy(x).to(torch.bfloat16).to(DEVICE)
    x64 = xt.double().cpu().numpy()
    ok = np.isfinite(x64).all(-1, keepdims=True)
    want = np.where(ok, x64, 0).sum(1) / np.maximum(ok.sum(1), 1)
    for chunk in (16, None):
        got = channel_mean(xt, chunk=chunk).cpu().numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (got[1, 0] == 0).all()


# 13 partials (two steps of 8, padded) and 4
@pytest.mark.parametrize("chunk", [16, pytest.param(64, marks=pytest.mark.slow)])
def test_mean_formed_in_the_quantize_launch_has_channel_means_bits(chunk):
    # K's path: the quantize launch adds smooth-K's partial sums up itself. Every output
    # must equal the one quantized with channel_mean's mean (checked against float64
    # above, and the copies against dma_jax.formats in test_head_dim_128_smooth_k_and_half_dtypes).
    xt = torch.from_numpy(inputs("outliers", (1, 200, 2, 64), seed=9)).to(torch.bfloat16).to(DEVICE)
    sums, launch = quantize_plan(Buffer("x", tuple(xt.shape), "bfloat16"), Target.interpreter(), smooth=True,
                                 chunk=chunk).launches
    assert sums.outputs[0].shape == (-(-200 // chunk), 1, 2, 64) and launch.args[1:5] == (
        "x_sums", "x_sums_count", plans.Scalar(-(-200 // chunk), "i32"), plans.Scalar(1, "i32"))
    for mode in (dict(codes=True, fp8=False), dict(codes=False, fp8=True, per_tile=True)):
        want = dual_quantize(xt, mean=channel_mean(xt, chunk=chunk), **mode)
        got = dual_quantize(xt, smooth=True, chunk=chunk, **mode)
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            if g is not None:
                np.testing.assert_array_equal(g.cpu().numpy().view(np.uint8), w.cpu().numpy().view(np.uint8))


@pytest.mark.parametrize("shape, want", [
    ((1, 1024, 8, 128), 128),    # 64 programs of 128
    ((1, 2048, 8, 128), 256),    # 64 programs of 256
    ((1, 8192, 8, 128), 256),
    ((1, 300, 3, 64), 64),       # 15 programs of 64: still too few, the smallest chunk
])
def test_mean_chunk_keeps_the_gpu_busy(shape, want):
    assert MEAN_MIN_PROGRAMS == 64
    assert mean_chunk(shape) == want
    sums, _ = channel_mean_plan(Buffer("x", shape, "bfloat16")).launches
    n_chunks = -(-shape[1] // want)
    assert sums.args[3] == plans.Scalar(want, "i32") and sums.grid == (n_chunks, shape[2], shape[0])
    assert sums.outputs[0].shape == (n_chunks, shape[0], shape[2], shape[3])


@pytest.mark.parametrize("name, element", [("mxfp8_e4m3", ml_dtypes.float8_e4m3fn),
                                           ("mxfp8_e5m2", ml_dtypes.float8_e5m2),
                                           ("mxfp4", ml_dtypes.float4_e2m1fn), ("nvfp4", ml_dtypes.float4_e2m1fn)])
def test_format_table_against_ml_dtypes(name, element):
    """The one format table (kernels, plan and dma_jax.formats read it) describes the
    element types as ml_dtypes defines them."""
    f, info = FORMATS[name], ml_dtypes.finfo(element)
    assert (f.exp_bits, f.man_bits) == (info.nexp, info.nmant)
    assert f.emin == info.minexp and f.emax == info.maxexp - 1 and f.max_value == float(info.max)
    assert f.block == (16 if name == "nvfp4" else 32)


def test_triton_kernels_never_import_jax():
    code = "import sys, triton_kernels.plan, triton_kernels.torch_executor; sys.exit('jax' in sys.modules)"
    root = pathlib.Path(__file__).parents[1]
    assert subprocess.run([sys.executable, "-c", code], cwd=root).returncode == 0


@pytest.mark.parametrize("rotate", [False, True])
def test_nvfp4_bf16_copy_holds_e_times_sb_exactly(rotate):
    """NVFP4's copy for Hopper's exact path (``lo_bf16``): bf16 values equal to the
    element times its E4M3 block scale, and ``s2`` per token (NaN for a token with a
    non-finite element), from the independent oracle's codes."""
    import oracle

    x = inputs("nan", (1, 70, 2, 64), seed=12)
    xt = torch.from_numpy(x).to(torch.bfloat16).to(DEVICE)
    got = dual_quantize(xt, fold=0.3, codes=False, fp8=True, lo_bf16=True, rotate=rotate)
    assert got.lo_f8.dtype == torch.bfloat16 and got.lo_ts.shape == (1, 70, 2)
    x32 = prepared(xt, fold=0.3, rotate=rotate)
    codes, scales, token, _ = oracle.quantize(x32, "nvfp4")
    e = np.stack([codes & 0xF, codes >> 4], -1).reshape(x32.shape).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    finite = scales != 0x7F
    sb = np.where(finite, scales.view(ml_dtypes.float8_e4m3fn).astype(np.float64), 0)
    want = (e.reshape(*x32.shape[:-1], -1, 16) * sb[..., None]).reshape(x32.shape)
    np.testing.assert_array_equal(got.lo_f8.float().cpu().numpy().astype(np.float64), want)
    ok = finite.all(-1)
    ts = got.lo_ts.cpu().numpy()
    np.testing.assert_array_equal(ts[ok], token[ok])
    assert np.isnan(ts[~ok]).all() and (~ok).sum() == 3
