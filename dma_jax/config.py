"""`DMAConfig`: which attention pairs are computed in which format."""

from __future__ import annotations

import dataclasses
import math

import jax

from triton_kernels.format_table import BF16, FORMATS, check_rule

from .rotation import ROTATIONS

# The high formats of the prefill kernels; "bf16" also for decode caches and the reference.
PREFILL_HIGH_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2")
HIGH_FORMATS = (*PREFILL_HIGH_FORMATS, BF16)
LOW_FORMATS = ("nvfp4", "mxfp4")
PV_MODES = ("input", "fp8")
NVFP4_COPIES = ("bf16", "e4m3")
# Large enough that every pair of any realistic sequence is on the "diagonal",
# small enough to stay an int32 in tile arithmetic.
ALL_TILES = 2**30


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"DMAConfig.{name} must be an int >= 0; got {value!r}")


def _check_choice(name: str, value: object, allowed: tuple) -> None:
    # By type and value: 1 is not True, 0 not False.
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise ValueError(f"DMAConfig.{name} must be one of {allowed}; got {value!r}")


# A static pytree node (no leaves): jax.jit(dma_jax.attention)(q, k, v, config=cfg)
# passes the config through as part of the tree structure, not as a traced value.
@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DMAConfig:
    """Configuration of Diagonal-Tiled Mixed-Precision Attention.

    A query/key pair is computed in the ``high`` format when its key tile is one
    of the first ``sink_tiles`` tiles or lies within ``diag_tiles`` tiles of the
    query's tile (tiles of ``triton_kernels.geometry.TILE`` = 128 tokens); every
    other pair uses the ``low`` format.
    ``diag_tiles=0, sink_tiles=0`` is all-low; a huge ``diag_tiles`` is all-high.

    Attributes:
      diag_tiles: width of the high-precision diagonal band, in tiles.
      sink_tiles: number of leading key tiles ("attention sinks") kept high.
      high: 8-bit format, ``"mxfp8_e4m3"`` or ``"mxfp8_e5m2"``; or ``"bf16"``: the high
        pairs unquantized (Q and K rounded to bfloat16 after smoothing and rotation),
        for a decode cache's sink and band keys (``LowBitKVCache``) and
        ``reference_attention``; the prefill kernels take the 8-bit formats only.
      low: 4-bit format, ``"nvfp4"`` or ``"mxfp4"``.
      smooth_k: subtract the per-channel mean of K over the valid tokens first.
      sm_scale: softmax scale; ``None`` means ``head_dim ** -0.5``.
      pv: ``"input"`` (P rounded to the input dtype, V as given) or
        ``"fp8"`` (P and V in E4M3, V with a power-of-two scale per channel: faster
        on Hopper, less accurate; see ``dma_jax.formats.fp8_per_channel``).
      high_rule, low_rule: how the high and the low copies choose their block scales
        (``FORMATS[fmt].rules``, see ``dma_jax.quantize``); ``None`` is the format's
        ``default_rule``. ``high="bf16"`` has no block scales and takes ``None`` only.
      rotate: ``"hadamard"`` (default: Q and K rotated along head_dim by the
        Walsh–Hadamard matrix before quantization, ``dma_jax.rotation``) or ``"none"``.
      nvfp4_copy: what NVFP4 tiles multiply on GPUs without native NVFP4 MMAs (Hopper):
        ``"bf16"`` (``e · sb`` exactly, on bf16 tensor cores: the reference's numbers)
        or ``"e4m3"`` (rounded to E4M3 for the FP8 tensor cores, within 2^-4 per
        element: faster, less accurate; README "Speed" has both).
      native: ``None`` (default): block-scaled MMAs (``tl.dot_scaled``) for every tile
        where the GPU has them (sm_100 and later), the FP8/bf16 copies elsewhere;
        ``False``: the copies everywhere (Hopper's path, the fallback on Blackwell);
        ``True``: ``tl.dot_scaled`` everywhere (Triton emulates it in bf16 before
        sm_100).
    """

    diag_tiles: int = 1
    sink_tiles: int = 1
    high: str = "mxfp8_e4m3"
    low: str = "nvfp4"
    smooth_k: bool = True
    sm_scale: float | None = None
    pv: str = "input"
    high_rule: str | None = None
    low_rule: str | None = None
    rotate: str = "hadamard"
    nvfp4_copy: str = "bf16"
    native: bool | None = None

    def __post_init__(self) -> None:
        _check_count("diag_tiles", self.diag_tiles)
        _check_count("sink_tiles", self.sink_tiles)
        _check_choice("high", self.high, HIGH_FORMATS)
        _check_choice("low", self.low, LOW_FORMATS)
        _check_choice("smooth_k", self.smooth_k, (True, False))
        _check_choice("pv", self.pv, PV_MODES)
        _check_choice("rotate", self.rotate, ROTATIONS)
        _check_choice("nvfp4_copy", self.nvfp4_copy, NVFP4_COPIES)
        _check_choice("native", self.native, (None, True, False))
        if self.high == BF16 and self.high_rule is not None:
            raise ValueError(f"DMAConfig.high_rule: high='bf16' has no block scales; got {self.high_rule!r}")
        for name, fmt in (("high_rule", self.high), ("low_rule", self.low)):
            if fmt == BF16:
                continue
            try:
                check_rule(FORMATS[fmt], getattr(self, name))
            except ValueError as e:
                raise ValueError(f"DMAConfig.{name}: {e}") from None
        s = self.sm_scale
        if s is not None and (
            isinstance(s, bool)
            or not isinstance(s, (int, float))
            or not math.isfinite(s)
            or s <= 0
        ):
            raise ValueError(
                f"DMAConfig.sm_scale must be None or a finite float > 0; got {s!r}"
            )

    @classmethod
    def all_high(cls, **kwargs) -> "DMAConfig":
        """Every pair in the high (8-bit) format."""
        return cls(diag_tiles=ALL_TILES, **kwargs)

    @classmethod
    def all_low(cls, **kwargs) -> "DMAConfig":
        """Every pair in the low (4-bit) format."""
        return cls(diag_tiles=0, sink_tiles=0, **kwargs)

    @classmethod
    def hopper_fast(cls, **kwargs) -> "DMAConfig":
        """The fast preset for Hopper (H100/H200): every pair in MXFP8 and an FP8 P·V.

        On sm_90 the kernel multiplies both the 8-bit and the 4-bit copies on the
        same FP8 tensor cores, so 4-bit tiles cost as much as 8-bit ones: the preset
        keeps all pairs high (one copy of Q and K to write instead of two) and
        spends the saved error on ``pv="fp8"``. It skips the rotation (its cost is a few
        percent of a call; pass ``rotate="hadamard"`` to have it). README "Speed" has its
        error and speed.
        """
        kwargs.setdefault("rotate", "none")
        return cls(diag_tiles=ALL_TILES, pv="fp8", **kwargs)

    def kernel_options(self, head_dim: int) -> dict:
        """The keywords of ``triton_kernels.plan.attention_plan`` for this config, the
        same for the JAX and the torch front end."""
        return dict(diag_tiles=self.diag_tiles, sink_tiles=self.sink_tiles, high=self.high, low=self.low,
                    smooth_k=self.smooth_k, sm_scale=self.softmax_scale(head_dim), pv=self.pv,
                    high_rule=self.scale_rules[0], low_rule=self.scale_rules[1], rotate=self.rotate == "hadamard",
                    nvfp4_copy=self.nvfp4_copy, native=self.native)

    def decode_options(self, head_dim: int) -> dict:
        """The keywords of ``triton_kernels.plan.decode_plan`` for this config (those of
        ``kernel_options`` that a decode step reads)."""
        options = self.kernel_options(head_dim)
        return {k: options[k] for k in ("diag_tiles", "sink_tiles", "high", "low", "sm_scale", "high_rule",
                                        "low_rule", "rotate")}

    def append_options(self) -> dict:
        """The keywords of ``triton_kernels.plan.cache_append_plan`` for this config."""
        high_rule, low_rule = self.scale_rules
        return dict(high=self.high, low=self.low, high_rule=high_rule, low_rule=low_rule,
                    rotate=self.rotate == "hadamard", smooth_k=self.smooth_k)

    @property
    def scale_rules(self) -> tuple[str | None, str]:
        """The block-scale rules of the high and the low copies, defaults resolved
        (``None`` for ``high="bf16"``, which has no block scales)."""
        high = None if self.high == BF16 else check_rule(FORMATS[self.high], self.high_rule)
        return high, check_rule(FORMATS[self.low], self.low_rule)

    def softmax_scale(self, head_dim: int) -> float:
        """The softmax scale for ``head_dim`` (``sm_scale`` or ``head_dim**-0.5``)."""
        return float(self.sm_scale) if self.sm_scale is not None else head_dim**-0.5
