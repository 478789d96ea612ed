"""Decode cases shared by the CPU tests and the GPU tests: a low-bit KV cache filled
from a prompt (rows of different lengths) and one appended step, and its oracle,
``reference_attention`` on each row's full sequence with the cache's smooth-K mean;
and the append cases, new tokens written into a filled cache, jnp or the kernel."""

import jax
import jax.numpy as jnp
import numpy as np

from dma_jax import DMAConfig, LowBitKVCache, reference_attention
from dma_jax.formats import dequantize_token_e4m3, quantize_token_e4m3

# (batch, prompt lengths, new rows, q_heads, kv_heads, head_dim, capacity, config, v_format, dtype):
# one row per run of the kernel (sink, far, the mixed tile, band), rows crossing a
# tile, a ring that has wrapped, MXFP4, FP8 V, all-high / all-low, no smoothing, and
# sink and band keys in bf16 (with MXFP4 and FP8 V).
CASES = [
    (1, (300,), 1, 4, 1, 64, 512, DMAConfig(), "input", jnp.bfloat16),
    (2, (700, 255), 3, 4, 2, 128, 1024, DMAConfig(diag_tiles=2), "input", jnp.bfloat16),
    (2, (300, 129), 2, 4, 2, 64, 512, DMAConfig(low="mxfp4"), "fp8", jnp.bfloat16),
    (1, (1000,), 1, 2, 1, 64, 1100, DMAConfig.all_low(), "input", jnp.float16),
    (1, (1000,), 1, 2, 1, 64, 1100, DMAConfig.all_high(), "fp8", jnp.float16),
    (1, (900,), 2, 2, 1, 64, 1000, DMAConfig(smooth_k=False, rotate="none"), "fp8", jnp.float32),
    (2, (300, 129), 2, 4, 2, 64, 512, DMAConfig(high="bf16", low="mxfp4"), "fp8", jnp.bfloat16),
]


# (batch, prompt lengths, new tokens, kv_heads, head_dim, capacity, config, v_format, dtype):
# rows of different lengths; tokens crossing a tile with a NaN key and an Inf value;
# a ring that has wrapped; positions past the capacity; no smoothing or rotation; the
# high copies in bf16, crossing a tile.
APPEND_CASES = [
    (2, (300, 250), 5, 2, 64, 512, DMAConfig(), "input", jnp.bfloat16),
    (2, (120, 60), 20, 1, 64, 512, DMAConfig(low="mxfp4"), "fp8", jnp.float16),
    (1, (700,), 3, 2, 128, 1024, DMAConfig(diag_tiles=2), "fp8", jnp.bfloat16),
    (2, (298, 100), 4, 1, 64, 300, DMAConfig(low_rule="4/6"), "input", jnp.float32),
    (1, (129,), 2, 1, 64, 512, DMAConfig(smooth_k=False, rotate="none", diag_tiles=0, sink_tiles=0), "input",
     jnp.bfloat16),
    (1, (250,), 8, 2, 64, 640, DMAConfig(high="bf16"), "fp8", jnp.float16),
]
APPEND_IDS = ["default", "mxfp4-fp8v-nan", "wrapped-ring-d128", "past-capacity-4over6", "plain", "bf16-high"]


def append_inputs(case):
    """(cache after the prompt, new keys, new values) of an ``APPEND_CASES`` case."""
    batch, lengths, new, hkv, d, capacity, config, v_format, dtype = case
    _, k, v = sequences(1, batch, max(lengths) + new, hkv, hkv, d, dtype)
    cache = LowBitKVCache.empty(batch, capacity, hkv, d, dtype=dtype, config=config, v_format=v_format)
    cache = cache.write(k[:, :max(lengths)], v[:, :max(lengths)], jnp.asarray(lengths))
    idx = jnp.asarray(lengths)[:, None] + jnp.arange(new)[None, :]
    rows = jnp.arange(batch)[:, None]
    k_new, v_new = k[rows, idx], v[rows, idx]
    if new > 10:
        k_new, v_new = k_new.at[0, 9, 0, 3].set(jnp.nan), v_new.at[1, 2, 0, 5].set(jnp.inf)
    return cache, k_new, v_new


def sequences(seed, batch, total, q_heads, kv_heads, head_dim, dtype, steps=1, new=1):
    """Keys and values of ``total`` positions and the queries of ``steps`` decode steps
    of ``new`` rows each: K with a per-channel offset (smooth-K's case) and outliers."""
    kq, kk, kv, ko = jax.random.split(jax.random.PRNGKey(seed), 4)
    k = jax.random.normal(kk, (batch, total, kv_heads, head_dim)) + 2.0 * jax.random.normal(ko, (1, 1, kv_heads,
                                                                                                  head_dim))
    k = k.at[..., :2].multiply(4.0)
    v = jax.random.normal(kv, (batch, total, kv_heads, head_dim))
    q = jax.random.normal(kq, (steps, batch, new, q_heads, head_dim)).at[..., :2].multiply(5.0)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def build(case, seed=0, value_octaves=0):
    """(q, cache after the prompt and one appended step, k, v): row b's prompt is its
    first ``lengths[b]`` positions, its step the next ``new``. ``value_octaves``: each
    token's values times 2^j, j uniform in [-value_octaves, value_octaves]."""
    batch, lengths, new, hq, hkv, d, capacity, config, v_format, dtype = case
    total = max(lengths) + new
    q, k, v = sequences(seed, batch, total, hq, hkv, d, dtype, new=new)
    if value_octaves:
        j = jax.random.randint(jax.random.PRNGKey(seed + 1), (batch, total, hkv, 1), -value_octaves,
                               value_octaves + 1)
        v = (v.astype(jnp.float32) * jnp.exp2(j.astype(jnp.float32))).astype(dtype)
    cache = LowBitKVCache.empty(batch, capacity, hkv, d, dtype=dtype, config=config, v_format=v_format)
    cache = cache.write(k[:, :max(lengths)], v[:, :max(lengths)], jnp.asarray(lengths))
    idx = jnp.asarray(lengths)[:, None] + jnp.arange(new)[None, :]
    rows = jnp.arange(batch)[:, None]
    cache = cache.append(k[rows, idx], v[rows, idx])
    return q[0], cache, k, v


def oracle_rows(q, cache, k, v, length_of_row):
    """``reference_attention`` on each row's full sequence (its first ``length_of_row[b]``
    positions, new rows last), on the CPU, float32 ``[B, n, HQ, D]``."""
    cpu = jax.devices("cpu")[0]
    out = []
    with jax.default_device(cpu):
        for b, length in enumerate(length_of_row):
            kb, vb = (jax.device_put(np.asarray(x[b:b + 1, :length]), cpu) for x in (k, v))
            if cache.v_format == "fp8":
                vb = dequantize_token_e4m3(quantize_token_e4m3(vb)).astype(vb.dtype)
            mean = jax.device_put(np.asarray(cache.k_mean[b:b + 1]), cpu) if cache.config.smooth_k else None
            qb = jax.device_put(np.asarray(q[b:b + 1]), cpu)
            out.append(np.asarray(reference_attention(qb, kb, vb, config=cache.config, k_mean=mean), np.float32)[0])
    return np.stack(out)


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def kernel_decode(q, cache, launch=None):
    """A decode step through ``dma_jax.torch_decode_attention`` (Triton's interpreter on
    the CPU, the cache handed over by DLPack), float32 ``[B, n, HQ, D]``. The query goes
    to the cache's device. ``launch``: other kernel settings (a ``tuning.DecodeConfig``),
    through the torch executor directly."""
    import torch

    from dma_jax import bridge, torch_decode_attention
    from triton_kernels import torch_executor
    from triton_kernels.geometry import CACHE_FIELDS

    device = bridge.to_torch(cache.length).device
    tq = torch.from_numpy(np.array(q.astype(jnp.float32))).to(device=device, dtype=getattr(torch, cache.dtype))
    if launch is None:
        return torch_decode_attention(tq, cache).float().cpu().numpy()
    arrays = {f: bridge.to_torch(getattr(cache, f)) for f in CACHE_FIELDS}
    sink_len, ring_len = cache.slots
    out = torch_executor.dma_decode(tq, arrays, sink_len=sink_len, ring_len=ring_len,
                                    v_fp8=cache.v_format == "fp8", launch=launch,
                                    **cache.config.decode_options(q.shape[3]))
    return out.float().cpu().numpy()


def kernel_append(cache, k, v):
    """The cache's arrays after ``cache.append(k, v)`` by the Triton append kernel
    (Triton's interpreter on the CPU, CUDA on a GPU), run on copies of the arrays
    through ``torch_executor.cache_append``: numpy arrays by ``CACHE_FIELDS`` but
    ``length``."""
    import torch

    from triton_kernels import torch_executor
    from triton_kernels.geometry import CACHE_FIELDS

    from conftest import HAS_CUDA

    device = "cuda" if HAS_CUDA else "cpu"

    def tensor(x):
        x = np.asarray(x)
        if x.dtype == jnp.bfloat16:
            return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16).to(device)
        return torch.from_numpy(x.copy()).to(device)

    arrays = {f: tensor(getattr(cache, f)) for f in CACHE_FIELDS}
    sink_len, ring_len = cache.slots
    out = torch_executor.cache_append(tensor(k), tensor(v), tensor(cache.k_mean), arrays, sink_len=sink_len,
                                      ring_len=ring_len, v_fp8=cache.v_format == "fp8",
                                      **cache.config.append_options())
    return {f: (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).cpu().numpy() for f, t in out.items()}
