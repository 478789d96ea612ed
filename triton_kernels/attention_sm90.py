"""The DMA prefill kernel for Hopper (sm_90), written in Gluon with FA3's schedule.

Same operands, numerics and outputs as ``attention._dma_attention_kernel`` with P·V
in the input's bf16/fp16: the quantizer's E4M3 copies of Q per token and of K per
128-key tile, and with ``LO_BF16`` NVFP4's exact bf16 copies of ``e · sb`` for the
low tiles (``s2`` per query row and per key column). One program holds 128 query
rows in two consumer warpgroups of 64 rows each plus one loader warpgroup
(``gl.warp_specialize``):

* the loader copies K and V blocks into a ring of shared-memory slots
  with ``cp.async`` and signals each slot on an mbarrier; the consumers give a
  slot back on another once their MMAs have read it;
* each consumer runs Q·Kᵀ → softmax → P·V for its rows, issuing block j's Q·Kᵀ
  together with block j-1's P·V so that the softmax of block j overlaps an MMA
  in flight (FA3's intra-warpgroup pipelining). The two warpgroups are
  independent, so while one runs its softmax (MUFU/FMA pipes) the other's MMAs
  keep the tensor cores busy. (Making them take strict turns issuing MMAs, FA3's
  ping-pong, measured within ±4% either way on an H200: not kept.)

The key range is walked in the runs of tiles of ``attention.key_runs`` (sink,
far, diagonal band, far side), one loop per run whose format is a compile-time
constant: an FP8 and a bf16 ``wgmma`` differ in operand layout, so the low tiles'
bf16 MMAs cannot share a loop body with the high tiles' FP8 ones. The runs take
the blocks that need no mask; the blocks at the causal or kv_len edge (MASK=True)
lie in one key tile and come last, in one loop of that tile's format. The K ring's
slots are sized for the wider copy; an FP8 block uses the front of its slot.

The FP8 P·V (``pv="fp8"``) stays on the Triton kernel, which measured faster there
on an H200, as does head_dim 64 (``target.uses_sm90_kernel``).

Launched through ``plan``; this module holds kernel code only.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                             warpgroup_mma_wait)

from .attention import key_runs
from .geometry import TILE

BLOCK_M = gl.constexpr(128)  # query rows per program: two consumer warpgroups of 64, one tile
_TILE = gl.constexpr(TILE)
CONSUMER_WARPS = gl.constexpr(4)
LOADER_WARPS = gl.constexpr(4)  # a whole warpgroup: 16-byte copies need few registers per thread


@gluon.constexpr_function
def _acc_layout(n, k):
    """The layout of a wgmma accumulator of 64 rows and ``n`` columns (one warpgroup)
    whose instruction takes ``k`` elements of each operand row: 32 bytes, so k names
    the operand type. The registers do not depend on k."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, k])


@gluon.jit
def _is_low(n0, k1, k2, k3, HAS_LO: gl.constexpr):
    if HAS_LO:
        return ((n0 >= k1) & (n0 < k2)) | (n0 >= k3)
    else:
        return n0 < 0


@gluon.jit
def _k_slot(k_smem, slot, LOW: gl.constexpr, LO_BF16: gl.constexpr):
    """Slot ``slot`` of the K ring as the blocks of the ``LOW`` copy use it. With
    ``LO_BF16`` the slots hold bf16 blocks; an E4M3 block takes the front half."""
    k = k_smem.index(slot)
    if LO_BF16 and not LOW:
        k = k._reinterpret(gl.float8e4nv, k.shape,
                           gl.NVMMASharedLayout(swizzle_byte_width=min(k.shape[1], 128), element_bitwidth=8, rank=2))
    return k


@gluon.jit
def _copy_rows(dst, src, n0, Lk, HKV, ROWS: gl.constexpr, D: gl.constexpr, VEC: gl.constexpr,
               WARPS: gl.constexpr):
    """Start copying rows [n0, n0 + ROWS) of a [Lk, HKV, D] slice (``src``: its
    token 0) into ``dst``, VEC elements (16 bytes) per thread and copy; rows past Lk
    are zero-filled. The offsets do not depend on n0, so they stay in registers
    across the loader's loop, shared by copies of one layout."""
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // (D // VEC), D // VEC], [WARPS, 1], [1, 0])
    n = gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    c = gl.arange(0, D, gl.SliceLayout(0, layout))
    offs = (n * HKV)[:, None] * D + c[None, :]
    async_copy.async_copy_global_to_shared(dst, src + n0 * HKV * D + offs, mask=(n0 + n < Lk)[:, None])


@gluon.jit
def _loader(k_smem, kt_smem, v_smem, k_ready, k_free, v_ready, v_free, kh_f8, kl_f8, kl_ts, v_ptr,
            kv_base, Lk, HKV, k1, k2, k3, kend,
            D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_LO: gl.constexpr,
            LO_BF16: gl.constexpr, WARPS: gl.constexpr):
    """Copy K and V blocks [0, kend) into the slot ring, in the consumers' order, and
    with ``LO_BF16`` a low block's per-key scales into ``kt_smem``. Each copy is 16
    bytes per thread (4 for the scales); cp.async's mbarrier arrive fires when this
    thread's copies have landed, so a slot's "ready" barrier counts one arrival per
    loader thread."""
    key_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    keys = gl.arange(0, BLOCK_N, key_layout)
    for n0 in range(0, kend, BLOCK_N):
        j = n0 // BLOCK_N
        slot = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_free.index(slot), phase ^ 1)
        if _is_low(n0, k1, k2, k3, HAS_LO):
            _copy_rows(_k_slot(k_smem, slot, True, LO_BF16), kl_f8 + kv_base * D, n0, Lk, HKV, BLOCK_N, D,
                       8 if LO_BF16 else 16, WARPS)
            if LO_BF16:
                # Staged beside the block, the consumers read their score columns'
                # scales from shared memory instead of 32 scattered global loads.
                async_copy.async_copy_global_to_shared(kt_smem.index(slot), kl_ts + kv_base + (n0 + keys) * HKV,
                                                       mask=n0 + keys < Lk)
        else:
            _copy_rows(_k_slot(k_smem, slot, False, LO_BF16), kh_f8 + kv_base * D, n0, Lk, HKV, BLOCK_N, D, 16,
                       WARPS)
        async_copy.mbarrier_arrive(k_ready.index(slot), increment_count=False)
        mbarrier.wait(v_free.index(slot), phase ^ 1)
        _copy_rows(v_smem.index(slot), v_ptr + kv_base * D, n0, Lk, HKV, BLOCK_N, D, 8, WARPS)
        async_copy.mbarrier_arrive(v_ready.index(slot), increment_count=False)


@gluon.jit
def _issue_qk(q_smem, k_smem, k_ready, n0, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              LOW: gl.constexpr, LO_BF16: gl.constexpr, Q_ROW0: gl.constexpr):
    """Start S = Q·Kᵀ of key block n0 on the tensor cores (not waited for)."""
    j = n0 // BLOCK_N
    slot = j % STAGES
    mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
    fence_async_shared()  # cp.async wrote the slot through the generic proxy; wgmma reads it async
    k = _k_slot(k_smem, slot, LOW, LO_BF16)
    s_zero = gl.zeros([64, BLOCK_N], gl.float32, _acc_layout(BLOCK_N, 256 // k.dtype.primitive_bitwidth))
    return warpgroup_mma(q_smem.slice(Q_ROW0, 64, dim=0), k.permute((1, 0)), s_zero, use_acc=False, is_async=True)


@gluon.jit
def _issue_pv(pa, acc, v_smem, v_ready, j, STAGES: gl.constexpr):
    """Start ``acc += P·V`` of key block j (not waited for)."""
    slot = j % STAGES
    mbarrier.wait(v_ready.index(slot), (j // STAGES) & 1)
    fence_async_shared()
    return warpgroup_mma(pa, v_smem.index(slot), acc, is_async=True)


@gluon.jit
def _finish_pv(pv, pa):
    """Wait for the P·V in flight; P's registers are free after it."""
    pv, pa = warpgroup_mma_wait(num_outstanding=0, deps=(pv, pa))
    return pv


@gluon.jit
def _read_scores(s, k_t_smem, k_free, j, STAGES: gl.constexpr, PER_KEY: gl.constexpr):
    """Block j's scores from the wgmma, in the softmax's layout, with K's per-key
    scales (``PER_KEY``; else 1) read before the slot is given back to the loader."""
    s_layout: gl.constexpr = _acc_layout(s.shape[1], 16)
    s = gl.convert_layout(s, s_layout)  # same registers whatever the MMA's k: nothing moves
    if PER_KEY:
        k_t = k_t_smem.index(j % STAGES).load(gl.SliceLayout(0, s_layout))
    else:
        k_t = 1.0
    mbarrier.arrive(k_free.index(j % STAGES))
    return s, k_t


@gluon.jit
def _softmax(s, k_t, m_i, l_i, n0, q_t, k_ts, kts_base, p, Lk, HKV,
             CAUSAL: gl.constexpr, MASK: gl.constexpr, PER_KEY: gl.constexpr,
             p_dtype: gl.constexpr, p_layout: gl.constexpr):
    """Online-softmax step on the raw scores S of key block n0: (P as the P·V
    operand, new row max, the rescale factor of the running sums, new row sum).
    ``q_t``: Q's scale per row; K's scales are ``k_t`` per key with ``PER_KEY``
    (NVFP4's ``s2``), else one per key tile in ``k_ts``."""
    if PER_KEY:
        # NVFP4's bf16 copies: products of e·sb are exact, the sums fp32; K's s2
        # scales each key's column and Q's s2 is the row factor.
        s = s * k_t[None, :]
        row = q_t
    else:
        # One scale per key tile for K's E4M3 copy; with Q's token scale a row factor.
        row = q_t * gl.load(k_ts + kts_base + (n0 // _TILE) * HKV)
    if MASK:
        # Scale before masking: a zero row factor times -inf would be NaN.
        s = s * row[:, None]
        row = gl.full(m_i.shape, 1.0, gl.float32, m_i.type.layout)
        t = n0 + gl.arange(0, s.shape[1], gl.SliceLayout(0, s.type.layout))
        valid = (t < Lk)[None, :]
        if CAUSAL:
            valid = valid & (t[None, :] <= p[:, None])
        s = gl.where(valid, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * row)
    if MASK:
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    alpha = gl.exp2(m_i - m_safe)
    pr = gl.exp2(s * row[:, None] - m_safe[:, None])
    l_i = l_i * alpha + gl.sum(pr, axis=1)
    return gl.convert_layout(pr.to(p_dtype), p_layout), m_new, alpha, l_i


@gluon.jit
def _first_block(m_i, l_i, q_smem, k_smem, kt_smem, k_ready, k_free, q_t, k_ts, kts_base, p, Lk, HKV,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, LOW: gl.constexpr,
                 LO_BF16: gl.constexpr, HALF_IDX: gl.constexpr, p_dtype: gl.constexpr, p_layout: gl.constexpr):
    """Key block 0 alone (masked: it may hold the causal edge): its P, row max and sum."""
    s = _issue_qk(q_smem, k_smem, k_ready, 0, BLOCK_N, STAGES, LOW, LO_BF16, HALF_IDX * 64)
    s, k_t = _read_scores(warpgroup_mma_wait(num_outstanding=0, deps=(s, )), kt_smem, k_free, 0, STAGES,
                          LOW and LO_BF16)
    pa, m_i, alpha, l_i = _softmax(s, k_t, m_i, l_i, 0, q_t, k_ts, kts_base, p, Lk, HKV, CAUSAL, True,
                                   LOW and LO_BF16, p_dtype, p_layout)
    return pa, m_i, l_i


@gluon.jit
def _consume_run(acc, m_i, l_i, pa, q_smem, k_smem, kt_smem, v_smem, k_ready, k_free, v_ready, v_free,
                 q_t, k_ts, kts_base, p, Lk, HKV, lo, hi,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASK: gl.constexpr,
                 LOW: gl.constexpr, LO_BF16: gl.constexpr, HALF_IDX: gl.constexpr,
                 o_layout: gl.constexpr, p_dtype: gl.constexpr, p_layout: gl.constexpr):
    """Key blocks [lo, hi), lo >= 1, all of one copy, for this warpgroup's 64 rows, in
    FA3's order: block j's Q·Kᵀ and block j-1's P·V go to the tensor cores together,
    and the softmax of block j runs while the P·V is in flight. ``pa`` is block
    lo-1's P."""
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 // BLOCK_N
        s = _issue_qk(q_smem, k_smem, k_ready, n0, BLOCK_N, STAGES, LOW, LO_BF16, HALF_IDX * 64)
        pv = _issue_pv(pa, acc, v_smem, v_ready, j - 1, STAGES)
        s, k_t = _read_scores(warpgroup_mma_wait(num_outstanding=1, deps=(s, )), kt_smem, k_free, j, STAGES,
                              LOW and LO_BF16)
        pa_next, m_i, alpha, l_i = _softmax(s, k_t, m_i, l_i, n0, q_t, k_ts, kts_base, p, Lk, HKV,
                                            CAUSAL, MASK, LOW and LO_BF16, p_dtype, p_layout)
        acc = _finish_pv(pv, pa)
        mbarrier.arrive(v_free.index((j - 1) % STAGES))
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        pa = pa_next
    return acc, m_i, l_i, pa


@gluon.jit
def _consumer(qh_smem, ql_smem, k_smem, kt_smem, v_smem, k_ready, k_free, v_ready, v_free,
              qh_ts, ql_ts, kh_ts, kl_ts, o_ptr,
              b, h, kvh, p0, Lq, Lk, HQ, HKV, q_offset, k1, k2, k3, kend,
              D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              HAS_LO: gl.constexpr, LO_BF16: gl.constexpr, HALF_IDX: gl.constexpr):
    """One warpgroup: 64 query rows from p0 + 64 * HALF_IDX."""
    HALF: gl.constexpr = 64
    s_layout: gl.constexpr = _acc_layout(BLOCK_N, 16)
    o_layout: gl.constexpr = _acc_layout(D, 16)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    p_lo = p0 + HALF_IDX * HALF
    p = p_lo + gl.arange(0, HALF, row_layout)
    r = p - q_offset
    row_ok = (r >= 0) & (r < Lq)
    q_rows = ((b * Lq + r) * HQ + h).to(gl.int64)
    qh_t = gl.load(qh_ts + q_rows, mask=row_ok, other=1.0)
    if HAS_LO:
        ql_t = gl.load(ql_ts + q_rows, mask=row_ok, other=1.0)
    else:
        ql_t = qh_t
    kts_base = (b * gl.cdiv(Lk, _TILE)) * HKV + kvh

    acc = gl.zeros([HALF, D], gl.float32, o_layout)
    m_i = gl.full([HALF], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([HALF], gl.float32, row_layout)
    safe = (Lk // BLOCK_N) * BLOCK_N
    if CAUSAL:
        safe = gl.maximum(gl.minimum(safe, ((p_lo + 1) // BLOCK_N) * BLOCK_N), 0)
    split = gl.maximum(gl.minimum(safe, kend), BLOCK_N)
    # P goes to the P·V from registers, in V's dtype.
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    p_dtype: gl.constexpr = v_smem.dtype
    if kend > 0:  # else no key block: the loader copies nothing, the rows stay empty
        # Block 0 alone; then the unmasked blocks [BLOCK_N, split) run by run (sink
        # high, far low, diagonal band high, far side low), each with the previous
        # block's P·V; then the masked blocks [split, kend) at the kv_len or causal
        # edge; then the last block's P·V. The masked blocks lie in one key tile (the
        # program's rows lie in one tile and BLOCK_N divides it), so in one run.
        if _is_low(0, k1, k2, k3, HAS_LO):
            pa, m_i, l_i = _first_block(m_i, l_i, ql_smem, k_smem, kt_smem, k_ready, k_free, ql_t, kl_ts, kts_base,
                                        p, Lk, HKV, BLOCK_N, STAGES, CAUSAL, HAS_LO, LO_BF16, HALF_IDX,
                                        p_dtype, p_layout)
        else:
            pa, m_i, l_i = _first_block(m_i, l_i, qh_smem, k_smem, kt_smem, k_ready, k_free, qh_t, kh_ts, kts_base,
                                        p, Lk, HKV, BLOCK_N, STAGES, CAUSAL, False, LO_BF16, HALF_IDX,
                                        p_dtype, p_layout)
        if HAS_LO:
            acc, m_i, l_i, pa = _consume_run(acc, m_i, l_i, pa, qh_smem, k_smem, kt_smem, v_smem, k_ready, k_free,
                                             v_ready, v_free, qh_t, kh_ts, kts_base, p, Lk, HKV,
                                             BLOCK_N, gl.minimum(k1, split), BLOCK_N, STAGES, CAUSAL, False, False,
                                             LO_BF16, HALF_IDX, o_layout, p_dtype, p_layout)
            acc, m_i, l_i, pa = _consume_run(acc, m_i, l_i, pa, ql_smem, k_smem, kt_smem, v_smem, k_ready, k_free,
                                             v_ready, v_free, ql_t, kl_ts, kts_base, p, Lk, HKV,
                                             gl.maximum(k1, BLOCK_N), gl.minimum(k2, split), BLOCK_N, STAGES,
                                             CAUSAL, False, True, LO_BF16, HALF_IDX, o_layout, p_dtype, p_layout)
            acc, m_i, l_i, pa = _consume_run(acc, m_i, l_i, pa, qh_smem, k_smem, kt_smem, v_smem, k_ready, k_free,
                                             v_ready, v_free, qh_t, kh_ts, kts_base, p, Lk, HKV,
                                             gl.maximum(k2, BLOCK_N), gl.minimum(k3, split), BLOCK_N, STAGES,
                                             CAUSAL, False, False, LO_BF16, HALF_IDX, o_layout, p_dtype, p_layout)
            if not CAUSAL:
                acc, m_i, l_i, pa = _consume_run(acc, m_i, l_i, pa, ql_smem, k_smem, kt_smem, v_smem, k_ready,
                                                 k_free, v_ready, v_free, ql_t, kl_ts, kts_base, p, Lk, HKV,
                                                 gl.maximum(k3, BLOCK_N), split, BLOCK_N, STAGES, CAUSAL, False,
                                                 True, LO_BF16, HALF_IDX, o_layout, p_dtype, p_layout)
        else:
            acc, m_i, l_i, pa = _consume_run(acc, m_i, l_i, pa, qh_smem, k_smem, kt_smem, v_smem, k_ready, k_free,
                                             v_ready, v_free, qh_t, kh_ts, kts_base, p, Lk, HKV, BLOCK_N, split,
                                             BLOCK_N, STAGES, CAUSAL, False, False, LO_BF16, HALF_IDX,
                                             o_layout, p_dtype, p_layout)
        if _is_low(split, k1, k2, k3, HAS_LO):
            acc, m_i, l_i, pa = _consume_run(acc, m_i, l_i, pa, ql_smem, k_smem, kt_smem, v_smem, k_ready, k_free,
                                             v_ready, v_free, ql_t, kl_ts, kts_base, p, Lk, HKV, split, kend,
                                             BLOCK_N, STAGES, CAUSAL, True, HAS_LO, LO_BF16, HALF_IDX,
                                             o_layout, p_dtype, p_layout)
        else:
            acc, m_i, l_i, pa = _consume_run(acc, m_i, l_i, pa, qh_smem, k_smem, kt_smem, v_smem, k_ready, k_free,
                                             v_ready, v_free, qh_t, kh_ts, kts_base, p, Lk, HKV, split, kend,
                                             BLOCK_N, STAGES, CAUSAL, True, False, LO_BF16, HALF_IDX,
                                             o_layout, p_dtype, p_layout)
        last = kend // BLOCK_N - 1
        pv = _issue_pv(pa, acc, v_smem, v_ready, last, STAGES)
        acc = _finish_pv(pv, pa)
        mbarrier.arrive(v_free.index(last % STAGES))

    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    cols = gl.arange(0, D, gl.SliceLayout(0, o_layout))
    l_o = gl.convert_layout(l_i, o_rows)
    out = gl.where(l_o[:, None] > 0, acc / l_o[:, None], 0.0)
    out = gl.where((l_o != l_o)[:, None], float("nan"), out)  # keep NaN rows NaN
    o_q = gl.convert_layout(q_rows, o_rows)
    o_ok = gl.convert_layout(row_ok, o_rows)
    gl.store(o_ptr + o_q[:, None] * D + cols[None, :], out.to(o_ptr.dtype.element_ty), mask=o_ok[:, None])


@gluon.jit
def _consumer_0(qh_smem, ql_smem, k_smem, kt_smem, v_smem, k_ready, k_free, v_ready, v_free, qh_ts, ql_ts, kh_ts,
                kl_ts, o_ptr, b, h, kvh, p0, Lq, Lk, HQ, HKV, q_offset, k1, k2, k3, kend,
                D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                HAS_LO: gl.constexpr, LO_BF16: gl.constexpr):
    _consumer(qh_smem, ql_smem, k_smem, kt_smem, v_smem, k_ready, k_free, v_ready, v_free, qh_ts, ql_ts, kh_ts,
              kl_ts, o_ptr, b, h, kvh, p0, Lq, Lk, HQ, HKV, q_offset, k1, k2, k3, kend,
              D, BLOCK_N, STAGES, CAUSAL, HAS_LO, LO_BF16, 0)


@gluon.jit
def _consumer_1(qh_smem, ql_smem, k_smem, kt_smem, v_smem, k_ready, k_free, v_ready, v_free, qh_ts, ql_ts, kh_ts,
                kl_ts, o_ptr, b, h, kvh, p0, Lq, Lk, HQ, HKV, q_offset, k1, k2, k3, kend,
                D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                HAS_LO: gl.constexpr, LO_BF16: gl.constexpr):
    _consumer(qh_smem, ql_smem, k_smem, kt_smem, v_smem, k_ready, k_free, v_ready, v_free, qh_ts, ql_ts, kh_ts,
              kl_ts, o_ptr, b, h, kvh, p0, Lq, Lk, HQ, HKV, q_offset, k1, k2, k3, kend,
              D, BLOCK_N, STAGES, CAUSAL, HAS_LO, LO_BF16, 1)


@gluon.jit
def _load_q(smem, ptr, b, h, p0, Lq, HQ, q_offset, D: gl.constexpr):
    """Store the program's BLOCK_M rows of a [B, Lq, HQ, D] Q copy into ``smem``
    (rows outside the query are zeros)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (D // 16), D // 16], [4, 1], [1, 0])
    rows = p0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, layout)) - q_offset
    cols = gl.arange(0, D, gl.SliceLayout(0, layout))
    ok = ((rows >= 0) & (rows < Lq))[:, None]
    offs = ((b * Lq + rows) * HQ + h).to(gl.int64)[:, None] * D + cols[None, :]
    smem.store(gl.load(ptr + offs, mask=ok, other=0.0))


@gluon.jit
def _dma_attention_sm90_kernel(
    qh_f8, qh_ts, ql_f8, ql_ts, kh_f8, kh_ts, kl_f8, kl_ts, v_ptr,
    Lq, Lk, HQ, HKV, q_offset, block0, diag, sink,
    o_ptr,
    D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    HAS_LO: gl.constexpr, LO_BF16: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):
    """Operands as for ``attention._dma_attention_kernel`` (its ``LO_FMT`` "bf16" is
    ``LO_BF16``: ``ql_f8`` and ``kl_f8`` bf16, ``ql_ts`` and ``kl_ts`` per token);
    grid (query blocks of BLOCK_M, HQ, B), 4 warps (the first consumer) plus the workers."""
    if CAUSAL:
        # Longest tiles first across all heads of a batch item, as in
        # attention._dma_attention_kernel (which says why).
        n_m, n_h = gl.num_programs(0), gl.num_programs(1)
        rank = gl.program_id(1) * n_m + gl.program_id(0)
        m = n_m - 1 - rank // n_h
        h = rank % n_h
    else:
        m = gl.program_id(0)
        h = gl.program_id(1)
    b = gl.program_id(2)
    kvh = h // (HQ // HKV)
    p0 = (block0 + m) * BLOCK_M
    k1, k2, k3, kend = key_runs(p0, Lk, sink, diag, CAUSAL, BLOCK_M, BLOCK_N)

    # The E4M3 copies arrive as bytes (uint8 pointers): read them as FP8.
    fp8: gl.constexpr = gl.float8e4nv
    f8_shared: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(D, 128), element_bitwidth=8, rank=2)
    qh_smem = gl.allocate_shared_memory(fp8, [BLOCK_M, D], f8_shared)
    _load_q(qh_smem, qh_f8.to(gl.pointer_type(fp8), bitcast=True), b, h, p0, Lq, HQ, q_offset, D)
    lo_dtype: gl.constexpr = gl.bfloat16 if LO_BF16 else fp8
    if LO_BF16:
        kl_p = kl_f8
        ql_p = ql_f8
    else:
        kl_p = kl_f8.to(gl.pointer_type(fp8), bitcast=True)
        ql_p = ql_f8.to(gl.pointer_type(fp8), bitcast=True)
    lo_shared: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(D * lo_dtype.primitive_bitwidth // 8, 128),
                                                   element_bitwidth=lo_dtype.primitive_bitwidth, rank=2)
    if HAS_LO:
        ql_smem = gl.allocate_shared_memory(lo_dtype, [BLOCK_M, D], lo_shared)
        _load_q(ql_smem, ql_p, b, h, p0, Lq, HQ, q_offset, D)
    else:
        ql_smem = qh_smem
    fence_async_shared()

    # K's ring holds the wider copy's blocks (_k_slot); with LO_BF16 a low block's
    # per-key scales sit beside it in kt_smem (one placeholder float per slot otherwise).
    k_smem = gl.allocate_shared_memory(lo_dtype, [STAGES, BLOCK_N, D], lo_shared)
    kt_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N if LO_BF16 else 1],
                                        gl.SwizzledSharedLayout(1, 1, 1, [0]))
    v_shared: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(2 * D, 128), element_bitwidth=16, rank=2)
    v_smem = gl.allocate_shared_memory(v_ptr.dtype.element_ty, [STAGES, BLOCK_N, D], v_shared)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=32 * LOADER_WARPS)
        mbarrier.init(v_ready.index(i), count=32 * LOADER_WARPS)
        mbarrier.init(k_free.index(i), count=2)
        mbarrier.init(v_free.index(i), count=2)

    kv_base = (b.to(gl.int64) * Lk) * HKV + kvh
    kh_p = kh_f8.to(gl.pointer_type(fp8), bitcast=True)
    gl.warp_specialize([
        (_consumer_0, (qh_smem, ql_smem, k_smem, kt_smem, v_smem, k_ready, k_free, v_ready, v_free, qh_ts, ql_ts,
                       kh_ts, kl_ts, o_ptr, b, h, kvh, p0, Lq, Lk, HQ, HKV, q_offset, k1, k2, k3, kend,
                       D, BLOCK_N, STAGES, CAUSAL, HAS_LO, LO_BF16)),
        (_consumer_1, (qh_smem, ql_smem, k_smem, kt_smem, v_smem, k_ready, k_free, v_ready, v_free, qh_ts, ql_ts,
                       kh_ts, kl_ts, o_ptr, b, h, kvh, p0, Lq, Lk, HQ, HKV, q_offset, k1, k2, k3, kend,
                       D, BLOCK_N, STAGES, CAUSAL, HAS_LO, LO_BF16)),
        (_loader, (k_smem, kt_smem, v_smem, k_ready, k_free, v_ready, v_free, kh_p, kl_p, kl_ts, v_ptr, kv_base,
                   Lk, HKV, k1, k2, k3, kend, D, BLOCK_N, STAGES, HAS_LO, LO_BF16, LOADER_WARPS)),
    ], [CONSUMER_WARPS, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])
