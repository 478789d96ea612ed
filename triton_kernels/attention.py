"""The DMA prefill kernel: Q·Kᵀ from MX copies, online base-2 softmax, P·V in
bf16/fp16 (or FP8 with ``pv="fp8"``).

One program per (query block, query head, batch). Query blocks (64 or 128 rows)
lie inside one 128-token tile of absolute positions, and key blocks inside one
key tile, so every (query block, key block) pair is entirely high or entirely
low precision (DESIGN.md §3.3). The key range of a program is cut into at most
four consecutive runs of tiles — sink (high), far (low), diagonal band (high),
and for non-causal attention the far side (low) — and each run is a loop whose
format is a compile-time constant: no branch per tile. Each run is split once
more into fully valid blocks (no masks) and the blocks at the causal or kv_len
edge (masked).

Q·Kᵀ per format:
* ``NATIVE_HI/LO`` (sm_100+): ``tl.dot_scaled`` on the codes and scale bytes, the
  block-scaled tensor-core MMA (``tcgen05.mma ... block_scale``).
* otherwise (sm_90, Triton's interpreter): the quantizer's E4M3 copies on FP8
  tensor cores, both operands K-major. Q's copy has a scale per token
  (``dma_jax.formats.fp8_per_token``), K's one per 128-key tile
  (``fp8_per_tile``), so each score row is scaled by one number. Decoding 4-bit codes inside the loop
  instead ran 4.3x slower on the H200 (NOTES.md).
NVFP4's float32 per-token scales multiply the native score tile afterwards.
``input_attention`` runs the same kernel with Q·Kᵀ on the unquantized inputs
(format "input"): the bf16 baseline the benchmarks compare DMA with.

Inputs are the outputs of ``triton_kernels.quantize`` (Q already carries
``sm_scale · log2(e)``; K is already smoothed). This module never imports JAX.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from .mx import round_to_bf16, round_to_element

TILE = 128  # the classification tile of DESIGN.md §3.3
_TILE = tl.constexpr(TILE)  # the same, readable inside @triton.jit functions


@triton.jit
def _as_fp8(ptr):
    """The E4M3 copies arrive as bytes (torch and jax-triton pass uint8): cast the
    pointer, not the loaded tile. A bitcast between a load and its ``tl.dot`` hides
    the load from Triton's pipeliner (no async copies into shared memory): a plain
    FP8 kernel ran 550 instead of 805 TFLOP/s on the H200 that way (NOTES.md)."""
    return ptr.to(tl.pointer_type(tl.float8e4nv), bitcast=True)


@triton.jit
def _tile_ptr(ptr, FMT: tl.constexpr):
    """Where Q·Kᵀ operand tiles of format FMT are read: the FP8 copies through an
    FP8 pointer, the unquantized inputs (FMT "input") as they are."""
    if FMT == "input":
        return ptr
    else:
        return _as_fp8(ptr)


@triton.jit
def _load_operand(codes_ptr, scales_ptr, token_ptr, f8_ptr, ts_ptr, rows, mask, D: tl.constexpr,
                  FMT: tl.constexpr, NV: tl.constexpr, NATIVE: tl.constexpr):
    """Load a [R, D] Q or K operand of one format for rows ``rows`` (int64).

    Returns (operand, scale bytes, per-row factor). NATIVE: the codes and scale
    bytes as ``tl.dot_scaled`` takes them, and NVFP4's s2 (else 1). Otherwise (Q
    only) the quantizer's per-token E4M3 copy (``dma_jax.formats.fp8_per_token``)
    for the FP8 tensor cores, with its token scale; FMT "input": Q itself
    (``f8_ptr``), whose factor the caller supplies.
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
            token = tl.load(token_ptr + rows, mask=mask, other=1.0)
        else:
            token = 1.0
        return codes, scales, token
    else:
        cols = tl.arange(0, D)
        values = tl.load(_tile_ptr(f8_ptr, FMT) + rows[:, None] * D + cols[None, :], mask=mask[:, None], other=0.0)
        if FMT == "input":
            return values, 0, 1.0
        else:
            return values, 0, tl.load(ts_ptr + rows, mask=mask, other=1.0)


@triton.jit
def _attend_run(
    acc, m_i, l_i, qa, qs, qt, p,
    k_codes, k_scales, k_token, k_f8, k_ts, v_ptr, vt_ptr,
    kv_base, kts_base, vt_base, Lk, HKV, lo, hi,
    D: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASK: tl.constexpr,
    FMT: tl.constexpr, NV: tl.constexpr, NATIVE: tl.constexpr,
    PV_FP8: tl.constexpr, DOT_F32: tl.constexpr, FIX_BF16: tl.constexpr,
):
    """Online softmax over keys [lo, hi) (multiples of BLOCK_N), all in format FMT.

    ``kv_base`` (int64) is the token-grid index of (batch, key 0, kv head),
    ``kts_base`` that of (batch, key tile 0, kv head) in K's per-tile FP8 scales, and
    ``vt_base`` the element offset of V^T[batch, kv head]. Pointer tiles are built
    once and advanced by BLOCK_N keys per step, so the loop does no 64-bit index
    arithmetic. MASK=False is for blocks that are entirely valid (inside kv_len
    and, when causal, at or before every query row): no masks on the hot path.
    """
    cols = tl.arange(0, D)
    offs = tl.arange(0, BLOCK_N)
    rows = (lo + offs) * HKV  # int32: the launcher checks Lk * HKV * D < 2^31
    k_ptrs = _tile_ptr(k_f8, FMT) + kv_base * D + rows[:, None] * D + cols[None, :]
    v_ptrs = v_ptr + kv_base * D + rows[:, None] * D + cols[None, :]
    # V^T rows are padded to a multiple of 16 bytes; saying so lets loads vectorize
    # also where Lk is not specialised (jax-triton passes it as a plain int).
    vt_stride = tl.cdiv(Lk, 16) * 16
    vt_ptrs = _as_fp8(vt_ptr) + vt_base + cols[:, None] * vt_stride + (lo + offs)[None, :]
    for n0 in range(lo, hi, BLOCK_N):
        t = n0 + offs
        t_ok = t < Lk  # keys past kv_len (tile padding) never contribute
        if NATIVE:
            k_rows = kv_base + (t * HKV).to(tl.int64)
            ka, ks, kt = _load_operand(k_codes, k_scales, k_token, k_f8, k_ts, k_rows, t_ok, D, FMT, NV, NATIVE)
            s = tl.dot_scaled(qa, qs, FMT, tl.trans(ka), ks, FMT)
            if NV:
                s = (s * qt[:, None]) * kt[None, :]
            row = tl.full(m_i.shape, 1.0, tl.float32)
        else:
            if MASK:
                ka = tl.load(k_ptrs, mask=t_ok[:, None], other=0.0)
            else:
                ka = tl.load(k_ptrs)
            if FMT == "input":
                # The unquantized baseline: qt is the softmax fold, applied to the
                # fp32 scores rather than rounded into Q.
                if DOT_F32:
                    s = tl.dot(qa.to(tl.float32), tl.trans(ka.to(tl.float32)), input_precision="ieee")
                else:
                    s = tl.dot(qa, tl.trans(ka), out_dtype=tl.float32)
                row = tl.zeros_like(m_i) + qt
            else:
                # FP8 x FP8 with both operands K-major (D contiguous); fp32 result.
                s = tl.dot(qa, tl.trans(ka), out_dtype=tl.float32)
                # K's copy has one scale per key tile (BLOCK_N divides TILE): with Q's
                # token scale it is a row factor. A per-key factor would cost a vector
                # in the score layout, which pushed the loop into register spills.
                row = qt * tl.load(k_ts + kts_base + (n0 // _TILE) * HKV)
        if MASK:
            # Scale before masking: a zero row factor (an all-zero NVFP4 token) times
            # -inf would be NaN.
            s = s * row[:, None]
            row = tl.full(m_i.shape, 1.0, tl.float32)
            valid = t_ok[None, :]
            if CAUSAL:
                valid = valid & (t[None, :] <= p[:, None])
            s = tl.where(valid, s, float("-inf"))
        # Unmasked blocks keep the raw scores: the row factor (> 0) scales the row max
        # exactly (rounding is monotonic) and goes into exp2's argument, one FMA per
        # score instead of a multiply and a subtraction.
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * row)
        if MASK:
            # A row that has seen no valid key yet keeps m = -inf: use 0 so P = 0, not NaN.
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new  # every row has a valid key in this block
        alpha = tl.exp2(m_i - m_new_safe)
        if PV_FP8:
            # P times 2^8 (at most 256): small probabilities stay out of E4M3's
            # subnormals; l carries the same factor, so it cancels in acc / l.
            pr = tl.exp2(s * row[:, None] - (m_new_safe - 8.0)[:, None])
        else:
            pr = tl.exp2(s * row[:, None] - m_new_safe[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        if PV_FP8:
            if FIX_BF16:
                pr = round_to_element(pr, 3, -6, 448.0)
            # V^T [D, BLOCK_N] bytes: the K-major B operand of an FP8 P·V. Each
            # block's product starts from zero (Hopper's FP8 accumulator keeps
            # ~22 bits) and is added to acc in fp32.
            if MASK:
                # Columns [Lk, LP) of V^T are zeros: masking by LP (a multiple of
                # 16) keeps the loads vectorized where Lk is not specialised.
                vt = tl.load(vt_ptrs, mask=(t < vt_stride)[None, :], other=0.0)
            else:
                vt = tl.load(vt_ptrs)
            pv = tl.dot(pr.to(tl.float8e4nv), tl.trans(vt), out_dtype=tl.float32)
        else:
            if MASK:
                v = tl.load(v_ptrs, mask=t_ok[:, None], other=0.0)
            else:
                v = tl.load(v_ptrs)
            # P is rounded to the input dtype before P·V, as in every flash kernel (§3.4).
            if FIX_BF16 and v.dtype == tl.bfloat16:
                pv_in = round_to_bf16(pr).to(tl.bfloat16)
            else:
                pv_in = pr.to(v.dtype)
            if DOT_F32:
                pv = tl.dot(pv_in.to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(pv_in, v, out_dtype=tl.float32)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
        k_ptrs += BLOCK_N * HKV * D
        v_ptrs += BLOCK_N * HKV * D
        vt_ptrs += BLOCK_N
    return acc, m_i, l_i


@triton.jit
def _attend_keys(
    acc, m_i, l_i, qa, qs, qt, p,
    k_codes, k_scales, k_token, k_f8, k_ts, v_ptr, vt_ptr,
    kv_base, kts_base, vt_base, Lk, HKV, lo, hi, safe,
    D: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    FMT: tl.constexpr, NV: tl.constexpr, NATIVE: tl.constexpr,
    PV_FP8: tl.constexpr, DOT_F32: tl.constexpr, FIX_BF16: tl.constexpr,
):
    """One run of keys [lo, hi) in one format: the blocks below ``safe`` unmasked,
    the rest masked."""
    split = tl.minimum(tl.maximum(lo, safe), hi)
    acc, m_i, l_i = _attend_run(acc, m_i, l_i, qa, qs, qt, p, k_codes, k_scales, k_token, k_f8, k_ts,
                                v_ptr, vt_ptr, kv_base, kts_base, vt_base, Lk, HKV, lo, split,
                                D, BLOCK_N, CAUSAL, False, FMT, NV, NATIVE, PV_FP8, DOT_F32, FIX_BF16)
    return _attend_run(acc, m_i, l_i, qa, qs, qt, p, k_codes, k_scales, k_token, k_f8, k_ts,
                       v_ptr, vt_ptr, kv_base, kts_base, vt_base, Lk, HKV, split, hi,
                       D, BLOCK_N, CAUSAL, True, FMT, NV, NATIVE, PV_FP8, DOT_F32, FIX_BF16)


@triton.jit
def _dma_attention_kernel(
    qh_codes, qh_scales, ql_codes, ql_scales, ql_token, qh_f8, qh_ts, ql_f8, ql_ts,
    kh_codes, kh_scales, kl_codes, kl_scales, kl_token, kh_f8, kh_ts, kl_f8, kl_ts,
    v_ptr, vt_ptr, v_scale,
    Lq, Lk, HQ, HKV, q_offset, block0, diag, sink, qk_scale,
    o_ptr,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HI_FMT: tl.constexpr, LO_NV: tl.constexpr, NATIVE_HI: tl.constexpr, NATIVE_LO: tl.constexpr,
    HAS_LO: tl.constexpr, PV_FP8: tl.constexpr, DOT_F32: tl.constexpr, FIX_BF16: tl.constexpr,
):
    """q operands [B, Lq, HQ, ·], k operands and v [B, Lk, HKV, ·], o [B, Lq, HQ, D];
    vt [B, HKV, D, Lk rounded up to 16] and v_scale [B, HKV, D] for the FP8 P·V. HAS_LO=False when
    every pair is high precision (the low copies were not written).

    HI_FMT "input" (with HAS_LO=False) is the unquantized baseline: ``qh_f8`` and
    ``kh_f8`` are Q and K themselves and ``qk_scale`` the softmax fold
    ``sm_scale · log2(e)``, which the quantized paths have already folded into Q."""
    if CAUSAL:
        # Later query blocks see more keys, and programs start in launch order (axis 0
        # fastest): deal the tiles longest first across all heads of a batch item.
        # Longest first within each head (head-major) left the last heads' long tiles
        # running alone at the end: ~5% of an 8k call with 32 heads on 132 SMs, by
        # benchmarks/experiments/causal_order_model.py. attention_sm90 deals them alike.
        n_m, n_h = tl.num_programs(0), tl.num_programs(1)
        rank = tl.program_id(1) * n_m + tl.program_id(0)
        m = n_m - 1 - rank // n_h
        h = rank % n_h
    else:
        m, h = tl.program_id(0), tl.program_id(1)
    b = tl.program_id(2)
    kvh = h // (HQ // HKV)  # GQA/MQA: index the shared kv head, never copy it
    p0 = (block0 + m) * BLOCK_M
    p = p0 + tl.arange(0, BLOCK_M)  # absolute query positions
    # BLOCK_M divides TILE: one classification tile per program. Integer division
    # truncates in Triton; positions can be negative (q_offset < 0), so floor it.
    tq = tl.where(p0 < 0, -((_TILE - 1 - p0) // _TILE), p0 // _TILE)
    r = p - q_offset
    row_ok = (r >= 0) & (r < Lq)
    q_rows = ((b * Lq + r) * HQ + h).to(tl.int64)
    qh_a, qh_s, qh_t = _load_operand(qh_codes, qh_scales, ql_token, qh_f8, qh_ts, q_rows, row_ok, D,
                                     HI_FMT, False, NATIVE_HI)
    if HI_FMT == "input":
        qh_t = qk_scale
    if HAS_LO:
        ql_a, ql_s, ql_t = _load_operand(ql_codes, ql_scales, ql_token, ql_f8, ql_ts, q_rows, row_ok, D,
                                         "e2m1", LO_NV, NATIVE_LO)

    kv_base = (b.to(tl.int64) * Lk) * HKV + kvh
    kts_base = (b * tl.cdiv(Lk, _TILE)) * HKV + kvh
    vt_base = ((b * HKV + kvh).to(tl.int64) * D) * (tl.cdiv(Lk, 16) * 16)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    # Keys are visited up to kend (a multiple of BLOCK_N). Runs of key tiles:
    # [0, b1) sink, high; [b1, b2) low; [b2, b3) diagonal band, high; [b3, end)
    # low (non-causal only). Bounds are clamped in tiles first (diag may be 2^30).
    kend = tl.cdiv(Lk, BLOCK_N) * BLOCK_N
    safe = (Lk // BLOCK_N) * BLOCK_N  # keys below need no mask
    if CAUSAL:
        kend = tl.maximum(tl.minimum(kend, tl.cdiv(p0 + BLOCK_M, BLOCK_N) * BLOCK_N), 0)
        safe = tl.maximum(tl.minimum(safe, ((p0 + 1) // BLOCK_N) * BLOCK_N), 0)
    end = tl.cdiv(kend, _TILE)
    b1 = tl.minimum(sink, end)
    b2 = tl.minimum(tl.maximum(b1, tq - diag + 1), end)
    if CAUSAL:
        b3 = end
    else:
        b3 = tl.minimum(tl.maximum(b2, tq + diag), end)
    k1 = tl.minimum(b1 * _TILE, kend)
    k2 = tl.minimum(b2 * _TILE, kend)
    k3 = tl.minimum(b3 * _TILE, kend)
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, qh_a, qh_s, qh_t, p, kh_codes, kh_scales, kl_token, kh_f8, kh_ts,
                                 v_ptr, vt_ptr, kv_base, kts_base, vt_base, Lk, HKV, 0, k1, safe, D, BLOCK_N, CAUSAL,
                                 HI_FMT, False, NATIVE_HI, PV_FP8, DOT_F32, FIX_BF16)
    if HAS_LO:
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, ql_a, ql_s, ql_t, p, kl_codes, kl_scales, kl_token, kl_f8,
                                     kl_ts, v_ptr, vt_ptr, kv_base, kts_base, vt_base, Lk, HKV, k1, k2, safe,
                                     D, BLOCK_N, CAUSAL, "e2m1", LO_NV, NATIVE_LO, PV_FP8, DOT_F32, FIX_BF16)
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, qh_a, qh_s, qh_t, p, kh_codes, kh_scales, kl_token, kh_f8, kh_ts,
                                 v_ptr, vt_ptr, kv_base, kts_base, vt_base, Lk, HKV, k2, k3, safe, D, BLOCK_N, CAUSAL,
                                 HI_FMT, False, NATIVE_HI, PV_FP8, DOT_F32, FIX_BF16)
    if HAS_LO and not CAUSAL:
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, ql_a, ql_s, ql_t, p, kl_codes, kl_scales, kl_token, kl_f8,
                                     kl_ts, v_ptr, vt_ptr, kv_base, kts_base, vt_base, Lk, HKV, k3, kend, safe,
                                     D, BLOCK_N, CAUSAL, "e2m1", LO_NV, NATIVE_LO, PV_FP8, DOT_F32, FIX_BF16)
    cols = tl.arange(0, D)
    if PV_FP8:
        acc = acc * tl.load(v_scale + (b * HKV + kvh) * D + cols)[None, :]
    # Rows without any valid key have l = 0 and output zeros.
    out = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)
    out = tl.where((l_i != l_i)[:, None], float("nan"), out)  # keep NaN rows NaN
    if FIX_BF16 and o_ptr.dtype.element_ty == tl.bfloat16:
        out = round_to_bf16(out)
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
    take the FP8 path unless ``native=True`` is asked for.
    """
    blackwell = capability is not None and capability[0] >= 10
    return blackwell, blackwell and low == "mxfp4"


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # query rows per program; divides TILE
    block_n: int  # keys per inner step; divides TILE
    num_warps: int
    num_stages: int


# Launch settings per GPU generation and (head_dim, causal, FP8 P·V). sm_90: from
# ``benchmarks/tune_attention.py`` and ``benchmarks/profile_attention.py`` on the H200
# (NOTES.md has the sweeps). With the FP8 tiles loaded through FP8 pointers (so
# they are pipelined into shared memory), 64 rows x 128 keys in 4 warps are best at
# head_dim 128: 591 / 515 TFLOP/s at 8k (non-causal / causal) with bf16 V and 2
# stages, 697 / 641 with the FP8 P·V and 3 stages. At head_dim 64, 64 x 64 blocks in 4
# warps and 3 stages (416-472).
# Everything else, sm_100 included, takes 128 rows and 8 warps: tcgen05's
# block-scaled MMA needs 128-row tiles (a CPU test checks the sm_100 PTX).
DEFAULT_LAUNCH = LaunchConfig(128, 64, 8, 2)
LAUNCH_SM90 = {
    (128, False, False): LaunchConfig(64, 128, 4, 2),
    (128, True, False): LaunchConfig(64, 128, 4, 2),
    (128, False, True): LaunchConfig(64, 128, 4, 3),
    (128, True, True): LaunchConfig(64, 128, 4, 3),
    (64, False, False): LaunchConfig(64, 64, 4, 3),
    (64, True, False): LaunchConfig(64, 64, 4, 3),
    (64, False, True): LaunchConfig(64, 64, 4, 3),
    (64, True, True): LaunchConfig(64, 64, 4, 3),
}
SM90_FALLBACK = LaunchConfig(64, 128, 4, 3)
# The unquantized baseline (``input_attention``, bf16 Q·Kᵀ and P·V) per (head_dim,
# causal), from ``tune_attention.py --unquantized``: 510 / 468 TFLOP/s at 8k and
# head_dim 128, 451 / 418 at 64; the MX table's 64/128/4/2 gave it 335 / 304.
LAUNCH_SM90_UNQUANTIZED = {
    (128, False): LaunchConfig(128, 128, 8, 3),
    (128, True): LaunchConfig(64, 64, 4, 3),
    (64, False): LaunchConfig(128, 64, 8, 3),
    (64, True): LaunchConfig(64, 64, 4, 3),
}


def launch_config(head_dim: int, causal: bool, pv_fp8: bool,
                  capability: tuple[int, int] | None, unquantized: bool = False) -> LaunchConfig:
    """The launch settings for a GPU of compute ``capability`` (None: interpreter);
    ``unquantized``: for ``input_attention``."""
    if capability is not None and capability[0] == 9:
        if unquantized:
            return LAUNCH_SM90_UNQUANTIZED.get((head_dim, causal), SM90_FALLBACK)
        return LAUNCH_SM90.get((head_dim, causal, pv_fp8), SM90_FALLBACK)
    return DEFAULT_LAUNCH


def band_covering_all(q_len: int, kv_len: int, q_offset: int) -> int:
    """The narrowest diagonal band (in tiles) that covers every (query, key) tile pair:
    one more than the largest |query tile - key tile|, causal or not (tiles of
    absolute positions, floored also below 0)."""
    first_q, last_q = q_offset // TILE, (q_offset + q_len - 1) // TILE
    last_k = (kv_len - 1) // TILE
    return max(last_q, last_k - first_q) + 1


def all_high(q_len: int, kv_len: int, q_offset: int, diag: int) -> bool:
    """True when the diagonal band covers every (query, key) tile pair."""
    return diag >= band_covering_all(q_len, kv_len, q_offset)


def check_extent(kv_len: int, kv_heads: int, head_dim: int) -> None:
    """The key loop indexes one batch item's K/V in int32."""
    if kv_len * kv_heads * head_dim >= 2**31:
        raise ValueError(f"kv_len * kv_heads * head_dim must be < 2^31 per batch item; got "
                         f"{kv_len} * {kv_heads} * {head_dim}")


def query_blocks(q_len: int, q_offset: int, block_m: int) -> tuple[int, int]:
    """(number of query blocks, first query block): blocks of ``block_m`` rows cover
    absolute positions ``[q_offset, q_offset + q_len)``, aligned to multiples of block_m."""
    block0 = q_offset // block_m  # floor, also for negative offsets
    return -(-(q_offset + q_len) // block_m) - block0, block0


def attention_meta(head_dim: int, *, causal: bool, high: str, low: str, native: tuple[bool, bool],
                   has_lo: bool, pv_fp8: bool, f32_inputs: bool, interpret: bool,
                   launch: LaunchConfig) -> dict:
    """Constexpr arguments of ``_dma_attention_kernel``; ``native``: (high, low) tiles.
    ``high="input"``: Q·Kᵀ on the unquantized inputs (``input_attention``)."""
    return dict(
        D=head_dim, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, CAUSAL=causal,
        HI_FMT={"mxfp8_e5m2": "e5m2", "input": "input"}.get(high, "e4m3"),
        LO_NV=low == "nvfp4", NATIVE_HI=native[0], NATIVE_LO=native[1], HAS_LO=has_lo, PV_FP8=pv_fp8,
        # fp32 operands at IEEE precision: for fp32 inputs, and in the interpreter,
        # whose tl.dot reads bf16 tiles as integers.
        DOT_F32=f32_inputs or interpret, FIX_BF16=interpret,
    )


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability kernels on ``device`` compile for; None in the interpreter or off CUDA."""
    if interpreting() or device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def resolve_native(capability: tuple[int, int] | None, low: str, native: bool | None) -> tuple[bool, bool]:
    """(high, low) ``tl.dot_scaled`` switches: forced by ``native``, else by GPU."""
    if native is not None:
        return native, native
    return native_formats(capability, low)


def operands(x8) -> tuple:
    """The nine kernel arguments of one quantized operand; unwritten ones get a
    placeholder pointer (the kernel never reads them)."""
    fields = (x8.hi_codes, x8.hi_scales, x8.lo_codes, x8.lo_scales, x8.lo_token_scale,
              x8.hi_f8, x8.hi_ts, x8.lo_f8, x8.lo_ts)
    spare = next(f for f in fields if f is not None)
    return tuple(spare if f is None else f for f in fields)


def _launch(q_args: tuple, k_args: tuple, v: torch.Tensor, vt, v_scale, *, q_len: int, q_heads: int,
            causal: bool, q_offset: int, diag: int, sink: int, qk_scale: float, launch: LaunchConfig | None,
            **meta) -> torch.Tensor:
    """One launch of ``_dma_attention_kernel``: the nine Q and nine K operand arguments,
    V ``[B, Lk, HKV, D]``; ``meta`` is ``attention_meta``'s without the launch."""
    b, kv_len, hkv, d = v.shape
    check_extent(kv_len, hkv, d)
    pv_fp8 = vt is not None
    capability = torch.cuda.get_device_capability(v.device) if v.is_cuda else None
    launch = launch or launch_config(d, causal, pv_fp8, capability, unquantized=meta["high"] == "input")
    n_m, block0 = query_blocks(q_len, q_offset, launch.block_m)
    out = torch.empty((b, q_len, q_heads, d), dtype=v.dtype, device=v.device)
    _dma_attention_kernel[(n_m, q_heads, b)](
        *q_args, *k_args, v, vt if pv_fp8 else v, v_scale if pv_fp8 else v,
        q_len, kv_len, q_heads, hkv, q_offset, block0, diag, sink, qk_scale, out,
        **attention_meta(d, causal=causal, pv_fp8=pv_fp8, f32_inputs=v.dtype == torch.float32,
                         interpret=interpreting(), launch=launch, **meta),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    return out


def mx_attention(
    q8, k8, v: torch.Tensor, *, q_len: int, causal: bool, q_offset: int, diag: int, sink: int,
    high: str, low: str, native: tuple[bool, bool], has_lo: bool = True, vt: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, launch: LaunchConfig | None = None,
) -> torch.Tensor:
    """Launch the kernel on ``DualQuantized`` Q and K and V ``[B, Lk, HKV, D]``.

    Tiles not in ``native`` read the FP8 copies, which must have been written (K's
    with ``per_tile=True``); ``has_lo=False`` (all pairs high) means the low copies were not.
    ``vt`` / ``v_scale`` (from ``quantize.fp8_transpose``) select the FP8 P·V.
    """
    kv_len = v.shape[1]
    if k8.hi_ts is not None and k8.hi_ts.shape[1] != triton.cdiv(kv_len, TILE):
        raise ValueError(f"K's FP8 copies need one scale per {TILE}-key tile (dual_quantize(..., per_tile=True)); "
                         f"got scales of shape {tuple(k8.hi_ts.shape)} for kv_len {kv_len}")
    hq = q8.hi_ts.shape[2] if q8.hi_ts is not None else q8.hi_codes.shape[2]
    return _launch(operands(q8), operands(k8), v, vt, v_scale, q_len=q_len, q_heads=hq, causal=causal,
                   q_offset=q_offset, diag=diag, sink=sink, qk_scale=1.0, launch=launch,
                   high=high, low=low, native=native, has_lo=has_lo)


def input_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, q_offset: int,
                    qk_scale: float, launch: LaunchConfig | None = None) -> torch.Tensor:
    """The same kernel with Q·Kᵀ on the unquantized inputs (and P·V as in DMA's
    default): a plain flash attention, the baseline that shows what the MX copies
    buy. ``q [B, Lq, HQ, D]``, ``k, v [B, Lk, HKV, D]`` contiguous, one dtype;
    ``qk_scale`` is ``softmax_fold(sm_scale)``."""
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    q_len, kv_len = q.shape[1], k.shape[1]
    return _launch((q,) * 9, (k,) * 9, v, None, None, q_len=q_len, q_heads=q.shape[2], causal=causal,
                   q_offset=q_offset, diag=band_covering_all(q_len, kv_len, q_offset), sink=0,
                   qk_scale=qk_scale, launch=launch, high="input", low="nvfp4", native=(False, False),
                   has_lo=False)
