"""Input checks shared by every public attention entry point."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .config import PREFILL_HIGH_FORMATS, DMAConfig

SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")
SUPPORTED_HEAD_DIMS = (64, 128)
# Positions stay int32 in the kernels' tile arithmetic.
MAX_OFFSET = 2**30


def is_array(x: Any) -> bool:
    """Whether ``x`` has the ``shape`` and ``dtype`` of a numpy, JAX or torch array."""
    return hasattr(x, "shape") and hasattr(x, "dtype")


def dtype_name(x: Any) -> str:
    """'bfloat16', 'float16', ... for numpy/JAX and torch arrays alike."""
    dtype = x.dtype
    if type(dtype).__module__.startswith("torch"):
        return str(dtype).rsplit(".", 1)[-1]
    return np.dtype(dtype).name


def check_attention_inputs(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool,
    config: DMAConfig | None,
    q_offset: int | None,
) -> None:
    """Raise ``TypeError``/``ValueError`` describing the first problem found.

    Expects ``q: [batch, q_len, q_heads, head_dim]`` and
    ``k, v: [batch, kv_len, kv_heads, head_dim]`` of one floating dtype.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not is_array(x):
            raise TypeError(f"{name} must be an array; got {type(x).__name__}")
        if len(x.shape) != 4:
            raise ValueError(
                f"{name} must have rank 4 [batch, seq_len, heads, head_dim]; "
                f"got shape {tuple(x.shape)}"
            )
        if dtype_name(x) not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name} must have dtype in {SUPPORTED_DTYPES}; got {dtype_name(x)}"
            )
    if not (dtype_name(q) == dtype_name(k) == dtype_name(v)):
        raise TypeError(
            f"q, k and v must share one dtype; got {dtype_name(q)}, {dtype_name(k)}, {dtype_name(v)}"
        )
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(
            f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    batch, q_len, q_heads, head_dim = q.shape
    kv_batch, kv_len, kv_heads, kv_head_dim = k.shape
    if batch != kv_batch:
        raise ValueError(f"batch size of q ({batch}) and k/v ({kv_batch}) differ")
    if head_dim != kv_head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and k/v ({kv_head_dim}) differ")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim must be one of {SUPPORTED_HEAD_DIMS}; got {head_dim}"
        )
    if q_heads % kv_heads:
        raise ValueError(
            f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads}) for GQA/MQA"
        )
    if q_len < 1 or kv_len < 1:
        raise ValueError(f"q_len and kv_len must be >= 1; got {q_len} and {kv_len}")
    if batch < 0:
        raise ValueError(f"batch must be >= 0; got {batch}")
    # (A DMAConfig is a static pytree node: jax.jit passes it through untraced.)
    for name, value in (("causal", causal), ("q_offset", q_offset)):
        if _is_traced(value):
            raise TypeError(
                f"{name} must be a static Python value, but it is traced ({type(value).__name__}): "
                f"options select kernels and shapes. Under jax.jit pass it statically, e.g. "
                f"jax.jit(functools.partial(dma_jax.attention, {name}=...)) or "
                f"jax.jit(dma_jax.attention, static_argnames=({name!r},))"
            )
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {causal!r}")
    if config is not None and not isinstance(config, DMAConfig):
        raise TypeError(f"config must be a DMAConfig or None; got {type(config).__name__}")
    if q_offset is None:
        if causal and q_len > kv_len:
            raise ValueError(
                f"causal attention with q_len ({q_len}) > kv_len ({kv_len}) needs an "
                "explicit q_offset (by default the queries are the last q_len tokens)"
            )
    elif isinstance(q_offset, bool) or not isinstance(q_offset, (int, np.integer)):
        raise TypeError(f"q_offset must be a Python int or None; got {q_offset!r}")
    elif causal and not 0 <= q_offset <= kv_len - q_len:
        raise ValueError(
            f"q_offset (the position of query row 0) must keep every query at a key position "
            f"for causal attention: 0 <= q_offset <= kv_len - q_len = {kv_len - q_len}; got {q_offset}"
        )
    elif abs(int(q_offset)) > MAX_OFFSET:
        raise ValueError(f"q_offset must be within ±{MAX_OFFSET}; got {q_offset}")


def check_prefill_config(config: DMAConfig | None) -> None:
    """The prefill front ends (``attention``, ``torch_attention``) run kernels whose high
    pairs are 8-bit: ``DMAConfig(high="bf16")`` is a decode cache's format."""
    if config is not None and config.high not in PREFILL_HIGH_FORMATS:
        raise ValueError(f"DMAConfig(high={config.high!r}) keeps a decode cache's sink and band keys in bf16 "
                         f"(dma_jax.LowBitKVCache, reference_attention); attention's kernels take high in "
                         f"{PREFILL_HIGH_FORMATS}")


def _is_traced(value: Any) -> bool:
    """Whether ``value`` is a JAX tracer (an argument of a jitted function)."""
    return isinstance(value, jax.core.Tracer)


def resolve_q_offset(q_len: int, kv_len: int, q_offset: int | None) -> int:
    """Absolute position of query row 0 (default: the queries are the last tokens)."""
    return kv_len - q_len if q_offset is None else int(q_offset)
