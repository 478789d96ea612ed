"""`dma_jax.torch_attention`: the DMA Triton kernel on PyTorch tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import DMAConfig
from .validation import check_attention_inputs, resolve_q_offset

if TYPE_CHECKING:
    import torch

__all__ = ["torch_attention"]


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

    from triton_kernels.target import interpreting
    from triton_kernels.torch_executor import attention_plan, execute

    check_attention_inputs(q, k, v, causal=causal, config=config, q_offset=q_offset)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if len({x.device for x in (q, k, v)}) != 1:
        raise ValueError(f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")
    if not q.is_cuda and not interpreting():
        raise ValueError(
            f"torch_attention runs a Triton kernel and needs CUDA tensors; got device "
            f"{q.device} (set TRITON_INTERPRET=1 to run Triton's interpreter on CPU)"
        )
    if q.shape[0] == 0:  # an empty batch, as dma_jax.attention returns it
        return torch.zeros_like(q)
    config = config or DMAConfig()
    offset = resolve_q_offset(q.shape[1], k.shape[1], q_offset)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    with torch.no_grad():
        plan = attention_plan(q, k, v, causal=causal, q_offset=offset, **config.kernel_options(q.shape[3]))
        return execute(plan, q=q, k=k, v=v)
