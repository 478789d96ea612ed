"""Flax NNX Llama: RMSNorm, SwiGLU, rotary embeddings (HF rotate-half), GQA, KV cache.

The KV cache is explicit: ``prefill`` and ``decode`` take a :class:`KVCache`
and return the updated one. Rows of a batch may hold prompts of different lengths
(right-padded): each row has its own cache length, position and key mask.
Attention is chosen by an :class:`AttentionSpec`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import dma_jax

from .attention import AttentionSpec
from .config import LlamaConfig


class KVCache(NamedTuple):
    """Keys and values, one ``[B, max_len, kv_heads, head_dim]`` array per layer (so
    that a decode step updates each in place), and each row's number of filled
    positions ``[B]``."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    length: jax.Array  # int32 [B]

    @classmethod
    def empty(cls, config: LlamaConfig, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
        shape = (batch, max_len, config.num_kv_heads, config.head_dim)
        layers = range(config.num_layers)
        return cls(tuple(jnp.zeros(shape, dtype) for _ in layers), tuple(jnp.zeros(shape, dtype) for _ in layers),
                   jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def nbytes(self) -> int:
        """Bytes of the key and value buffers."""
        return sum(x.nbytes for x in (*self.k, *self.v))


@jax.tree_util.register_pytree_node_class
class LowBitCache:
    """DMA decode's cache (``AttentionSpec(decode="dma")``): one
    :class:`dma_jax.LowBitKVCache` per layer (``layers``), keys in DMA's formats, and
    each row's number of filled positions ``length [B]``. Every layer holds the same
    positions, so the layers' ``length`` is this one array, and as a pytree the cache
    carries it once: a decode step passes, donates and advances one length instead of
    one per layer. The cache keeps each layer's arrays without the length (``LowBitCache.of``
    takes them apart) and builds the layers when read, so that flattening and rebuilding
    it, which every jitted step does on the host, stays as cheap as a tuple's."""

    def __init__(self, parts: tuple, layout: tuple, length: jax.Array):
        self._parts, self._layout, self.length = parts, layout, length

    @classmethod
    def of(cls, layers: Sequence[dma_jax.LowBitKVCache], length: jax.Array) -> "LowBitCache":
        """The cache of ``layers``, all of them given ``length``."""
        parts, layout = [], []
        for layer in layers:
            leaves, treedef = jax.tree.flatten(dataclasses.replace(layer, length=length))
            at = next(i for i, x in enumerate(leaves) if x is length)
            parts.append(tuple(leaves[:at] + leaves[at + 1:]))
            layout.append((treedef, at))
        return cls(tuple(parts), tuple(layout), length)

    @property
    def layers(self) -> tuple[dma_jax.LowBitKVCache, ...]:
        return tuple(treedef.unflatten([*leaves[:at], self.length, *leaves[at:]])
                     for (treedef, at), leaves in zip(self._layout, self._parts))

    def tree_flatten(self):
        return (self._parts, self.length), self._layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        parts, length = children
        return cls(parts, layout, length)

    @classmethod
    def empty(cls, config: LlamaConfig, spec: AttentionSpec, batch: int, max_len: int,
              dtype=jnp.float32) -> "LowBitCache":
        cfg = spec.cache_config(config.head_dim**-0.5)
        layers = [dma_jax.LowBitKVCache.empty(batch, max_len, config.num_kv_heads, config.head_dim, dtype=dtype,
                                              config=cfg, v_format=spec.kv_cache) for _ in range(config.num_layers)]
        return cls.of(layers, layers[0].length)

    @property
    def max_len(self) -> int:
        return self.layers[0].capacity

    def nbytes(self) -> int:
        """Bytes of the layers' arrays and the length (counted once)."""
        return sum(x.nbytes for x in jax.tree.leaves(self))


def new_cache(config: LlamaConfig, spec: AttentionSpec, batch: int, max_len: int,
              dtype=jnp.float32) -> "KVCache | LowBitCache":
    """An empty cache of the kind ``spec``'s decode reads."""
    if spec.low_bit_cache:
        return LowBitCache.empty(config, spec, batch, max_len, dtype)
    return KVCache.empty(config, batch, max_len, dtype)


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
    """Rotate-half rotary embedding of ``x [B, T, H, D]`` at ``positions`` ``[T]`` or
    ``[B, T]`` (fp32 math)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([angles, angles], axis=-1)[..., None, :]
    if emb.ndim == 3:
        emb = emb[None]
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

    def run_layers(self, tokens, positions, attend, write=lambda i, k, v: None, select=None):
        """Logits of ``tokens`` at ``positions`` (``[T]`` or ``[B, T]``) with a custom
        attention: ``attend(layer, q, k, v) -> o`` (after RoPE); ``write(layer, k, v)``
        sees each layer's keys and values; ``select(h)`` picks the hidden states that
        get logits (default all). prefill and decode are built on it."""
        inv_freq = rope_frequencies(self.config)
        h = self.embed_tokens(tokens)
        for i, block in enumerate(self.layers):
            x = block.input_layernorm(h)
            q, k, v = block.self_attn.qkv(x, positions, inv_freq)
            write(i, k, v)
            h = h + block.self_attn.out(attend(i, q, k, v))
            h = h + block.mlp(block.post_attention_layernorm(h))
        return self._logits(h if select is None else select(h))

    def prefill(self, tokens: jax.Array, cache: KVCache | None, spec: AttentionSpec,
                lengths: jax.Array | None = None, last_only: bool = False):
        """Logits of a prompt at positions 0..T-1, and the cache holding its keys and
        values (``None`` in, ``None`` out: a plain forward). ``lengths [B]``: each row's
        prompt length when rows are right-padded to T (default T); the cache counts
        only those. Logits ``[B, T, vocab]``, or with ``last_only`` ``[B, vocab]`` at
        each row's last prompt token (the only ones generation needs)."""
        b, t = tokens.shape
        scale = self.config.head_dim**-0.5
        lengths = jnp.full((b,), t, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        new_k, new_v = [], []

        def write(i, k, v):
            new_k.append(k)
            new_v.append(v)

        def last(h):
            return h[jnp.arange(b), lengths - 1]

        # Causal attention: a row's padding comes after its prompt and never reaches it.
        logits = self.run_layers(tokens, jnp.arange(t), lambda i, q, k, v: spec.prefill_fn(q, k, v, sm_scale=scale),
                                 write, last if last_only else None)
        if cache is None:
            return logits, None
        if t > cache.max_len:
            raise ValueError(f"prompt of {t} tokens does not fit a cache of {cache.max_len}")
        if isinstance(cache, LowBitCache):
            layers = [layer.write(k, v, lengths) for layer, k, v in zip(cache.layers, new_k, new_v)]
            return logits, LowBitCache.of(layers, lengths)
        k = tuple(jax.lax.dynamic_update_slice_in_dim(c, x.astype(c.dtype), 0, axis=1) for c, x in zip(cache.k, new_k))
        v = tuple(jax.lax.dynamic_update_slice_in_dim(c, x.astype(c.dtype), 0, axis=1) for c, x in zip(cache.v, new_v))
        return logits, KVCache(k, v, lengths)

    def decode(self, tokens: jax.Array, cache: "KVCache | LowBitCache", spec: AttentionSpec):
        """One step: logits ``[B, 1, vocab]`` of ``tokens [B, 1]``, each row at its
        position ``cache.length``."""
        pos = cache.length
        if isinstance(cache, LowBitCache):
            layers = list(cache.layers)

            def append(i, k, v):
                layers[i] = layers[i].append(k, v)

            def attend_low_bit(i, q, k, v):
                return dma_jax.decode_attention(q.astype(layers[i].dtype), layers[i]).astype(q.dtype)

            logits = self.run_layers(tokens, pos[:, None], attend_low_bit, append)
            return logits, LowBitCache.of(layers, layers[0].length)
        rows = jnp.arange(tokens.shape[0])
        scale = self.config.head_dim**-0.5
        ks, vs = list(cache.k), list(cache.v)

        def write(i, k, v):
            ks[i] = ks[i].at[rows, pos].set(k[:, 0].astype(ks[i].dtype))
            vs[i] = vs[i].at[rows, pos].set(v[:, 0].astype(vs[i].dtype))

        def attend(i, q, k, v):
            return spec.decode_fn(q, ks[i].astype(q.dtype), vs[i].astype(q.dtype), q_offset=pos,
                                  kv_len=pos + 1, sm_scale=scale)

        logits = self.run_layers(tokens, pos[:, None], attend, write)
        return logits, KVCache(tuple(ks), tuple(vs), pos + 1)
