"""What a launch plan is made for: a GPU of some compute capability, or Triton's
interpreter; and what that GPU does natively. Plain Python: each executor finds its
device's capability its own way (torch or JAX) and hands it over as a ``Target``."""

from __future__ import annotations

import os
from typing import NamedTuple

__all__ = ["Target", "interpreting", "native_formats", "resolve_native", "uses_sm90_kernel"]


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class Target(NamedTuple):
    """``capability``: (major, minor) of the GPU the kernels compile for, None in the
    interpreter. ``interpret``: kernels run in Triton's interpreter, whose E4M3
    conversion does not round to nearest and whose bf16 ``tl.dot`` is wrong, so the
    kernels take exact emulations there."""

    capability: tuple[int, int] | None
    interpret: bool = False

    @classmethod
    def interpreter(cls) -> "Target":
        return cls(None, True)


def native_formats(capability: tuple[int, int] | None) -> tuple[bool, bool]:
    """Whether the (high, low) tiles use ``tl.dot_scaled`` by default: every tile on
    sm_100 and later (Blackwell's block-scaled MMAs: ``kind::mxf8f6f4`` block32 for
    MXFP8, ``kind::mxf4`` block32 for MXFP4, ``kind::mxf4nvf4`` block16 with unsigned
    E4M3 scales for NVFP4), none before. The CPU suite runs this path in Triton's
    interpreter with PTX's scale semantics (tests/conftest.py)."""
    blackwell = capability is not None and capability[0] >= 10
    return blackwell, blackwell


def resolve_native(capability: tuple[int, int] | None, native: bool | None) -> tuple[bool, bool]:
    """(high, low) ``tl.dot_scaled`` switches: forced by ``native``, else by GPU."""
    if native is not None:
        return native, native
    return native_formats(capability)


def uses_sm90_kernel(capability: tuple[int, int] | None, head_dim: int, dtype: str, pv_fp8: bool,
                     native: tuple[bool, bool]) -> bool:
    """Whether a DMA call's attention launch is the Gluon sm_90 kernel rather than the
    Triton one: an sm_90 GPU, head_dim 128, bf16/fp16 V and P·V, Q·Kᵀ on copies
    (E4M3, or NVFP4's exact bf16 ones), not native. Elsewhere (head_dim 64, the FP8
    P·V) the Triton kernel measured as fast or faster on the H200."""
    return (capability == (9, 0) and head_dim == 128 and dtype in ("bfloat16", "float16") and not pv_fp8
            and not any(native))
