"""benchmarks/device_name.py: result files are named after the GPU model, not the last
word of the device name (an H100's run once wrote ``hbm3.json``)."""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
from device_name import gpu_tag  # noqa: E402


@pytest.mark.parametrize("name, tag", [
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA GeForce RTX 4090", "4090"),
    ("Some Accelerator", "gpu"),
])
def test_gpu_tag_is_the_model(monkeypatch, name, tag):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: name)
    assert gpu_tag() == tag
