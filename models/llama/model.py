"""Flax NNX Llama: RMSNorm, SwiGLU, rotary embeddings (HF rotate-half), GQA, KV cache.

The KV cache is explicit: ``prefill`` and ``decode`` take a :class:`KVCache`
and return the updated one. Attention is chosen by an :class:`AttentionSpec`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import AttentionSpec
from .config import LlamaConfig


class KVCache(NamedTuple):
    """Keys and values of every layer: ``[layers, B, max_len, kv_heads, head_dim]``,
    and the number of filled positions."""

    k: jax.Array
    v: jax.Array
    length: jax.Array  # int32 scalar

    @classmethod
    def empty(cls, config: LlamaConfig, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
        shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))


def rope_frequencies(config: LlamaConfig) -> jax.Array:
    """Inverse frequencies [head_dim // 2], with Llama-3.1 scaling when configured."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if config.rope_llama3 is None:
        return inv
    factor, low, high, old = config.rope_llama3
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return jnp.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rotary(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half rotary embedding of ``x [B, T, H, D]`` at ``positions [T]`` (fp32 math)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * jnp.cos(emb) + rotated * jnp.sin(emb)).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.weight[...]).astype(x.dtype)


def _linear(rngs, n_in, n_out, dtype):
    return nnx.Linear(n_in, n_out, use_bias=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)


class MLP(nnx.Module):
    def __init__(self, config: LlamaConfig, dtype, rngs: nnx.Rngs):
        self.gate_proj = _linear(rngs, config.hidden_size, config.intermediate_size, dtype)
        self.up_proj = _linear(rngs, config.hidden_size, config.intermediate_size, dtype)
        self.down_proj = _linear(rngs, config.intermediate_size, config.hidden_size, dtype)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nnx.Module):
    def __init__(self, config: LlamaConfig, dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.q_proj = _linear(rngs, c.hidden_size, c.num_heads * c.head_dim, dtype)
        self.k_proj = _linear(rngs, c.hidden_size, c.num_kv_heads * c.head_dim, dtype)
        self.v_proj = _linear(rngs, c.hidden_size, c.num_kv_heads * c.head_dim, dtype)
        self.o_proj = _linear(rngs, c.num_heads * c.head_dim, c.hidden_size, dtype)

    def qkv(self, x, positions, inv_freq):
        c = self.config
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, c.num_heads, c.head_dim)
        k = self.k_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim)
        return rotary(q, positions, inv_freq), rotary(k, positions, inv_freq), v

    def out(self, o):
        b, t = o.shape[:2]
        return self.o_proj(o.reshape(b, t, -1))


class Block(nnx.Module):
    def __init__(self, config: LlamaConfig, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, dtype, rngs)


class Llama(nnx.Module):
    """Llama decoder. ``dtype`` is the compute dtype; parameters are float32."""

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                                      param_dtype=jnp.float32, rngs=rngs)
        self.layers = nnx.List([Block(config, dtype, rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else _linear(
            rngs, config.hidden_size, config.vocab_size, dtype)

    def _logits(self, h):
        h = self.norm(h)
        if self.lm_head is None:
            return self.embed_tokens.attend(h).astype(jnp.float32)
        return self.lm_head(h).astype(jnp.float32)

    def run_layers(self, tokens, positions, attend, write=lambda i, k, v: None):
        """Logits of ``tokens`` at ``positions`` with a custom attention:
        ``attend(layer, q, k, v) -> o`` (after RoPE); ``write(layer, k, v)`` sees
        each layer's keys and values. prefill and decode are built on it."""
        inv_freq = rope_frequencies(self.config)
        h = self.embed_tokens(tokens)
        for i, block in enumerate(self.layers):
            x = block.input_layernorm(h)
            q, k, v = block.self_attn.qkv(x, positions, inv_freq)
            write(i, k, v)
            h = h + block.self_attn.out(attend(i, q, k, v))
            h = h + block.mlp(block.post_attention_layernorm(h))
        return self._logits(h)

    def prefill(self, tokens: jax.Array, cache: KVCache | None, spec: AttentionSpec):
        """Logits ``[B, T, vocab]`` of a prompt at positions 0..T-1, and the cache
        holding its keys and values (``None`` in, ``None`` out: a plain forward)."""
        t = tokens.shape[1]
        scale = self.config.head_dim**-0.5
        new_k, new_v = [], []

        def write(i, k, v):
            new_k.append(k)
            new_v.append(v)

        logits = self.run_layers(tokens, jnp.arange(t), lambda i, q, k, v: spec.prefill_fn(q, k, v, sm_scale=scale), write)
        if cache is None:
            return logits, None
        if t > cache.k.shape[2]:
            raise ValueError(f"prompt of {t} tokens does not fit a cache of {cache.k.shape[2]}")
        k = jax.lax.dynamic_update_slice_in_dim(cache.k, jnp.stack(new_k).astype(cache.k.dtype), 0, axis=2)
        v = jax.lax.dynamic_update_slice_in_dim(cache.v, jnp.stack(new_v).astype(cache.v.dtype), 0, axis=2)
        return logits, KVCache(k, v, jnp.asarray(t, jnp.int32))

    def decode(self, tokens: jax.Array, cache: KVCache, spec: AttentionSpec):
        """One step: logits ``[B, 1, vocab]`` of ``tokens [B, 1]`` at position ``cache.length``."""
        pos = cache.length
        scale = self.config.head_dim**-0.5
        ks, vs = [cache.k[i] for i in range(self.config.num_layers)], [cache.v[i] for i in range(self.config.num_layers)]

        def write(i, k, v):
            ks[i] = jax.lax.dynamic_update_slice_in_dim(ks[i], k.astype(ks[i].dtype), pos, axis=1)
            vs[i] = jax.lax.dynamic_update_slice_in_dim(vs[i], v.astype(vs[i].dtype), pos, axis=1)

        def attend(i, q, k, v):
            return spec.decode_fn(q, ks[i].astype(q.dtype), vs[i].astype(q.dtype), q_offset=pos,
                                  kv_len=pos + 1, sm_scale=scale)

        logits = self.run_layers(tokens, pos[None], attend, write)
        return logits, KVCache(jnp.stack(ks), jnp.stack(vs), pos + 1)
