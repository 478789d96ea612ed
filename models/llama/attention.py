"""Attention functions the Llama model can use, chosen by name.

Every function takes ``q [B, T, Hq, D]``, ``k, v [B, S, Hkv, D]``, the absolute
position of query row 0 (``q_offset``) and the number of valid keys (``kv_len``),
each a scalar or one per batch row ``[B]`` (traced during decode), and returns
``[B, T, Hq, D]``.

* ``exact``: jnp, fp32 softmax, GQA by grouping heads.
* ``xla``: ``jax.nn.dot_product_attention`` (implementation="xla").
* ``bf16``: ``jax.nn.dot_product_attention`` on Q, K, V rounded to bf16 (JAX's
  choice of implementation): the standard attention a JAX user would otherwise run.
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` in bf16 (an
  NVIDIA GPU only): the fastest bf16 attention JAX offers, the honest baseline.
* ``dma``: in prefill ``dma_jax.attention`` with a ``DMAConfig``; in decode
  ``dma_jax.decode_attention`` over a ``dma_jax.LowBitKVCache`` (the model then keeps
  its cache in DMA's formats: keys 4-bit, the band's also 8-bit, V in the compute
  dtype or with ``kv_cache="fp8"`` in E4M3). The paper decodes in exact attention.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import dma_jax
from dma_jax.config import HIGH_FORMATS
from triton_kernels.format_table import BF16

ATTENTION_NAMES = ("exact", "xla", "bf16", "cudnn", "dma")
DECODE_NAMES = ("exact", "xla", "bf16", "cudnn", "dma")
KV_CACHE_FORMATS = ("input", "fp8")


def _mask(q_len, kv_total, q_offset, kv_len):
    """``[B or 1, T, S]``: key s is visible to query row t (causal, below kv_len)."""
    q_offset = jnp.atleast_1d(jnp.asarray(q_offset))
    kv_len = jnp.atleast_1d(jnp.asarray(kv_len))
    q_pos = q_offset[:, None, None] + jnp.arange(q_len)[None, :, None]
    k_pos = jnp.arange(kv_total)[None, None, :]
    return (k_pos <= q_pos) & (k_pos < kv_len[:, None, None])


def exact(q, k, v, *, q_offset, kv_len, sm_scale):
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d)
    s = jnp.einsum("bthgd,bshd->bhgts", qg, k.astype(jnp.float32), precision="highest") * sm_scale
    s = jnp.where(_mask(t, k.shape[1], q_offset, kv_len)[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhgts,bshd->bthgd", p, v.astype(jnp.float32), precision="highest")
    return o.reshape(b, t, hq, d).astype(q.dtype)


def xla(q, k, v, *, q_offset, kv_len, sm_scale):
    mask = _mask(q.shape[1], k.shape[1], q_offset, kv_len)[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=sm_scale, implementation="xla")


def bf16(q, k, v, *, q_offset, kv_len, sm_scale):
    mask = _mask(q.shape[1], k.shape[1], q_offset, kv_len)[:, None]
    q16, k16, v16 = (x.astype(jnp.bfloat16) for x in (q, k, v))
    return jax.nn.dot_product_attention(q16, k16, v16, mask=mask, scale=sm_scale).astype(q.dtype)


def cudnn(q, k, v, *, q_offset, kv_len, sm_scale):
    """cuDNN's fused attention in bf16. A prefill (``q_offset`` 0, every key valid) is
    causal; a decode step (one query row at position ``q_offset``, ``kv_len`` =
    ``q_offset + 1``) sees its row's first ``kv_len`` keys, cuDNN's per-row key lengths."""
    if jax.default_backend() != "gpu":
        raise ValueError(f"cudnn attention needs an NVIDIA GPU; JAX's default backend is {jax.default_backend()!r}")
    b, t = q.shape[:2]
    q16, k16, v16 = (x.astype(jnp.bfloat16) for x in (q, k, v))
    if t == 1:
        lengths = jnp.broadcast_to(jnp.asarray(kv_len, jnp.int32), (b,))
        out = jax.nn.dot_product_attention(q16, k16, v16, scale=sm_scale, implementation="cudnn",
                                           key_value_seq_lengths=lengths)
    else:
        out = jax.nn.dot_product_attention(q16, k16, v16, scale=sm_scale, implementation="cudnn", is_causal=True)
    return out.astype(q.dtype)


_FUNCTIONS = {"exact": exact, "xla": xla, "bf16": bf16, "cudnn": cudnn}


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Which attention runs in prefill and in decode.

    ``prefill``: one of ``ATTENTION_NAMES``; ``decode``: one of ``DECODE_NAMES``.
    ``dma`` configures DMA (prefill and decode); ``kv_cache``: the values' format in
    DMA decode's cache, ``"input"`` (the compute dtype) or ``"fp8"``; ``decode_high``:
    the high format of DMA decode's cache (``dma.high`` for ``None``; ``"bf16"`` keeps
    its sink and band keys unquantized).
    """

    prefill: str = "exact"
    decode: str = "exact"
    dma: dma_jax.DMAConfig = dma_jax.DMAConfig()
    kv_cache: str = "input"
    decode_high: str | None = None

    def __post_init__(self) -> None:
        if self.prefill not in ATTENTION_NAMES:
            raise ValueError(f"unknown attention {self.prefill!r}; expected one of {ATTENTION_NAMES}")
        if self.decode not in DECODE_NAMES:
            raise ValueError(f"decode attention must be one of {DECODE_NAMES}; got {self.decode!r}")
        if self.kv_cache not in KV_CACHE_FORMATS:
            raise ValueError(f"kv_cache must be one of {KV_CACHE_FORMATS}; got {self.kv_cache!r}")
        if self.decode_high is not None and self.decode_high not in HIGH_FORMATS:
            raise ValueError(f"decode_high must be None or one of {HIGH_FORMATS}; got {self.decode_high!r}")
        if self.kv_cache != "input" and self.decode != "dma":
            raise ValueError(f"kv_cache={self.kv_cache!r} is the format of DMA decode's cache: it needs decode='dma'; "
                             f"got decode={self.decode!r}")
        if self.decode_high is not None and self.decode != "dma":
            raise ValueError(f"decode_high={self.decode_high!r} is a format of DMA decode's cache: it needs "
                             f"decode='dma'; got decode={self.decode!r}")

    @classmethod
    def named(cls, name: str, dma: dma_jax.DMAConfig | None = None, decode: str | None = None,
              kv_cache: str = "input", decode_high: str | None = None) -> "AttentionSpec":
        """``"dma"`` means DMA prefill with exact decode (the paper's setting)."""
        if name not in ATTENTION_NAMES:
            raise ValueError(f"unknown attention {name!r}; expected one of {ATTENTION_NAMES}")
        default_decode = "exact" if name == "dma" else name
        return cls(prefill=name, decode=decode or default_decode, dma=dma or dma_jax.DMAConfig(), kv_cache=kv_cache,
                   decode_high=decode_high)

    @property
    def low_bit_cache(self) -> bool:
        """Whether the model keeps its KV cache in DMA's formats (DMA decode)."""
        return self.decode == "dma"

    def dma_config(self, sm_scale: float) -> dma_jax.DMAConfig:
        """``dma`` with the model's softmax scale."""
        return dataclasses.replace(self.dma, sm_scale=sm_scale)

    def cache_config(self, sm_scale: float) -> dma_jax.DMAConfig:
        """DMA decode's config (its cache's formats): ``dma_config`` with ``decode_high``."""
        config = self.dma_config(sm_scale)
        if self.decode_high is None or self.decode_high == config.high:
            return config
        rule = None if BF16 in (self.decode_high, config.high) else config.high_rule
        return dataclasses.replace(config, high=self.decode_high, high_rule=rule)

    def prefill_fn(self, q, k, v, *, sm_scale):
        """Causal attention over a fresh prompt (queries = keys = positions 0..T-1)."""
        if self.prefill == "dma":
            return dma_jax.attention(q, k, v, causal=True, config=self.dma_config(sm_scale))
        return _FUNCTIONS[self.prefill](q, k, v, q_offset=0, kv_len=k.shape[1], sm_scale=sm_scale)

    def decode_fn(self, q, k, v, *, q_offset, kv_len, sm_scale):
        """One decode step over a cache of full-precision keys and values. DMA decode
        reads a low-bit cache instead (``dma_jax.decode_attention``)."""
        if self.decode == "dma":
            raise ValueError("decode='dma' reads a dma_jax.LowBitKVCache through dma_jax.decode_attention; "
                             "decode_fn takes full-precision keys and values")
        return _FUNCTIONS[self.decode](q, k, v, q_offset=q_offset, kv_len=kv_len, sm_scale=sm_scale)
