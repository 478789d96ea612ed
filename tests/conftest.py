import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU, Triton kernels run in Triton's interpreter on torch CPU tensors.
# The flag is read when a kernel is defined, so it is set before any test imports one.
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

# Ahead-of-time compilation for sm_90/sm_100 without a GPU needs triton >= 3.9 (the
# device image has 3.6). Such compiles run in a subprocess without the interpreter.
import triton  # noqa: E402  (after TRITON_INTERPRET is set)

TRITON_39 = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 9)


def compiler_env() -> dict:
    """The environment minus TRITON_INTERPRET: for a subprocess that compiles kernels."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: larger sweeps of checks the fast tier also makes on small inputs (make test-slow)")


def _ptx_scale_to_f32(original):
    """Triton's interpreter decodes every ``tl.dot_scaled`` scale byte as E8M0
    (``2^(byte - 127)``). That is PTX's meaning for the block-32 kinds we emit
    (``tcgen05.mma ... kind::mxf8f6f4`` / ``kind::mxf4 ... block_scale.block32``, scale
    type ``ue8m0``), but for NVFP4 (``kind::mxf4nvf4 ... block_scale.block16``) PTX
    defines the scale as ``ue4m3``: an unsigned E4M3 value, 0x7F NaN (PTX ISA,
    "tcgen05.mma" block scaling, scale_vec::4X with ue4m3). Our kernel passes NVFP4's
    scale bytes bitcast to float8e4nv, so a float8e4nv scale is decoded as E4M3 here."""
    import ml_dtypes
    import numpy as np
    import triton.language as tl

    def decode(scale_handle, compute_type):
        if scale_handle.dtype == tl.float8e4nv:
            bits = scale_handle.data.view(np.uint8) & np.uint8(0x7F)  # unsigned: the sign bit is not read
            return bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        return original(scale_handle, compute_type)

    return decode


def ptx_dot_scaled_semantics():
    """A context manager under which Triton's interpreter runs ``tl.dot_scaled`` with
    PTX's scale semantics for every kind the sm_100 kernel emits (see
    ``_ptx_scale_to_f32``)."""
    import contextlib

    from triton.runtime import interpreter

    @contextlib.contextmanager
    def patched():
        original = interpreter._dot_scaled_scale_to_f32
        interpreter._dot_scaled_scale_to_f32 = _ptx_scale_to_f32(original)
        try:
            yield
        finally:
            interpreter._dot_scaled_scale_to_f32 = original

    return patched()
