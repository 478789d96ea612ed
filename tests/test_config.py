"""DMAConfig: defaults, immutability and validation messages."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from triton_kernels.format_table import FORMATS

import dma_jax
from dma_jax import DMAConfig
from dma_jax.config import ALL_TILES


def test_defaults_follow_the_paper():
    c = DMAConfig()
    assert (c.diag_tiles, c.sink_tiles, c.high, c.low, c.smooth_k, c.sm_scale, c.pv) == (
        1, 1, "mxfp8_e4m3", "nvfp4", True, None, "input")
    assert c.softmax_scale(128) == 128**-0.5
    assert DMAConfig(sm_scale=0.1).softmax_scale(128) == 0.1


def test_numerics_defaults_are_the_measured_best():
    """README "Quality": rotation on, round-up scales for MXFP8 and NVFP4 (NVFP4 tiles
    exact on Hopper); the speed preset skips the rotation unless asked."""
    c = DMAConfig()
    assert (c.rotate, c.scale_rules, c.nvfp4_copy) == ("hadamard", ("up", "up"), "bf16")
    assert DMAConfig(low="mxfp4").scale_rules == ("up", "nearest")
    assert DMAConfig.hopper_fast().rotate == "none"
    assert DMAConfig.hopper_fast(rotate="hadamard").rotate == "hadamard"
    assert DMAConfig.all_low().rotate == DMAConfig.all_high().rotate == "hadamard"


def test_frozen_and_hashable():
    c = DMAConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.diag_tiles = 3
    assert hash(c) == hash(DMAConfig()) and c == DMAConfig()
    assert DMAConfig(diag_tiles=2) != c


def test_presets():
    assert DMAConfig.all_high().diag_tiles == ALL_TILES
    low = DMAConfig.all_low(low="mxfp4")
    assert (low.diag_tiles, low.sink_tiles, low.low) == (0, 0, "mxfp4")
    fast = DMAConfig.hopper_fast()
    assert (fast.diag_tiles, fast.pv, fast.high) == (ALL_TILES, "fp8", "mxfp8_e4m3")
    assert DMAConfig.hopper_fast(sm_scale=0.1).sm_scale == 0.1


@pytest.mark.parametrize("field,value,message", [
    ("diag_tiles", -1, r"DMAConfig.diag_tiles must be an int >= 0; got -1"),
    ("diag_tiles", 1.0, r"DMAConfig.diag_tiles must be an int >= 0; got 1.0"),
    ("sink_tiles", True, r"DMAConfig.sink_tiles must be an int >= 0; got True"),
    ("high", "nvfp4", r"DMAConfig.high must be one of \('mxfp8_e4m3', 'mxfp8_e5m2', 'bf16'\); got 'nvfp4'"),
    ("low", "int4", r"DMAConfig.low must be one of \('nvfp4', 'mxfp4'\); got 'int4'"),
    ("smooth_k", "yes", r"DMAConfig.smooth_k must be one of \(True, False\); got 'yes'"),
    ("pv", "bf16", r"DMAConfig.pv must be one of \('input', 'fp8'\); got 'bf16'"),
    ("sm_scale", 0.0, r"DMAConfig.sm_scale must be None or a finite float > 0; got 0.0"),
    ("sm_scale", float("nan"), r"sm_scale must be None or a finite float > 0; got nan"),
    ("sm_scale", np.float32(0.1), r"sm_scale must be None or a finite float > 0"),
])
def test_bad_values_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        DMAConfig(**{field: value})


def test_kernel_options_carry_every_field_the_kernels_need():
    """Both front ends pass these to the launch plan: a field left out would be ignored
    on the GPU while the reference honours it."""
    c = DMAConfig(diag_tiles=3, sink_tiles=0, high="mxfp8_e5m2", low="mxfp4", smooth_k=False, sm_scale=0.2, pv="fp8",
                  high_rule="floor", low_rule="nearest", rotate="hadamard", nvfp4_copy="e4m3", native=False)
    assert c.kernel_options(64) == dict(diag_tiles=3, sink_tiles=0, high="mxfp8_e5m2", low="mxfp4", smooth_k=False,
                                        sm_scale=0.2, pv="fp8", high_rule="floor", low_rule="nearest", rotate=True,
                                        nvfp4_copy="e4m3", native=False)
    assert {f.name for f in dataclasses.fields(DMAConfig)} == set(c.kernel_options(64))
    default = DMAConfig().kernel_options(64)
    assert default["sm_scale"] == 64**-0.5
    # None resolves to the formats' documented defaults.
    assert (default["high_rule"], default["low_rule"]) == (FORMATS["mxfp8_e4m3"].default_rule,
                                                           FORMATS["nvfp4"].default_rule)


@pytest.mark.parametrize("field, value, message", [
    ("high_rule", "4/6", r"DMAConfig.high_rule: mxfp8_e4m3 block scales accept the rules \('up', 'floor', 'nearest'\); got '4/6'"),
    ("low_rule", "ceil", r"DMAConfig.low_rule: nvfp4 block scales accept the rules .*'4/6'\); got 'ceil'"),
    ("rotate", True, r"DMAConfig.rotate must be one of \('none', 'hadamard'\); got True"),
    ("nvfp4_copy", "fp8", r"DMAConfig.nvfp4_copy must be one of \('bf16', 'e4m3'\); got 'fp8'"),
    ("native", 1, r"DMAConfig.native must be one of \(None, True, False\); got 1"),
    ("smooth_k", 0, r"DMAConfig.smooth_k must be one of \(True, False\); got 0"),
])
def test_bad_rules_and_rotation(field, value, message):
    with pytest.raises(ValueError, match=message):
        DMAConfig(**{field: value})


def test_bf16_high_is_a_decode_cache_format():
    """``high="bf16"`` has no block scales, and the prefill front ends, whose kernels
    multiply 8-bit high tiles, name the formats they take."""
    import torch

    assert DMAConfig(high="bf16").scale_rules == (None, "up")
    with pytest.raises(ValueError, match="high='bf16' has no block scales; got 'up'"):
        DMAConfig(high="bf16", high_rule="up")
    message = r"attention's kernels take high in \('mxfp8_e4m3', 'mxfp8_e5m2'\)"
    x = jnp.zeros((1, 8, 1, 64), jnp.float32)
    with pytest.raises(ValueError, match=message):
        dma_jax.attention(x, x, x, config=DMAConfig(high="bf16"))
    t = torch.zeros((1, 8, 1, 64))
    with pytest.raises(ValueError, match=message):
        dma_jax.torch_attention(t, t, t, config=DMAConfig(high="bf16"))


def test_tile_size_is_not_a_config_field():
    with pytest.raises(TypeError):
        DMAConfig(tile_size=128)
