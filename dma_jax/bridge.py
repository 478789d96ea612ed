"""Zero-copy hand-over of arrays between JAX and PyTorch through DLPack.

On GPU (and on CPU) both sides share one buffer: the same data pointer.
Low-precision dtypes arrive as uint8 views of the same bytes (float8_e4m3fn,
float8_e5m2, float8_e8m0fnu), which is how the kernels take them. float4_e2m1fn
has no DLPack code that torch reads, so it is converted to uint8 codes (a copy);
dma_jax itself always stores 4-bit codes packed in uint8.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["to_torch", "from_torch"]

_BYTE_VIEWS = {"float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"}


def to_torch(x: jax.Array) -> "torch.Tensor":
    """A torch tensor on the same buffer as ``x`` (float8 and e8m0 as uint8 views)."""
    import torch

    name = np.dtype(x.dtype).name
    if name == "float4_e2m1fn":
        return torch.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint8))
    t = torch.from_dlpack(x)
    return t.view(torch.uint8) if name in _BYTE_VIEWS else t


def from_torch(t: "torch.Tensor") -> jax.Array:
    """A JAX array on the same buffer as ``t`` (torch float8 dtypes as uint8)."""
    import torch

    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, getattr(torch, "float8_e8m0fnu", None)):
        t = t.view(torch.uint8)
    return jax.dlpack.from_dlpack(t)
