"""The launches a call makes: kernel, grid, arguments, constexprs and outputs, decided
once for both executors (``dma_jax.executor`` through jax-triton, ``torch_executor``
on torch tensors). Imports Triton (for the kernel objects), never JAX or torch.

A plan names its buffers: the call's inputs (``"q"``, ``"k"``, ``"v"``, ``"x"``) and
the outputs of its launches (``"q.hi_f8"``, ``"k_sums"``, ...). A launch's arguments
are buffer names or typed scalars; its outputs are allocated by the executor and
appended to the arguments (the order jax-triton uses, which the kernels follow:
inputs and scalars, then outputs, then constexprs). An output a launch does not
write is a one-element placeholder that the kernels never touch. An output that
``updates`` an input is that input's memory, written in place (jax-triton's
input-output aliases; the same tensor in torch): the kernel gets it twice, as the
input and as the output, and writes only the output.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from . import attention as attn
from . import attention_sm90 as attn90
from . import cache_append as append
from . import decode as dec
from . import quantize as quant
from . import tuning
from .format_table import BF16, BF16_EXP_BITS, BF16_MAX, E4M3, FORMATS, VALUE_SCALE_RULE, check_rule
from .geometry import CACHE_FIELDS, TILE, all_high, band_covering_all, check_extent, padded_length, query_blocks
from .query_scale import query_fold, softmax_fold
from .target import Target, resolve_native, uses_sm90_kernel

__all__ = ["Buffer", "Launch", "OPERAND_FIELDS", "Plan", "Scalar", "attention_plan", "cache_append_plan",
           "channel_mean_plan", "decode_plan", "fp8_transpose_plan", "input_attention_plan", "quantize_plan"]

# The nine outputs of a dual quantization, as the attention kernels take them per operand.
OPERAND_FIELDS = ("hi_codes", "hi_scales", "lo_codes", "lo_scales", "lo_token_scale", "hi_f8", "hi_ts", "lo_f8", "lo_ts")


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A named array: ``dtype`` is a numpy-style name ("uint8", "float32", "bfloat16")."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    written: bool = True  # False: a one-element placeholder the kernel never touches
    updates: str | None = None  # an output that is this input's memory, updated in place


@dataclasses.dataclass(frozen=True)
class Scalar:
    """A scalar kernel argument: ``dtype`` "i32" or "fp32" (rounded to float32)."""

    value: int | float
    dtype: str


def _i32(value: int) -> Scalar:
    return Scalar(int(value), "i32")


def _f32(value: float) -> Scalar:
    return Scalar(float(np.float32(value)), "fp32")


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch: ``kernel[grid](*args, *outputs, **constexprs)``."""

    kernel: Any  # a triton.jit or gluon.jit function
    grid: tuple[int, int, int]
    args: tuple[str | Scalar, ...]
    outputs: tuple[Buffer, ...]
    constexprs: tuple[tuple[str, Any], ...]
    num_warps: int = 4
    num_stages: int = 3
    gluon: bool = False

    @property
    def meta(self) -> dict[str, Any]:
        return dict(self.constexprs)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Launches in order; ``result`` names the buffer the call returns."""

    launches: tuple[Launch, ...]
    result: str

    def buffer(self, name: str) -> Buffer:
        """The output buffer called ``name``."""
        return next(o for launch in self.launches for o in launch.outputs if o.name == name)


def _meta(**constexprs: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(constexprs.items())


def ftz_multiplier(f: float) -> bool:
    """Whether ``mx.mul_flushed`` may multiply by float32 ``f`` with ``mul.ftz``: f is
    zero or a normal float of magnitude at most 1 (a subnormal f would be flushed too,
    and |f| > 1 can lift a subnormal x into the normal range)."""
    a = abs(float(np.float32(f)))
    return a == 0.0 or 2.0**-126 <= a <= 1.0


# -- channel reductions ---------------------------------------------------------------

def _channel_reduce(x: Buffer, out: str, *, amax: bool, chunk: int | None = None) -> Launch:
    """Partial sums over the finite tokens of ``x [B, L, H, D]`` (or abs-maxima over all)
    over chunks of tokens, into ``out [n_chunks, B, H, D]``, and for sums the counts of
    those tokens into ``{out}_count [n_chunks, B, H]``."""
    b, length, h, d = x.shape
    chunk = tuning.mean_chunk(x.shape) if chunk is None else chunk
    n_chunks = -(-length // chunk)
    counts = (n_chunks, b, h) if not amax else (1,)
    return Launch(quant._channel_reduce_kernel, (n_chunks, h, b), (x.name, _i32(length), _i32(h), _i32(chunk)),
                  (Buffer(out, (n_chunks, b, h, d), "float32"), Buffer(f"{out}_count", counts, "float32", not amax)),
                  _meta(D=d, BLOCK_T=tuning.MEAN_BLOCK_T, AMAX=amax))


def channel_mean_plan(x: Buffer, *, chunk: int | None = None) -> Plan:
    """Smooth-K's float32 mean of ``x [B, L, H, D]`` over the tokens whose elements are
    all finite, ``[B, H, D]`` (zero where none is): partial sums and counts, then their
    totals in chunk order (the bits that a smoothed quantize launch forms)."""
    b, length, h, d = x.shape
    sums = _channel_reduce(x, "sums", amax=False, chunk=chunk)
    n_chunks = sums.grid[0]
    total = Launch(quant._channel_mean_kernel, (h, b, 1), ("sums", "sums_count", _i32(h), _i32(n_chunks)),
                   (Buffer("mean", (b, h, d), "float32"),), _meta(D=d))
    return Plan((sums, total), "mean")


def fp8_transpose_plan(v: Buffer, target: Target, prefix: str = "") -> Plan:
    """V for the FP8 P·V: its per-channel amax partials, then E4M3 bytes transposed to
    ``[B, H, D, padded_length(L)]`` (``{prefix}vt``) with float32 per-channel scales
    ``[B, H, D]`` (``{prefix}v_scale``)."""
    b, length, h, d = v.shape
    amax = _channel_reduce(v, f"{prefix}v_amax", amax=True)
    transpose = Launch(
        quant._fp8_transpose_kernel, (-(-length // tuning.TRANSPOSE_BLOCK_T), h, b),
        (v.name, f"{prefix}v_amax", _i32(length), _i32(h), _i32(amax.grid[0])),
        (Buffer(f"{prefix}vt", (b, h, d, padded_length(length)), "uint8"),
         Buffer(f"{prefix}v_scale", (b, h, d), "float32")),
        _meta(D=d, BLOCK_T=tuning.TRANSPOSE_BLOCK_T, HW_CVT=not target.interpret))
    return Plan((amax, transpose), f"{prefix}vt")


# -- dual quantization ----------------------------------------------------------------

def _high_meta(high: str, rule: str | None) -> dict[str, Any]:
    """The HI_* constexprs of the high format ``high`` with block-scale ``rule``.
    ``"bf16"`` (no block scales, no rule) is HI_E = 8, bf16's exponent bits: the
    kernels store and read its values unscaled, and no other HI_* is read."""
    if high == BF16:
        if rule is not None:
            raise ValueError(f"high='bf16' has no block scales; got high_rule={rule!r}")
        return dict(HI_E=BF16_EXP_BITS, HI_M=7, HI_EMIN=-126, HI_EMAX=127, HI_MAX=BF16_MAX, HI_BLOCK=32,
                    HI_RULE="none")
    hi = FORMATS[high]
    return dict(HI_E=hi.exp_bits, HI_M=hi.man_bits, HI_EMIN=hi.emin, HI_EMAX=hi.emax, HI_MAX=hi.max_value,
                HI_BLOCK=hi.block, HI_RULE=check_rule(hi, rule))


def _quantize_outputs(prefix: str, shape: tuple[int, ...], high: str, low: str, *, codes: bool, fp8: bool,
                      write_lo: bool, per_tile: bool, lo_bf16: bool) -> tuple[Buffer, ...]:
    """The nine outputs (``OPERAND_FIELDS``): codes, scales and NVFP4's per-token
    scale for ``tl.dot_scaled``; the E4M3 copies with their float32 scales, per token
    ``[B, L, H]`` or with ``per_tile`` per ``TILE`` tokens ``[B, cdiv(L, TILE), H]``.
    With ``lo_bf16`` the low copy (``lo_f8``, ``lo_ts``) is NVFP4's exact bf16 ``e · sb``
    with ``s2`` per token."""
    b, length, h, d = shape
    ts = (b, -(-length // TILE) if per_tile else length, h)
    lo_ts = (b, length, h) if lo_bf16 else ts
    lo_codes, lo_fp8 = codes and write_lo, fp8 and write_lo
    bf16_high = high == BF16
    specs = (
        ((b, length, h, d), "bfloat16" if bf16_high else "uint8", codes),
        ((b, length, h, d // (32 if bf16_high else FORMATS[high].block)), "uint8", codes and not bf16_high),
        ((b, length, h, d // 2), "uint8", lo_codes),
        ((b, length, h, d // FORMATS[low].block), "uint8", lo_codes),
        ((b, length, h), "float32", lo_codes and low == "nvfp4"),
        ((b, length, h, d), "uint8", fp8),
        (ts, "float32", fp8),
        ((b, length, h, d), "bfloat16" if lo_bf16 else "uint8", lo_fp8),
        (lo_ts, "float32", lo_fp8),
    )
    return tuple(Buffer(f"{prefix}.{field}", s if w else (1,), t, w)
                 for field, (s, t, w) in zip(OPERAND_FIELDS, specs))


def _quantize(x: Buffer, prefix: str, target: Target, *, high: str, low: str, fold: float = 1.0,
              mean: tuple[str, str | None, int] | None = None, codes: bool = True, fp8: bool = False,
              write_lo: bool = True, per_tile: bool = False, tile_t: int | None = None,
              high_rule: str | None = None, low_rule: str | None = None, rotate: bool = False,
              lo_bf16: bool = False, block_t: int = tuning.QUANTIZE_BLOCK_T,
              num_warps: int = tuning.QUANTIZE_WARPS) -> Launch:
    """The dual quantization of ``(x - mean)``, rotated with ``rotate``, times ``fold``
    into ``high`` and ``low`` with the block-scale rules ``high_rule`` and ``low_rule``
    (``None``: the formats' defaults). ``mean``: (buffer of partial sums
    ``[n, B, H, D]``, buffer of their token counts ``[n, B, H]`` or None for one token
    each, n) for smooth-K. ``lo_bf16`` (NVFP4 low, with ``fp8``): the low copy in bf16
    with per-token scales, the exact operands of Hopper's NVFP4 tiles."""
    if per_tile and not fp8:
        raise ValueError("per_tile scales belong to the FP8 copies: it needs fp8=True")
    if lo_bf16 and (low != "nvfp4" or not fp8):
        raise ValueError(f"lo_bf16 is NVFP4's exact copy: it needs low='nvfp4' and fp8=True; got low={low!r}, "
                         f"fp8={fp8}")
    if high == BF16 and fp8:
        raise ValueError("high='bf16' is a decode cache's format: its quantize launch writes codes only (fp8=False)")
    b, length, h, d = x.shape
    tile_t = tuning.k_tile_tokens(x.shape) if tile_t is None else tile_t
    if per_tile and (TILE % tile_t or tile_t % block_t):
        raise ValueError(f"per_tile programs take a multiple of block_t={block_t} tokens that divides {TILE}, "
                         f"got tile_t={tile_t}")
    lo = FORMATS[low]
    low_rule = check_rule(lo, low_rule)
    if rotate and x.shape[3] & (x.shape[3] - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head_dim; got {x.shape[3]}")
    if mean is None:
        shift: tuple[str | Scalar, ...] = (x.name, x.name, _i32(1), _i32(1))
    else:
        shift = (mean[0], mean[1] or mean[0], _i32(mean[2]), _i32(1))
    step = tile_t if per_tile else block_t
    return Launch(
        quant._dual_quantize_kernel, (-(-length // step), h, b),
        (x.name, *shift, _f32(fold), _i32(length), _i32(h)),
        _quantize_outputs(prefix, x.shape, high, low, codes=codes, fp8=fp8, write_lo=write_lo, per_tile=per_tile,
                          lo_bf16=lo_bf16),
        _meta(D=d, BLOCK_T=block_t, SMOOTH=mean is not None, COUNTED=mean is not None and mean[1] is not None,
              ROTATE=rotate, WRITE_CODES=codes, WRITE_FP8=fp8,
              WRITE_LO=write_lo, **_high_meta(high, high_rule), LO_E=lo.exp_bits, LO_M=lo.man_bits,
              LO_EMIN=lo.emin, LO_EMAX=lo.emax, LO_MAX=lo.max_value, LO_BLOCK=lo.block, LO_NVFP4=low == "nvfp4",
              LO_RULE=low_rule, TILE_T=step, PER_TILE=per_tile,
              HW_CVT=not target.interpret, FTZ_FOLD=ftz_multiplier(fold), LO_BF16=lo_bf16),
        num_warps=num_warps)


def quantize_plan(x: Buffer, target: Target, *, smooth: bool | str = False, chunk: int | None = None,
                  **options: Any) -> Plan:
    """A quantize-only call on ``x [B, L, H, D]``: its dual quantization (outputs
    ``x.{field}``), after smooth-K's partial sums when ``smooth`` is True. ``smooth``
    may instead name a float32 mean ``[B, H, D]`` among the call's inputs, taken as
    one partial of one token. Smooth-K's mean is over the tokens with finite elements. ``options`` as for the quantize launch (``high``,
    ``low``, ``fold``, ``codes``, ``fp8``, ``write_lo``, ``per_tile``, ``tile_t``,
    ``high_rule``, ``low_rule``, ``rotate``, ``block_t``, ``num_warps``)."""
    options.setdefault("high", "mxfp8_e4m3")
    options.setdefault("low", "nvfp4")
    launches: tuple[Launch, ...] = ()
    mean: tuple[str, str | None, int] | None = None
    if smooth is True:
        sums = _channel_reduce(x, "x_sums", amax=False, chunk=chunk)
        launches, mean = (sums,), ("x_sums", "x_sums_count", sums.grid[0])
    elif isinstance(smooth, str):
        mean = (smooth, None, 1)
    return Plan(launches + (_quantize(x, "x", target, mean=mean, **options),), "x.hi_codes")


# -- attention ------------------------------------------------------------------------

def _operands(prefix: str) -> tuple[str, ...]:
    return tuple(f"{prefix}.{field}" for field in OPERAND_FIELDS)


def _triton_attention(q: Buffer, v: Buffer, q_args: tuple[str, ...], k_args: tuple[str, ...],
                      pv_args: tuple[str, str], *, causal: bool, q_offset: int, diag: int, sink: int,
                      qk_scale: float, launch: tuning.LaunchConfig, high: str, low: str,
                      native: tuple[bool, bool], has_lo: bool, pv_fp8: bool, target: Target,
                      lo_bf16: bool = False) -> Launch:
    b, q_len, q_heads, d = q.shape
    kv_len, kv_heads = v.shape[1], v.shape[2]
    n_m, block0 = query_blocks(q_len, q_offset, launch.block_m)
    return Launch(
        attn._dma_attention_kernel, (n_m, q_heads, b),
        (*q_args, *k_args, v.name, *pv_args, _i32(q_len), _i32(kv_len), _i32(q_heads), _i32(kv_heads),
         _i32(q_offset), _i32(block0), _i32(diag), _i32(sink), _f32(qk_scale)),
        (Buffer("out", q.shape, q.dtype),),
        _meta(D=d, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, CAUSAL=causal,
              HI_FMT={"mxfp8_e5m2": "e5m2", "input": "input"}.get(high, "e4m3"), LO_NV=low == "nvfp4",
              LO_FMT="bf16" if lo_bf16 else "e2m1", NATIVE_HI=native[0], NATIVE_LO=native[1], HAS_LO=has_lo,
              PV_FP8=pv_fp8,
              # fp32 operands at IEEE precision: for fp32 inputs, and in the
              # interpreter, whose tl.dot reads bf16 tiles as integers.
              DOT_F32=q.dtype == "float32" or target.interpret, FIX_BF16=target.interpret),
        num_warps=launch.num_warps, num_stages=launch.num_stages)


def _sm90_attention(q: Buffer, v: Buffer, *, causal: bool, q_offset: int, diag: int, sink: int, has_lo: bool,
                    lo_bf16: bool, gluon: tuning.Sm90GluonConfig) -> Launch:
    b, q_len, q_heads, d = q.shape
    kv_len, kv_heads = v.shape[1], v.shape[2]
    n_m, block0 = query_blocks(q_len, q_offset, attn90.BLOCK_M.value)
    return Launch(
        attn90._dma_attention_sm90_kernel, (n_m, q_heads, b),
        (*_operands("q")[5:], *_operands("k")[5:], v.name, _i32(q_len), _i32(kv_len), _i32(q_heads),
         _i32(kv_heads), _i32(q_offset), _i32(block0), _i32(diag), _i32(sink)),
        (Buffer("out", q.shape, q.dtype),),
        _meta(D=d, BLOCK_N=gluon.block_n, STAGES=gluon.stages(causal, lo_bf16), CAUSAL=causal, HAS_LO=has_lo,
              LO_BF16=lo_bf16, CONSUMER_REGS=gluon.consumer_regs, LOADER_REGS=gluon.loader_regs),
        num_warps=gluon.num_warps, gluon=True)


def attention_plan(q: Buffer, k: Buffer, v: Buffer, target: Target, *, causal: bool, q_offset: int,
                   diag_tiles: int, sink_tiles: int, high: str, low: str, smooth_k: bool, sm_scale: float,
                   pv: str = "input", high_rule: str | None = None, low_rule: str | None = None,
                   rotate: bool = False, nvfp4_copy: str = "bf16", native: bool | None = None,
                   kernel: str | None = None,
                   launch: tuning.LaunchConfig | None = None,
                   gluon: tuning.Sm90GluonConfig = tuning.SM90_GLUON) -> Plan:
    """One DMA call on ``q [B, Lq, HQ, D]``, ``k, v [B, Lk, HKV, D]`` (validated):
    smooth-K's partial sums, the dual quantization of Q and of K (whose programs add
    the partials up into the mean), V's transposed FP8 copy for ``pv="fp8"``, and the
    attention launch. Only the copies some tile reads are written: codes and scales
    for native tiles (``tl.dot_scaled``, sm_100), E4M3 copies for the others (K's with
    one scale per key tile), no low copies when every pair is high. ``high_rule``,
    ``low_rule``: the block-scale rules; ``rotate``: the Hadamard rotation of Q and K
    (its factor 1/D goes into Q's fold). ``nvfp4_copy``: what NVFP4 tiles that are not
    native multiply: "bf16" (``e · sb`` exactly, with per-token ``s2`` factors on both
    sides of the scores, bf16 MMAs) or "e4m3" (rounded into the E4M3 copies).

    ``native`` forces ``tl.dot_scaled`` on or off (default by GPU); ``kernel``
    ("triton" or "gluon") the attention kernel (default ``target.uses_sm90_kernel``);
    ``launch`` the Triton kernel's settings and ``gluon`` the Gluon kernel's.
    """
    q_len, d = q.shape[1], q.shape[3]
    kv_len, kv_heads = k.shape[1], k.shape[2]
    check_extent(kv_len, kv_heads, d)
    tiles = resolve_native(target.capability, native)
    has_lo = not all_high(q_len, kv_len, q_offset, diag_tiles)
    fp8 = not all(tiles)
    if nvfp4_copy not in ("bf16", "e4m3"):
        raise ValueError(f"nvfp4_copy must be 'bf16' or 'e4m3'; got {nvfp4_copy!r}")
    if high == BF16:
        raise ValueError("high='bf16' is a decode cache's format; the attention kernels take an MXFP8 high format")
    lo_bf16 = has_lo and low == "nvfp4" and not tiles[1] and nvfp4_copy == "bf16"
    copies: dict[str, Any] = dict(high=high, low=low, codes=any(tiles), fp8=fp8, write_lo=has_lo,
                                  high_rule=high_rule, low_rule=low_rule, rotate=rotate, lo_bf16=lo_bf16)
    launches: list[Launch] = []
    mean = None
    if smooth_k:
        sums = _channel_reduce(k, "k_sums", amax=False)
        launches.append(sums)
        mean = ("k_sums", "k_sums_count", sums.grid[0])
    fold = query_fold(sm_scale, d, rotate)
    launches.append(_quantize(q, "q", target, fold=fold, **copies))
    # K's FP8 copies carry one scale per key tile (formats.fp8_per_tile).
    launches.append(_quantize(k, "k", target, mean=mean, per_tile=fp8, **copies))
    pv_fp8 = pv == "fp8"
    if pv_fp8:
        launches.extend(fp8_transpose_plan(v, target).launches)
    if kernel is None:
        kernel = "gluon" if uses_sm90_kernel(target.capability, d, v.dtype, pv_fp8, tiles) else "triton"
    if kernel == "gluon":
        launches.append(_sm90_attention(q, v, causal=causal, q_offset=q_offset, diag=diag_tiles, sink=sink_tiles,
                                        has_lo=has_lo, lo_bf16=lo_bf16, gluon=gluon))
    else:
        launch = launch or tuning.launch_config(d, causal, pv_fp8, target.capability, lo_bf16=lo_bf16)
        launches.append(_triton_attention(
            q, v, _operands("q"), _operands("k"), ("vt", "v_scale") if pv_fp8 else (v.name, v.name),
            causal=causal, q_offset=q_offset, diag=diag_tiles, sink=sink_tiles, qk_scale=1.0, launch=launch,
            high=high, low=low, native=tiles, has_lo=has_lo, pv_fp8=pv_fp8, target=target, lo_bf16=lo_bf16))
    return Plan(tuple(launches), "out")


def input_attention_plan(q: Buffer, k: Buffer, v: Buffer, target: Target, *, causal: bool, q_offset: int,
                         sm_scale: float, launch: tuning.LaunchConfig | None = None) -> Plan:
    """The DMA kernel with Q·Kᵀ on the unquantized inputs (P·V as in DMA's default):
    a plain flash attention in one launch, the baseline that shows what the MX copies
    buy. Same shapes and ``q_offset`` as a DMA call; one dtype for q, k and v."""
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    q_len, d = q.shape[1], q.shape[3]
    kv_len, kv_heads = k.shape[1], k.shape[2]
    check_extent(kv_len, kv_heads, d)
    launch = launch or tuning.launch_config(d, causal, False, target.capability, unquantized=True)
    return Plan((_triton_attention(
        q, v, (q.name,) * 9, (k.name,) * 9, (v.name, v.name), causal=causal, q_offset=q_offset,
        diag=band_covering_all(q_len, kv_len, q_offset), sink=0, qk_scale=softmax_fold(sm_scale), launch=launch,
        high="input", low="nvfp4", native=(False, False), has_lo=False, pv_fp8=False, target=target),), "out")


# -- decode ---------------------------------------------------------------------------

def decode_plan(q: Buffer, cache: dict[str, Buffer], target: Target, *, sink_len: int, ring_len: int,
                v_fp8: bool, diag_tiles: int, sink_tiles: int, high: str, low: str, sm_scale: float,
                high_rule: str | None = None, low_rule: str | None = None, rotate: bool = False,
                launch: tuning.DecodeConfig = tuning.DECODE) -> Plan:
    """A decode step: the ``n_q`` new query rows ``q [B, n_q, HQ, D]`` (whose keys the
    cache already holds: row r of batch row b is at position ``length[b] - n_q + r``)
    against ``cache`` (``CACHE_FIELDS``, ``[B, S, HKV, ...]``). Q's dual quantization
    (codes only), the split decode kernel, the combine. ``sink_len``, ``ring_len``: the
    cache's high slots (``geometry.cache_slots``); ``launch``: the kernel's settings."""
    b, n_q, hq, d = q.shape
    capacity, kv_heads = cache["lo_codes"].shape[1], cache["lo_codes"].shape[2]
    if n_q < 1 or n_q > TILE:
        raise ValueError(f"a decode step takes 1 to {TILE} new query rows; got {n_q}")
    check_extent(capacity, kv_heads, d)
    tiles = -(-capacity // TILE)
    # Bounded so that tile arithmetic stays in int32 (a huge band or sink is "all").
    diag, sink = min(diag_tiles, tiles + 1), min(sink_tiles, tiles)
    has_lo = not all_high(1, capacity, capacity - 1, diag)
    has_hi = diag > 0 or sink > 0
    quantize = _quantize(q, "q", target, fold=query_fold(sm_scale, d, rotate), high=high, low=low, codes=True,
                         fp8=False, write_lo=has_lo, high_rule=high_rule, low_rule=low_rule, rotate=rotate)
    group = hq // kv_heads
    block_m = max(16, 1 << (group * n_q - 1).bit_length())
    split_len = tuning.decode_split_len(b, kv_heads, capacity, launch)
    n_split = -(-capacity // split_len)
    lo = FORMATS[low]
    partial = (b, kv_heads, n_split, block_m)
    attend = Launch(
        dec._dma_decode_kernel, (n_split, kv_heads, b),
        (*_operands("q")[:5], *(cache[f].name for f in CACHE_FIELDS), _i32(n_q), _i32(capacity),
         _i32(cache["hi_codes"].shape[1]), _i32(hq), _i32(kv_heads), _i32(sink_len), _i32(ring_len), _i32(diag),
         _i32(sink), _i32(split_len)),
        (Buffer("acc", (*partial, d), "float32"), Buffer("row_max", partial, "float32"),
         Buffer("row_sum", partial, "float32")),
        _meta(D=d, GROUP=group, BLOCK_M=block_m, BLOCK_N=launch.block_n, HI_E=_high_meta(high, high_rule)["HI_E"],
              LO_BLOCK=lo.block,
              LO_NV=low == "nvfp4", HAS_LO=has_lo, HAS_HI=has_hi, MIXED=n_q > 1, V_FP8=v_fp8,
              # Lifted FP8 values need P·V in bf16 (the interpreter runs their float32
              # emulation); fp16 and fp32 inputs convert them.
              V_LIFT=v_fp8 and q.dtype == "bfloat16" and launch.lift_values, P_DTYPE=q.dtype,
              # fp32 P·V for fp32 inputs, and for fp16 with E4M3 V (not always an fp16 value).
              PV_F32=q.dtype == "float32" or (v_fp8 and q.dtype != "bfloat16") or target.interpret,
              HW_CVT=not target.interpret, DOT_F32=target.interpret),
        num_warps=launch.num_warps, num_stages=launch.num_stages)
    combine = Launch(dec._decode_combine_kernel, (kv_heads, b, 1),
                     ("acc", "row_max", "row_sum", _i32(n_q), _i32(hq), _i32(kv_heads), _i32(n_split)),
                     (Buffer("out", q.shape, q.dtype),), _meta(D=d, GROUP=group, BLOCK_M=block_m))
    return Plan((quantize, attend, combine), "out")


def cache_append_plan(k: Buffer, v: Buffer, cache: dict[str, Buffer], target: Target, *, sink_len: int,
                      ring_len: int, v_fp8: bool, high: str, low: str, high_rule: str | None = None,
                      low_rule: str | None = None, rotate: bool = False, smooth_k: bool = True,
                      block_t: int = tuning.QUANTIZE_BLOCK_T, num_warps: int = tuning.QUANTIZE_WARPS) -> Plan:
    """``n`` new tokens per row, ``k``, ``v [B, n, H, D]`` (named apart from the cache's
    arrays), written into a low-bit KV cache at each row's ``length`` in one launch.
    The cache's arrays (``cache``, by ``CACHE_FIELDS``) are updated in place and keep
    their names; ``"k_mean"`` (float32 ``[B, H, D]``) is smooth-K's fixed mean.
    ``sink_len``, ``ring_len``: the cache's high slots (``geometry.cache_slots``).
    ``length`` itself is not advanced. The result names the first updated array; the
    executor's environment holds all of them."""
    b, n, h, d = k.shape
    capacity = cache["lo_codes"].shape[1]
    if {k.name, v.name} & {*CACHE_FIELDS, "k_mean"}:
        raise ValueError(f"the new tokens' buffers need names of their own; got {k.name!r}, {v.name!r}")
    if not 1 <= n <= TILE:
        raise ValueError(f"an append takes 1 to {TILE} tokens per row; got {n}")
    check_extent(capacity, h, d)
    if rotate and d & (d - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head_dim; got {d}")
    lo, values = FORMATS[low], E4M3  # V's FP8 elements, one block per token
    low_rule = check_rule(lo, low_rule)
    fields = CACHE_FIELDS[:-1]  # every array but length
    launch = Launch(
        append._cache_append_kernel, (-(-n // block_t), h, b),
        (k.name, v.name, "k_mean", "length", *fields, _i32(n), _i32(capacity), _i32(cache["hi_codes"].shape[1]),
         _i32(h), _i32(sink_len), _i32(ring_len)),
        tuple(dataclasses.replace(cache[f], name=f, updates=f) for f in fields),
        _meta(D=d, BLOCK_T=block_t, SMOOTH=smooth_k, ROTATE=rotate, **_high_meta(high, high_rule),
              LO_E=lo.exp_bits, LO_M=lo.man_bits, LO_EMIN=lo.emin, LO_EMAX=lo.emax, LO_MAX=lo.max_value,
              LO_BLOCK=lo.block, LO_NVFP4=low == "nvfp4", LO_RULE=low_rule, V_FP8=v_fp8, V_E=values.exp_bits,
              V_M=values.man_bits, V_EMIN=values.emin, V_EMAX=values.emax, V_MAX=values.max_value,
              V_RULE=VALUE_SCALE_RULE, HW_CVT=not target.interpret),
        num_warps=num_warps)
    return Plan((launch,), fields[0])
