"""The Walsh–Hadamard rotation of Q and K along head_dim (docs/design.md, "Pre-processing").

``q·H`` and ``k·H`` with ``H`` the unnormalised Walsh–Hadamard matrix of order
``head_dim`` (entries ±1, ``H·Hᵀ = D·I``, Sylvester's order) leave ``Q·Kᵀ`` unchanged
up to the factor ``D``, which the softmax scale absorbs, while spreading outlier
channels over every block. Computed as a float32 butterfly in one fixed order (log2 D
stages of ``(a + b, a − b)`` at strides 1, 2, 4, ...), the order the Triton kernels
use, so every backend rounds alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["ROTATIONS", "hadamard"]

ROTATIONS = ("none", "hadamard")


def hadamard(x: jax.Array) -> jax.Array:
    """``x · H`` along the last axis (a power of two long), in ``x``'s dtype."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two last axis; got {d}")
    stride = 1
    while stride < d:
        pairs = x.reshape(*x.shape[:-1], d // (2 * stride), 2, stride)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = jnp.stack([a + b, a - b], axis=-2).reshape(*x.shape[:-1], d)
        stride *= 2
    return x
