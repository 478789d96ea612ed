"""The factor folded into Q before it is quantized (plain Python: the jnp reference and
the launch plans both read it, so both scale Q with the same float32 bits)."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["query_fold", "softmax_fold"]


def softmax_fold(sm_scale: float) -> float:
    """The float32 factor ``sm_scale · log2(e)`` folded into Q (softmax in base 2)."""
    return float(np.float32(sm_scale * math.log2(math.e)))


def query_fold(sm_scale: float, head_dim: int, rotate: bool) -> float:
    """The factor Q's quantization folds in: ``softmax_fold``, and with the rotation
    1/head_dim ((q·H)(k·H)ᵀ = D · q·kᵀ, an exact power of two, so still a float32)."""
    return softmax_fold(sm_scale) / (head_dim if rotate else 1)
