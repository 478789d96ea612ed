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
