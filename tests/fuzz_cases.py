"""Seeded random attention calls for the fuzz tests: random structures (batch, lengths
including 1 and non-multiples of 128, heads and GQA ratios, head_dim, dtype, causal,
q_offset, every DMAConfig knob), each with random inputs of several kinds (outlier
channels, zeros, tiny and huge magnitudes, a NaN key). A structure fixes everything that
selects a compiled program, so each compiles once and runs all of its inputs."""

from __future__ import annotations

import dataclasses

import numpy as np

from dma_jax import DMAConfig
from dma_jax.config import ALL_TILES, LOW_FORMATS, PREFILL_HIGH_FORMATS
from triton_kernels.format_table import FORMATS

DTYPES = ("bfloat16", "float16", "float32")
KINDS = ("normal", "outliers", "zeros", "tiny", "huge", "mixed", "nan_key")
LENGTHS = (1, 2, 17, 64, 127, 128, 129, 200, 255, 256, 257, 300)


@dataclasses.dataclass(frozen=True)
class Structure:
    b: int
    lq: int
    lk: int
    hq: int
    hkv: int
    d: int
    dtype: str
    causal: bool
    q_offset: int | None
    config: DMAConfig


def structure(seed: int) -> Structure:
    rng = np.random.default_rng(seed)
    causal = bool(rng.integers(2))
    lq, lk = (int(x) for x in rng.choice(LENGTHS, 2))
    if causal and lq > lk:
        lq, lk = lk, lq
    hkv = int(rng.choice((1, 2, 3)))
    hq = hkv * int(rng.choice((1, 2, 4)))
    high = str(rng.choice(PREFILL_HIGH_FORMATS))
    low = str(rng.choice(LOW_FORMATS))
    # NVFP4's "floor" rule is left out: it puts the block holding a token's amax exactly
    # on an E4M3 boundary (amax / (6 · amax/2688) = 448), so one ulp of difference in the
    # operands (smooth-K's summation order, the rotation's rounding: the oracle rotates
    # in float64) picks 448 or 416 for that block. The quantize tests check the rule bit
    # for bit on identical inputs; across independent implementations it cannot agree.
    low_rules = [r for r in FORMATS[low].rules if not (low == "nvfp4" and r == "floor")]
    config = DMAConfig(
        diag_tiles=int(rng.choice((0, 1, 2, ALL_TILES))), sink_tiles=int(rng.integers(0, 3)), high=high, low=low,
        smooth_k=bool(rng.integers(2)), sm_scale=None if rng.integers(2) else float(rng.uniform(0.02, 0.3)),
        pv=str(rng.choice(("input", "input", "fp8"))),
        high_rule=str(rng.choice(FORMATS[high].rules)), low_rule=str(rng.choice(low_rules)),
        rotate=str(rng.choice(("hadamard", "none"))), nvfp4_copy=str(rng.choice(("bf16", "e4m3"))))
    if rng.integers(2):
        q_offset = None
    elif causal:
        q_offset = int(rng.integers(0, lk - lq + 1))
    else:
        q_offset = int(rng.integers(-lq, lk + 1))
    return Structure(int(rng.integers(1, 3)), lq, lk, hq, hkv, int(rng.choice((64, 128))),
                     str(rng.choice(DTYPES)), causal, q_offset, config)


def inputs(s: Structure, seed: int) -> tuple[str, list[np.ndarray]]:
    """(kind, [q, k, v] as float32 arrays holding values of ``s.dtype``)."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    kind = str(rng.choice(KINDS))
    shapes = ((s.b, s.lq, s.hq, s.d), (s.b, s.lk, s.hkv, s.d), (s.b, s.lk, s.hkv, s.d))
    q, k, v = (rng.standard_normal(shape) for shape in shapes)
    k += 1.5 * rng.standard_normal((1, 1, s.hkv, s.d))  # a per-channel offset: smooth-K's job
    # Magnitudes are extreme, but q·k stays moderate: with scores in the hundreds, a
    # one-ulp difference in smooth-K's float32 mean (whose summation order the numerics
    # leave open) flips near-ties of a one-hot softmax, and no oracle can agree then.
    if kind == "outliers":  # a few channels several times larger in both Q and K
        channels = rng.integers(0, s.d, 3)
        q[..., channels] *= 6.0
        k[..., channels] *= 6.0
    elif kind == "zeros":
        q, k, v = (np.zeros_like(x) if rng.integers(2) else x for x in (q, k, v))
    elif kind == "tiny":
        q, k, v = q * 1e-4, k * 1e-4, v * (1e-30 if s.dtype == "float32" else 1e-3)
    elif kind == "huge":  # Q and V huge, K small
        big = {"float16": 100.0, "bfloat16": 1e4, "float32": 1e4}[s.dtype]
        q, k, v = q * big, k / big, v * big
    elif kind == "mixed":  # rows of very different magnitudes
        q = q * 10.0 ** rng.integers(-2, 2, q.shape[:-1])[..., None]
        k = k * 10.0 ** rng.integers(-1, 1, k.shape[:-1])[..., None]
        v = v * 10.0 ** rng.integers(-3, 3, v.shape[:-1])[..., None]
    elif kind == "nan_key":
        k[0, int(rng.integers(0, s.lk)), int(rng.integers(0, s.hkv)), int(rng.integers(0, s.d))] = np.nan
    dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[s.dtype]
    return kind, [x.astype(dtype).astype(np.float32) for x in (q, k, v)]


def oracle_kwargs(s: Structure) -> dict:
    """``oracle.dma_attention``'s keywords for a structure's call (smooth-K left to
    ``oracle_keys``)."""
    import ml_dtypes

    c = s.config
    p_dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": None}[s.dtype]
    return dict(causal=s.causal, diag=c.diag_tiles, sink=c.sink_tiles, high=c.high, low=c.low, smooth_k=False,
                sm_scale=c.sm_scale, q_offset=s.q_offset, pv=c.pv, high_rule=c.scale_rules[0],
                low_rule=c.scale_rules[1], rotate=c.rotate, p_dtype=p_dtype)


def oracle_keys(s: Structure, k: np.ndarray, mean: np.ndarray | None) -> np.ndarray:
    """K as the oracle gets it: with smooth-K, minus the float32 ``mean`` the
    implementation under test formed (its summation order is not part of the numerics,
    and one ulp of it can flip a block scale: NVFP4's "floor" rule puts the block that
    holds a token's amax exactly on an E4M3 boundary, 448, where rounding noise picks
    448 or 416). The mean itself is checked against float64 elsewhere."""
    if not s.config.smooth_k:
        return k
    return (k - mean).astype(np.float32)


def tolerance(s: Structure) -> float:
    """Relative L2 bound against the float64 oracle: the output's rounding to its dtype
    (and P's, which the oracle rounds as the reference does); with the rotation, the
    few elements whose rotated value (float64 in the oracle, a float32 butterfly here)
    sits at a rounding boundary of the 4/8-bit grid and rounds the other way; with the
    FP8 P·V the E4M3 rounding of P against the final rather than the running row max."""
    base = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 8e-3}[s.dtype]
    if s.config.rotate == "hadamard":
        base = max(base, 2e-3)
    return base + (3e-2 if s.config.pv == "fp8" else 0.0)


def compare(out: np.ndarray, want: np.ndarray, s: Structure, slack: float = 0.0) -> str | None:
    """None when ``out`` matches the oracle's ``want``, else what is wrong: NaN exactly
    where the oracle has NaN, and the finite part within ``tolerance`` (plus ``slack``)."""
    out, want = np.asarray(out, np.float64), np.asarray(want, np.float64)
    if out.shape != want.shape:
        return f"shape {out.shape} != {want.shape}"
    if (np.isnan(out) != np.isnan(want)).any():
        return f"NaN at {int((np.isnan(out) != np.isnan(want)).sum())} places the oracle has none or the reverse"
    ok = ~np.isnan(want)
    err, norm = np.linalg.norm(out[ok] - want[ok]), np.linalg.norm(want[ok])
    if norm == 0:
        return None if err == 0 else f"oracle output is zero, ours has norm {err:.3g}"
    bound = tolerance(s) + slack
    if err > bound * norm:
        return f"rel L2 {err / norm:.3g} > {bound:.3g}"
    return None


def fp8_accumulation(s: Structure, q: np.ndarray, k: np.ndarray) -> float:
    """Relative L2 that Hopper's FP8 tensor cores add: their products accumulate with
    about 14 significant bits rather than float32's 24, so a score moves by up to about
    2⁻¹⁴ of Σ_d |q_d k_d| (times the softmax scale), and the output by about as much
    relative to itself. Bounded by twice that, on the mean over the case's (query, key)
    pairs (finite keys, smooth-K's shift applied)."""
    g = s.hq // s.hkv
    keys = np.repeat(k, g, axis=2).astype(np.float64)
    keys = np.where(np.isfinite(keys).all(-1, keepdims=True), keys, 0.0)
    if s.config.smooth_k:
        keys = keys - keys.mean(axis=1, keepdims=True)
    sums = np.einsum("bqhd,bkhd->bhqk", np.abs(q), np.abs(keys))
    return 2.0**-13 * s.config.softmax_scale(s.d) * float(sums.mean())
