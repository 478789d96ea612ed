"""dma_jax.torch_attention and the DLPack bridge on CPU (interpreter)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dma_jax import DMAConfig, bridge, reference_attention, torch_attention

import oracle
from conftest import HAS_CUDA

DEVICE = "cuda" if HAS_CUDA else "cpu"


def test_torch_attention_matches_reference():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 200, 6, 64, generator=g).half()
    k = torch.randn(1, 260, 2, 64, generator=g).half()
    v = torch.randn(1, 260, 2, 64, generator=g).half()
    cfg = DMAConfig(diag_tiles=2, low="mxfp4")
    out = torch_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), causal=True, config=cfg)
    assert out.dtype == torch.float16 and out.shape == q.shape
    with jax.default_device(jax.devices("cpu")[0]):
        ref = reference_attention(*(jnp.asarray(x.numpy()) for x in (q, k, v)), config=cfg)
    assert oracle.rel_l2(out.float().cpu().numpy(), np.asarray(ref, np.float32)) <= 2e-3


def test_torch_attention_accepts_non_contiguous_views():
    q = torch.randn(1, 64, 64, 2).half().transpose(2, 3)  # [1, 64, 2, 64], strided
    out = torch_attention(q.to(DEVICE), q.to(DEVICE), q.to(DEVICE))
    ref = torch_attention(q.contiguous().to(DEVICE), q.contiguous().to(DEVICE), q.contiguous().to(DEVICE))
    assert torch.equal(out, ref)


def test_torch_attention_validates_like_jax():
    q = torch.zeros(1, 16, 3, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"q_heads \(3\) must be a multiple of kv_heads \(2\)"):
        torch_attention(q, k, k)
    with pytest.raises(TypeError, match="dtype in .*; got int32"):
        torch_attention(q.int(), k.int(), k.int())
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        torch_attention(jnp.zeros((1, 16, 2, 64), jnp.bfloat16), k, k)
    with pytest.raises(ValueError, match=r"0 <= q_offset <= kv_len - q_len = 0; got -3"):
        torch_attention(k, k, k, q_offset=-3)


def test_torch_attention_of_an_empty_batch_is_empty():
    q, k = (torch.zeros(0, n, 2, 64, dtype=torch.bfloat16, device=DEVICE) for n in (5, 9))
    out = torch_attention(q, k, k)
    assert out.shape == (0, 5, 2, 64) and out.dtype == torch.bfloat16 and out.device == q.device


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-without-interpreter error; a GPU machine has CUDA tensors")
def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs CUDA tensors; got device cpu"):
        torch_attention(x, x, x)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e8m0fnu])
def test_bridge_to_torch_shares_the_buffer(dtype):
    x = jnp.arange(64, dtype=jnp.float32).astype(dtype)
    t = bridge.to_torch(x)
    assert t.data_ptr() == x.unsafe_buffer_pointer()
    if jnp.dtype(dtype).itemsize == 1:
        assert t.dtype == torch.uint8
        np.testing.assert_array_equal(t.cpu().numpy(), np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8)))
    else:
        np.testing.assert_array_equal(t.float().cpu().numpy(), np.asarray(x, np.float32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_bridge_from_torch_shares_the_buffer(dtype):
    t = torch.arange(64, dtype=torch.float32).to(dtype)
    x = bridge.from_torch(t)
    assert x.unsafe_buffer_pointer() == t.data_ptr()
    if dtype == torch.float8_e4m3fn:
        assert x.dtype == jnp.uint8
        np.testing.assert_array_equal(np.asarray(x), t.view(torch.uint8).numpy())
    else:
        np.testing.assert_array_equal(np.asarray(x, np.float32), t.float().numpy())
