"""DMA decode over a low-bit KV cache (``dma_jax.decode_attention``, ``LowBitKVCache``):
the jnp path and the Triton kernel (Triton's interpreter on the CPU) against
``reference_attention`` on each row's full sequence and against the float64 oracle
while the band moves through the cache's ring of high copies; the FP8 values against
``ml_dtypes``; the cache's bytes; bad inputs."""

import dataclasses
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import triton
import triton.language as tl

import dma_jax
from dma_jax import DMAConfig, LowBitKVCache, decode_attention
from dma_jax.formats import dequantize_token_e4m3, quantize_token_e4m3
from triton_kernels import decode as decode_kernels
from triton_kernels.geometry import TILE, cache_slot, cache_slots
from triton_kernels.tuning import DecodeConfig

import decode_cases
import oracle
from conftest import TRITON_39, compiler_env

SLOW = pytest.mark.slow
CASE_IDS = ["default", "rows-cross-a-tile", "mxfp4-fp8v", "all-low-fp16", "all-high-fp8v", "plain-fp32", "bf16-high"]


def _params(fast):
    return [pytest.param(c, id=i, marks=() if i in fast else SLOW) for c, i in zip(decode_cases.CASES, CASE_IDS)]


@pytest.mark.parametrize("case", _params({"bf16-high"}))
def test_jnp_decode_equals_full_sequence_reference(case):
    """Decode over the cache computes what reference_attention computes on the full
    sequence for the new rows (same high/low pairs by absolute position, the cache's
    fixed smooth-K mean): equal up to float32 summation order. The inputs are committed to
    the CPU, so a machine with a GPU runs the jnp path here too."""
    q, cache, k, v = decode_cases.build(case)
    q, cache = jax.device_put((q, cache), jax.devices("cpu")[0])
    out = np.asarray(decode_attention(q, cache), np.float32)
    ref = decode_cases.oracle_rows(q, cache, k, v, np.asarray(cache.length))
    assert decode_cases.rel_l2(out, ref) <= 1e-5


@pytest.mark.parametrize("case", _params({"default", "bf16-high"}))
def test_decode_kernel_equals_full_sequence_reference(case):
    """The split-KV Triton kernel (interpreted on a CPU) against the same oracle: bf16 P rounded
    against the running row max, splits merged afterwards (rel-L2 <= 5e-3)."""
    q, cache, k, v = decode_cases.build(case)
    out = decode_cases.kernel_decode(q, cache)
    ref = decode_cases.oracle_rows(q, cache, k, v, np.asarray(cache.length))
    assert np.isfinite(out).all()
    assert decode_cases.rel_l2(out, ref) <= 5e-3


@pytest.mark.parametrize("value_octaves", [0, 60], ids=["values", "wide-value-scales"])
def test_lifted_fp8_values_give_the_same_numbers(value_octaves):
    """FP8 values (bf16 inputs) decoded by the conversions and lifted by bit moves
    (``DecodeConfig(lift_values=True)``: value · 2^-120, P's columns and each block's
    product rescaled by powers of two relative to the block's largest value scale). Both
    match the oracle and each other, also with token scales from 2^-60 to 2^60 in one
    block of keys (without the rescaling the factors overflow bf16)."""
    case = decode_cases.CASES[CASE_IDS.index("mxfp4-fp8v")]
    q, cache, k, v = decode_cases.build(case, value_octaves=value_octaves)
    ref = decode_cases.oracle_rows(q, cache, k, v, np.asarray(cache.length))
    converted = decode_cases.kernel_decode(q, cache)
    lifted = decode_cases.kernel_decode(q, cache, launch=DecodeConfig(lift_values=True))
    for out in (converted, lifted):
        assert np.isfinite(out).all()
        assert decode_cases.rel_l2(out, ref) <= 5e-3
    assert decode_cases.rel_l2(lifted, converted) <= 1e-6


def test_band_copies_are_replaced_as_the_band_moves():
    """Steps across a tile boundary with a ring that has wrapped: each step's output, by
    the jnp path and by the kernel, matches the float64 oracle on the full sequence, and
    a slot holds the high copy of the newest position that maps to it."""
    config = DMAConfig(diag_tiles=1, sink_tiles=1)
    prompt, steps, capacity = 636, 6, 1024
    sink_len, ring_len = cache_slots(capacity, 1, 1)
    assert (sink_len, ring_len) == (TILE, 2 * TILE)
    q, k, v = decode_cases.sequences(1, 1, prompt + steps, 2, 1, 64, jnp.float32, steps=steps)
    cache = LowBitKVCache.empty(1, capacity, 1, 64, dtype=jnp.float32, config=config).write(k[:, :prompt],
                                                                                           v[:, :prompt])
    step = jax.jit(lambda c, kk, vv, qq: (lambda c2: (c2, decode_attention(qq, c2)))(c.append(kk, vv)))
    for i in range(steps):
        cache, out = step(cache, k[:, prompt + i:prompt + i + 1], v[:, prompt + i:prompt + i + 1], q[i])
        length = prompt + i + 1
        keys = (np.asarray(k[:, :length]) - np.asarray(cache.k_mean)[:, None]).astype(np.float32)
        want = oracle.dma_attention(np.asarray(q[i]), keys, np.asarray(v[:, :length]), diag=1, sink=1,
                                    smooth_k=False)
        assert oracle.rel_l2(np.asarray(out), want) <= 2e-3, i
        assert oracle.rel_l2(decode_cases.kernel_decode(q[i], cache), want) <= 2e-3, i
    # Position 641 went to slot 128 + 641 % 256 = 257, replacing position 385 (tile 3).
    newest = prompt + steps - 1
    slot = int(cache_slot(newest, sink_len, ring_len))
    assert slot == sink_len + newest % ring_len
    hi = dma_jax.quantize(dma_jax.rotation.hadamard(k[:, newest] - cache.k_mean), "mxfp8_e4m3")
    np.testing.assert_array_equal(np.asarray(cache.hi_codes[:, slot]), np.asarray(hi.codes))


@pytest.mark.parametrize("case", [pytest.param(c, id=i) for c, i in zip(
    decode_cases.APPEND_CASES, decode_cases.APPEND_IDS)])
def test_append_kernel_writes_the_jnp_bytes(case):
    """The one-launch append kernel (interpreted on a CPU) writes the bytes that
    ``LowBitKVCache.append``'s jnp path writes, in every array, and leaves the rest of
    the cache alone."""
    cache, k_new, v_new = decode_cases.append_inputs(case)
    cpu = jax.devices("cpu")[0]
    want = jax.device_put(cache, cpu).append(jax.device_put(k_new, cpu), jax.device_put(v_new, cpu))
    got = decode_cases.kernel_append(cache, k_new, v_new)
    for f, x in got.items():
        w = np.asarray(getattr(want, f))
        np.testing.assert_array_equal(x, w.view(np.uint16) if w.dtype == jnp.bfloat16 else w, err_msg=f)


def test_append_places_tokens_and_drops_those_past_the_capacity():
    """Appended tokens land at their positions as ``dma_jax.quantize`` codes them, their
    high copies at their ring slots; tokens past the capacity change nothing, not even
    the high copy of the slot their position would wrap to."""
    cache, k_new, v_new = decode_cases.append_inputs(decode_cases.APPEND_CASES[3])
    cpu = jax.devices("cpu")[0]
    cache, k_new, v_new = jax.device_put((cache, k_new, v_new), cpu)
    after = cache.append(k_new, v_new)
    sink_len, ring_len = cache.slots
    assert (sink_len, ring_len) == (0, 300)  # every position has its own slot
    config = cache.config
    for row, length in enumerate((298, 100)):
        keys = dma_jax.rotation.hadamard(k_new[row].astype(jnp.float32) - cache.k_mean[row])
        hi = dma_jax.quantize(keys, config.high)
        lo = dma_jax.quantize(keys, config.low, config.low_rule)
        kept = min(4, 300 - length)
        np.testing.assert_array_equal(after.lo_codes[row, length:length + kept], lo.codes[:kept])
        np.testing.assert_array_equal(after.lo_token[row, length:length + kept], lo.token_scale[:kept])
        np.testing.assert_array_equal(after.hi_codes[row, length:length + kept], hi.codes[:kept])
        np.testing.assert_array_equal(after.v[row, length:length + kept], v_new[row, :kept])
    # Positions 300 and 301 of row 0 would wrap to slots 0 and 1: left alone.
    for f in ("hi_codes", "hi_scales"):
        np.testing.assert_array_equal(getattr(after, f)[0, :2], getattr(cache, f)[0, :2])
    np.testing.assert_array_equal(after.length, [302, 104])


def test_fp8_values_match_ml_dtypes():
    """V's FP8 form: one power-of-two scale per token, the smallest with amax / scale <=
    448, elements E4M3 rounded to nearest even (ml_dtypes)."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 6, 64)) * np.exp2(rng.integers(-20, 20, (4, 6, 1)))).astype(np.float32)
    x[0, 0] = 0.0
    got = quantize_token_e4m3(x)
    amax = np.abs(x).max(-1)
    e = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-38) / 448.0)), -127).astype(np.int64)
    e = np.where(amax / np.exp2(e - 1.0) <= 448.0, e - 1, e)  # log2 rounding at exact powers of two
    np.testing.assert_array_equal(np.asarray(got.scales), np.clip(e + 127, 0, 254).astype(np.uint8))
    want = (x / np.exp2(e.astype(np.float64))[..., None]).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(got.codes), want)
    back = np.asarray(dequantize_token_e4m3(got))
    np.testing.assert_array_equal(back, want.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
                                  * np.exp2(e.astype(np.float64))[..., None])
    nan = quantize_token_e4m3(np.array([[1.0, np.nan] * 16], np.float32))
    assert int(nan.scales[0]) == 0xFF and np.isnan(np.asarray(dequantize_token_e4m3(nan))).all()


@triton.jit
def _decode_codes_kernel(codes_ptr, even_ptr, odd_ptr, v_ptr, lifted_ptr, scale_ptr, HW: tl.constexpr,
                         F32: tl.constexpr):
    """Every byte value through the decode kernel's code readers: as two lifted E2M1
    nibbles, as an E4M3 value and lifted (V, read as words) and as an NVFP4 block scale."""
    rows, cols = tl.arange(0, 16), tl.arange(0, 16)
    at = rows[:, None] * 16 + cols[None, :]
    even, odd = decode_kernels._nibbles(tl.load(codes_ptr + at), True, HW, F32)
    tl.store(even_ptr + at, even.to(tl.float32))
    tl.store(odd_ptr + at, odd.to(tl.float32))
    tl.store(v_ptr + at, decode_kernels._e4m3_words(codes_ptr, rows, rows < 16, 16, False, HW, F32).to(tl.float32))
    tl.store(lifted_ptr + at,
             decode_kernels._e4m3_words(codes_ptr, rows, rows < 16, 16, True, HW, F32).to(tl.float32))
    tl.store(scale_ptr + at, decode_kernels._block_scales(codes_ptr, rows, rows < 16, 16, True, HW))


def test_code_readers_against_ml_dtypes():
    """The decode kernel's readers of cache bytes, for all 256 byte values, against
    ml_dtypes: a 4-bit code lifted is its E2M1 value times 2^-126 (subnormal for 0 and
    0.5), bit for bit; an E4M3 byte is its value, and lifted its value times 2^-120 (bf16
    subnormals for E4M3's); an unsigned E4M3 block scale is its value (NaN for 0x7F). On
    a GPU the PTX readers, in the interpreter their integer emulation. V's E4M3 NaN bytes
    are left out: the cache marks a non-finite token by its scale (0xFF), so its
    elements never hold them."""
    import torch

    from conftest import HAS_CUDA

    device = "cuda" if HAS_CUDA else "cpu"
    codes = torch.arange(256, dtype=torch.uint8, device=device)
    even, odd, v, lifted, scale = (torch.empty(256, dtype=torch.float32, device=device) for _ in range(5))
    _decode_codes_kernel[(1,)](codes, even, odd, v, lifted, scale, HW=HAS_CUDA, F32=not HAS_CUDA)
    b = np.arange(256, dtype=np.uint8)
    e2m1 = lambda n: n.view(ml_dtypes.float4_e2m1fn).astype(np.float32) * np.float32(2.0**-126)  # noqa: E731
    np.testing.assert_array_equal(even.cpu().numpy().view(np.uint32), e2m1(b & 0xF).view(np.uint32))
    np.testing.assert_array_equal(odd.cpu().numpy().view(np.uint32), e2m1(b >> 4).view(np.uint32))
    e4m3 = b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = np.isfinite(e4m3)  # a NaN value's token has the NaN scale instead
    np.testing.assert_array_equal(v.cpu().numpy()[finite], e4m3[finite])
    np.testing.assert_array_equal(lifted.cpu().numpy()[finite].view(np.uint32),
                                  (e4m3[finite] * np.float32(2.0**-120)).view(np.uint32))
    np.testing.assert_array_equal(scale.cpu().numpy()[:128], e4m3[:128])


@pytest.mark.parametrize("high", ["mxfp8_e4m3", "bf16"])
@pytest.mark.parametrize("v_format", ["input", "fp8"])
def test_bytes_per_token_counts_the_arrays(v_format, high):
    """``bytes_per_token`` (per token and kv head) against the arrays' own sizes, and
    against the formats: NVFP4 keys (64 + 8 + 4 bytes at head_dim 128), bf16 or
    E4M3 + E8M0 values, and the sink and band copies (128 + 4 bytes in MXFP8, 256 in
    bf16) in 3 tiles of slots."""
    config = DMAConfig(high=high)
    cache = LowBitKVCache.empty(2, 4096, 3, 128, v_format=v_format, config=config)
    per_token = LowBitKVCache.bytes_per_token(128, v_format=v_format, context=4096, config=config)
    fixed = cache.k_mean.nbytes + cache.length.nbytes + (0 if v_format == "fp8" else cache.v_scale.nbytes)
    fixed += cache.hi_scales.nbytes if high == "bf16" else 0
    assert (cache.nbytes() - fixed) / (2 * 4096 * 3) == pytest.approx(per_token)
    values = 129 if v_format == "fp8" else 256
    assert LowBitKVCache.bytes_per_token(128, v_format=v_format, config=config) == 76 + values
    assert per_token == pytest.approx(76 + values + 3 * TILE * (256 if high == "bf16" else 132) / 4096)


@pytest.mark.parametrize("make, message", [
    (lambda c, q: decode_attention(jnp.zeros((1, 1, 3, 64), jnp.bfloat16), LowBitKVCache.empty(1, 256, 2, 64)),
     "q_heads must be a multiple"),
    (lambda c, q: decode_attention(q[..., :32], c), "head_dim=64"),
    (lambda c, q: decode_attention(jnp.zeros((1, 129, 2, 64), jnp.bfloat16), c), "1 to 128 new query rows"),
    (lambda c, q: decode_attention(q.astype(jnp.float16), c), "cache's dtype bfloat16"),
    (lambda c, q: decode_attention(q, {"k": 1}), "must be a dma_jax.LowBitKVCache"),
    (lambda c, q: c.write(jnp.zeros((1, 300, 1, 64)), jnp.zeros((1, 300, 1, 64))), "do not fit a cache of capacity"),
    (lambda c, q: c.append(jnp.zeros((1, 1, 2, 64)), jnp.zeros((1, 1, 2, 64))), "kv_heads=1"),
    (lambda c, q: c.append(jnp.zeros((1, 2, 1, 64)), jnp.zeros((1, 1, 1, 64))), "same number of tokens"),
    (lambda c, q: c.append(jnp.zeros((1, 129, 1, 64)), jnp.zeros((1, 129, 1, 64))), "1 to 128 tokens"),
    (lambda c, q: LowBitKVCache.empty(1, 8, 1, 64, v_format="int8"), "v_format must be one of"),
    (lambda c, q: LowBitKVCache.empty(1, 8, 1, 96), "head_dim must be 64 or 128"),
    (lambda c, q: LowBitKVCache.empty(0, 8, 1, 64), "batch must be an int >= 1"),
    (lambda c, q: LowBitKVCache.empty(1, 8, 1, 64, dtype=jnp.int32), "dtype must be one of"),
    (lambda c, q: LowBitKVCache.empty(1, 8, 1, 64, config=DMAConfig.hopper_fast()), "pv='input'"),
    (lambda c, q: LowBitKVCache.empty(1, 8, 1, 64, config="default"), "config must be a DMAConfig"),
    (lambda c, q: DMAConfig(high="bf16", high_rule="up"), "high='bf16' has no block scales"),
])
def test_bad_inputs_are_named(make, message):
    cache = LowBitKVCache.empty(1, 256, 1, 64)
    q = jnp.zeros((1, 1, 2, 64), jnp.bfloat16)
    with pytest.raises((ValueError, TypeError), match=message):
        make(cache, q)


def test_torch_decode_bad_inputs_are_named(monkeypatch):
    """The torch entry point checks what decode_attention checks, and that q is a torch
    tensor on the cache's device that a Triton kernel can read."""
    import torch

    from dma_jax import torch_decode_attention

    cache = jax.device_put(LowBitKVCache.empty(1, 256, 1, 64), jax.devices("cpu")[0])
    q = torch.zeros(1, 1, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="q must be a torch.Tensor; got Array"):
        torch_decode_attention(jnp.zeros((1, 1, 2, 64), jnp.bfloat16), cache)
    with pytest.raises(TypeError, match="cache's dtype bfloat16; got float16"):
        torch_decode_attention(q.half(), cache)
    with pytest.raises(ValueError, match="head_dim=64"):
        torch_decode_attention(q[..., :32], cache)
    with pytest.raises(ValueError, match="one device; got meta and cpu"):
        torch_decode_attention(q.to("meta"), cache)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="torch_decode_attention runs a Triton kernel and needs CUDA tensors"):
        torch_decode_attention(q, cache)


def test_cache_passes_through_jit_with_its_config_static():
    """A LowBitKVCache is a pytree whose config is static: jit traces its arrays only."""
    cache = LowBitKVCache.empty(1, 256, 1, 64, config=DMAConfig(diag_tiles=2))
    leaves, tree = jax.tree.flatten(cache)
    assert len(leaves) == 9 and all(isinstance(x, jax.Array) for x in leaves)
    back = jax.jit(lambda c: c)(cache)
    assert back.config == DMAConfig(diag_tiles=2) and back.v_format == "input"
    assert dataclasses.replace(back, length=back.length + 1).length[0] == 1


def test_decode_and_append_have_no_gradient():
    """Both primitives are inference-only and say so when differentiated."""
    cache = LowBitKVCache.empty(1, 256, 1, 64, dtype=jnp.float32)
    q, k = jnp.ones((1, 1, 2, 64)), jnp.ones((1, 1, 1, 64))
    with pytest.raises(NotImplementedError, match="decode_attention is inference-only"):
        jax.grad(lambda q: decode_attention(q, cache.append(k, k)).sum())(q)
    with pytest.raises(NotImplementedError, match="LowBitKVCache.append is inference-only"):
        jax.grad(lambda k: cache.append(k, k).v.sum())(k)


COMPILE_FOR_SM90 = """
import sys
import jax.numpy as jnp
from dma_jax import DMAConfig, LowBitKVCache
from triton_kernels.aot import compile_kernel
from triton_kernels.geometry import CACHE_FIELDS
from triton_kernels.plan import Buffer, cache_append_plan, decode_plan
from triton_kernels.target import Target

config = DMAConfig(high=sys.argv[1])
empty = LowBitKVCache.empty(2, 512, 2, 64, config=config, v_format="fp8")
cache = {f: Buffer(f, getattr(empty, f).shape, jnp.dtype(getattr(empty, f).dtype).name) for f in CACHE_FIELDS}
sink_len, ring_len = empty.slots
new = Buffer("new_k", (2, 2, 2, 64), "bfloat16")
plans = [(decode_plan(Buffer("q", (2, 2, 4, 64), "bfloat16"), cache, Target((9, 0)), sink_len=sink_len,
                      ring_len=ring_len, v_fp8=True, **config.decode_options(64)), {"q": "bfloat16"}),
         (cache_append_plan(new, Buffer("new_v", new.shape, new.dtype), cache, Target((9, 0)), sink_len=sink_len,
                            ring_len=ring_len, v_fp8=True, **config.append_options()),
          {"new_k": "bfloat16", "new_v": "bfloat16", "k_mean": "float32"})]
for plan, inputs in plans:
    for launch in plan.launches:
        compile_kernel(plan, launch, {**inputs, **{f: b.dtype for f, b in cache.items()}}, 90)
        print(launch.kernel.fn.__name__)
"""


@pytest.mark.skipif(not TRITON_39, reason="compiling for sm_90 without a GPU needs triton >= 3.9 here")
def test_decode_launches_compile_for_sm90_with_a_bf16_band():
    """Without a GPU: a decode step's launches (Q's copies, the decode kernel, the
    combine) and the append compile for H100/H200 with ``high="bf16"``, whose copies are
    16-bit where the MX copies are bytes. Triton's compiler, unlike its interpreter,
    builds code that follows a return inside a compile-time branch: such code would
    reinterpret bf16 values as FP8 bytes and fail only on a GPU."""
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90, "bf16"], cwd=pathlib.Path(__file__).parents[1],
                          env=compiler_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["_dual_quantize_kernel", "_dma_decode_kernel", "_decode_combine_kernel",
                                   "_cache_append_kernel"]
