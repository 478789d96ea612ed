"""The DMA prefill kernel for Hopper (sm_90), written in Gluon with FA3's schedule.

Same operands, numerics and outputs as ``attention._dma_attention_kernel`` on its
FP8 path with P·V in the input's bf16/fp16 (the quantizer's E4M3 copies of Q per
token and of K per 128-key tile), but one program holds 128 query rows in two
consumer warpgroups of 64 rows each plus one loader warpgroup (``gl.warp_specialize``):

* the loader copies K and V blocks into a ring of shared-memory slots
  with ``cp.async`` and signals each slot on an mbarrier; the consumers give a
  slot back on another once their MMAs have read it;
* each consumer runs Q·Kᵀ → softmax → P·V for its rows, issuing block j's Q·Kᵀ
  together with block j-1's P·V so that the softmax of block j overlaps an MMA
  in flight (FA3's intra-warpgroup pipelining). The two warpgroups are
  independent, so while one runs its softmax (MUFU/FMA pipes) the other's MMAs
  keep the tensor cores busy. (Making them take strict turns issuing MMAs, FA3's
  ping-pong, measured within ±4% either way on an H200: not kept.)

Per key block the tile format (high or low copy) is chosen at run time from the
sink / diagonal-band bounds, by indexing a two-slot shared-memory Q buffer, so
the loop is the same for every run of tiles. Masks (causal edge, kv_len) are
only applied in the blocks that need them (a second loop with MASK=True).

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


@gluon.jit
def _is_low(n0, k1, k2, k3, HAS_LO: gl.constexpr):
    if HAS_LO:
        return ((n0 >= k1) & (n0 < k2)) | (n0 >= k3)
    else:
        return n0 < 0


@gluon.jit
def _loader(k_smem, v_smem, k_ready, k_free, v_ready, v_free, kh_f8, kl_f8, v_ptr,
            kv_base, Lk, HKV, k1, k2, k3, kend,
            D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_LO: gl.constexpr,
            WARPS: gl.constexpr):
    """Copy K and V blocks [0, kend) into the slot ring. Each copy is 16
    bytes per thread; cp.async's mbarrier arrive fires when this thread's copies
    have landed, so a slot's "ready" barrier counts one arrival per loader thread."""
    k_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (D // 16), D // 16], [WARPS, 1], [1, 0])
    n_k = gl.arange(0, BLOCK_N, gl.SliceLayout(1, k_layout))
    c_k = gl.arange(0, D, gl.SliceLayout(0, k_layout))
    k_offs = (n_k * HKV)[:, None] * D + c_k[None, :]
    v_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [WARPS, 1], [1, 0])
    n_v = gl.arange(0, BLOCK_N, gl.SliceLayout(1, v_layout))
    c_v = gl.arange(0, D, gl.SliceLayout(0, v_layout))
    v_offs = (n_v * HKV)[:, None] * D + c_v[None, :]
    for n0 in range(0, kend, BLOCK_N):
        j = n0 // BLOCK_N
        slot = j % STAGES
        phase = (j // STAGES) & 1
        k_ok = (n0 + n_k < Lk)[:, None]
        mbarrier.wait(k_free.index(slot), phase ^ 1)
        if _is_low(n0, k1, k2, k3, HAS_LO):
            async_copy.async_copy_global_to_shared(k_smem.index(slot), kl_f8 + (kv_base + n0 * HKV) * D + k_offs,
                                                   mask=k_ok)
        else:
            async_copy.async_copy_global_to_shared(k_smem.index(slot), kh_f8 + (kv_base + n0 * HKV) * D + k_offs,
                                                   mask=k_ok)
        async_copy.mbarrier_arrive(k_ready.index(slot), increment_count=False)
        mbarrier.wait(v_free.index(slot), phase ^ 1)
        async_copy.async_copy_global_to_shared(v_smem.index(slot), v_ptr + (kv_base + n0 * HKV) * D + v_offs,
                                               mask=(n0 + n_v < Lk)[:, None])
        async_copy.mbarrier_arrive(v_ready.index(slot), increment_count=False)


@gluon.jit
def _issue_qk(q_smem, k_smem, k_ready, n0, k1, k2, k3, s_zero,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_LO: gl.constexpr, Q_ROW0: gl.constexpr):
    """Start S = Q·Kᵀ of key block n0 on the tensor cores (not waited for)."""
    j = n0 // BLOCK_N
    slot = j % STAGES
    mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
    fence_async_shared()  # cp.async wrote the slot through the generic proxy; wgmma reads it async
    low = _is_low(n0, k1, k2, k3, HAS_LO)
    qa = q_smem.index(low.to(gl.int32)).slice(Q_ROW0, 64, dim=0)
    return warpgroup_mma(qa, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)


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
def _softmax(s, m_i, l_i, n0, k1, k2, k3, qh_t, ql_t, kh_ts, kl_ts, kts_base, p, Lk, HKV,
             CAUSAL: gl.constexpr, MASK: gl.constexpr, HAS_LO: gl.constexpr,
             p_dtype: gl.constexpr, p_layout: gl.constexpr):
    """Online-softmax step on the raw scores S of key block n0: (P as the P·V
    operand, new row max, the rescale factor of the running sums, new row sum)."""
    # One scale per key tile for K's copy; with Q's token scale a row factor.
    if _is_low(n0, k1, k2, k3, HAS_LO):
        row = ql_t * gl.load(kl_ts + kts_base + (n0 // _TILE) * HKV)
    else:
        row = qh_t * gl.load(kh_ts + kts_base + (n0 // _TILE) * HKV)
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
def _consume_run(acc, m_i, l_i, pa, q_smem, k_smem, v_smem, k_ready, k_free, v_ready, v_free,
                 qh_t, ql_t, kh_ts, kl_ts, kts_base, p, Lk, HKV, k1, k2, k3, lo, hi,
                 D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                 MASK: gl.constexpr, HAS_LO: gl.constexpr, HALF_IDX: gl.constexpr,
                 s_layout: gl.constexpr, o_layout: gl.constexpr, p_dtype: gl.constexpr, p_layout: gl.constexpr):
    """Key blocks [lo, hi), lo >= 1, for this warpgroup's 64 rows, in FA3's order:
    block j's Q·Kᵀ and block j-1's P·V go to the tensor cores together, and the
    softmax of block j runs while the P·V is in flight. ``pa`` is block lo-1's P."""
    s_zero = gl.zeros([64, BLOCK_N], gl.float32, s_layout)
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 // BLOCK_N
        s = _issue_qk(q_smem, k_smem, k_ready, n0, k1, k2, k3, s_zero, BLOCK_N, STAGES, HAS_LO, HALF_IDX * 64)
        pv = _issue_pv(pa, acc, v_smem, v_ready, j - 1, STAGES)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        mbarrier.arrive(k_free.index(j % STAGES))
        pa_next, m_i, alpha, l_i = _softmax(s, m_i, l_i, n0, k1, k2, k3, qh_t, ql_t, kh_ts, kl_ts, kts_base, p,
                                            Lk, HKV, CAUSAL, MASK, HAS_LO, p_dtype, p_layout)
        acc = _finish_pv(pv, pa)
        mbarrier.arrive(v_free.index((j - 1) % STAGES))
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        pa = pa_next
    return acc, m_i, l_i, pa


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, k_ready, k_free, v_ready, v_free,
              qh_ts, ql_ts, kh_ts, kl_ts, o_ptr,
              b, h, kvh, p0, Lq, Lk, HQ, HKV, q_offset, k1, k2, k3, kend,
              D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              HAS_LO: gl.constexpr, HALF_IDX: gl.constexpr):
    """One warpgroup: 64 query rows from p0 + 64 * HALF_IDX."""
    HALF: gl.constexpr = 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
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
    split = gl.minimum(safe, kend)
    # P goes to the P·V from registers, in V's dtype.
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    p_dtype: gl.constexpr = v_smem.dtype
    if kend > 0:  # else no key block: the loader copies nothing, the rows stay empty
        # Block 0 alone (masked: it may hold the causal edge), then blocks 1.. in
        # pairs with the previous block's P·V, then the last block's P·V.
        s = _issue_qk(q_smem, k_smem, k_ready, 0, k1, k2, k3, gl.zeros([HALF, BLOCK_N], gl.float32, s_layout),
                      BLOCK_N, STAGES, HAS_LO, HALF_IDX * HALF)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        mbarrier.arrive(k_free.index(0))
        pa, m_i, alpha, l_i = _softmax(s, m_i, l_i, 0, k1, k2, k3, qh_t, ql_t, kh_ts, kl_ts, kts_base, p, Lk, HKV,
                                       CAUSAL, True, HAS_LO, p_dtype, p_layout)
        acc, m_i, l_i, pa = _consume_run(acc, m_i, l_i, pa, q_smem, k_smem, v_smem, k_ready, k_free, v_ready, v_free,
                                         qh_t, ql_t, kh_ts, kl_ts, kts_base, p, Lk, HKV, k1, k2, k3,
                                         BLOCK_N, split, D, BLOCK_N, STAGES, CAUSAL, False, HAS_LO,
                                         HALF_IDX, s_layout, o_layout, p_dtype, p_layout)
        acc, m_i, l_i, pa = _consume_run(acc, m_i, l_i, pa, q_smem, k_smem, v_smem, k_ready, k_free, v_ready, v_free,
                                         qh_t, ql_t, kh_ts, kl_ts, kts_base, p, Lk, HKV, k1, k2, k3,
                                         gl.maximum(split, BLOCK_N), kend, D, BLOCK_N, STAGES, CAUSAL, True,
                                         HAS_LO, HALF_IDX, s_layout, o_layout, p_dtype, p_layout)
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
def _consumer_0(q_smem, k_smem, v_smem, k_ready, k_free, v_ready, v_free, qh_ts, ql_ts, kh_ts, kl_ts,
                o_ptr, b, h, kvh, p0, Lq, Lk, HQ, HKV, q_offset, k1, k2, k3, kend,
                D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                HAS_LO: gl.constexpr):
    _consumer(q_smem, k_smem, v_smem, k_ready, k_free, v_ready, v_free, qh_ts, ql_ts, kh_ts, kl_ts,
              o_ptr, b, h, kvh, p0, Lq, Lk, HQ, HKV, q_offset, k1, k2, k3, kend,
              D, BLOCK_N, STAGES, CAUSAL, HAS_LO, 0)


@gluon.jit
def _consumer_1(q_smem, k_smem, v_smem, k_ready, k_free, v_ready, v_free, qh_ts, ql_ts, kh_ts, kl_ts,
                o_ptr, b, h, kvh, p0, Lq, Lk, HQ, HKV, q_offset, k1, k2, k3, kend,
                D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                HAS_LO: gl.constexpr):
    _consumer(q_smem, k_smem, v_smem, k_ready, k_free, v_ready, v_free, qh_ts, ql_ts, kh_ts, kl_ts,
              o_ptr, b, h, kvh, p0, Lq, Lk, HQ, HKV, q_offset, k1, k2, k3, kend,
              D, BLOCK_N, STAGES, CAUSAL, HAS_LO, 1)


@gluon.jit
def _dma_attention_sm90_kernel(
    qh_f8, qh_ts, ql_f8, ql_ts, kh_f8, kh_ts, kl_f8, kl_ts, v_ptr,
    Lq, Lk, HQ, HKV, q_offset, block0, diag, sink,
    o_ptr,
    D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    HAS_LO: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):
    """Operands as for ``attention._dma_attention_kernel``'s FP8 path; grid
    (query blocks of BLOCK_M, HQ, B), 4 warps (the first consumer) plus the workers."""
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

    # Both Q copies of the program's rows, [copy, row, D], copy 1 the low one.
    q_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (D // 16), D // 16], [4, 1], [1, 0])
    q_shared: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(D, 128), element_bitwidth=8, rank=2)
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_M, D], q_shared)
    rows = p0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, q_layout)) - q_offset
    cols = gl.arange(0, D, gl.SliceLayout(0, q_layout))
    q_ok = ((rows >= 0) & (rows < Lq))[:, None]
    q_offs = ((b * Lq + rows) * HQ + h).to(gl.int64)[:, None] * D + cols[None, :]
    qh_p = qh_f8.to(gl.pointer_type(gl.float8e4nv), bitcast=True)
    q_smem.index(0).store(gl.load(qh_p + q_offs, mask=q_ok, other=0.0))
    if HAS_LO:
        ql_p = ql_f8.to(gl.pointer_type(gl.float8e4nv), bitcast=True)
        q_smem.index(1).store(gl.load(ql_p + q_offs, mask=q_ok, other=0.0))
    fence_async_shared()

    k_shared: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(D, 128), element_bitwidth=8, rank=2)
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, D], k_shared)
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
    kh_p = kh_f8.to(gl.pointer_type(gl.float8e4nv), bitcast=True)
    kl_p = kl_f8.to(gl.pointer_type(gl.float8e4nv), bitcast=True)
    gl.warp_specialize([
        (_consumer_0, (q_smem, k_smem, v_smem, k_ready, k_free, v_ready, v_free, qh_ts, ql_ts, kh_ts, kl_ts,
                       o_ptr, b, h, kvh, p0, Lq, Lk, HQ, HKV, q_offset, k1, k2, k3, kend,
                       D, BLOCK_N, STAGES, CAUSAL, HAS_LO)),
        (_consumer_1, (q_smem, k_smem, v_smem, k_ready, k_free, v_ready, v_free, qh_ts, ql_ts, kh_ts, kl_ts,
                       o_ptr, b, h, kvh, p0, Lq, Lk, HQ, HKV, q_offset, k1, k2, k3, kend,
                       D, BLOCK_N, STAGES, CAUSAL, HAS_LO)),
        (_loader, (k_smem, v_smem, k_ready, k_free, v_ready, v_free, kh_p, kl_p, v_ptr, kv_base,
                   Lk, HKV, k1, k2, k3, kend, D, BLOCK_N, STAGES, HAS_LO, LOADER_WARPS)),
    ], [CONSUMER_WARPS, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])
