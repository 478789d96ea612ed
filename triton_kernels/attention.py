"""The DMA prefill kernel: Q·Kᵀ from MX copies, online base-2 softmax, P·V in bf16/fp16.

One program per (query tile, query head, batch). Query tiles are aligned to
absolute positions (tile ``tq`` holds positions ``[tq·128, tq·128 + 128)``), and
key blocks to key positions, so every (query tile, key block) pair is entirely
high or entirely low precision (DESIGN.md §3.3). The key range of a program is
cut into at most four consecutive runs of tiles — sink (high), far (low),
diagonal band (high), and for non-causal attention the far side (low) — and
each run is a loop whose format is a compile-time constant: no branch per tile.

Q·Kᵀ per format:
* ``NATIVE_MX`` (sm_100+): ``tl.dot_scaled`` on the codes and scale bytes, the
  block-scaled tensor-core MMA (``tcgen05.mma ... block_scale``).
* otherwise (sm_90, Triton's interpreter): the quantizer's bf16 copy of
  ``e · block_scale`` (exact: at most 6 significant bits), written once per call,
  multiplied on bf16 tensor cores (fp32 under the interpreter, whose bf16 dot is
  broken), accumulating in fp32. Decoding 4-bit codes inside the loop instead
  ran 4.3x slower on the H200 (NOTES.md).
NVFP4's float32 per-token scales multiply the score tile afterwards.

Inputs are the outputs of ``triton_kernels.quantize`` (Q already carries
``sm_scale · log2(e)``; K is already smoothed). This module never imports JAX.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .mx import round_to_bf16

TILE = 128  # the classification tile of DESIGN.md §3.3, and BLOCK_M
BLOCK_N = 64  # divides TILE: a key block never straddles two tiles
NUM_WARPS = 8
NUM_STAGES = 2


@triton.jit
def _load_operand(codes_ptr, scales_ptr, values_ptr, rows, mask, D: tl.constexpr, FMT: tl.constexpr,
                  NV: tl.constexpr, NATIVE: tl.constexpr, DOT_F32: tl.constexpr):
    """Load a [R, D] operand of one format for rows ``rows`` (int64).

    NATIVE: (codes, scales) as ``tl.dot_scaled`` takes them. Otherwise (values, 0):
    the quantizer's bf16 copy of codes x block scales (exact), as float32 when
    DOT_F32; NVFP4's per-token factor is applied to the scores instead.
    """
    if NATIVE:
        BLOCK: tl.constexpr = 16 if NV else 32
        KP: tl.constexpr = D // 2 if FMT == "e2m1" else D
        kc = tl.arange(0, KP)
        codes = tl.load(codes_ptr + rows[:, None] * KP + kc[None, :], mask=mask[:, None], other=0)
        sc = tl.arange(0, D // BLOCK)
        scales = tl.load(scales_ptr + rows[:, None] * (D // BLOCK) + sc[None, :], mask=mask[:, None], other=0)
        if NV:
            scales = scales.to(tl.float8e4nv, bitcast=True)
        return codes, scales
    else:
        cols = tl.arange(0, D)
        values = tl.load(values_ptr + rows[:, None] * D + cols[None, :], mask=mask[:, None], other=0.0)
        if DOT_F32:
            return values.to(tl.float32), 0
        else:
            return values, 0


@triton.jit
def _scores(qa, qs, ka, ks, FMT: tl.constexpr, NATIVE: tl.constexpr):
    """fp32 Q·Kᵀ of one format for a [BLOCK_M, BLOCK_N] tile."""
    if NATIVE:
        return tl.dot_scaled(qa, qs, FMT, tl.trans(ka), ks, FMT)
    else:
        return tl.dot(qa, tl.trans(ka), out_dtype=tl.float32)


@triton.jit
def _attend_run(
    acc, m_i, l_i, qa, qs, s2q, p,
    k_codes, k_scales, k_token, k_values, v_ptr,
    b, kvh, Lk, HKV, tile_lo, tile_hi,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    FMT: tl.constexpr, NV: tl.constexpr, NATIVE: tl.constexpr,
    DOT_F32: tl.constexpr, PV_F32: tl.constexpr, FIX_BF16: tl.constexpr,
):
    """Online softmax over key tiles [tile_lo, tile_hi), all in format FMT."""
    cols = tl.arange(0, D)
    for n0 in range(tile_lo * BLOCK_M, tile_hi * BLOCK_M, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        t_ok = t < Lk  # keys past kv_len (tile padding) never contribute
        k_rows = ((b * Lk + t) * HKV + kvh).to(tl.int64)
        ka, ks = _load_operand(k_codes, k_scales, k_values, k_rows, t_ok, D, FMT, NV, NATIVE, DOT_F32)
        s = _scores(qa, qs, ka, ks, FMT, NATIVE)
        if NV:
            s2k = tl.load(k_token + k_rows, mask=t_ok, other=1.0)
            s = (s * s2q[:, None]) * s2k[None, :]
        valid = t_ok[None, :]
        if CAUSAL:
            valid = valid & (t[None, :] <= p[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no valid key yet keeps m = -inf: use 0 so P = 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        pr = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        v = tl.load(v_ptr + k_rows[:, None] * D + cols[None, :], mask=t_ok[:, None], other=0.0)
        # P is rounded to the input dtype before P·V, as in every flash kernel (§3.4).
        if FIX_BF16 and v.dtype == tl.bfloat16:
            pv_in = round_to_bf16(pr).to(tl.bfloat16)
        else:
            pv_in = pr.to(v.dtype)
        if PV_F32:
            pv = tl.dot(pv_in.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(pv_in, v, out_dtype=tl.float32)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _dma_attention_kernel(
    qh_codes, qh_scales, ql_codes, ql_scales, ql_token, qh_values, ql_values,
    kh_codes, kh_scales, kl_codes, kl_scales, kl_token, kh_values, kl_values,
    v_ptr,
    Lq, Lk, HQ, HKV, q_offset, tile0, diag, sink,
    o_ptr,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HI_FMT: tl.constexpr, LO_NV: tl.constexpr,
    NATIVE_HI: tl.constexpr, NATIVE_LO: tl.constexpr, DOT_F32: tl.constexpr,
    PV_F32: tl.constexpr, FIX_BF16: tl.constexpr,
):
    """q codes [B, Lq, HQ, ·], k codes and v [B, Lk, HKV, ·], o [B, Lq, HQ, D]."""
    m, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kvh = h // (HQ // HKV)  # GQA/MQA: index the shared kv head, never copy it
    tq = tile0 + m
    p = tq * BLOCK_M + tl.arange(0, BLOCK_M)  # absolute query positions
    r = p - q_offset
    row_ok = (r >= 0) & (r < Lq)
    q_rows = ((b * Lq + r) * HQ + h).to(tl.int64)
    qh_a, qh_s = _load_operand(qh_codes, qh_scales, qh_values, q_rows, row_ok, D, HI_FMT, False, NATIVE_HI, DOT_F32)
    ql_a, ql_s = _load_operand(ql_codes, ql_scales, ql_values, q_rows, row_ok, D, "e2m1", LO_NV, NATIVE_LO, DOT_F32)
    if LO_NV:
        s2q = tl.load(ql_token + q_rows, mask=row_ok, other=1.0)
    else:
        s2q = tl.full((BLOCK_M,), 1.0, tl.float32)

    acc = tl.zeros((BLOCK_M, D), tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    # Runs of key tiles: [0, b1) sink, high; [b1, b2) low; [b2, b3) diagonal band,
    # high; [b3, n_tiles) low (non-causal only). Each bound is clamped into
    # [previous bound, end], so empty runs cost nothing.
    n_tiles = tl.cdiv(Lk, BLOCK_M)
    if CAUSAL:
        end = tl.maximum(tl.minimum(tq + 1, n_tiles), 0)
    else:
        end = n_tiles
    b1 = tl.minimum(sink, end)
    b2 = tl.minimum(tl.maximum(b1, tq - diag + 1), end)
    if CAUSAL:
        b3 = end
    else:
        b3 = tl.minimum(tl.maximum(b2, tq + diag), end)
    acc, m_i, l_i = _attend_run(acc, m_i, l_i, qh_a, qh_s, s2q, p, kh_codes, kh_scales, kl_token, kh_values, v_ptr,
                                b, kvh, Lk, HKV, 0, b1, D, BLOCK_M, BLOCK_N, CAUSAL,
                                HI_FMT, False, NATIVE_HI, DOT_F32, PV_F32, FIX_BF16)
    acc, m_i, l_i = _attend_run(acc, m_i, l_i, ql_a, ql_s, s2q, p, kl_codes, kl_scales, kl_token, kl_values, v_ptr,
                                b, kvh, Lk, HKV, b1, b2, D, BLOCK_M, BLOCK_N, CAUSAL,
                                "e2m1", LO_NV, NATIVE_LO, DOT_F32, PV_F32, FIX_BF16)
    acc, m_i, l_i = _attend_run(acc, m_i, l_i, qh_a, qh_s, s2q, p, kh_codes, kh_scales, kl_token, kh_values, v_ptr,
                                b, kvh, Lk, HKV, b2, b3, D, BLOCK_M, BLOCK_N, CAUSAL,
                                HI_FMT, False, NATIVE_HI, DOT_F32, PV_F32, FIX_BF16)
    if not CAUSAL:
        acc, m_i, l_i = _attend_run(acc, m_i, l_i, ql_a, ql_s, s2q, p, kl_codes, kl_scales, kl_token, kl_values, v_ptr,
                                    b, kvh, Lk, HKV, b3, end, D, BLOCK_M, BLOCK_N, CAUSAL,
                                    "e2m1", LO_NV, NATIVE_LO, DOT_F32, PV_F32, FIX_BF16)
    # Rows without any valid key have l = 0 and output zeros.
    out = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)
    out = tl.where((l_i != l_i)[:, None], float("nan"), out)  # keep NaN rows NaN
    if FIX_BF16 and o_ptr.dtype.element_ty == tl.bfloat16:
        out = round_to_bf16(out)
    cols = tl.arange(0, D)
    tl.store(o_ptr + q_rows[:, None] * D + cols[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def native_formats(capability: tuple[int, int] | None, low: str) -> tuple[bool, bool]:
    """Whether the (high, low) tiles use ``tl.dot_scaled`` by default.

    Block-scaled MMA exists from sm_100 (Blackwell) on. NVFP4 tiles compile to
    ``tcgen05.mma ... kind::mxf4nvf4.block_scale.block16``, but Triton's
    interpreter treats every scale as E8M0, so that path has not been checked
    against the reference anywhere yet: until it runs on a B200, NVFP4 tiles
    take the bf16 path unless ``native=True`` is asked for.
    """
    blackwell = capability is not None and capability[0] >= 10
    return blackwell, blackwell and low == "mxfp4"


def query_tiles(q_len: int, q_offset: int) -> tuple[int, int]:
    """(number of query tiles, first query tile): tiles cover absolute positions
    ``[q_offset, q_offset + q_len)`` aligned to multiples of TILE."""
    tile0 = q_offset // TILE  # floor, also for negative offsets
    return -(-(q_offset + q_len) // TILE) - tile0, tile0


def attention_meta(head_dim: int, *, causal: bool, high: str, low: str, native: tuple[bool, bool],
                   v_dtype_is_f32: bool, interpret: bool) -> dict:
    """Constexpr arguments of ``_dma_attention_kernel``; ``native``: (high, low) tiles."""
    return dict(
        D=head_dim, BLOCK_M=TILE, BLOCK_N=BLOCK_N, CAUSAL=causal,
        HI_FMT="e5m2" if high == "mxfp8_e5m2" else "e4m3",
        LO_NV=low == "nvfp4", NATIVE_HI=native[0], NATIVE_LO=native[1],
        DOT_F32=interpret,
        PV_F32=v_dtype_is_f32 or interpret, FIX_BF16=interpret,
    )


def resolve_native(device: torch.device, low: str, native: bool | None) -> tuple[bool, bool]:
    """(high, low) ``tl.dot_scaled`` switches: forced by ``native``, else by GPU."""
    if native is not None:
        return native, native
    if interpreting() or device.type != "cuda":
        return False, False
    return native_formats(torch.cuda.get_device_capability(device), low)


def mx_attention(
    q8, k8, v: torch.Tensor, *, q_len: int, causal: bool, q_offset: int, diag: int, sink: int,
    high: str, low: str, native: tuple[bool, bool],
    num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
) -> torch.Tensor:
    """Launch the kernel on ``DualQuantized`` Q and K copies and V ``[B, Lk, HKV, D]``.

    Tiles not in ``native`` read the copies' bf16 values, which must have been written.
    """
    b, kv_len, hkv, d = v.shape
    hq = q8.hi_codes.shape[2]
    n_m, tile0 = query_tiles(q_len, q_offset)
    out = torch.empty((b, q_len, hq, d), dtype=v.dtype, device=v.device)

    def parts(x8):
        token = x8.lo_token_scale if x8.lo_token_scale is not None else x8.lo_scales
        hi_values = x8.hi_values if x8.hi_values is not None else x8.hi_codes
        lo_values = x8.lo_values if x8.lo_values is not None else x8.lo_codes
        return x8.hi_codes, x8.hi_scales, x8.lo_codes, x8.lo_scales, token, hi_values, lo_values

    _dma_attention_kernel[(n_m, hq, b)](
        *parts(q8), *parts(k8), v, q_len, kv_len, hq, hkv, q_offset, tile0, diag, sink, out,
        **attention_meta(d, causal=causal, high=high, low=low, native=native,
                         v_dtype_is_f32=v.dtype == torch.float32, interpret=interpreting()),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
