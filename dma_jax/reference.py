"""The jnp oracle of DMA (docs/design.md, "Numerics") and exact float32 attention.

Both work on query chunks under ``lax.map`` so that memory stays bounded by one
chunk's score matrix (``batch * q_heads * chunk * kv_len`` floats), whatever
``q_len`` is: q_len = kv_len = 8192 with 32 heads fits a 24 GB machine.
GQA/MQA groups query heads over their shared kv head inside the einsum, so K
and V are never repeated per query head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from triton_kernels import geometry
from triton_kernels.format_table import BF16
from triton_kernels.query_scale import query_fold, softmax_fold

from .config import DMAConfig
from .formats import (FORMATS, bf16_copy, dequantize, fp8_per_channel, fp8_per_tile, fp8_per_token, quantize,
                      round_to_element)
from .rotation import hadamard
from .validation import check_attention_inputs, resolve_q_offset

__all__ = ["reference_attention", "exact_attention", "pair_is_high", "high_pair_fraction"]

_HIGHEST = jax.lax.Precision.HIGHEST
# Target size of one chunk's score matrix, in float32 elements (128 MiB).
_CHUNK_SCORES = 2**25


def pair_is_high(
    q_pos: jax.Array, k_pos: jax.Array, *, causal: bool, config: DMAConfig
) -> jax.Array:
    """True where the (query position, key position) pair uses the high format
    (``triton_kernels.geometry.pair_is_high`` with ``config``'s band and sinks).

    Positions broadcast against each other; the causal mask is applied elsewhere.
    """
    return geometry.pair_is_high(q_pos, k_pos, causal=causal, diag_tiles=config.diag_tiles,
                                 sink_tiles=config.sink_tiles)


def high_pair_fraction(config: DMAConfig, seq_len: int, *, causal: bool = True) -> float:
    """Fraction of the unmasked (query, key) pairs of a ``seq_len`` self-attention
    that are computed in the high format."""
    pos = np.arange(seq_len)
    high = np.asarray(pair_is_high(jnp.asarray(pos[:, None]), jnp.asarray(pos[None, :]), causal=causal,
                                   config=config))
    valid = pos[None, :] <= pos[:, None] if causal else np.ones_like(high)
    return float((high & valid).sum() / valid.sum())


def _uniform_precision(
    config: DMAConfig, q_len: int, kv_len: int, q_offset: int
) -> str | None:
    """``"high"``/``"low"`` when every pair uses one format, else ``None``."""
    if config.diag_tiles == 0 and config.sink_tiles == 0:
        return "low"
    if geometry.all_high(q_len, kv_len, q_offset, config.diag_tiles):
        return "high"
    return None


def _chunk_size(batch: int, heads: int, q_len: int, kv_len: int) -> int:
    size = _CHUNK_SCORES // max(1, batch * heads * kv_len)
    size = 1 << max(4, min(9, size.bit_length() - 1))
    return min(size, 1 << max(0, (q_len - 1).bit_length()))


def _attend(
    q_hi: jax.Array,
    q_lo: jax.Array | None,
    k_hi: jax.Array,
    k_lo: jax.Array | None,
    v: jax.Array,
    *,
    causal: bool,
    q_offset: int,
    high_fn,
    p_dtype,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """Base-2 softmax attention on prepared float32 operands, chunked over queries.

    ``q_*: [B, Lq, Hq, D]`` already carry the softmax scale times log2(e);
    ``k_*, v: [B, Lk, Hkv, D]``. When ``q_lo`` is given, ``high_fn(q_pos, k_pos)``
    picks per pair between the ``*_hi`` and ``*_lo`` scores. P is rounded to
    ``p_dtype`` before P·V; the normaliser uses the unrounded fp32 P.
    With ``v_scale [B, Hkv, D]`` (FP8 P·V), ``v`` holds E4M3 values, P is computed
    times 2^8 and rounded to E4M3, and the product is scaled back per channel.
    Returns float32 ``[B, Lq, Hq, D]``.
    """
    batch, q_len, q_heads, dim = q_hi.shape
    kv_len, kv_heads = k_hi.shape[1], k_hi.shape[2]
    groups = q_heads // kv_heads
    chunk = _chunk_size(batch, q_heads, q_len, kv_len)
    n_chunks = -(-q_len // chunk)

    def split(x):
        x = jnp.pad(x, ((0, 0), (0, n_chunks * chunk - q_len), (0, 0), (0, 0)))
        x = x.reshape(batch, n_chunks, chunk, kv_heads, groups, dim)
        return jnp.moveaxis(x, 1, 0)

    def scores(qc, kk):
        return jnp.einsum("bqhgd,bkhd->bhgqk", qc, kk, precision=_HIGHEST)

    k_pos = jnp.arange(kv_len)

    def one_chunk(args):
        start, qh, ql = args
        q_pos = (q_offset + start + jnp.arange(chunk))[:, None]
        s = scores(qh, k_hi)
        if ql is not None:
            s = jnp.where(high_fn(q_pos, k_pos[None, :]), s, scores(ql, k_lo))
        if causal:
            s = jnp.where(k_pos[None, :] <= q_pos, s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        # A row without any valid key has m = -inf: keep P = 0 there, not NaN.
        # FP8 P·V: P times 2^8 (at most 256) keeps small probabilities out of
        # E4M3's subnormals; the normaliser carries the same factor.
        p = jnp.exp2(s - jnp.where(m == -jnp.inf, 0.0, m) + (8.0 if v_scale is not None else 0.0))
        l = jnp.sum(p, axis=-1)
        if v_scale is None:
            p = p.astype(p_dtype).astype(jnp.float32)
        else:
            p = round_to_element(p, FORMATS["mxfp8_e4m3"])
        o = jnp.einsum("bhgqk,bkhd->bhgqd", p, v, precision=_HIGHEST)
        if v_scale is not None:
            o = o * v_scale[:, :, None, None, :]
        o = jnp.where(l[..., None] == 0, 0.0, o / l[..., None])
        return jnp.moveaxis(o, (1, 2), (2, 3))  # [B, chunk, Hkv, G, D]

    starts = jnp.arange(n_chunks) * chunk
    q_lo_chunks = None if q_lo is None else split(q_lo)
    out = jax.lax.map(one_chunk, (starts, split(q_hi), q_lo_chunks))
    out = jnp.moveaxis(out, 0, 1).reshape(batch, n_chunks * chunk, q_heads, dim)
    return out[:, :q_len]


OPERANDS = ("exact", "fp8")


def _dequantized(x: jax.Array, fmt: str, rule: str | None, operands: str, key_tile: int | None = None) -> jax.Array:
    """Q (``key_tile=None``) or K ``[B, L, H, D]`` as the kernel's Q·Kᵀ sees it
    (``operands``: "exact" or "fp8", see ``dma_reference``; "bf16" is exact for both)."""
    if fmt == BF16:
        return bf16_copy(x).astype(jnp.float32)
    if operands == "fp8" and key_tile:
        values, scale = fp8_per_tile(quantize(x, fmt, rule), fmt, key_tile, axis=1)
        return values * jnp.repeat(scale, key_tile, axis=1)[:, : x.shape[1], :, None]
    if operands == "fp8":
        values, token = fp8_per_token(quantize(x, fmt, rule), fmt)
        return values * token[..., None]
    return dequantize(quantize(x, fmt, rule), fmt)


def smoothing_mean(k: jax.Array) -> jax.Array:
    """Smooth-K's float32 mean of ``k [B, L, H, D]`` over the tokens whose elements are
    all finite, ``[B, 1, H, D]`` (zero where there are none), so that a non-finite key
    poisons only the query rows that see it."""
    ok = jnp.all(jnp.isfinite(k), axis=-1, keepdims=True)
    total = jnp.sum(jnp.where(ok, k, 0.0), axis=1, keepdims=True)
    return total / jnp.maximum(jnp.sum(ok, axis=1, keepdims=True), 1).astype(jnp.float32)


def scaled_queries(q: jax.Array, config: DMAConfig) -> jax.Array:
    """Q in float32 as its quantization sees it: rotated with ``config.rotate``, times
    the softmax scale and log2(e) (the softmax runs in base 2) and, with the rotation,
    1/head_dim: (q·H)(k·H)ᵀ = D · q·kᵀ, an exact power of two."""
    dim = q.shape[-1]
    rotate = config.rotate == "hadamard"
    q32 = q.astype(jnp.float32)
    if rotate:
        q32 = hadamard(q32)
    return q32 * np.float32(query_fold(config.softmax_scale(dim), dim, rotate))


def dma_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool,
    config: DMAConfig,
    q_offset: int,
    operands: str = "exact",
    k_mean: jax.Array | None = None,
) -> jax.Array:
    """DMA on validated inputs with a resolved ``q_offset`` (the primitive's body).
    ``k_mean [B, 1, HKV, D]``: smooth-K's mean, if not that of ``k``.

    ``operands="fp8"`` computes Q·Kᵀ from the copies that the sm_90 kernel reads:
    E4M3 (Q ``formats.fp8_per_token``, K ``formats.fp8_per_tile``) for MX tiles and,
    with ``config.nvfp4_copy="e4m3"``, NVFP4 tiles; exact values otherwise.
    """
    if operands not in OPERANDS:
        raise ValueError(f"operands must be one of {OPERANDS}; got {operands!r}")
    q_len, kv_len = q.shape[1], k.shape[1]
    k32 = k.astype(jnp.float32)
    if config.smooth_k:
        k32 = k32 - (smoothing_mean(k32) if k_mean is None else k_mean.astype(jnp.float32))
    q32 = scaled_queries(q, config)
    if config.rotate == "hadamard":
        k32 = hadamard(k32)
    hi_rule, lo_rule = config.scale_rules
    # sm_90 multiplies NVFP4 tiles from exact bf16 copies unless told to round them to E4M3.
    lo_operands = "exact" if config.low == "nvfp4" and config.nvfp4_copy == "bf16" else operands

    uniform = _uniform_precision(config, q_len, kv_len, q_offset)
    tile = geometry.TILE
    q_lo: jax.Array | None
    k_lo: jax.Array | None
    if uniform is None:
        q_hi, k_hi = (_dequantized(q32, config.high, hi_rule, operands),
                      _dequantized(k32, config.high, hi_rule, operands, tile))
        q_lo, k_lo = (_dequantized(q32, config.low, lo_rule, lo_operands),
                      _dequantized(k32, config.low, lo_rule, lo_operands, tile))
    else:
        fmt, rule, ops = ((config.high, hi_rule, operands) if uniform == "high"
                          else (config.low, lo_rule, lo_operands))
        q_hi, k_hi = _dequantized(q32, fmt, rule, ops), _dequantized(k32, fmt, rule, ops, tile)
        q_lo = k_lo = None

    def high_fn(q_pos, k_pos):
        return pair_is_high(q_pos, k_pos, causal=causal, config=config)

    v32, v_scale = v.astype(jnp.float32), None
    if config.pv == "fp8":
        v32, v_scale = fp8_per_channel(v, axis=1)
    out = _attend(
        q_hi, q_lo, k_hi, k_lo, v32,
        causal=causal, q_offset=q_offset, high_fn=high_fn, p_dtype=q.dtype, v_scale=v_scale,
    )
    return out.astype(q.dtype)


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    config: DMAConfig | None = None,
    q_offset: int | None = None,
    operands: str = "exact",
    k_mean: jax.Array | None = None,
) -> jax.Array:
    """DMA attention in plain jnp: the numerical oracle of every backend.

    Args:
      q: ``[batch, q_len, q_heads, head_dim]``, bf16/fp16/fp32.
      k, v: ``[batch, kv_len, kv_heads, head_dim]``, same dtype.
      causal: mask keys after each query's position.
      config: :class:`DMAConfig` (default ``DMAConfig()``).
      q_offset: absolute position of query row 0; default ``kv_len - q_len``.
      operands: ``"exact"`` (the MX values themselves, as the numerics define them) or ``"fp8"``
        (the copies that Hopper's tensor cores read: E4M3 with Q's scale per token and
        K's per 128-key tile, exact for MX formats except E4M3 subnormals; NVFP4 tiles
        exact in bf16, or with ``config.nvfp4_copy="e4m3"`` E4M3 within 2^-4 per element).
      k_mean: smooth-K's per-channel mean ``[batch, kv_heads, head_dim]`` to subtract instead
        of the mean of ``k`` (e.g. the mean fixed when a prompt was prefilled, so that the
        cached keys' codes never change as the sequence grows). Any per-channel constant
        leaves the softmax unchanged in exact arithmetic; only the quantization sees it.

    Returns:
      ``[batch, q_len, q_heads, head_dim]`` in the input dtype.
    """
    check_attention_inputs(q, k, v, causal=causal, config=config, q_offset=q_offset)
    config = config or DMAConfig()
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    mean = None
    if k_mean is not None:
        expected = (k.shape[0], k.shape[2], k.shape[3])
        if not config.smooth_k:
            raise ValueError("k_mean is smooth-K's mean: it needs DMAConfig(smooth_k=True)")
        if tuple(getattr(k_mean, "shape", ())) != expected:
            raise ValueError(f"k_mean must have shape [batch, kv_heads, head_dim] = {expected}; "
                             f"got {tuple(getattr(k_mean, 'shape', ()))}")
        mean = jnp.asarray(k_mean, jnp.float32)[:, None]
    if q.shape[0] == 0:
        return jnp.zeros(q.shape, q.dtype)
    offset = resolve_q_offset(q.shape[1], k.shape[1], q_offset)
    return dma_reference(q, k, v, causal=causal, config=config, q_offset=offset, operands=operands, k_mean=mean)


def exact_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    q_offset: int | None = None,
) -> jax.Array:
    """Unquantized attention in float32 (fp32 P, no smoothing) for error measurement.

    Same layout, masking and ``q_offset`` convention as :func:`reference_attention`.
    Returns float32.
    """
    check_attention_inputs(q, k, v, causal=causal, config=None, q_offset=q_offset)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if q.shape[0] == 0:
        return jnp.zeros(q.shape, jnp.float32)
    offset = resolve_q_offset(q.shape[1], k.shape[1], q_offset)
    scale = sm_scale if sm_scale is not None else q.shape[3] ** -0.5
    q32 = q.astype(jnp.float32) * np.float32(softmax_fold(scale))
    return _attend(
        q32, None, k.astype(jnp.float32), None, v.astype(jnp.float32),
        causal=causal, q_offset=offset, high_fn=None, p_dtype=jnp.float32,
    )
