"""`dma_jax.torch_attention`: the DMA Triton kernel on PyTorch tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import bridge
from .config import DMAConfig
from .decode import check_decode_inputs
from .kv_cache import LowBitKVCache
from .validation import check_attention_inputs, check_prefill_config, resolve_q_offset

if TYPE_CHECKING:
    import torch

__all__ = ["torch_attention", "torch_decode_attention"]


def torch_attention(
    q: "torch.Tensor",
    k: "torch.Tensor",
    v: "torch.Tensor",
    *,
    causal: bool = True,
    config: DMAConfig | None = None,
    q_offset: int | None = None,
) -> "torch.Tensor":
    """DMA attention on torch tensors, same layout, options and numerics as
    :func:`dma_jax.attention` (inference only: no autograd).

    Needs CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1`` set before
    ``triton_kernels`` is first imported (slow; for tests).
    """
    import torch

    from triton_kernels.torch_executor import attention_plan, execute

    check_attention_inputs(q, k, v, causal=causal, config=config, q_offset=q_offset)
    check_prefill_config(config)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if len({x.device for x in (q, k, v)}) != 1:
        raise ValueError(f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")
    _check_device("torch_attention", q.device)
    if q.shape[0] == 0:  # an empty batch, as dma_jax.attention returns it
        return torch.zeros_like(q)
    config = config or DMAConfig()
    offset = resolve_q_offset(q.shape[1], k.shape[1], q_offset)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    with torch.no_grad():
        plan = attention_plan(q, k, v, causal=causal, q_offset=offset, **config.kernel_options(q.shape[3]))
        return execute(plan, q=q, k=k, v=v)


def torch_decode_attention(q: "torch.Tensor", cache: LowBitKVCache) -> "torch.Tensor":
    """:func:`dma_jax.decode_attention` for a torch query: the same kernels and numbers.

    ``q [batch, n, q_heads, head_dim]`` holds the queries of each row's last ``n``
    positions, already appended to ``cache`` (a :class:`dma_jax.LowBitKVCache` of JAX
    arrays, on the same device as ``q``). The cache's buffers are handed to torch
    through DLPack without a copy. Returns ``[batch, n, q_heads, head_dim]`` in ``q``'s
    dtype (inference only: no autograd).
    """
    import torch

    from triton_kernels.geometry import CACHE_FIELDS
    from triton_kernels.torch_executor import dma_decode

    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor; got {type(q).__name__}")
    check_decode_inputs(q, cache)
    arrays = {f: bridge.to_torch(getattr(cache, f)) for f in CACHE_FIELDS}
    if arrays["lo_codes"].device != q.device:
        raise ValueError(f"q and the cache must be on one device; got {q.device} and {arrays['lo_codes'].device}")
    _check_device("torch_decode_attention", q.device)
    sink_len, ring_len = cache.slots
    with torch.no_grad():
        return dma_decode(q, arrays, sink_len=sink_len, ring_len=ring_len, v_fp8=cache.v_format == "fp8",
                          **cache.config.decode_options(q.shape[3]))


def _check_device(name: str, device: "torch.device") -> None:
    """Triton's kernels need CUDA tensors, or Triton's interpreter for CPU ones."""
    from triton_kernels.target import interpreting

    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"{name} runs a Triton kernel and needs CUDA tensors; got device "
            f"{device} (set TRITON_INTERPRET=1 to run Triton's interpreter on CPU)"
        )
