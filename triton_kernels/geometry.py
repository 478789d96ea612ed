"""Tile geometry: the classification tile, which (query, key) pairs are high precision,
and the index arithmetic that launches share. Plain Python (no Triton, no JAX, no
torch): the jnp reference, the launch plan and the tests read it.
"""

from __future__ import annotations

__all__ = ["CACHE_FIELDS", "TILE", "all_high", "band_covering_all", "cache_slot", "cache_slots", "check_extent",
           "padded_length", "pair_is_high", "query_blocks"]

# Tokens per tile of the high/low classification. The kernels' query and key blocks
# divide it, so a block pair is entirely high or entirely low precision; K's FP8 copy
# on Hopper carries one scale per tile.
TILE = 128


def pair_is_high(q_pos, k_pos, *, causal: bool, diag_tiles: int, sink_tiles: int):
    """True where the (query position, key position) pair uses the high format: its key
    tile is a sink tile or lies within ``diag_tiles`` tiles of the query's (causal: at
    or before it). Positions are absolute and broadcast against each other (ints, numpy
    or jnp arrays: operators only); floor division keeps negative positions in the
    right tile. The causal mask itself is applied elsewhere."""
    tq, tk = q_pos // TILE, k_pos // TILE
    near = (tq - tk) if causal else abs(tq - tk)
    return (tk < sink_tiles) | (near < diag_tiles)


def band_covering_all(q_len: int, kv_len: int, q_offset: int) -> int:
    """The narrowest diagonal band (in tiles) that covers every (query, key) tile pair:
    one more than the largest |query tile - key tile|, causal or not."""
    first_q, last_q = q_offset // TILE, (q_offset + q_len - 1) // TILE
    last_k = (kv_len - 1) // TILE
    return max(last_q, last_k - first_q) + 1


def all_high(q_len: int, kv_len: int, q_offset: int, diag_tiles: int) -> bool:
    """True when the diagonal band covers every (query, key) tile pair (no low copies
    are needed)."""
    return diag_tiles >= band_covering_all(q_len, kv_len, q_offset)


def query_blocks(q_len: int, q_offset: int, block_m: int) -> tuple[int, int]:
    """(number of query blocks, first query block): blocks of ``block_m`` rows cover
    absolute positions ``[q_offset, q_offset + q_len)``, aligned to multiples of
    ``block_m`` (which divides TILE), so a block never straddles two tiles."""
    block0 = q_offset // block_m  # floor, also for negative offsets
    return -(-(q_offset + q_len) // block_m) - block0, block0


def check_extent(kv_len: int, kv_heads: int, head_dim: int) -> None:
    """The key loop indexes one batch item's K/V in int32."""
    if kv_len * kv_heads * head_dim >= 2**31:
        raise ValueError(f"kv_len * kv_heads * head_dim must be < 2^31 per batch item; got "
                         f"{kv_len} * {kv_heads} * {head_dim}")


def padded_length(length: int) -> int:
    """The row length of V's transposed FP8 copy: a multiple of 16 bytes, so that every
    row starts 16-byte aligned and loads vectorize."""
    return -(-length // 16) * 16


# The arrays of a low-bit KV cache (``dma_jax.kv_cache.LowBitKVCache``), in the order the
# decode launch takes them: the low copy of every key (codes, block scales, NVFP4's
# per-token scale), the high copy of the sink and band keys (``cache_slots``), V (input
# dtype, or E4M3 codes with one E8M0 scale per token) and each row's filled length.
CACHE_FIELDS = ("lo_codes", "lo_scales", "lo_token", "hi_codes", "hi_scales", "v", "v_scale", "length")


def cache_slots(capacity: int, sink_tiles: int, diag_tiles: int) -> tuple[int, int]:
    """(sink_len, ring_len) of a decode cache's high-precision key copies for
    ``capacity`` positions: the first ``sink_len`` positions keep their slot, every later
    position ``p`` goes to slot ``sink_len + p % ring_len``. The ring holds
    ``diag_tiles + 1`` tiles: the band of any query row, also while up to ``TILE`` new
    rows cross into the next tile. When sinks and ring would cover the capacity, every
    position keeps its own slot: (0, capacity)."""
    sink, ring = sink_tiles * TILE, (diag_tiles + 1) * TILE
    if sink + ring >= capacity:
        return 0, capacity
    return sink, ring


def cache_slot(pos, sink_len: int, ring_len: int):
    """The slot of absolute position ``pos`` among a decode cache's high copies
    (``cache_slots``); operators only, for ints, numpy and jnp arrays."""
    return (pos < sink_len) * pos + (pos >= sink_len) * (sink_len + pos % ring_len)
