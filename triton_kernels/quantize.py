"""Fused dual quantization of Q or K into a high (MXFP8) and a low (NVFP4/MXFP4) copy.

One program quantizes ``BLOCK_T`` tokens of one (batch, head): it reads the
bf16/fp16 tile once, optionally subtracts K's per-channel mean (smooth-K) and
multiplies by the folded softmax scale (Q), then writes both copies with their
scale bytes and, for NVFP4, the float32 per-token scale. The numerics are those
of ``dma_jax.formats`` (DESIGN.md §3.1) bit for bit: element rounding is done
with integer bit manipulation and a round-half-even trick, divisions with
``div_rn``, never with float8 casts of unrepresentable values.

Smooth-K needs the mean over all valid tokens before any tile can be quantized,
so it is a separate reduction launch (``channel_mean``); K is read twice.

This module imports torch and triton only, never JAX.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .mx import abs_max, e8m0_value, element_code, exponent, pow2, round_to_element

# Element formats: (exponent bits, mantissa bits, emin, emax, max value, block).
# Kept in step with dma_jax.formats.FORMATS (a test checks it).
FORMATS = {
    "mxfp8_e4m3": (4, 3, -6, 8, 448.0, 32),
    "mxfp8_e5m2": (5, 2, -14, 15, 57344.0, 32),
    "mxfp4": (2, 1, 0, 2, 6.0, 32),
    "nvfp4": (2, 1, 0, 2, 6.0, 16),
}


@triton.jit
def _quantize_tile(
    x, rows, cols, mask,
    codes_ptr, scales_ptr, token_ptr, values_ptr,
    EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
    MAX_VALUE: tl.constexpr, BLOCK: tl.constexpr, NVFP4: tl.constexpr,
    BLOCK_T: tl.constexpr, D: tl.constexpr, WRITE_VALUES: tl.constexpr,
):
    """Quantize a [BLOCK_T, D] float32 tile into one format and store it.

    rows: token indices into the flattened [tokens] outputs; cols: arange(D).
    WRITE_VALUES also stores element x block scale in bf16 (exact: at most 6
    significant bits), the tensor-core-ready copy the sm_90 kernel reads; NVFP4's
    per-token scale stays out of it.
    """
    NB: tl.constexpr = D // BLOCK
    xb = tl.reshape(x, (BLOCK_T, NB, BLOCK))
    amax = abs_max(xb, 2)  # [T, NB]
    if NVFP4:
        # NVFP4 per-token scale: the token amax maps onto 6 (E2M1 max) x 448 (E4M3 max).
        s2 = tl.math.div_rn(abs_max(x, 1), tl.full((BLOCK_T,), 2688.0, tl.float32))
        s2 = tl.where(s2 == 0, 1.0, s2)
        sb_f = tl.math.div_rn(amax, 6.0 * s2[:, None])
        finite = (sb_f == sb_f) & (tl.abs(sb_f) < float("inf"))
        sb = round_to_element(tl.where(finite, sb_f, 0.0), 3, -6, 448.0)
        usable = finite & (sb > 0)
        sb_b = tl.where(usable, sb, 1.0)[:, :, None]
        xs = tl.math.div_rn(xb, tl.broadcast_to(s2[:, None, None], (BLOCK_T, NB, BLOCK)))
        v = tl.math.div_rn(xs, tl.broadcast_to(sb_b, (BLOCK_T, NB, BLOCK)))
        # Signed zeros where the block scale is 0; +0 for NaN (its sign means nothing).
        zero = (xb.to(tl.uint32, bitcast=True) & 0x80000000).to(tl.float32, bitcast=True)
        zero = tl.where(xb == xb, zero, 0.0)
        v = tl.where(usable[:, :, None], v, zero)
        v = tl.where((v == v) & (tl.abs(v) < float("inf")), v, 0.0)
        scale_code = tl.where(finite, element_code(sb, 4, 3, -6), 0x7F)
        scale_value = tl.where(finite, sb, float("nan"))
        tl.store(token_ptr + rows, s2, mask=mask)
    else:
        finite = (amax == amax) & (amax < float("inf"))
        e = tl.minimum(tl.maximum(exponent(tl.where(finite, amax, 0.0)) - EMAX, -127), 127)
        # Multiply by 2^-e: -e lies in [-125, 127], so the factor is a normal float.
        v = tl.where(finite[:, :, None], xb * pow2(-e)[:, :, None], 0.0)
        scale_code = tl.where(finite, e + 127, 255)
        scale_value = e8m0_value(scale_code)
    r = round_to_element(v, MAN_BITS, EMIN, MAX_VALUE)
    if WRITE_VALUES:
        values = tl.reshape(r * scale_value[:, :, None], (BLOCK_T, D))
        tl.store(values_ptr + rows[:, None] * D + cols[None, :], values.to(tl.bfloat16), mask=mask[:, None])
    codes = tl.reshape(element_code(r, EXP_BITS, MAN_BITS, EMIN), (BLOCK_T, D))
    sblk = tl.arange(0, NB)
    tl.store(scales_ptr + rows[:, None] * NB + sblk[None, :], scale_code.to(tl.uint8), mask=mask[:, None])
    if EXP_BITS + MAN_BITS == 3:
        # Two E2M1 codes per byte along head_dim, element 2t in the low nibble.
        lo, hi = tl.split(tl.reshape(codes, (BLOCK_T, D // 2, 2)))
        packed = (lo | (hi << 4)).to(tl.uint8)
        half = tl.arange(0, D // 2)
        tl.store(codes_ptr + rows[:, None] * (D // 2) + half[None, :], packed, mask=mask[:, None])
    else:
        tl.store(codes_ptr + rows[:, None] * D + cols[None, :], codes.to(tl.uint8), mask=mask[:, None])


@triton.jit
def _dual_quantize_kernel(
    x_ptr, mean_ptr, fold, L, H,
    hi_codes, hi_scales, lo_codes, lo_scales, lo_token, hi_values, lo_values,
    D: tl.constexpr, BLOCK_T: tl.constexpr, SMOOTH: tl.constexpr, WRITE_VALUES: tl.constexpr,
    HI_E: tl.constexpr, HI_M: tl.constexpr, HI_EMIN: tl.constexpr, HI_EMAX: tl.constexpr,
    HI_MAX: tl.constexpr, HI_BLOCK: tl.constexpr,
    LO_E: tl.constexpr, LO_M: tl.constexpr, LO_EMIN: tl.constexpr, LO_EMAX: tl.constexpr,
    LO_MAX: tl.constexpr, LO_BLOCK: tl.constexpr, LO_NVFP4: tl.constexpr,
):
    """One program per (BLOCK_T tokens, head, batch) of x [B, L, H, D] (contiguous)."""
    pid_t, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, D)
    mask = t < L
    # Flattened token index in [B, L, H] order: outputs are [B, L, H, ...].
    rows = (b * L + t) * H + h
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
    if SMOOTH:
        x = x - tl.load(mean_ptr + (b * H + h) * D + cols)[None, :]
    x = x * fold
    # float32 subnormals count as signed zeros (as in dma_jax.formats).
    sign = (x.to(tl.uint32, bitcast=True) & 0x80000000).to(tl.float32, bitcast=True)
    x = tl.where(tl.abs(x) < 1.1754943508222875e-38, sign, x)
    _quantize_tile(x, rows, cols, mask, hi_codes, hi_scales, lo_token, hi_values,
                   HI_E, HI_M, HI_EMIN, HI_EMAX, HI_MAX, HI_BLOCK, False, BLOCK_T, D, WRITE_VALUES)
    _quantize_tile(x, rows, cols, mask, lo_codes, lo_scales, lo_token, lo_values,
                   LO_E, LO_M, LO_EMIN, LO_EMAX, LO_MAX, LO_BLOCK, LO_NVFP4, BLOCK_T, D, WRITE_VALUES)


@triton.jit
def _channel_sum_kernel(x_ptr, L, H, CHUNK, part_ptr, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Partial sums over one CHUNK of tokens of x [B, L, H, D], per (head, batch).

    A grid over chunks keeps every SM busy; partials land in [chunks, B, H, D]
    and are added in a fixed order afterwards, so the mean is deterministic.
    """
    c, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = tl.arange(0, D)
    acc = tl.zeros((D,), tl.float32)
    end = tl.minimum(c * CHUNK + CHUNK, L)
    for start in range(c * CHUNK, end, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        ptrs = x_ptr + ((b * L + t) * H + h)[:, None] * D + cols[None, :]
        acc += tl.sum(tl.load(ptrs, mask=(t < end)[:, None], other=0.0).to(tl.float32), axis=0)
    tl.store(part_ptr + ((c * tl.num_programs(2) + b) * H + h) * D + cols, acc)


@triton.jit
def _channel_mean_kernel(part_ptr, L, H, N_CHUNKS, mean_ptr, D: tl.constexpr):
    """mean = (sum of the partials, in chunk order) / L, per (head, batch)."""
    h, b = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, D)
    acc = tl.zeros((D,), tl.float32)
    for c in range(0, N_CHUNKS):
        acc += tl.load(part_ptr + ((c * tl.num_programs(1) + b) * H + h) * D + cols)
    mean = tl.math.div_rn(acc, tl.full((D,), 1.0, tl.float32) * L)
    tl.store(mean_ptr + (b * H + h) * D + cols, mean)


@dataclasses.dataclass
class DualQuantized:
    """Both copies of one tensor ``[B, L, H, D]`` (uint8 unless noted)."""

    hi_codes: torch.Tensor  # [B, L, H, D]
    hi_scales: torch.Tensor  # [B, L, H, D // 32], E8M0
    lo_codes: torch.Tensor  # [B, L, H, D // 2], packed E2M1
    lo_scales: torch.Tensor  # [B, L, H, D // block], E4M3 (nvfp4) or E8M0 (mxfp4)
    lo_token_scale: torch.Tensor | None  # float32 [B, L, H] for nvfp4
    hi_values: torch.Tensor | None = None  # bf16 [B, L, H, D]: codes x block scales
    lo_values: torch.Tensor | None = None  # bf16 [B, L, H, D] (NVFP4: without s2)


# Launch settings (measured on the H200, see NOTES.md). Kernel parameters are
# ordered inputs and scalars first, then outputs, then constexprs: the order
# jax-triton uses, so the torch launchers and the JAX lowering share one kernel.
QUANTIZE_BLOCK_T = 16
QUANTIZE_WARPS = 4
MEAN_CHUNK = 256
MEAN_BLOCK_T = 64


def mean_launches(shape: tuple[int, ...], chunk: int = MEAN_CHUNK):
    """(grid, partial-sum shape) of the two smooth-K mean launches for x ``[B, L, H, D]``."""
    b, l, h, d = shape
    n_chunks = triton.cdiv(l, chunk)
    return (n_chunks, h, b), (h, b), (n_chunks, b, h, d), n_chunks


def quantize_meta(head_dim: int, high: str, low: str, smooth: bool, write_values: bool,
                  block_t: int = QUANTIZE_BLOCK_T) -> dict:
    """Constexpr arguments of ``_dual_quantize_kernel``."""
    hi, lo = FORMATS[high], FORMATS[low]
    return dict(
        D=head_dim, BLOCK_T=block_t, SMOOTH=smooth, WRITE_VALUES=write_values,
        HI_E=hi[0], HI_M=hi[1], HI_EMIN=hi[2], HI_EMAX=hi[3], HI_MAX=hi[4], HI_BLOCK=hi[5],
        LO_E=lo[0], LO_M=lo[1], LO_EMIN=lo[2], LO_EMAX=lo[3], LO_MAX=lo[4], LO_BLOCK=lo[5],
        LO_NVFP4=low == "nvfp4",
    )


def quantize_outputs(shape: tuple[int, ...], high: str, low: str,
                     write_values: bool) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype name) of the seven outputs: hi codes, hi scales, lo codes,
    lo scales, lo per-token scale (written for nvfp4 only), hi and lo bf16 values
    (one-element placeholders unless written)."""
    b, l, h, d = shape
    values = (b, l, h, d) if write_values else (1,)
    return [
        ((b, l, h, d), "uint8"),
        ((b, l, h, d // FORMATS[high][5]), "uint8"),
        ((b, l, h, d // 2), "uint8"),
        ((b, l, h, d // FORMATS[low][5]), "uint8"),
        ((b, l, h), "float32"),
        (values, "bfloat16"),
        (values, "bfloat16"),
    ]


def quantize_grid(shape: tuple[int, ...], block_t: int = QUANTIZE_BLOCK_T) -> tuple[int, int, int]:
    b, l, h, _ = shape
    return (triton.cdiv(l, block_t), h, b)


def channel_mean(x: torch.Tensor, chunk: int = MEAN_CHUNK) -> torch.Tensor:
    """Float32 mean of ``x [B, L, H, D]`` over L, shape ``[B, H, D]`` (deterministic)."""
    b, l, h, d = x.shape
    grid_sum, grid_mean, part_shape, n_chunks = mean_launches(x.shape, chunk)
    parts = torch.empty(part_shape, dtype=torch.float32, device=x.device)
    _channel_sum_kernel[grid_sum](x, l, h, chunk, parts, D=d, BLOCK_T=MEAN_BLOCK_T)
    mean = torch.empty((b, h, d), dtype=torch.float32, device=x.device)
    _channel_mean_kernel[grid_mean](parts, l, h, n_chunks, mean, D=d)
    return mean


def dual_quantize(
    x: torch.Tensor,
    *,
    high: str = "mxfp8_e4m3",
    low: str = "nvfp4",
    fold: float = 1.0,
    mean: torch.Tensor | None = None,
    write_values: bool = False,
    block_t: int = QUANTIZE_BLOCK_T,
    num_warps: int = QUANTIZE_WARPS,
) -> DualQuantized:
    """Quantize ``(x - mean) * fold`` into ``high`` and ``low`` in one launch.

    x: bf16/fp16/fp32 ``[B, L, H, D]``, contiguous. ``mean``: float32 ``[B, H, D]``
    (smooth-K) or None. ``fold`` is rounded to float32 (the folded softmax scale for Q).
    ``write_values`` also writes the bf16 ``hi_values`` / ``lo_values``.
    """
    if not x.is_contiguous():
        raise ValueError("dual_quantize needs a contiguous [B, L, H, D] tensor")
    b, l, h, d = x.shape
    outs = [torch.empty(shape, dtype=getattr(torch, dtype), device=x.device)
            for shape, dtype in quantize_outputs(x.shape, high, low, write_values)]
    _dual_quantize_kernel[quantize_grid(x.shape, block_t)](
        x, mean if mean is not None else x, float(torch.tensor(fold, dtype=torch.float32)), l, h,
        *outs, **quantize_meta(d, high, low, mean is not None, write_values, block_t), num_warps=num_warps,
    )
    return DualQuantized(
        *outs[:4], lo_token_scale=outs[4] if low == "nvfp4" else None,
        hi_values=outs[5] if write_values else None, lo_values=outs[6] if write_values else None,
    )
