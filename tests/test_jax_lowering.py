"""dma_jax.kernels (the CUDA lowering through jax-triton) launches what the torch front
end launches, checked on CPU by recording the launches of both instead of running them.

The torch front end (``triton_kernels.dma.dma_attention``) is written separately and its
kernels are checked against the reference in the interpreter; here the JAX lowering's
kernels, grids, scalar arguments, argument shapes and dtypes, constexprs, warps and
stages must equal its, for the launch settings of an sm_90 and an sm_100 GPU.
``tests/test_gpu.py`` runs the JAX lowering itself on a GPU.
"""

import dataclasses
import types

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dma_jax import DMAConfig, kernels
from triton_kernels import attention as attn
from triton_kernels import attention_sm90 as attn90
from triton_kernels import dma
from triton_kernels import quantize as quant

KERNELS = [(quant, "_channel_reduce_kernel"), (quant, "_dual_quantize_kernel"),
           (quant, "_fp8_transpose_kernel"), (attn, "_dma_attention_kernel"), (attn90, "_dma_attention_sm90_kernel")]
ATTENTION = ("_dma_attention_kernel", "_dma_attention_sm90_kernel")


def _arg(x):
    """A launch argument as compared: (shape, dtype name) for arrays, the value otherwise."""
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), str(x.dtype).removeprefix("torch.")
    if hasattr(x, "shape") and hasattr(x, "dtype") and np.ndim(x) > 0:
        return tuple(x.shape), np.dtype(x.dtype).name
    return float(x) if isinstance(x, (float, np.floating)) else x


def _record(name, grid, args, kw, log):
    meta = {k: v for k, v in kw.items() if k not in ("num_warps", "num_stages")}
    log.append((name, tuple(grid), [_arg(a) for a in args], meta, kw.get("num_warps"), kw.get("num_stages")))


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **meta)`` is logged."""

    def __init__(self, fn, log):
        self.fn, self.log = fn, log

    def __getitem__(self, grid):
        return lambda *args, **kw: _record(self.fn.__name__, grid, args, kw, self.log)


def _fake_call(log):
    """Stands in for ``jax_triton.triton_call`` and ``dma_jax.gluon_call.gluon_call``."""
    def call(*args, kernel, out_shape, grid, **kw):
        outs = list(out_shape) if isinstance(out_shape, (list, tuple)) else [out_shape]
        # Both append the outputs to the kernel's arguments.
        _record(kernel.fn.__name__, grid, list(args) + outs, kw, log)
        arrays = [jnp.zeros(o.shape, o.dtype) for o in outs]
        return arrays if isinstance(out_shape, (list, tuple)) else arrays[0]
    return call


def _plans(monkeypatch, capability, config, causal, q_len, kv_len, heads, dim):
    """The launches of one DMA call through torch and through the JAX lowering."""
    torch_log, jax_log = [], []
    for module, name in KERNELS:
        monkeypatch.setattr(module, name, _Recorder(getattr(module, name).fn, torch_log))
    # Both front ends plan for a GPU of this capability: the torch one asks the tensors'
    # device (CPU here), the JAX one asks JAX.
    for module in (attn, quant):
        monkeypatch.setattr(module, "interpreting", lambda: False)
    plain_launch_config = attn.launch_config
    monkeypatch.setattr(attn, "launch_config",
                        lambda d, c, p, _cap, unquantized=False: plain_launch_config(d, c, p, capability, unquantized))
    monkeypatch.setattr(dma, "device_capability", lambda device: capability)
    monkeypatch.setattr(kernels, "_capability", lambda: capability)
    monkeypatch.setattr(kernels, "import_jax_triton", lambda: types.SimpleNamespace(triton_call=_fake_call(jax_log)))
    monkeypatch.setattr(kernels, "gluon_call", _fake_call(jax_log))
    # Which of Q's and K's nine operands the torch front end did not write (it passes
    # another operand in their place; the JAX lowering passes a one-element placeholder).
    # The Triton kernel takes all nine of each, the Gluon kernel the last four (FP8 copies).
    unwritten = []
    for launcher, first in (("mx_attention", 0), ("sm90_attention", 5)):
        def wrapped(q8, k8, v, plain=getattr(dma, launcher), first=first, **kw):
            unwritten.extend(getattr(x8, f.name) is None for x8 in (q8, k8) for f in dataclasses.fields(x8)[first:])
            return plain(q8, k8, v, **kw)
        monkeypatch.setattr(dma, launcher, wrapped)

    q_heads, kv_heads = heads
    offset = kv_len - q_len
    tq, tk, tv = (torch.zeros(1, n, h, dim, dtype=torch.bfloat16)
                  for n, h in ((q_len, q_heads), (kv_len, kv_heads), (kv_len, kv_heads)))
    dma.dma_attention(tq, tk, tv, causal=causal, q_offset=offset, diag_tiles=config.diag_tiles,
                      sink_tiles=config.sink_tiles, high=config.high, low=config.low, smooth_k=config.smooth_k,
                      sm_scale=config.softmax_scale(dim), pv=config.pv)
    jq, jk, jv = (jnp.zeros(t.shape, jnp.bfloat16) for t in (tq, tk, tv))
    out = kernels.triton_attention(jq, jk, jv, causal=causal, config=config, q_offset=offset)
    assert out.shape == jq.shape and out.dtype == jq.dtype
    for log in (torch_log, jax_log):
        assert log[-1][0] in ATTENTION
    for i, skip in enumerate(unwritten):  # the kernel never reads these
        if skip:
            assert jax_log[-1][2][i][0] == (1,), i
            torch_log[-1][2][i] = jax_log[-1][2][i] = "unwritten"
    return torch_log, jax_log


CONFIGS = {
    "default": DMAConfig(),
    "hopper_fast": DMAConfig.hopper_fast(),
    "mxfp4_no_smooth": DMAConfig(low="mxfp4", smooth_k=False, diag_tiles=2, sink_tiles=0),
    "pv_fp8_e5m2": DMAConfig(high="mxfp8_e5m2", pv="fp8"),
    "all_low": DMAConfig.all_low(),
    # A fold above 1 (4 * log2(e)) multiplies Q in without mul.ftz (quantize.FTZ_FOLD).
    "sm_scale_4": DMAConfig(sm_scale=4.0),
}


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)], ids=["sm90", "sm100"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_jax_lowering_launches_what_torch_launches(monkeypatch, capability, name, causal):
    config = CONFIGS[name]
    for q_len, kv_len, heads, dim in ((300, 300, (4, 2), 64), (1, 700, (6, 3), 128), (200, 456, (4, 4), 64)):
        torch_log, jax_log = _plans(monkeypatch, capability, config, causal, q_len, kv_len, heads, dim)
        # The Gluon kernel exactly where documented: Hopper, head_dim 128, P·V in bf16.
        gluon = capability == (9, 0) and dim == 128 and config.pv == "input"
        assert torch_log[-1][0] == ATTENTION[gluon]
        assert [launch[0] for launch in jax_log] == [launch[0] for launch in torch_log]
        for got, want in zip(jax_log, torch_log):
            assert got == want, (q_len, kv_len, got[0])
