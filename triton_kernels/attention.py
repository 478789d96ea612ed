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
* otherwise (sm_90, Triton's interpreter): codes are decoded in registers to
  ``e · block_scale``, which is exact in bf16 (at most 6 significant bits), and
  multiplied on bf16 tensor cores (fp32 under the interpreter, whose bf16 dot is
  broken), accumulating in fp32.
NVFP4's float32 per-token scales multiply the score tile afterwards.

Inputs are the outputs of ``triton_kernels.quantize`` (Q already carries
``sm_scale · log2(e)``; K is already smoothed). This module never imports JAX.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .mx import e2m1_value, e8m0_value, fp8_value, round_to_bf16

TILE = 128  # the classification tile of DESIGN.md §3.3, and BLOCK_M
BLOCK_N = 64  # divides TILE: a key block never straddles two tiles
NUM_WARPS = 8
NUM_STAGES = 2


@triton.jit
def _load_operand(codes_ptr, scales_ptr, rows, mask, D: tl.constexpr, FMT: tl.constexpr,
                  E5M2: tl.constexpr, NV: tl.constexpr, NATIVE: tl.constexpr, DOT_F32: tl.constexpr):
    """Load a [R, D] operand of one format for rows ``rows`` (int64).

    NATIVE: returns (codes, scales) as ``tl.dot_scaled`` takes them. Otherwise
    returns (values, 0): codes times block scales, exactly, in bf16 (float32 when
    DOT_F32); NVFP4's per-token factor is left out (applied to the scores).
    """
    BLOCK: tl.constexpr = 16 if NV else 32
    if NATIVE:
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
        scale_bytes = tl.load(scales_ptr + rows[:, None] * (D // BLOCK) + (cols // BLOCK)[None, :],
                              mask=mask[:, None], other=0)
        if FMT == "e2m1":
            packed = tl.load(codes_ptr + rows[:, None] * (D // 2) + (cols // 2)[None, :],
                             mask=mask[:, None], other=0).to(tl.int32)
            values = e2m1_value((packed >> ((cols & 1) * 4)[None, :]) & 0xF)
        else:
            codes = tl.load(codes_ptr + rows[:, None] * D + cols[None, :], mask=mask[:, None], other=0)
            values = fp8_value(codes, E5M2)
        if NV:
            scale = fp8_value(scale_bytes, False)
        else:
            scale = e8m0_value(scale_bytes)
        if DOT_F32:
            return values * scale, 0
        else:
            return (values * scale).to(tl.bfloat16), 0


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
    k_codes, k_scales, k_token, v_ptr,
    b, kvh, Lk, HKV, tile_lo, tile_hi,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    FMT: tl.constexpr, E5M2: tl.constexpr, NV: tl.constexpr, NATIVE: tl.constexpr,
    DOT_F32: tl.constexpr, PV_F32: tl.constexpr, FIX_BF16: tl.constexpr,
):
    """Online softmax over key tiles [tile_lo, tile_hi), all in format FMT."""
    cols = tl.arange(0, D)
    for n0 in range(tile_lo * BLOCK_M, tile_hi * BLOCK_M, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        t_ok = t < Lk  # keys past kv_len (tile padding) never contribute
        k_rows = ((b * Lk + t) * HKV + kvh).to(tl.int64)
        ka, ks = _load_operand(k_codes, k_scales, k_rows, t_ok, D, FMT, E5M2, NV, NATIVE, DOT_F32)
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
    qh_codes, qh_scales, ql_codes, ql_scales, ql_token,
    kh_codes, kh_scales, kl_codes, kl_scales, kl_token,
    v_ptr,
    Lq, Lk, HQ, HKV, q_offset, tile0, diag, sink,
    o_ptr,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HI_FMT: tl.constexpr, HI_E5M2: tl.constexpr, LO_NV: tl.constexpr,
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
    qh_a, qh_s = _load_operand(qh_codes, qh_scales, q_rows, row_ok, D, HI_FMT, HI_E5M2, False, NATIVE_HI, DOT_F32)
    ql_a, ql_s = _load_operand(ql_codes, ql_scales, q_rows, row_ok, D, "e2m1", False, LO_NV, NATIVE_LO, DOT_F32)
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
    acc, m_i, l_i = _attend_run(acc, m_i, l_i, qh_a, qh_s, s2q, p, kh_codes, kh_scales, kl_token, v_ptr,
                                b, kvh, Lk, HKV, 0, b1, D, BLOCK_M, BLOCK_N, CAUSAL,
                                HI_FMT, HI_E5M2, False, NATIVE_HI, DOT_F32, PV_F32, FIX_BF16)
    acc, m_i, l_i = _attend_run(acc, m_i, l_i, ql_a, ql_s, s2q, p, kl_codes, kl_scales, kl_token, v_ptr,
                                b, kvh, Lk, HKV, b1, b2, D, BLOCK_M, BLOCK_N, CAUSAL,
                                "e2m1", False, LO_NV, NATIVE_LO, DOT_F32, PV_F32, FIX_BF16)
    acc, m_i, l_i = _attend_run(acc, m_i, l_i, qh_a, qh_s, s2q, p, kh_codes, kh_scales, kl_token, v_ptr,
                                b, kvh, Lk, HKV, b2, b3, D, BLOCK_M, BLOCK_N, CAUSAL,
                                HI_FMT, HI_E5M2, False, NATIVE_HI, DOT_F32, PV_F32, FIX_BF16)
    if not CAUSAL:
        acc, m_i, l_i = _attend_run(acc, m_i, l_i, ql_a, ql_s, s2q, p, kl_codes, kl_scales, kl_token, v_ptr,
                                    b, kvh, Lk, HKV, b3, end, D, BLOCK_M, BLOCK_N, CAUSAL,
                                    "e2m1", False, LO_NV, NATIVE_LO, DOT_F32, PV_F32, FIX_BF16)
    # Rows without any valid key have l = 0 and output zeros.
    out = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)
    out = tl.where((l_i != l_i)[:, None], float("nan"), out)  # keep NaN rows NaN
    if FIX_BF16 and o_ptr.dtype.element_ty == tl.bfloat16:
        out = round_to_bf16(out)
    cols = tl.arange(0, D)
    tl.store(o_ptr + q_rows[:, None] * D + cols[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def native_formats(capability: tuple[int, int] | None, low: str) -> tuple[bool, bool]:
    """Whether the (high, low) tiles use ``tl.dot_scaled`` by default.

    Block-scaled MMA exists from sm_100 (Blackwell) on. NVFP4 tiles compile to
    ``tcgen05.mma ... kind::mxf4nvf4.block_scale.block16``, but Triton's
    interpreter treats every scale as E8M0, so that path has not been checked
    against the reference anywhere yet: until it runs on a B200, NVFP4 tiles
    take the exact decode path unless ``native=True`` is asked for.
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
        HI_FMT="e5m2" if high == "mxfp8_e5m2" else "e4m3", HI_E5M2=high == "mxfp8_e5m2",
        LO_NV=low == "nvfp4", NATIVE_HI=native[0], NATIVE_LO=native[1],
        DOT_F32=interpret,
        PV_F32=v_dtype_is_f32 or interpret, FIX_BF16=interpret,
    )


def mx_attention(
    q8, k8, v: torch.Tensor, *, q_len: int, causal: bool, q_offset: int, diag: int, sink: int,
    high: str, low: str, native: bool | None = None, num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
) -> torch.Tensor:
    """Launch the kernel on ``DualQuantized`` Q and K copies and V ``[B, Lk, HKV, D]``.

    ``native=True/False`` forces ``tl.dot_scaled`` on or off for every tile;
    ``None`` chooses by GPU (:func:`native_formats`).
    """
    b, kv_len, hkv, d = v.shape
    hq = q8.hi_codes.shape[2]
    n_m, tile0 = query_tiles(q_len, q_offset)
    out = torch.empty((b, q_len, hq, d), dtype=v.dtype, device=v.device)
    interpret = interpreting()
    cap = None if interpret or not v.is_cuda else torch.cuda.get_device_capability(v.device)
    q_token = q8.lo_token_scale if q8.lo_token_scale is not None else q8.lo_scales
    k_token = k8.lo_token_scale if k8.lo_token_scale is not None else k8.lo_scales
    _dma_attention_kernel[(n_m, hq, b)](
        q8.hi_codes, q8.hi_scales, q8.lo_codes, q8.lo_scales, q_token,
        k8.hi_codes, k8.hi_scales, k8.lo_codes, k8.lo_scales, k_token,
        v, q_len, kv_len, hq, hkv, q_offset, tile0, diag, sink, out,
        **attention_meta(d, causal=causal, high=high, low=low,
                         native=native_formats(cap, low) if native is None else (native, native),
                         v_dtype_is_f32=v.dtype == torch.float32, interpret=interpret),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
