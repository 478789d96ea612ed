import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU, Triton kernels run in Triton's interpreter on torch CPU tensors.
# The flag is read when a kernel is defined, so it is set before any test imports one.
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
