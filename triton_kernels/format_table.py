"""The block-scaled number formats: the one table that the kernels, the launch plan
and ``dma_jax.formats`` read. Plain Python (no Triton, no JAX, no torch), so that the
CPU-only package imports it.
"""

from __future__ import annotations

import dataclasses

__all__ = ["E4M3", "FORMATS", "Format", "NVFP4_TOKEN_DIVISOR"]


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

    @property
    def packed(self) -> bool:
        """True for 4-bit elements, stored two per byte."""
        return self.exp_bits + self.man_bits + 1 == 4


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("mxfp8_e4m3", 4, 3, -6, 8, 448.0, 32, "e8m0"),
        Format("mxfp8_e5m2", 5, 2, -14, 15, 57344.0, 32, "e8m0"),
        Format("mxfp4", 2, 1, 0, 2, 6.0, 32, "e8m0"),
        Format("nvfp4", 2, 1, 0, 2, 6.0, 16, "e4m3_fp32"),
    )
}

# E4M3 elements: MXFP8's default element, NVFP4's block scale, and the FP8 copies that
# Hopper's tensor cores read.
E4M3 = FORMATS["mxfp8_e4m3"]
# NVFP4's per-token scale maps the token amax onto (E2M1 max) x (E4M3 max).
NVFP4_TOKEN_DIVISOR = FORMATS["nvfp4"].max_value * E4M3.max_value
