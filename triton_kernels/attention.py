"""The DMA prefill kernel: Q·Kᵀ from MX copies, online base-2 softmax, P·V in
bf16/fp16 (or FP8 with ``pv="fp8"``).

One program per (query block, query head, batch). Query blocks (64 or 128 rows)
lie inside one ``TILE``-token tile of absolute positions, and key blocks inside one
key tile, so every (query block, key block) pair is entirely high or entirely low
precision (docs/design.md, "Which pairs are high precision"). The key range of a
program is cut into at most four consecutive runs of tiles (``key_runs``) — sink
(high), far (low), diagonal band (high), and for non-causal attention the far side
(low) — and each run is a loop whose format is a compile-time constant: no branch
per tile. Each run is split once more into fully valid blocks (no masks) and the
blocks at the causal or kv_len edge (masked).

Q·Kᵀ per format:
* ``NATIVE_HI/LO`` (sm_100+): ``tl.dot_scaled`` on the codes and scale bytes, the
  block-scaled tensor-core MMA (``tcgen05.mma ... block_scale``).
* otherwise (sm_90, Triton's interpreter): the quantizer's E4M3 copies on FP8
  tensor cores, both operands K-major. Q's copy has a scale per token
  (``dma_jax.formats.fp8_per_token``), K's one per key tile (``fp8_per_tile``), so
  each score row is scaled by one number. Decoding 4-bit codes inside the loop
  instead ran 4.3x slower on an H200: the ALU work per K element rivals the MMA.
  E4M3 holds MX values exactly but not NVFP4's ``e · sb`` (up to 6 significant
  bits), so NVFP4 tiles read bf16 copies of ``e · sb`` instead (FMT "bf16", bf16
  tensor cores), with ``s2`` per query row and per key column; the E4M3 rounding
  of NVFP4 is an opt-in (``nvfp4_copy="e4m3"``).
NVFP4's float32 per-token scales multiply the native score tile afterwards.
Format "input" runs the same kernel with Q·Kᵀ on the unquantized inputs: the bf16
baseline the benchmarks compare DMA with.

Inputs are the outputs of ``quantize`` (Q already carries ``sm_scale · log2(e)``;
K is already smoothed). Launched through ``plan``; this module holds kernel code only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .geometry import TILE
from .mx import round_to_bf16, round_to_e4m3_emulated

_TILE = tl.constexpr(TILE)  # the classification tile, readable inside @triton.jit functions


@triton.jit
def _as_fp8(ptr):
    """The E4M3 copies arrive as bytes (torch and jax-triton pass uint8): cast the
    pointer, not the loaded tile. A bitcast between a load and its ``tl.dot`` hides
    the load from Triton's pipeliner (no async copies into shared memory): a plain
    FP8 kernel ran 550 instead of 805 TFLOP/s on an H200 that way."""
    return ptr.to(tl.pointer_type(tl.float8e4nv), bitcast=True)


@triton.jit
def _tile_ptr(ptr, FMT: tl.constexpr):
    """Where Q·Kᵀ operand tiles of format FMT are read: the FP8 copies through an
    FP8 pointer, the unquantized inputs (FMT "input") and NVFP4's bf16 copies (FMT
    "bf16") as they are."""
    if FMT == "input" or FMT == "bf16":
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
            if FMT == "input" or FMT == "bf16":
                # The unquantized baseline: qt is the softmax fold, applied to the
                # fp32 scores rather than rounded into Q. NVFP4's bf16 copies: products
                # of e·sb values are exact, the sums fp32; qt is Q's s2 per row, and
                # K's s2 scales each key's column.
                if DOT_F32:
                    s = tl.dot(qa.to(tl.float32), tl.trans(ka.to(tl.float32)), input_precision="ieee")
                else:
                    s = tl.dot(qa, tl.trans(ka), out_dtype=tl.float32)
                if FMT == "bf16":
                    if MASK:
                        kt = tl.load(k_ts + kv_base + t * HKV, mask=t_ok, other=1.0)
                    else:
                        kt = tl.load(k_ts + kv_base + t * HKV)
                    s = s * kt[None, :]
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
                pr = round_to_e4m3_emulated(pr)
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
def key_runs(p0, Lk, sink, diag, CAUSAL: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The runs of key tiles that query rows [p0, p0 + ROWS) (inside one tile) visit:
    keys [0, k1) sink (high), [k1, k2) low, [k2, k3) diagonal band (high), [k3, kend)
    low (non-causal only); kend is the end of the keys visited, a multiple of BLOCK_N.
    The pair rule of ``geometry.pair_is_high`` as bounds, shared by the Triton and
    the Gluon kernel. Bounds are clamped in tiles first (``diag`` may be 2^30).
    Positions can be negative (q_offset < 0) and integer division truncates, so the
    query tile is floored by hand."""
    tq = tl.where(p0 < 0, -((_TILE - 1 - p0) // _TILE), p0 // _TILE)
    kend = tl.cdiv(Lk, BLOCK_N) * BLOCK_N
    if CAUSAL:
        kend = tl.maximum(tl.minimum(kend, tl.cdiv(p0 + ROWS, BLOCK_N) * BLOCK_N), 0)
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
    return k1, k2, k3, kend


@triton.jit
def _dma_attention_kernel(
    qh_codes, qh_scales, ql_codes, ql_scales, ql_token, qh_f8, qh_ts, ql_f8, ql_ts,
    kh_codes, kh_scales, kl_codes, kl_scales, kl_token, kh_f8, kh_ts, kl_f8, kl_ts,
    v_ptr, vt_ptr, v_scale,
    Lq, Lk, HQ, HKV, q_offset, block0, diag, sink, qk_scale,
    o_ptr,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HI_FMT: tl.constexpr, LO_FMT: tl.constexpr, LO_NV: tl.constexpr, NATIVE_HI: tl.constexpr,
    NATIVE_LO: tl.constexpr, HAS_LO: tl.constexpr, PV_FP8: tl.constexpr, DOT_F32: tl.constexpr,
    FIX_BF16: tl.constexpr,
):
    """q operands [B, Lq, HQ, ·], k operands and v [B, Lk, HKV, ·], o [B, Lq, HQ, D];
    vt [B, HKV, D, Lk rounded up to 16] and v_scale [B, HKV, D] for the FP8 P·V. HAS_LO=False when
    every pair is high precision (the low copies were not written). LO_FMT: "e2m1"
    (native codes, or E4M3 copies) or "bf16" (NVFP4's exact bf16 copies, ``ql_ts`` and
    ``kl_ts`` then per token).

    HI_FMT "input" (with HAS_LO=False) is the unquantized baseline: ``qh_f8`` and
    ``kh_f8`` are Q and K themselves and ``qk_scale`` the softmax fold
    ``sm_scale · log2(e)``, which the quantized paths have already folded into Q."""
    if CAUSAL:
        # Later query blocks see more keys, and programs start in launch order (axis 0
        # fastest): deal the tiles longest first across all heads of a batch item.
        # Longest first within each head (head-major) left the last heads' long tiles
        # running alone at the end: ~5% of an 8k call with 32 heads on 132 SMs, by
        # a list-scheduling model of the launch. attention_sm90 deals them alike.
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
    r = p - q_offset
    row_ok = (r >= 0) & (r < Lq)
    q_rows = ((b * Lq + r) * HQ + h).to(tl.int64)
    qh_a, qh_s, qh_t = _load_operand(qh_codes, qh_scales, ql_token, qh_f8, qh_ts, q_rows, row_ok, D,
                                     HI_FMT, False, NATIVE_HI)
    if HI_FMT == "input":
        qh_t = qk_scale
    if HAS_LO:
        ql_a, ql_s, ql_t = _load_operand(ql_codes, ql_scales, ql_token, ql_f8, ql_ts, q_rows, row_ok, D,
                                         LO_FMT, LO_NV, NATIVE_LO)

    kv_base = (b.to(tl.int64) * Lk) * HKV + kvh
    kts_base = (b * tl.cdiv(Lk, _TILE)) * HKV + kvh
    vt_base = ((b * HKV + kvh).to(tl.int64) * D) * (tl.cdiv(Lk, 16) * 16)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    k1, k2, k3, kend = key_runs(p0, Lk, sink, diag, CAUSAL, BLOCK_M, BLOCK_N)
    safe = (Lk // BLOCK_N) * BLOCK_N  # keys below need no mask
    if CAUSAL:
        safe = tl.maximum(tl.minimum(safe, ((p0 + 1) // BLOCK_N) * BLOCK_N), 0)
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, qh_a, qh_s, qh_t, p, kh_codes, kh_scales, kl_token, kh_f8, kh_ts,
                                 v_ptr, vt_ptr, kv_base, kts_base, vt_base, Lk, HKV, 0, k1, safe, D, BLOCK_N, CAUSAL,
                                 HI_FMT, False, NATIVE_HI, PV_FP8, DOT_F32, FIX_BF16)
    if HAS_LO:
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, ql_a, ql_s, ql_t, p, kl_codes, kl_scales, kl_token, kl_f8,
                                     kl_ts, v_ptr, vt_ptr, kv_base, kts_base, vt_base, Lk, HKV, k1, k2, safe,
                                     D, BLOCK_N, CAUSAL, LO_FMT, LO_NV, NATIVE_LO, PV_FP8, DOT_F32, FIX_BF16)
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, qh_a, qh_s, qh_t, p, kh_codes, kh_scales, kl_token, kh_f8, kh_ts,
                                 v_ptr, vt_ptr, kv_base, kts_base, vt_base, Lk, HKV, k2, k3, safe, D, BLOCK_N, CAUSAL,
                                 HI_FMT, False, NATIVE_HI, PV_FP8, DOT_F32, FIX_BF16)
    if HAS_LO and not CAUSAL:
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, ql_a, ql_s, ql_t, p, kl_codes, kl_scales, kl_token, kl_f8,
                                     kl_ts, v_ptr, vt_ptr, kv_base, kts_base, vt_base, Lk, HKV, k3, kend, safe,
                                     D, BLOCK_N, CAUSAL, LO_FMT, LO_NV, NATIVE_LO, PV_FP8, DOT_F32, FIX_BF16)
    cols = tl.arange(0, D)
    if PV_FP8:
        acc = acc * tl.load(v_scale + (b * HKV + kvh) * D + cols)[None, :]
    # Rows without any valid key have l = 0 and output zeros.
    out = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)
    out = tl.where((l_i != l_i)[:, None], float("nan"), out)  # keep NaN rows NaN
    if FIX_BF16 and o_ptr.dtype.element_ty == tl.bfloat16:
        out = round_to_bf16(out)
    tl.store(o_ptr + q_rows[:, None] * D + cols[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
