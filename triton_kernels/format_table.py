"""The block-scaled number formats: the one table that the kernels, the launch plan
and ``dma_jax.formats`` read. Plain Python (no Triton, no JAX, no torch), so that the
CPU-only package imports it.
"""

from __future__ import annotations

import dataclasses

__all__ = ["BF16", "BF16_EXP_BITS", "BF16_MAX", "E4M3", "FORMATS", "Format", "NVFP4_TOKEN_DIVISOR", "SCALE_RULES",
           "VALUE_SCALE_RULE", "check_rule"]


@dataclasses.dataclass(frozen=True)
class Format:
    """A block-scaled number format."""

    name: str
    exp_bits: int  # element exponent bits
    man_bits: int  # element mantissa bits
    emin: int  # element exponent of the smallest normal value
    emax: int  # element exponent of the largest normal value (OCP "emax_elem")
    max_value: float  # largest finite element value (saturation bound)
    block: int  # elements per block along head_dim
    scale: str  # "e8m0" (MX) or "e4m3_fp32" (NVFP4's two-level scale)
    # The block-scale rule used unless another is asked for (SCALE_RULES), chosen on
    # SmolLM2-135M (README "Quality", benchmarks/quality.py --rules): "up" for MXFP8 and
    # NVFP4, "nearest" for MXFP4.
    default_rule: str

    @property
    def packed(self) -> bool:
        """True for 4-bit elements, stored two per byte."""
        return self.exp_bits + self.man_bits + 1 == 4

    @property
    def rules(self) -> tuple[str, ...]:
        """The block-scale rules this format accepts (``SCALE_RULES``)."""
        return tuple(SCALE_RULES[self.scale])


# How a block's scale is chosen from its largest magnitude ``amax``:
#   E8M0 (MX) scales 2^e:
#     "up"      the smallest e with amax / 2^e <= element max: nothing saturates
#               (cuBLAS / Transformer Engine).
#     "floor"   OCP MX v1.0: e = floor(log2 amax) - emax; amax / 2^e may exceed the
#               element max, and the block's largest elements saturate.
#     "nearest" as "floor", but one step up where amax / 2^e, rounded to the element's
#               precision, exceeds the element max (saturation limited to half a step).
#   NVFP4's E4M3 block scale sb, from amax / (6 · s2):
#     "nearest" rounded to nearest E4M3, ties to even (NVIDIA's recipe).
#     "up"      rounded up: no element saturates.
#     "floor"   rounded down.
#     "4/6"     per block, "nearest" scaling to 6 or the E4M3 scale of amax / (4 · s2),
#               whichever reconstructs the block with the smaller sum of absolute
#               errors (Cook et al., "Four Over Six", 2025); ties keep 6.
SCALE_RULES: dict[str, tuple[str, ...]] = {
    "e8m0": ("up", "floor", "nearest"),
    "e4m3_fp32": ("nearest", "up", "floor", "4/6"),
}


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("mxfp8_e4m3", 4, 3, -6, 8, 448.0, 32, "e8m0", "up"),
        Format("mxfp8_e5m2", 5, 2, -14, 15, 57344.0, 32, "e8m0", "up"),
        Format("mxfp4", 2, 1, 0, 2, 6.0, 32, "e8m0", "nearest"),
        Format("nvfp4", 2, 1, 0, 2, 6.0, 16, "e4m3_fp32", "up"),
    )
}

# The high "format" without block scales (``DMAConfig(high="bf16")``): Q and K kept as
# bfloat16 values after smoothing and rotation. A decode cache reads its few sink and
# band keys once per step, so their precision costs next to nothing there.
BF16 = "bf16"
# What the kernels take for its element exponent bits (HI_E): bf16's own, 8.
BF16_EXP_BITS = 8
BF16_MAX = (2 - 2**-7) * 2.0**127
# E4M3 elements: MXFP8's default element, NVFP4's block scale, and the FP8 copies that
# Hopper's tensor cores read.
E4M3 = FORMATS["mxfp8_e4m3"]
# A low-bit KV cache's FP8 values: E4M3 with one E8M0 scale per token, chosen so that
# nothing saturates.
VALUE_SCALE_RULE = "up"
# NVFP4's per-token scale maps the token amax onto (E2M1 max) x (E4M3 max).
NVFP4_TOKEN_DIVISOR = FORMATS["nvfp4"].max_value * E4M3.max_value


def check_rule(fmt: Format, rule: str | None) -> str:
    """``rule``, or the format's default for ``None``; a ValueError naming the
    accepted rules for anything else."""
    if rule is None:
        return fmt.default_rule
    if not isinstance(rule, str) or rule not in fmt.rules:
        raise ValueError(f"{fmt.name} block scales accept the rules {fmt.rules}; got {rule!r}")
    return rule
