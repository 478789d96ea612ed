"""The short GPU name that result files carry (``h200.json``, ``quantize_h100.json``)."""

from __future__ import annotations

import re

import torch


def gpu_tag(name: str | None = None) -> str:
    """The model in a device name (by default the CUDA device's), lower case: "h200"
    for "NVIDIA H200", "h100" for "NVIDIA H100 80GB HBM3" (not its last word); "gpu"
    if none is found."""
    found = re.search(r"\b[A-Z]*\d{3,}[A-Za-z]*\b", torch.cuda.get_device_name() if name is None else name)
    return found.group(0).lower() if found else "gpu"
