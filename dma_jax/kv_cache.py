"""A KV cache in DMA's formats for decoding (``dma_jax.decode_attention``).

Every key is kept in the low format (NVFP4 by default): a 4-bit key row is a quarter of
a bf16 one, and decode reads each key once per step. The keys that some query of the
step may compute in the high format (the first ``sink_tiles`` tiles and the tiles of
the diagonal band) are kept in MXFP8 as well, in a small ring of slots that the band
moves through (``triton_kernels.geometry.cache_slots``): a tile's high copy is
overwritten once the band has passed it. V stays in the input dtype, or with
``v_format="fp8"`` in E4M3 with one E8M0 scale per token (``formats.quantize_token_e4m3``).

Smooth-K subtracts a per-channel mean fixed when the prompt is written (the mean of its
finite keys), so the codes of cached keys never change as the sequence grows; the
softmax is unchanged by any per-channel constant, and ``reference_attention(...,
k_mean=cache.k_mean)`` on the full sequence gives the same numbers.

``append`` (a decode step's new tokens) is the primitive ``dma_cache_append``: on
NVIDIA GPUs one Triton launch that quantizes the tokens and writes them into the
cache's arrays in place (``triton_kernels.cache_append``), elsewhere jnp; both write
the same bytes. ``write`` (a prompt) is jnp.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from triton_kernels.format_table import BF16, FORMATS
from triton_kernels.geometry import CACHE_FIELDS, TILE, cache_slot, cache_slots

from .config import DMAConfig
from .formats import Quantized, bf16_copy, quantize, quantize_token_e4m3
from .kernel_primitive import kernel_primitive
from .reference import smoothing_mean
from .rotation import hadamard

__all__ = ["LowBitKVCache", "V_FORMATS", "dma_cache_append_p"]

V_FORMATS = ("input", "fp8")
_DTYPES = ("bfloat16", "float16", "float32")


def _keys(k: jax.Array, k_mean: jax.Array, config: DMAConfig):
    """The (low, high) copies of keys ``[B, T, H, D]`` after smooth-K's fixed mean
    ``[B, H, D]`` and the rotation, as ``reference_attention`` forms them: the high copy
    is ``Quantized``, or the bf16 values for ``high="bf16"``."""
    k32 = k.astype(jnp.float32)
    if config.smooth_k:
        k32 = k32 - k_mean[:, None]
    if config.rotate == "hadamard":
        k32 = hadamard(k32)
    hi_rule, lo_rule = config.scale_rules
    high = bf16_copy(k32) if config.high == BF16 else quantize(k32, config.high, hi_rule)
    return quantize(k32, config.low, lo_rule), high


def _encoded(k: jax.Array, v: jax.Array, mean: jax.Array, config: DMAConfig, v_fp8: bool,
             dtype: str) -> dict[str, jax.Array]:
    """New tokens' arrays by field: the low and high key copies after smooth-K's
    ``mean`` and the rotation, and the values (in ``dtype``, or E4M3 with ``v_fp8``);
    NVFP4's token scale, the high block scales and the FP8 values' scale only where
    the cache stores them."""
    lo, hi = _keys(jnp.asarray(k), mean, config)
    out = {"lo_codes": lo.codes, "lo_scales": lo.scales}
    if isinstance(hi, Quantized):
        out["hi_codes"], out["hi_scales"] = hi.codes, hi.scales
    else:
        out["hi_codes"] = hi
    if lo.token_scale is not None:
        out["lo_token"] = lo.token_scale
    if v_fp8:
        values = quantize_token_e4m3(v)
        out["v"], out["v_scale"] = values.codes, values.scales
    else:
        out["v"] = jnp.asarray(v).astype(dtype)
    return out


def _abstract_eval(k, v, k_mean, *cache, config, v_fp8, sink_len, ring_len):
    return [jax.core.ShapedArray(x.shape, x.dtype) for x in cache[:-1]]


def append_reference(k, v, k_mean, *cache, config: DMAConfig, v_fp8: bool, sink_len: int,
                     ring_len: int) -> list[jax.Array]:
    """The jnp body of ``dma_cache_append``: the cache's arrays (``CACHE_FIELDS`` but
    ``length``) with row b's new tokens ``k``, ``v [B, n, H, D]`` at positions
    ``length[b] ..``; positions at or past the capacity are dropped, high copies too."""
    arrays = dict(zip(CACHE_FIELDS, cache))
    b, n = k.shape[:2]
    capacity, slots = arrays["lo_codes"].shape[1], arrays["hi_codes"].shape[1]
    pos = arrays["length"][:, None] + jnp.arange(n)[None, :]
    slot = jnp.where(pos < capacity, cache_slot(pos, sink_len, ring_len), slots)
    rows = jnp.arange(b)[:, None]
    for f, x in _encoded(k, v, k_mean, config, v_fp8, arrays["v"].dtype).items():
        buf = arrays[f]
        arrays[f] = buf.at[rows, slot if f.startswith("hi_") else pos].set(x.astype(buf.dtype), mode="drop")
    return [arrays[f] for f in CACHE_FIELDS[:-1]]


dma_cache_append_p = kernel_primitive("dma_cache_append", append_reference, "triton_cache_append",
                                      multiple_results=True, public_name="LowBitKVCache.append")
dma_cache_append_p.def_abstract_eval(_abstract_eval)


@dataclasses.dataclass(frozen=True)
class LowBitKVCache:
    """One attention layer's keys and values in DMA's formats (a pytree: pass it
    through ``jax.jit``; the config, the V format and the dtype are static).

    Arrays (``B`` rows, ``S`` = capacity positions, ``H`` kv heads, ``D`` head_dim):
      lo_codes uint8 ``[B, S, H, D/2]``, lo_scales uint8 ``[B, S, H, D/block]``, lo_token
      float32 ``[B, S, H]`` (NVFP4's per-token scale; ``[1, 1, 1]`` for MXFP4): every key
      in ``config.low``.
      hi_codes uint8 ``[B, R, H, D]``, hi_scales uint8 ``[B, R, H, D/32]``: the sink and
      band keys in ``config.high``, in ``R = sink_len + ring_len`` slots; for
      ``high="bf16"`` hi_codes holds their bf16 values and hi_scales is ``[1, 1, 1, 1]``.
      v ``[B, S, H, D]``: the values in ``dtype``, or E4M3 codes (uint8) with v_scale
      uint8 ``[B, S, H]`` (E8M0) for ``v_format="fp8"``.
      k_mean float32 ``[B, H, D]``: smooth-K's fixed mean (zeros without smooth-K).
      length int32 ``[B]``: each row's filled positions.
    """

    lo_codes: jax.Array
    lo_scales: jax.Array
    lo_token: jax.Array
    hi_codes: jax.Array
    hi_scales: jax.Array
    v: jax.Array
    v_scale: jax.Array
    k_mean: jax.Array
    length: jax.Array
    config: DMAConfig = DMAConfig()
    v_format: str = "input"
    dtype: str = "bfloat16"

    @classmethod
    def empty(cls, batch: int, capacity: int, kv_heads: int, head_dim: int, *, dtype=jnp.bfloat16,
              config: DMAConfig | None = None, v_format: str = "input") -> "LowBitKVCache":
        """An empty cache for ``capacity`` positions of ``batch`` rows; ``dtype`` is the
        dtype of the queries it will serve (and of V with ``v_format="input"``)."""
        config = config or DMAConfig()
        if not isinstance(config, DMAConfig):
            raise TypeError(f"config must be a DMAConfig; got {type(config).__name__}")
        if v_format not in V_FORMATS:
            raise ValueError(f"v_format must be one of {V_FORMATS}; got {v_format!r}")
        name = jnp.dtype(dtype).name
        if name not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}; got {name}")
        for what, value in (("batch", batch), ("capacity", capacity), ("kv_heads", kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{what} must be an int >= 1; got {value!r}")
        if head_dim not in (64, 128):
            raise ValueError(f"head_dim must be 64 or 128; got {head_dim!r}")
        if config.pv != "input":
            raise ValueError(f"a low-bit KV cache keeps P·V in the input dtype: it needs DMAConfig(pv='input'); "
                             f"got pv={config.pv!r} (use v_format='fp8' for FP8 values)")
        lo = FORMATS[config.low]
        bf16_high = config.high == BF16
        sink_len, ring_len = cache_slots(capacity, config.sink_tiles, config.diag_tiles)
        grid = (batch, capacity, kv_heads)
        slots = (batch, sink_len + ring_len, kv_heads)
        fp8 = v_format == "fp8"
        return cls(
            lo_codes=jnp.zeros((*grid, head_dim // 2), jnp.uint8),
            lo_scales=jnp.zeros((*grid, head_dim // lo.block), jnp.uint8),
            lo_token=jnp.ones(grid if config.low == "nvfp4" else (1, 1, 1), jnp.float32),
            hi_codes=jnp.zeros((*slots, head_dim), jnp.bfloat16 if bf16_high else jnp.uint8),
            hi_scales=jnp.zeros((1, 1, 1, 1) if bf16_high else (*slots, head_dim // FORMATS[config.high].block),
                                jnp.uint8),
            v=jnp.zeros((*grid, head_dim), jnp.uint8 if fp8 else name),
            v_scale=jnp.zeros(grid if fp8 else (1, 1, 1), jnp.uint8),
            k_mean=jnp.zeros((batch, kv_heads, head_dim), jnp.float32),
            length=jnp.zeros((batch,), jnp.int32),
            config=config, v_format=v_format, dtype=name)

    @property
    def capacity(self) -> int:
        return self.lo_codes.shape[1]

    @property
    def slots(self) -> tuple[int, int]:
        """(sink_len, ring_len) of the high copies (``geometry.cache_slots``)."""
        return cache_slots(self.capacity, self.config.sink_tiles, self.config.diag_tiles)

    def nbytes(self) -> int:
        """Bytes of the cache's arrays."""
        return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(self))

    def _check(self, k, v, what: str) -> None:
        b, _, h, half = self.lo_codes.shape
        d = 2 * half
        for name, x in (("k", k), ("v", v)):
            shape = tuple(getattr(x, "shape", ()))
            if len(shape) != 4 or shape[0] != b or shape[2] != h or shape[3] != d:
                raise ValueError(f"{what}: {name} must be [batch={b}, tokens, kv_heads={h}, head_dim={d}]; "
                                 f"got {shape}")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"{what}: k and v must have the same number of tokens; got {k.shape[1]} and {v.shape[1]}")

    def write(self, k: jax.Array, v: jax.Array, lengths: jax.Array | None = None) -> "LowBitKVCache":
        """The cache holding a prompt's keys and values ``[B, T, H, D]`` at positions
        0..T-1, row b's first ``lengths[b]`` of them (default T; rows right-padded),
        with smooth-K's mean fixed from those keys."""
        self._check(k, v, "write")
        b, t = k.shape[:2]
        if t > self.capacity:
            raise ValueError(f"write: {t} tokens do not fit a cache of capacity {self.capacity}")
        lengths = jnp.full((b,), t, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        mean = self.k_mean
        if self.config.smooth_k:
            # Padding counts as non-finite: the mean is over each row's prompt only.
            valid = (jnp.arange(t)[None, :] < lengths[:, None])[..., None, None]
            mean = smoothing_mean(jnp.where(valid, jnp.asarray(k).astype(jnp.float32), jnp.nan))[:, 0]
        # Slot j of the high copies holds the latest prompt position that maps to it.
        sink_len, ring_len = self.slots
        j = jnp.arange(sink_len + ring_len)
        r = j - sink_len
        latest = r + ring_len * (jnp.maximum(lengths[:, None] - 1 - r, 0) // ring_len)
        pos = jnp.clip(jnp.where(j < sink_len, j, latest), 0, t - 1)  # [B, R]
        rows = jnp.arange(b)[:, None]
        placed: dict[str, Any] = {}
        for f, x in _encoded(k, v, mean, self.config, self.v_format == "fp8", self.dtype).items():
            buf = getattr(self, f)
            placed[f] = x[rows, pos] if f.startswith("hi_") else \
                jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), 0, axis=1)
        return dataclasses.replace(self, **placed, k_mean=mean, length=lengths)

    def append(self, k: jax.Array, v: jax.Array) -> "LowBitKVCache":
        """The cache with ``n`` new tokens per row ``[B, n, H, D]`` written at each row's
        positions ``length .. length + n - 1`` (1 <= n <= 128). Positions at or past the
        capacity are dropped: size the cache for prompt + new tokens."""
        self._check(k, v, "append")
        b, n = k.shape[:2]
        if not 1 <= n <= TILE:
            raise ValueError(f"append takes 1 to {TILE} tokens per row; got {n}")
        sink_len, ring_len = self.slots
        k, v = jnp.asarray(k), jnp.asarray(v)
        arrays = dma_cache_append_p.bind(k, v, self.k_mean, *(getattr(self, f) for f in CACHE_FIELDS),
                                         config=self.config, v_fp8=self.v_format == "fp8", sink_len=sink_len,
                                         ring_len=ring_len)
        return dataclasses.replace(self, **dict(zip(CACHE_FIELDS, arrays)), length=self.length + n)

    @staticmethod
    def bytes_per_token(head_dim: int, *, config: DMAConfig | None = None, v_format: str = "input",
                        dtype=jnp.bfloat16, context: int | None = None) -> float:
        """Cache bytes per token and kv head: the low key copy, the values and, spread
        over ``context`` tokens when given, the high copies' slots."""
        config = config or DMAConfig()
        lo = FORMATS[config.low]
        per: float = head_dim // 2 + head_dim // lo.block + (4 if config.low == "nvfp4" else 0)
        per += head_dim + 1 if v_format == "fp8" else head_dim * jnp.dtype(dtype).itemsize
        if context:
            sink_len, ring_len = cache_slots(context, config.sink_tiles, config.diag_tiles)
            high = 2 * head_dim if config.high == BF16 else head_dim + head_dim // FORMATS[config.high].block
            per += (sink_len + ring_len) * high / context
        return float(per)


jax.tree_util.register_dataclass(
    LowBitKVCache,
    data_fields=["lo_codes", "lo_scales", "lo_token", "hi_codes", "hi_scales", "v", "v_scale", "k_mean", "length"],
    meta_fields=["config", "v_format", "dtype"])
