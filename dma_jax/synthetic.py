"""Structured attention inputs that look like real LLM activations.

Random Gaussian Q/K make attention diffuse and hide what DMA is about. Real
Q/K have (a) a large per-channel bias in K, (b) a few outlier channels with
much larger magnitude, (c) rotary-like positional components that make nearby
tokens score high, and (d) an "attention sink" at the first token. These
inputs have all four, so that low-bit error and the value of the diagonal band
show up as they do in a real model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["llm_like_qkv"]


def llm_like_qkv(
    key: jax.Array,
    *,
    batch: int = 1,
    q_len: int = 1024,
    kv_len: int | None = None,
    q_heads: int = 4,
    kv_heads: int | None = None,
    head_dim: int = 128,
    dtype=jnp.bfloat16,
    n_outliers: int = 4,
    outlier_scale: float = 4.0,
    k_bias: float = 3.0,
    locality: float = 0.3,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Return ``q [B, q_len, Hq, D]``, ``k, v [B, kv_len, Hkv, D]`` in ``dtype``.

    The queries are the last ``q_len`` of ``kv_len`` positions.
    """
    kv_len = q_len if kv_len is None else kv_len
    kv_heads = q_heads if kv_heads is None else kv_heads
    groups = q_heads // kv_heads
    kq, kk, kv, kb, ko, kf = jax.random.split(key, 6)

    def noise(k, length, heads):
        return jax.random.normal(k, (batch, length, heads, head_dim), jnp.float32)

    k = noise(kk, kv_len, kv_heads)
    q = noise(kq, q_len, q_heads)
    v = noise(kv, kv_len, kv_heads)

    # (a) per-channel bias of K, shared by all tokens of a head.
    k = k + k_bias * jax.random.normal(kb, (batch, 1, kv_heads, head_dim))
    # (b) outlier channels, the same ones in Q and K (as in real models).
    channels = jax.random.choice(ko, head_dim, (n_outliers,), replace=False)
    boost = jnp.ones(head_dim).at[channels].set(outlier_scale)
    q, k = q * boost, k * boost
    # (c) rotary-like components on half the channels: q_p . k_t gains
    # sum_j cos((p - t) w_j), large when p and t are close.
    half = head_dim // 2
    freqs = 1.0 / (10.0 ** (4.0 * jnp.arange(half // 2) / (half // 2)))
    freqs = freqs * jnp.exp(0.1 * jax.random.normal(kf, freqs.shape))

    def rotary(positions):
        angle = positions[:, None] * freqs[None, :]
        pos = jnp.concatenate([jnp.cos(angle), jnp.sin(angle)], axis=-1)
        pad = jnp.zeros((positions.shape[0], head_dim - half))
        return jnp.concatenate([pos, pad], axis=-1)[None, :, None, :]

    k_pos = jnp.arange(kv_len, dtype=jnp.float32)
    q_pos = k_pos[kv_len - q_len:] if q_len <= kv_len else jnp.arange(q_len, dtype=jnp.float32)
    scale = locality * np.sqrt(head_dim / half) * 3.0
    k = k + scale * rotary(k_pos)
    q = q + scale * rotary(q_pos)
    # (d) a sink: token 0's key aligns with the mean query direction of its group.
    q_mean = q.reshape(batch, q_len, kv_heads, groups, head_dim).mean(axis=(1, 3))
    sink = 2.0 * q_mean / (jnp.linalg.norm(q_mean, axis=-1, keepdims=True) + 1e-6)
    k = k.at[:, 0].add(sink * np.sqrt(head_dim) * 2.0)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)
