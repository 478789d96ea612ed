"""DMA attention on torch tensors: smooth-K mean, dual quantization of Q and K, the kernel.

Four launches (mean partials, mean, quantize Q, quantize K), two more for the
FP8 P·V (V's channel amax partials, its transposed E4M3 copy), and one attention
launch: the Gluon kernel of ``attention_sm90`` where ``attention_sm90.applies``,
else ``attention``'s. The JAX front end (``dma_jax.kernels``) issues the same
launches through jax-triton (the Gluon kernel through ``dma_jax.gluon_call``). This module never imports JAX.
"""

from __future__ import annotations

import math

import torch

from .attention import all_high, device_capability, mx_attention, resolve_native
from .attention_sm90 import applies as sm90_applies
from .attention_sm90 import sm90_attention
from .quantize import channel_mean, dual_quantize, fp8_transpose


def softmax_fold(sm_scale: float) -> float:
    """The float32 factor ``sm_scale · log2(e)`` folded into Q (DESIGN.md §3.2)."""
    return float(torch.tensor(sm_scale * math.log2(math.e), dtype=torch.float32))


def dma_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    causal: bool, q_offset: int, diag_tiles: int, sink_tiles: int,
    high: str, low: str, smooth_k: bool, sm_scale: float, pv: str = "input", native: bool | None = None,
) -> torch.Tensor:
    """DMA on contiguous ``q [B, Lq, HQ, D]``, ``k, v [B, Lk, HKV, D]`` (checked by the caller).

    ``pv``: "input" or "fp8" (``DMAConfig.pv``). ``native``: force ``tl.dot_scaled``
    on (True) or off (False); default by GPU.
    """
    capability = device_capability(q.device)
    tiles = resolve_native(capability, low, native)
    has_lo = not all_high(q.shape[1], k.shape[1], q_offset, diag_tiles)
    copies = dict(high=high, low=low, codes=any(tiles), fp8=not all(tiles), write_lo=has_lo)
    mean = channel_mean(k) if smooth_k else None
    q8 = dual_quantize(q, fold=softmax_fold(sm_scale), **copies)
    k8 = dual_quantize(k, mean=mean, per_tile=copies["fp8"], **copies)
    vt, v_scale = fp8_transpose(v) if pv == "fp8" else (None, None)
    if sm90_applies(capability, q.shape[3], str(v.dtype).removeprefix("torch."), pv == "fp8", tiles):
        return sm90_attention(q8, k8, v, q_len=q.shape[1], causal=causal, q_offset=q_offset, diag=diag_tiles,
                              sink=sink_tiles, has_lo=has_lo)
    return mx_attention(q8, k8, v, q_len=q.shape[1], causal=causal, q_offset=q_offset,
                        diag=diag_tiles, sink=sink_tiles, high=high, low=low, native=tiles,
                        has_lo=has_lo, vt=vt, v_scale=v_scale)
