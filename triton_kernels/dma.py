"""DMA attention on torch tensors: smooth-K mean, dual quantization of Q and K, the kernel.

Three launches (smooth-K's partial sums, quantize Q, quantize K, which adds the
partials up into the mean), two more for the FP8 P·V (V's channel amax partials, its transposed E4M3 copy), and one attention
launch (``attend``): the Gluon kernel of ``attention_sm90`` where ``attention_sm90.applies``,
else ``attention``'s. The JAX front end (``dma_jax.kernels``) issues the same
launches through jax-triton (the Gluon kernel through ``dma_jax.gluon_call``). This module never imports JAX.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .attention import all_high, device_capability, mx_attention, resolve_native
from .attention_sm90 import applies as sm90_applies
from .attention_sm90 import sm90_attention
from .quantize import channel_sums, dual_quantize, fp8_transpose


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
    copies: dict[str, Any] = dict(high=high, low=low, codes=any(tiles), fp8=not all(tiles), write_lo=has_lo)
    mean = channel_sums(k) if smooth_k else None
    q8 = dual_quantize(q, fold=softmax_fold(sm_scale), **copies)
    k8 = dual_quantize(k, mean=mean, per_tile=copies["fp8"], **copies)
    vt, v_scale = fp8_transpose(v) if pv == "fp8" else (None, None)
    return attend(q8, k8, v, vt, v_scale, q_len=q.shape[1], causal=causal, q_offset=q_offset, diag=diag_tiles,
                  sink=sink_tiles, high=high, low=low, native=tiles, has_lo=has_lo, capability=capability)


def attend(q8, k8, v: torch.Tensor, vt: torch.Tensor | None, v_scale: torch.Tensor | None, *, q_len: int,
           causal: bool, q_offset: int, diag: int, sink: int, high: str, low: str, native: tuple[bool, bool],
           has_lo: bool, capability: tuple[int, int] | None) -> torch.Tensor:
    """The attention launch of a DMA call on its quantized operands (``dual_quantize``'s
    Q and K, V and, for the FP8 P·V, ``fp8_transpose``'s V^T and scales): the Gluon
    kernel where ``attention_sm90.applies``, else the Triton kernel."""
    if sm90_applies(capability, v.shape[3], str(v.dtype).removeprefix("torch."), vt is not None, native):
        return sm90_attention(q8, k8, v, q_len=q_len, causal=causal, q_offset=q_offset, diag=diag, sink=sink,
                              has_lo=has_lo)
    return mx_attention(q8, k8, v, q_len=q_len, causal=causal, q_offset=q_offset, diag=diag, sink=sink, high=high,
                        low=low, native=native, has_lo=has_lo, vt=vt, v_scale=v_scale)
