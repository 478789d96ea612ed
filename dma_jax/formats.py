"""Microscaling (MX) and NVFP4 quantization in jnp, exactly as docs/design.md defines them.

Every format quantizes along the last axis (head_dim) in blocks (the format table,
``FORMATS``, lives in ``triton_kernels.format_table``, shared with the kernels):

* ``mxfp8_e4m3``, ``mxfp8_e5m2``, ``mxfp4``: blocks of 32 elements share one
  E8M0 (power-of-two) scale ``2^e``. By default ("up") ``e`` is the smallest
  exponent with ``amax / 2^e <= element max``; "floor" is the OCP v1.0 rule
  ``e = floor(log2(amax)) - emax_elem`` and "nearest" lies between
  (``format_table.SCALE_RULES``).
* ``nvfp4``: a float32 scale per token ``s2 = amax_token / 2688``, then blocks of
  16 elements share an E4M3 scale, by default ``RTNE(amax_block / (6 * s2))``
  (other rules: rounded up or down, or "4/6").

Elements are rounded to nearest, ties to even, and saturate at the element
format's largest finite value. The rounding is written with float32 arithmetic
and integer bit manipulation only (no float8 casts of unrepresentable values),
so that the Triton kernel can reproduce it bit for bit.

Conventions beyond the OCP text, shared with the kernels:

* float32 subnormal inputs (``|x| < 2^-126``) are treated as signed zeros: XLA's
  CPU backend flushes them anyway, so we flush them explicitly everywhere.
* A block whose amax is zero gets the smallest scale (E8M0 byte 0; an NVFP4
  block scale of 0) and all-zero elements.
* A block that holds NaN or ±Inf gets the E8M0 NaN scale byte ``0xFF`` (MX) or a
  NaN per-token scale (NVFP4), and zero element codes, so that dequantizing
  gives NaN for the block instead of a silently saturated value.
* E2M1 codes are packed two per byte, element ``2t`` in the low nibble.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from triton_kernels.format_table import E4M3, FORMATS, NVFP4_TOKEN_DIVISOR, VALUE_SCALE_RULE, Format, check_rule
from triton_kernels.geometry import TILE

from .validation import dtype_name, is_array

__all__ = ["FORMATS", "Format", "Quantized", "bf16_copy", "get_format", "quantize", "dequantize", "fp8_per_token",
           "fp8_per_tile", "fp8_per_channel", "quantize_token_e4m3", "dequantize_token_e4m3"]

_MIN_NORMAL_F32 = np.float32(2.0**-126)


class Quantized(NamedTuple):
    """Codes and scales of one quantized tensor ``x`` of shape ``[..., D]``.

    codes: uint8 ``[..., D]`` (8-bit formats) or ``[..., D // 2]`` (4-bit, packed).
    scales: uint8 ``[..., D // block]``: E8M0 bytes (MX) or E4M3 bytes (NVFP4).
    token_scale: float32 ``[...]`` for NVFP4, ``None`` for MX formats.
    """

    codes: jax.Array
    scales: jax.Array
    token_scale: jax.Array | None


def get_format(name: str) -> Format:
    """Look a format up by name, with an error that lists the known names."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown format {name!r}; expected one of {sorted(FORMATS)}"
        ) from None


def _pow2(e: jax.Array) -> jax.Array:
    """Exact float32 ``2**e`` for integer ``e`` in the normal range [-126, 127]."""
    return jax.lax.bitcast_convert_type(
        ((e.astype(jnp.int32) + 127) << 23).astype(jnp.uint32), jnp.float32
    )


def _exponent(a: jax.Array) -> jax.Array:
    """``floor(log2(a))`` for normal positive float32 ``a``; -127 for zero."""
    bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
    return ((bits >> 23) & 0xFF).astype(jnp.int32) - 127


def div_rn(a: jax.Array, b: jax.Array) -> jax.Array:
    """Correctly rounded float32 ``a / b`` with numpy broadcasting.

    XLA's algebraic simplifier rewrites a division by a broadcast (or constant)
    divisor into a multiplication by its reciprocal, and ``(a / b) / c`` into
    ``a / (b * c)``; both are off by one ulp for some inputs. Broadcasting first
    and fencing operands and result with optimization barriers keeps one true
    division, so codes match the kernels and numpy bit for bit.
    """
    a, b = jax.lax.optimization_barrier(jnp.broadcast_arrays(a, b))
    return jax.lax.optimization_barrier(a / b)


def flush_subnormals(x: jax.Array) -> jax.Array:
    """Replace float32 subnormals by zeros of the same sign."""
    return jnp.where(jnp.abs(x) < _MIN_NORMAL_F32, jnp.copysign(0.0, x), x)


def bf16_copy(x: jax.Array) -> jax.Array:
    """``x`` as ``DMAConfig(high="bf16")`` keeps it: float32 subnormals flushed (as
    every format flushes its input), then rounded to the nearest bfloat16 (ties to
    even). Returns bfloat16."""
    return flush_subnormals(jnp.asarray(x).astype(jnp.float32)).astype(jnp.bfloat16)


def round_to_element(v: jax.Array, fmt: Format) -> jax.Array:
    """Round finite float32 ``v`` to the nearest ``fmt`` element value (ties to
    even), saturating at ``±fmt.max_value``. Returns float32."""
    v = jnp.clip(v, -fmt.max_value, fmt.max_value)
    exp = jnp.maximum(_exponent(jnp.abs(v)), fmt.emin)
    quantum = _pow2(exp - fmt.man_bits)
    # v / quantum is exact (a power-of-two scaling); jnp.round is half-to-even.
    return jnp.round(v / quantum) * quantum


def _element_codes(r: jax.Array, fmt: Format) -> jax.Array:
    """Bit patterns (uint8, one per element) of exactly representable values."""
    if not fmt.packed:
        dtype = jnp.float8_e4m3fn if fmt.exp_bits == 4 else jnp.float8_e5m2
        return jax.lax.bitcast_convert_type(r.astype(dtype), jnp.uint8)
    mag = jnp.abs(r)
    # E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 have codes 0..7:
    # code = 2 * mag below 1 (subnormals), else (exponent + 1) * 2 + mantissa bit.
    exp = jnp.maximum(_exponent(mag), 0)
    normal = (exp + 1) * 2 + (mag / _pow2(exp) - 1.0 >= 0.5).astype(jnp.int32)
    code = jnp.where(mag < 1.0, (mag * 2).astype(jnp.int32), normal)
    return (code | (jnp.signbit(r).astype(jnp.int32) << 3)).astype(jnp.uint8)


def _element_values(codes: jax.Array, fmt: Format) -> jax.Array:
    """Float32 values of unpacked element codes."""
    if not fmt.packed:
        dtype = jnp.float8_e4m3fn if fmt.exp_bits == 4 else jnp.float8_e5m2
        return jax.lax.bitcast_convert_type(codes, dtype).astype(jnp.float32)
    table = jnp.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], jnp.float32)
    mag = table[(codes & 7).astype(jnp.int32)]
    return jnp.where((codes & 8) != 0, -mag, mag)


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """Pack 4-bit codes ``[..., D]`` into bytes ``[..., D // 2]``, low nibble first."""
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """Inverse of :func:`pack_nibbles`."""
    pairs = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    return pairs.reshape(*packed.shape[:-1], -1).astype(jnp.uint8)


def _blocks(x: jax.Array, block: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _abs_max(x: jax.Array, axis: int, keepdims: bool = False) -> jax.Array:
    """max |x| along ``axis``, NaN when any element is NaN.

    XLA's CPU max reduction does not reliably propagate NaN, so it is made explicit.
    """
    m = jnp.max(jnp.abs(x), axis=axis, keepdims=keepdims)
    return jnp.where(jnp.any(jnp.isnan(x), axis=axis, keepdims=keepdims), jnp.nan, m)


def round_significand(a: jax.Array, man_bits: int) -> jax.Array:
    """Non-negative float32 ``a`` rounded to ``man_bits`` mantissa bits (ties to even),
    without an exponent bound (``a`` at least 1 or zero)."""
    quantum = _pow2(jnp.maximum(_exponent(a), 0) - man_bits)
    return jnp.round(a / quantum) * quantum


def mx_exponent(amax: jax.Array, fmt: Format, rule: str) -> jax.Array:
    """The E8M0 scale exponent, in [-127, 127], of blocks with finite ``amax >= 0``
    under ``rule`` (``format_table.SCALE_RULES``)."""
    e = jnp.clip(_exponent(amax) - fmt.emax, -127, 127)
    if rule == "floor":
        return e
    # amax / 2^e, exact: -e lies in [-125, 127]. It is below 2^(emax + 1), so one step
    # up always brings it to the element max or below (and e + 1 <= 126).
    top = amax * _pow2(-e)
    if rule == "nearest":
        top = round_significand(top, fmt.man_bits)
    return e + (top > fmt.max_value).astype(jnp.int32)


def _quantize_mx(x: jax.Array, fmt: Format, rule: str) -> tuple[jax.Array, jax.Array]:
    xb = _blocks(x, fmt.block)
    amax = _abs_max(xb, -1, keepdims=True)
    finite = jnp.isfinite(amax)
    e = mx_exponent(jnp.where(finite, amax, 0.0), fmt, rule)
    # Multiply by 2^-e instead of dividing by 2^e: 2^-127 is a float32 subnormal,
    # while -e lies in [-125, 127] and 2^-e is always normal. Both are exact.
    r = round_to_element(jnp.where(finite, xb * _pow2(-e), 0.0), fmt)
    codes = _element_codes(r, fmt)
    scales = jnp.where(finite, e + 127, 255).astype(jnp.uint8)[..., 0]
    return codes.reshape(x.shape), scales


def e4m3_scale(sb_f: jax.Array, rule: str) -> jax.Array:
    """An E4M3 block scale for finite ``sb_f >= 0``: nearest (ties to even, saturating
    at 448), or the neighbour above ("up") or below ("floor") where that misses
    ``sb_f``. Positive E4M3 codes are ordered like their values, so a neighbour is the
    code plus or minus one."""
    sb = round_to_element(sb_f, E4M3)
    if rule in ("nearest", "4/6"):
        return sb
    code = _element_codes(sb, E4M3).astype(jnp.int32)
    if rule == "up":
        code = jnp.where((sb < sb_f) & (code < 0x7E), code + 1, code)
    else:
        code = jnp.where((sb > sb_f) & (code > 0), code - 1, code)
    return _element_values(code.astype(jnp.uint8), E4M3)


def pairwise_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis (a power of two long) as a tree of neighbour pairs: the
    order the kernel uses, so both round alike."""
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def _nvfp4_elements(xs: jax.Array, sb: jax.Array, finite: jax.Array, zero: jax.Array, fmt: Format) -> jax.Array:
    """E2M1 values of blocks ``xs = x / s2`` with block scales ``sb``: ``RTNE(xs / sb)``,
    signed zeros (``zero``) where the scale is zero or the block not ``finite``."""
    usable = finite & (sb > 0)
    v = jnp.where(usable, div_rn(xs, jnp.where(usable, sb, 1.0)), zero)
    return round_to_element(jnp.where(jnp.isfinite(v), v, 0.0), fmt)


def _quantize_nvfp4(
    x: jax.Array, fmt: Format, rule: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    amax_token = _abs_max(x, -1)
    # A token whose scale would be a float32 subnormal (amax < 2688 * 2^-126) counts
    # as all-zero, on every backend (XLA CPU flushes it, GPUs need not).
    s2 = flush_subnormals(div_rn(amax_token, jnp.float32(NVFP4_TOKEN_DIVISOR)))
    s2 = jnp.where(s2 == 0, jnp.float32(1.0), s2)[..., None, None]
    xb = _blocks(x, fmt.block)
    amax_block = _abs_max(xb, -1, keepdims=True)
    # A subnormal quotient counts as zero (as every float32 subnormal here): with any rule
    # its block encodes zeros with a zero scale.
    sb_f = flush_subnormals(div_rn(amax_block, jnp.float32(fmt.max_value) * s2))
    finite = jnp.isfinite(sb_f)
    sb = e4m3_scale(jnp.where(finite, sb_f, 0.0), rule)
    # The elements are encoded with the rounded block scale, as they are decoded.
    # A block with a zero scale encodes signed zeros, like any element that rounds
    # to 0; a NaN element (whose sign bit means nothing) encodes +0.
    zero = jnp.where(jnp.isnan(xb), 0.0, jnp.copysign(0.0, xb))
    xs = div_rn(xb, s2)
    r = _nvfp4_elements(xs, sb, finite, zero, fmt)
    if rule == "4/6":
        # The block maximum mapped to 4 instead of 6: finer steps near the maximum. The
        # error terms |xs - r·sb| are exact (r·sb has 6 significant bits at most).
        sb4 = round_to_element(jnp.where(finite, div_rn(amax_block, 4.0 * s2), 0.0), E4M3)
        r4 = _nvfp4_elements(xs, sb4, finite, zero, fmt)
        four = (pairwise_sum(jnp.abs(xs - r4 * sb4)) < pairwise_sum(jnp.abs(xs - r * sb)))[..., None]
        sb, r = jnp.where(four, sb4, sb), jnp.where(four, r4, r)
    codes = _element_codes(r, fmt).reshape(x.shape)
    sb_codes = jnp.where(finite, _element_codes(sb, E4M3), 0x7F)[..., 0]
    return codes, sb_codes, s2[..., 0, 0]


def quantize(x: jax.Array, fmt: str, rule: str | None = None) -> Quantized:
    """Quantize ``x`` (``[..., D]``, any float dtype) along its last axis.

    ``D`` must be a multiple of the format's block size (32 for MX, 16 for NVFP4).
    ``rule`` picks how block scales are chosen (``FORMATS[fmt].rules``; ``None``: the
    format's ``default_rule``). Every rule gives valid data of the format, decoded
    the same way.
    Returns :class:`Quantized` (uint8 codes, uint8 block scales and, for NVFP4,
    the float32 per-token scale).
    """
    f = get_format(fmt)
    rule = check_rule(f, rule)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize expects a floating-point array; got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] % f.block:
        raise ValueError(
            f"{f.name} quantizes the last axis in blocks of {f.block}; "
            f"got shape {x.shape}"
        )
    return _quantize(x, f, rule)


@partial(jax.jit, static_argnums=(1, 2))
def _quantize(x: jax.Array, f: Format, rule: str) -> Quantized:
    x = flush_subnormals(x.astype(jnp.float32))
    if f.scale == "e8m0":
        codes, scales = _quantize_mx(x, f, rule)
        token_scale = None
    else:
        codes, scales, token_scale = _quantize_nvfp4(x, f, rule)
    if f.packed:
        codes = pack_nibbles(codes)
    return Quantized(codes, scales, token_scale)


def _describe(a) -> str:
    if a is None:
        return "None"
    if not is_array(a):
        return type(a).__name__
    return f"{dtype_name(a)}{list(a.shape)}"


def _has_layout(q: Quantized, f: Format) -> bool:
    codes, scales, token_scale = q
    if not (is_array(codes) and is_array(scales)):
        return False
    if codes.dtype != jnp.uint8 or scales.dtype != jnp.uint8 or codes.ndim < 1:
        return False
    d = codes.shape[-1] * (2 if f.packed else 1)
    if d % f.block or tuple(scales.shape) != (*codes.shape[:-1], d // f.block):
        return False
    if f.scale == "e8m0":
        return token_scale is None
    return (token_scale is not None and token_scale.dtype == jnp.float32
            and tuple(token_scale.shape) == tuple(codes.shape[:-1]))


def _checked(q: Quantized, fmt: str) -> Format:
    """The format of ``fmt`` once ``q`` is known to have its layout (else ValueError)."""
    f = get_format(fmt)
    if not _has_layout(q, f):
        width = "D // 2" if f.packed else "D"
        token = "token_scale None" if f.scale == "e8m0" else "float32 token_scale [...]"
        raise ValueError(
            f"{f.name} expects Quantized(codes uint8 [..., {width}], scales uint8 [..., D // {f.block}], {token}) "
            f"as quantize(x, {f.name!r}) returns; got codes {_describe(q.codes)}, scales {_describe(q.scales)}, "
            f"token_scale {_describe(q.token_scale)}"
        )
    return f


def _token_scale(q: Quantized) -> jax.Array:
    """NVFP4's per-token scale, which ``_checked`` has made sure is there."""
    return cast(jax.Array, q.token_scale)


def dequantize(q: Quantized, fmt: str) -> jax.Array:
    """Float32 values of a :class:`Quantized` tensor, ``[..., D]``.

    ``q`` must have ``fmt``'s layout (as ``quantize(x, fmt)`` returns); a mismatch
    raises ``ValueError``.
    """
    return _dequantize(q, _checked(q, fmt))


@partial(jax.jit, static_argnums=1)
def _dequantize(q: Quantized, f: Format) -> jax.Array:
    codes = unpack_nibbles(q.codes) if f.packed else q.codes
    values = _blocks(_element_values(codes, f), f.block)
    if f.scale == "e8m0":
        # 2^(s - 127) in two normal factors: 2^-127 itself is a float32 subnormal,
        # which XLA flushes, while element x 2^-127 is normal for every nonzero code.
        e = q.scales.astype(jnp.int32) - 127
        low = e < -100
        out = (values * _pow2(jnp.where(low, e + 64, e))[..., None]) * jnp.where(low, 2.0**-64, 1.0)[..., None]
        out = jnp.where((q.scales == 255)[..., None], jnp.nan, out)
    else:
        sb = _element_values(q.scales, E4M3)[..., None]
        out = (values * sb) * _token_scale(q)[..., None, None]
    return out.reshape(*out.shape[:-2], -1)


def fp8_per_token(q: Quantized, fmt: str) -> tuple[jax.Array, jax.Array]:
    """The tensor-core-ready copy of a quantized tensor: E4M3 values and one float32
    scale per token, ``x ≈ values * token_scale[..., None]`` (what the sm_90 kernel reads).

    MX formats: ``token_scale = 2^T`` with ``T = max_b(X_b) + emax - 8`` (at least -126)
    over the token's block exponents ``X_b``, and ``values = RTNEE4M3(e · 2^(X_b - T))``.
    That is exact unless a block lies so far below the token's largest block that its
    elements fall into E4M3's subnormal range (below 2^-6).
    NVFP4: ``token_scale = 8 · s2`` and ``values = RTNEE4M3(e · sb / 8)``. The product
    ``e · sb`` of an E2M1 element and an E4M3 block scale has up to 5 significant bits,
    E4M3 keeps 4, so each element moves by at most 2^-4 of itself (and elements below
    2^-9 · token_scale round to subnormals or zero).
    A token with a non-finite block gets a NaN scale and zero values.
    Returns (float32 values ``[..., D]``, float32 ``token_scale [...]``).
    """
    return _fp8_per_token(q, _checked(q, fmt))


@partial(jax.jit, static_argnums=1)
def _fp8_per_token(q: Quantized, f: Format) -> tuple[jax.Array, jax.Array]:
    codes = unpack_nibbles(q.codes) if f.packed else q.codes
    e = _blocks(_element_values(codes, f), f.block)  # [..., NB, block]
    if f.scale == "e8m0":
        finite = q.scales != 255
        x_b = q.scales.astype(jnp.int32) - 127
        top = jnp.max(jnp.where(finite, x_b, -127), axis=-1, keepdims=True)
        t = jnp.maximum(top + f.emax - 8, -126)
        shift = jnp.maximum(x_b - t, -126)
        values = round_to_element(e * _pow2(shift)[..., None], E4M3)
        token = _pow2(t[..., 0])
    else:
        finite = q.scales != 0x7F
        sb = _element_values(q.scales, E4M3)
        values = round_to_element(e * jnp.where(finite, sb, 0.0)[..., None] * 0.125, E4M3)
        token = _token_scale(q) * 8.0
    values = jnp.where(finite[..., None], values, 0.0)
    token = jnp.where(jnp.all(finite, axis=-1), token, jnp.nan)
    return values.reshape(*values.shape[:-2], -1), token


def fp8_per_tile(q: Quantized, fmt: str, tile: int = TILE, axis: int = 1) -> tuple[jax.Array, jax.Array]:
    """K's tensor-core-ready copy on sm_90: E4M3 values with one float32 scale per
    ``tile`` consecutive tokens along ``axis`` (the last tile may be shorter), so that
    the kernel scales a whole key block by one number instead of every score column.

    The tile scale is the largest per-token scale of :func:`fp8_per_token` over the
    tile's finite tokens (NVFP4: over its finite, non-zero tokens).
    MX formats: ``scale = 2^T`` with ``T`` the largest token ``T`` of the tile, and
    ``values = RTNEE4M3(e · 2^(X_b - T))``: exact unless an element falls below
    E4M3's normal range (rare: the tile's tokens would have to differ by ~2^6 in
    magnitude). NVFP4: ``scale = 8 · s2_max`` and
    ``values = RTNEE4M3((e · sb / 8) · (s2 / s2_max))`` with the ratio rounded to
    float32 first: each element moves by at most 2^-4 of itself, as per token, but
    almost every element is re-rounded.
    A token with a NaN or Inf gets NaN values (its scale is shared), so only the
    scores of that key become NaN.
    ``axis`` is an axis of the token grid (the shape without head_dim), e.g. 1
    for ``[batch, tokens, heads, head_dim]``.
    Returns (float32 values of the quantized tensor's shape, float32 scales of the
    token grid's shape with ``axis`` of length ``ceil(tokens / tile)``).
    """
    f = _checked(q, fmt)
    grid = q.codes.ndim - 1
    if not -grid <= axis < grid or tile < 1:
        raise ValueError(f"axis must index the token grid (ndim {grid}) and tile be >= 1; got axis={axis}, "
                         f"tile={tile}")
    return _fp8_per_tile(q, f, tile, axis % grid)


def _tile_max(x: jax.Array, tile: int, axis: int, fill) -> jax.Array:
    """Max over groups of ``tile`` consecutive entries along ``axis`` (padded with ``fill``)."""
    n = x.shape[axis]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, -n % tile)
    x = jnp.pad(x, pad, constant_values=fill)
    return jnp.max(x.reshape(*x.shape[:axis], -1, tile, *x.shape[axis + 1:]), axis=axis + 1)


def _per_token(x: jax.Array, tile: int, axis: int, n: int) -> jax.Array:
    return jnp.take(jnp.repeat(x, tile, axis=axis), jnp.arange(n), axis=axis)


@partial(jax.jit, static_argnums=(1, 2, 3))
def _fp8_per_tile(q: Quantized, f: Format, tile: int, axis: int) -> tuple[jax.Array, jax.Array]:
    codes = unpack_nibbles(q.codes) if f.packed else q.codes
    e = _blocks(_element_values(codes, f), f.block)  # [..., NB, block]
    n = codes.shape[axis]
    if f.scale == "e8m0":
        finite = q.scales != 255
        token_ok = jnp.all(finite, axis=-1)
        x_b = q.scales.astype(jnp.int32) - 127
        t = jnp.maximum(jnp.max(x_b, axis=-1) + f.emax - 8, -126)
        t_tile = _tile_max(jnp.where(token_ok, t, -126), tile, axis, -126)
        shift = jnp.maximum(x_b - _per_token(t_tile, tile, axis, n)[..., None], -126)
        values = round_to_element(e * _pow2(shift)[..., None], E4M3)
        scale = _pow2(t_tile)
    else:
        finite = q.scales != 0x7F
        token_ok = jnp.all(finite, axis=-1)
        nonzero = token_ok & jnp.any(q.scales != 0, axis=-1)
        s2 = _token_scale(q)
        s2_max = _tile_max(jnp.where(nonzero, s2, 0.0), tile, axis, 0.0)
        s2_max = jnp.where(s2_max == 0, 1.0, s2_max)
        ratio = div_rn(s2, _per_token(s2_max, tile, axis, n))
        sb = _element_values(q.scales, E4M3)
        values = round_to_element((e * (jnp.where(finite, sb, 0.0) * 0.125)[..., None]) * ratio[..., None, None],
                                  E4M3)
        scale = s2_max * 8.0
    values = jnp.where(token_ok[..., None, None], values, jnp.nan)
    return values.reshape(*values.shape[:-2], -1), scale


def fp8_per_channel(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """E4M3 values of ``x`` with one power-of-two scale per channel, the amax taken
    along ``axis`` (V for the optional FP8 P·V, scaled over its tokens).

    ``scale = 2^clip(floor(log2(amax)) - 7, -126, 127)``, so the largest value lands in
    [128, 256) and nothing saturates; ``values = RTNEE4M3(x / scale)``. A channel with
    a NaN or Inf gets a NaN scale and zero values. Returns float32 (values with
    ``x``'s shape, scales with ``axis`` removed).
    """
    x = flush_subnormals(jnp.asarray(x).astype(jnp.float32))
    amax = _abs_max(x, axis, keepdims=True)
    finite = jnp.isfinite(amax)
    t = jnp.clip(_exponent(jnp.where(finite, amax, 0.0)) - 7, -126, 127)
    values = jnp.where(finite, round_to_element(x * _pow2(-t), E4M3), 0.0)
    scale = jnp.where(finite, _pow2(t), jnp.nan)
    return values, jnp.squeeze(scale, axis)


def _token_format(dim: int) -> Format:
    """E4M3 elements in one MX block per token of ``dim`` elements."""
    return dataclasses.replace(E4M3, name="e4m3_per_token", block=dim)


def quantize_token_e4m3(x: jax.Array) -> Quantized:
    """E4M3 elements with one E8M0 scale per token (the whole last axis one MX block,
    scale rule "up": nothing saturates): the FP8 values of a low-bit KV cache.
    Returns ``Quantized(codes uint8 [..., D], scales uint8 [...], None)``; a token with a
    NaN or Inf gets the NaN scale 0xFF and zero codes."""
    x = flush_subnormals(jnp.asarray(x).astype(jnp.float32))
    codes, scales = _quantize_mx(x, _token_format(x.shape[-1]), VALUE_SCALE_RULE)
    return Quantized(codes, scales[..., 0], None)


def dequantize_token_e4m3(q: Quantized) -> jax.Array:
    """Float32 values of :func:`quantize_token_e4m3`'s output, ``[..., D]``."""
    f = _token_format(q.codes.shape[-1])
    return _dequantize(Quantized(q.codes, q.scales[..., None], None), f)
