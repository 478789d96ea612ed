"""Accuracy ordering on LLM-like inputs: the diagonal band buys accuracy."""

import jax
import pytest

from dma_jax import DMAConfig, attention, exact_attention
from dma_jax.metrics import error_metrics
from dma_jax.synthetic import llm_like_qkv


@pytest.mark.parametrize("low,kv_heads", [("nvfp4", 2), ("mxfp4", 4)])
def test_error_all_high_lt_default_lt_all_low(low, kv_heads):
    q, k, v = llm_like_qkv(jax.random.PRNGKey(0), q_len=1024, q_heads=4, kv_heads=kv_heads)
    exact = exact_attention(q, k, v)
    configs = {
        "all-high": DMAConfig.all_high(low=low),
        "default": DMAConfig(low=low),
        "all-low": DMAConfig.all_low(low=low),
    }
    errors = {name: error_metrics(attention(q, k, v, config=c), exact) for name, c in configs.items()}
    for name, e in errors.items():
        print(f"{low:6s} {name:9s} cosine {e['cosine']:.5f}  rel_l1 {e['rel_l1']:.5f}  rmse {e['rmse']:.5f}")
    for metric in ("rel_l1", "rmse"):
        assert errors["all-high"][metric] < errors["default"][metric] < errors["all-low"][metric], metric
    assert errors["all-high"]["cosine"] > errors["default"]["cosine"] > errors["all-low"]["cosine"]


def test_smooth_k_reduces_low_bit_error():
    q, k, v = llm_like_qkv(jax.random.PRNGKey(1), q_len=512, q_heads=2)
    exact = exact_attention(q, k, v)
    smooth = error_metrics(attention(q, k, v, config=DMAConfig.all_low()), exact)
    raw = error_metrics(attention(q, k, v, config=DMAConfig.all_low(smooth_k=False)), exact)
    assert smooth["rel_l1"] < raw["rel_l1"]


def test_metrics_against_hand_computed_values():
    import numpy as np

    r = np.array([1.0, -2.0, 3.0, 0.0])
    o = np.array([1.5, -2.0, 2.0, 0.5])
    m = error_metrics(o, r)
    assert m["rel_l1"] == pytest.approx(2.0 / 6.0)
    assert m["rmse"] == pytest.approx(np.sqrt((0.25 + 1 + 0.25) / 4))
    assert m["max_abs"] == pytest.approx(1.0)
    assert m["cosine"] == pytest.approx((1.5 + 4 + 6) / (np.sqrt(14) * np.sqrt(1.5**2 + 4 + 4 + 0.25)))
