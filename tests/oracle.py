"""Independent oracles: numpy + ml_dtypes quantization and float64 DMA attention.

Written from docs/design.md's numerics without reusing dma_jax code: element rounding is
ml_dtypes' own cast (round-to-nearest-even), the scale exponent comes from
np.frexp, and attention runs in float64.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

ELEMENT = {
    "mxfp8_e4m3": (ml_dtypes.float8_e4m3fn, 448.0, 8, 32),
    "mxfp8_e5m2": (ml_dtypes.float8_e5m2, 57344.0, 15, 32),
    "mxfp4": (ml_dtypes.float4_e2m1fn, 6.0, 2, 32),
    "nvfp4": (ml_dtypes.float4_e2m1fn, 6.0, 2, 16),
}


# docs/design.md's default block-scale rules.
DEFAULT_RULE = {"mxfp8_e4m3": "up", "mxfp8_e5m2": "up", "mxfp4": "nearest", "nvfp4": "up"}
RULES = {"mxfp8_e4m3": ("up", "floor", "nearest"), "mxfp8_e5m2": ("up", "floor", "nearest"),
         "mxfp4": ("up", "floor", "nearest"), "nvfp4": ("nearest", "up", "floor", "4/6")}


def _flush(x):
    x = np.asarray(x, np.float32)
    return np.where(np.abs(x) < np.float32(2.0**-126), np.copysign(np.float32(0), x), x)


def _cast(values, dtype, vmax):
    """ml_dtypes RTNE cast after saturation; returns (codes uint8, float64 values)."""
    e = np.clip(values, -vmax, vmax).astype(np.float32).astype(dtype)
    return e.view(np.uint8) & (0xF if dtype == ml_dtypes.float4_e2m1fn else 0xFF), e.astype(np.float64)


def bf16(x):
    """``high="bf16"``'s copy: float32 subnormals flushed, ml_dtypes' RTNE cast to
    bfloat16, as float64."""
    return _flush(x).astype(ml_dtypes.bfloat16).astype(np.float64)


def pack(codes):
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


_E4M3_GRID = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)  # 0 .. 448


def _mx_exponent(amax, fmt, rule):
    """E8M0 exponent of blocks with finite amax (zero allowed) under ``rule``."""
    _, vmax, emax, _ = ELEMENT[fmt]
    man = {"mxfp8_e4m3": 3, "mxfp8_e5m2": 2, "mxfp4": 1}[fmt]
    _, ex = np.frexp(amax)
    floor = np.where(amax > 0, ex - 1, -127) - emax
    if rule == "up":
        # the smallest e with amax / 2^e <= vmax: ceil(log2(amax / vmax)), from frexp
        m, ex = np.frexp(np.where(amax > 0, amax / vmax, 1.0))
        e = np.where(amax > 0, np.where(m == 0.5, ex - 1, ex), -127)
    elif rule == "nearest":
        top = np.where(amax > 0, amax / 2.0**floor, 0)  # in [2^emax, 2^(emax + 1))
        rounded = np.round(top / 2.0 ** (emax - man)) * 2.0 ** (emax - man)
        e = floor + (rounded > vmax)
    else:
        e = floor
    return np.clip(e, -127, 127)


def _e4m3_scale(sb_f, rule):
    """An E4M3 block scale for sb_f >= 0: nearest (ml_dtypes), or the smallest E4M3 value
    >= sb_f ("up", at most 448) / the largest <= sb_f ("floor")."""
    codes, sb = _cast(sb_f, ml_dtypes.float8_e4m3fn, 448.0)
    if rule == "up":
        i = np.minimum(np.searchsorted(_E4M3_GRID, sb_f, side="left"), len(_E4M3_GRID) - 1)
        sb = _E4M3_GRID[i]
    elif rule == "floor":
        sb = _E4M3_GRID[np.maximum(np.searchsorted(_E4M3_GRID, sb_f, side="right") - 1, 0)]
    codes = sb.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return codes, sb


def _pairwise_f32(x):
    x = x.astype(np.float32)
    while x.shape[-1] > 1:
        x = (x[..., 0::2] + x[..., 1::2]).astype(np.float32)
    return x[..., 0]


def _nvfp4_blocks(xs, sb, finite, zero, dtype, vmax):
    usable = finite & (sb > 0)
    v = (xs / np.where(usable, sb, 1).astype(np.float32)).astype(np.float32)
    v = np.where(usable, v, zero)
    return _cast(np.where(np.isfinite(v), v, 0), dtype, vmax)


def quantize(x, fmt, rule=None):
    """Return (codes, scales, token_scale or None, dequantized float64). ``rule``: the
    block-scale rule (default: the format's documented default)."""
    dtype, vmax, emax, block = ELEMENT[fmt]
    rule = rule or DEFAULT_RULE[fmt]
    x = _flush(x)
    xb = x.reshape(*x.shape[:-1], -1, block)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if fmt != "nvfp4":
            amax = np.abs(xb).max(-1, keepdims=True)
            finite = np.isfinite(amax)
            e = _mx_exponent(np.where(finite, amax, 0), fmt, rule)
            scaled = np.where(finite, xb.astype(np.float64) / 2.0**e, 0)
            codes, vals = _cast(scaled, dtype, vmax)
            scales = np.where(finite, e + 127, 255).astype(np.uint8)[..., 0]
            scale_vals = np.where(finite, 2.0**e, np.nan)
            deq = vals * scale_vals
            token = None
        else:
            amax_t = np.abs(x).max(-1)
            s2 = (amax_t / np.float32(2688)).astype(np.float32)
            s2 = np.where(s2 < np.float32(2.0**-126), np.float32(1), s2).astype(np.float32)  # flushed: "zero"
            s2b = s2[..., None, None]
            amax_b = np.abs(xb).max(-1, keepdims=True)
            sb_f = (amax_b / (np.float32(6) * s2b)).astype(np.float32)
            sb_f = np.where(np.abs(sb_f) < np.float32(2.0**-126), np.float32(0), sb_f)  # subnormals count as zero
            finite = np.isfinite(sb_f)
            sb_codes, sb = _e4m3_scale(np.where(finite, sb_f, 0), rule)
            xs = (xb / s2b).astype(np.float32)
            zero = np.where(np.isnan(xb), np.float32(0), np.copysign(np.float32(0), xb))
            codes, vals = _nvfp4_blocks(xs, sb, finite, zero, dtype, vmax)
            if rule == "4/6":
                sb4_codes, sb4 = _cast(np.where(finite, (amax_b / (4 * s2b)).astype(np.float32), 0),
                                       ml_dtypes.float8_e4m3fn, 448.0)
                codes4, vals4 = _nvfp4_blocks(xs, sb4, finite, zero, dtype, vmax)
                err6 = _pairwise_f32(np.abs(xs - vals * sb))
                err4 = _pairwise_f32(np.abs(xs - vals4 * sb4))
                four = (err4 < err6)[..., None]
                sb_codes, sb = np.where(four, sb4_codes, sb_codes), np.where(four, sb4, sb)
                codes, vals = np.where(four, codes4, codes), np.where(four, vals4, vals)
            scales = np.where(finite, sb_codes, 0x7F).astype(np.uint8)[..., 0]
            # Dequantize as the numerics say, (e * sb) * s2, in float32 (e * sb is exact).
            deq = (vals * np.where(finite, sb, np.nan)).astype(np.float32) * s2b
            token = s2
    codes = codes.reshape(x.shape)
    if dtype == ml_dtypes.float4_e2m1fn:
        codes = pack(codes)
    return codes, scales, token, deq.reshape(x.shape)


def _e4m3(values):
    return _cast(values, ml_dtypes.float8_e4m3fn, 448.0)[1]


def fp8_per_token(x, fmt, rule=None):
    """(float64 E4M3 values, float64 token scale) of the per-token FP8 copy
    (the sm_90 kernel's operand), built from this module's own quantize."""
    codes, scales, token, deq = quantize(x, fmt, rule)
    block = ELEMENT[fmt][3]
    with np.errstate(invalid="ignore", over="ignore"):
        if fmt != "nvfp4":
            finite = scales != 255
            e = scales.astype(np.int64) - 127
            t = np.maximum(np.where(finite, e, -127).max(-1) + ELEMENT[fmt][2] - 8, -126)
            scale = 2.0 ** t.astype(np.float64)
            blocks = deq.reshape(*deq.shape[:-1], -1, block)
            vals = _e4m3(np.where(finite[..., None], blocks, 0) / scale[..., None, None])
        else:
            finite = scales != 0x7F
            nib = np.stack([codes & 0xF, codes >> 4], -1).reshape(*codes.shape[:-1], -1)
            elem = nib.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
            sb = np.where(finite, scales.view(ml_dtypes.float8_e4m3fn).astype(np.float64), 0)
            blocks = elem.reshape(*elem.shape[:-1], -1, block) * sb[..., None]
            vals = _e4m3(blocks / 8)
            scale = token.astype(np.float64) * 8
        vals = np.where(finite[..., None], vals, 0).reshape(deq.shape)
        scale = np.where(finite.all(-1), scale, np.nan)
    return vals, scale


def fp8_per_tile(x, fmt, tile=128, rule=None):
    """(float64 E4M3 values, float64 scales [B, ceil(L / tile), H]) of K's per-tile FP8
    copy for x [B, L, H, D]: the largest per-token scale of the tile's finite (for
    NVFP4 also non-zero) tokens, every value re-rounded to E4M3 against it."""
    codes, scales, token, deq = quantize(x, fmt, rule)
    _, tok_scale = fp8_per_token(x, fmt, rule)
    b, n, h, d = deq.shape
    finite = np.isfinite(tok_scale)

    def tile_max(key, fill):
        padded = np.concatenate([key, np.full((b, -n % tile, h), fill)], axis=1)
        return padded.reshape(b, -1, tile, h).max(2)

    def per_token(t):
        return np.repeat(t, tile, axis=1)[:, :n]

    with np.errstate(invalid="ignore", over="ignore"):
        if fmt != "nvfp4":
            tile_scale = tile_max(np.where(finite, tok_scale, 2.0**-126), 2.0**-126)
            vals = _e4m3(deq / per_token(tile_scale)[..., None])
        else:
            nonzero = finite & (scales != 0).any(-1)
            s2_max = tile_max(np.where(nonzero, token.astype(np.float64), 0), 0.0)
            s2_max = np.where(s2_max == 0, 1.0, s2_max)
            tile_scale = s2_max * 8
            ratio = (token / per_token(s2_max).astype(np.float32)).astype(np.float32)
            block = ELEMENT[fmt][3]
            nib = np.stack([codes & 0xF, codes >> 4], -1).reshape(b, n, h, d)
            elem = nib.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
            sb = np.where(scales != 0x7F, scales.view(ml_dtypes.float8_e4m3fn).astype(np.float64), 0)
            eighth = (elem.reshape(b, n, h, -1, block) * sb[..., None] / 8).astype(np.float32)
            vals = _e4m3((eighth * ratio[..., None, None]).astype(np.float32)).reshape(b, n, h, d)
        vals = np.where(finite[..., None], vals, np.nan)
    return vals, tile_scale


def fp8_per_channel(x, axis):
    """(float64 E4M3 values, power-of-two scales) with the amax along ``axis``."""
    x = _flush(x).astype(np.float64)
    with np.errstate(invalid="ignore"):
        amax = np.abs(x).max(axis, keepdims=True)
        finite = np.isfinite(amax)
        _, ex = np.frexp(np.where(finite, amax, 0))
        t = np.clip(np.where(amax > 0, ex - 1, -127) - 7, -126, 127)
        vals = np.where(finite, _e4m3(np.where(finite, x, 0) / 2.0**t), 0)
        scale = np.where(finite, 2.0**t, np.nan)
    return vals, np.squeeze(scale, axis)


def is_high(p, t, causal, diag, sink, tile=128):
    tq, tk = p // tile, t // tile
    near = (tq - tk) if causal else np.abs(tq - tk)
    return (tk < sink) | (near < diag)


def sylvester(d):
    """The unnormalised Walsh–Hadamard matrix of order d (Sylvester's construction)."""
    h = np.ones((1, 1))
    while len(h) < d:
        h = np.block([[h, h], [h, -h]])
    return h


def dma_attention(q, k, v, *, causal=True, diag=1, sink=1, high="mxfp8_e4m3",
                  low="nvfp4", smooth_k=True, sm_scale=None, q_offset=None,
                  p_dtype=None, operands="exact", pv="input", high_rule=None, low_rule=None, rotate="hadamard"):
    """Float64 DMA per docs/design.md (pre-processing, pairs, computation); ``diag=None`` means exact (no quantization).

    ``operands="fp8"``: Q·Kᵀ from the FP8 copies (Q per token, K per 128-key tile). ``pv="fp8"``: P·2^8 and V
    (per-channel scale) rounded to E4M3. ``rotate="hadamard"``: Q and K times the Hadamard matrix (in float64, then
    float32), 1/D in the softmax scale. Smooth-K's mean is over the keys whose elements are all finite."""
    q32, k32, v64 = (np.asarray(a, np.float32) for a in (q, k, v))
    v64 = v64.astype(np.float64)
    b, lq, hq, d = q32.shape
    lk, hkv = k32.shape[1], k32.shape[2]
    g = hq // hkv
    off = lk - lq if q_offset is None else q_offset
    scale = d**-0.5 if sm_scale is None else sm_scale
    if diag is None:
        qf = q32.astype(np.float64) * scale * math.log2(math.e)
        kf = k32.astype(np.float64)
        s = np.einsum("bqhgd,bkhd->bhgqk", qf.reshape(b, lq, hkv, g, d), kf)
    else:
        if smooth_k:
            ok = np.isfinite(k32).all(-1, keepdims=True)
            with np.errstate(invalid="ignore"):
                mean = np.where(ok, k32, 0).sum(1, keepdims=True, dtype=np.float64) / np.maximum(ok.sum(1, keepdims=True), 1)
            k32 = (k32 - mean).astype(np.float32)
        fold = scale * math.log2(math.e)
        if rotate == "hadamard":
            with np.errstate(invalid="ignore"):
                q32 = (q32.astype(np.float64) @ sylvester(d)).astype(np.float32)
                k32 = (k32.astype(np.float64) @ sylvester(d)).astype(np.float32)
            fold /= d
        qs = (q32 * np.float32(fold)).astype(np.float32)
        parts = {}
        for fmt, rule in ((high, high_rule), (low, low_rule)):
            if fmt == "bf16":  # exact in both operand modes
                dq, dk = bf16(qs), bf16(k32)
            elif operands == "fp8":
                vals, scale = fp8_per_token(qs, fmt, rule)
                dq = vals * scale[..., None]
                vals, scale = fp8_per_tile(k32, fmt, rule=rule)
                dk = vals * np.repeat(scale, 128, axis=1)[:, :lk, :, None]
            else:
                dq, dk = quantize(qs, fmt, rule)[3], quantize(k32, fmt, rule)[3]
            parts[fmt] = np.einsum("bqhgd,bkhd->bhgqk", dq.reshape(b, lq, hkv, g, d), dk)
        p = (off + np.arange(lq))[:, None]
        t = np.arange(lk)[None, :]
        s = np.where(is_high(p, t, causal, diag, sink), parts[high], parts[low])
    p = (off + np.arange(lq))[:, None]
    t = np.arange(lk)[None, :]
    if causal:
        s = np.where(t <= p, s, -np.inf)
    m = s.max(-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        pr = np.exp2(s - np.where(m == -np.inf, 0, m) + (8 if pv == "fp8" else 0))
    l = pr.sum(-1, keepdims=True)
    if pv == "fp8":
        v8, v_scale = fp8_per_channel(v64, axis=1)
        o = np.einsum("bhgqk,bkhd->bhgqd", _e4m3(pr), v8) * v_scale[:, :, None, None, :]
    else:
        if p_dtype is not None:
            pr = pr.astype(np.float32).astype(p_dtype).astype(np.float64)
        o = np.einsum("bhgqk,bkhd->bhgqd", pr, v64)
    with np.errstate(invalid="ignore", divide="ignore"):
        o = np.where(l == 0, 0, o / l)
    return np.moveaxis(o, 3, 1).reshape(b, lq, hq, d)


def rel_l2(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
