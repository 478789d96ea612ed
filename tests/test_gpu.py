"""GPU-only: the JAX and torch front ends on the real kernels."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import dma_jax
from dma_jax import DMAConfig, bridge, reference_attention, torch_attention
from triton_kernels.tuning import SM90_GLUON, LaunchConfig

import decode_cases
import oracle
from conftest import HAS_CUDA

pytestmark = pytest.mark.skipif(
    not (HAS_CUDA and any(d.platform == "gpu" for d in jax.devices())),
    reason="needs an NVIDIA GPU visible to both torch and JAX",
)


def inputs(seed, b, lq, lk, hq, hkv, d, dtype=jnp.bfloat16):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (b, lq, hq, d), jnp.float32).at[..., :2].multiply(5.0)
    k = jax.random.normal(kk, (b, lk, hkv, d), jnp.float32) + 1.5
    v = jax.random.normal(kv, (b, lk, hkv, d), jnp.float32)
    return [x.astype(dtype) for x in (q, k, v)]


# sm_100+ multiplies the quantized operands themselves (block-scaled MMAs); sm_90 the
# FP8 copies (Q per token, K per 128-key tile).
OPERANDS = "exact" if HAS_CUDA and torch.cuda.get_device_capability()[0] >= 10 else "fp8"


def cpu_reference(q, k, v, **kw):
    """The reference with the operands this GPU reads."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        args = [jax.device_put(np.asarray(x), cpu) for x in (q, k, v)]
        return np.asarray(reference_attention(*args, operands=kw.pop("operands", OPERANDS), **kw), np.float32)


CASES = [
    # (b, lq, lk, hq, hkv, d, causal, diag, sink, low, dtype)
    (1, 1000, 1000, 32, 8, 128, True, 1, 1, "nvfp4", jnp.bfloat16),
    (2, 300, 300, 9, 3, 64, False, 2, 1, "mxfp4", jnp.float16),
    (1, 127, 1000, 4, 1, 128, True, 0, 0, "nvfp4", jnp.float16),
    (1, 128, 128, 2, 2, 64, True, 2**30, 1, "nvfp4", jnp.float32),
    (1, 1, 385, 2, 1, 128, True, 1, 1, "nvfp4", jnp.bfloat16),
]


def tolerance(dtype):
    return 4e-3 if dtype == jnp.bfloat16 else 2e-3


@pytest.mark.parametrize("causal", [True, False])
def test_jax_unquantized_baseline_matches_float64(causal):
    """The benchmark's own bf16 path (Q·Kᵀ on the inputs) through JAX is
    plain attention up to bf16 rounding of P and of the output."""
    from dma_jax.executor import triton_input_attention

    q, k, v = inputs(17, 1, 300, 700, 8, 2, 128)
    f = jax.jit(lambda q, k, v: triton_input_attention(q, k, v, causal=causal, sm_scale=0.1, q_offset=400))
    out = np.asarray(f(q, k, v), np.float32)
    ref = oracle.dma_attention(q, k, v, causal=causal, diag=None, sm_scale=0.1, q_offset=400)
    assert oracle.rel_l2(out, ref) <= 4e-3


@pytest.mark.parametrize("b,lq,lk,hq,hkv,d,causal,diag,sink,low,dtype", CASES)
def test_jax_path_matches_reference(b, lq, lk, hq, hkv, d, causal, diag, sink, low, dtype):
    q, k, v = inputs(lq + lk, b, lq, lk, hq, hkv, d, dtype)
    cfg = DMAConfig(diag_tiles=diag, sink_tiles=sink, low=low)
    f = jax.jit(lambda q, k, v: dma_jax.attention(q, k, v, causal=causal, config=cfg))
    assert "triton_kernel_call" in f.lower(q, k, v).as_text()  # the kernel, not the reference
    out = np.asarray(f(q, k, v), np.float32)
    assert oracle.rel_l2(out, cpu_reference(q, k, v, causal=causal, config=cfg)) <= tolerance(dtype)


@pytest.mark.parametrize("b,lq,lk,hq,hkv,d,causal,diag,sink,low,dtype", CASES[:3])
def test_torch_path_matches_reference_and_jax(b, lq, lk, hq, hkv, d, causal, diag, sink, low, dtype):
    q, k, v = inputs(lq + lk, b, lq, lk, hq, hkv, d, dtype)
    cfg = DMAConfig(diag_tiles=diag, sink_tiles=sink, low=low)
    jax_out = dma_jax.attention(q, k, v, causal=causal, config=cfg)
    torch_out = torch_attention(*(bridge.to_torch(x) for x in (q, k, v)), causal=causal, config=cfg)
    ref = cpu_reference(q, k, v, causal=causal, config=cfg)
    assert oracle.rel_l2(torch_out.float().cpu().numpy(), ref) <= tolerance(dtype)
    # The same kernels with the same inputs: identical bits.
    assert torch.equal(torch_out, bridge.to_torch(jax_out))


@pytest.mark.parametrize("causal", [True, False])
def test_jax_fp8_pv_matches_reference(causal):
    """pv="fp8" through JAX (seven launches) on inputs whose rows peak at
    key 0, so the kernel's running max rounds P like the reference does."""
    q, k, v = inputs(7, 1, 1000, 1000, 8, 2, 128, jnp.float16)
    q = q.at[..., 0].set(jnp.abs(q[..., 0]) + 2)
    k = k.at[:, 0, :, 0].set(60)
    cfg = DMAConfig(pv="fp8")
    f = jax.jit(lambda q, k, v: dma_jax.attention(q, k, v, causal=causal, config=cfg))
    out = np.asarray(f(q, k, v), np.float32)
    assert oracle.rel_l2(out, cpu_reference(q, k, v, causal=causal, config=cfg)) <= 2e-3
    t_out = torch_attention(*(bridge.to_torch(x) for x in (q, k, v)), causal=causal, config=cfg)
    np.testing.assert_array_equal(t_out.float().cpu().numpy(), out)


def test_jax_then_torch_in_one_process():
    """JAX launches, then torch launches of the same kernels in one process, each
    compiling through Triton, which keeps its cache directory."""
    q, k, v = inputs(1, 1, 256, 256, 2, 2, 64)
    jax.block_until_ready(jax.jit(dma_jax.attention)(q, k, v))
    assert os.environ.get("TRITON_CACHE_DIR", "unset") != ""
    out = torch_attention(*(bridge.to_torch(x) for x in (q, k, v)))
    assert torch.isfinite(out).all()


def test_vmap_on_gpu():
    q, k, v = inputs(2, 4, 130, 130, 2, 1, 64)
    q, k, v = (x.reshape(2, 2, *x.shape[1:]) for x in (q, k, v))
    out = jax.jit(jax.vmap(dma_jax.attention))(q, k, v)
    flat = dma_jax.attention(*(x.reshape(4, *x.shape[2:]) for x in (q, k, v)))
    np.testing.assert_array_equal(np.asarray(out).reshape(flat.shape), np.asarray(flat))


@pytest.mark.skipif(len([d for d in jax.devices() if d.platform == "gpu"]) < 2,
                    reason="needs two or more GPUs (dma_jax.sharding on the kernels)")
def test_sharded_over_gpus_runs_per_device_and_equals_one_gpu():
    """Batch and heads sharded over the GPUs: each runs the kernels on its shard
    (no all-gather in the compiled program) and the result is bit-equal to one GPU's."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    gpus = np.array([d for d in jax.devices() if d.platform == "gpu"][:2])
    mesh = Mesh(gpus, ("model",))
    q, k, v = inputs(5, 2, 300, 300, 8, 2, 128)
    single = np.asarray(jax.jit(dma_jax.attention)(q, k, v))
    heads = NamedSharding(mesh, P(None, None, "model"))
    f = jax.jit(dma_jax.attention, out_shardings=heads)
    args = [jax.device_put(x, heads) for x in (q, k, v)]
    assert "all-gather" not in f.lower(*args).compile().as_text()
    np.testing.assert_array_equal(np.asarray(f(*args)), single)


def test_dlpack_is_zero_copy_on_gpu():
    x = jnp.ones((4, 128), jnp.bfloat16)
    t = bridge.to_torch(x)
    assert t.is_cuda and t.data_ptr() == x.unsafe_buffer_pointer()
    back = bridge.from_torch(t)
    assert back.unsafe_buffer_pointer() == t.data_ptr()
    codes = dma_jax.quantize(x, "mxfp8_e4m3").codes
    assert bridge.to_torch(codes).data_ptr() == codes.unsafe_buffer_pointer()


def test_long_sequence_runs():
    q, k, v = inputs(3, 1, 16384, 16384, 32, 32, 128)
    out = jax.jit(dma_jax.attention)(q, k, v)
    assert out.shape == q.shape and bool(jnp.isfinite(out).all())
    t_out = torch_attention(*(bridge.to_torch(x) for x in (q, k, v)))
    assert torch.isfinite(t_out).all()


ON_SM90 = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)
SM90_CASES = [
    # (b, lq, lk, hq, hkv, causal, q_offset, diag, sink): kv_len and q_len off the 128
    # grid, GQA, a KV cache (q_offset > 0), a chunk in mid-sequence,
    # all pairs high (diag covering everything), one query row.
    (2, 300, 300, 8, 2, True, 0, 1, 1),
    (1, 200, 700, 4, 4, False, 500, 1, 1),
    (1, 129, 1200, 6, 2, True, 1071, 2, 0),
    (1, 250, 300, 4, 1, True, 20, 1, 1),
    (1, 640, 640, 2, 2, False, 0, 2**30, 0),
    (1, 1, 1000, 4, 2, True, 999, 1, 1),
]


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernel is for sm_90 (Hopper)")
@pytest.mark.parametrize("nvfp4_copy", ["bf16", "e4m3"])
@pytest.mark.parametrize("b,lq,lk,hq,hkv,causal,q_offset,diag,sink", SM90_CASES)
def test_sm90_gluon_kernel_matches_reference_and_triton_kernel(b, lq, lk, hq, hkv, causal, q_offset, diag, sink,
                                                               nvfp4_copy):
    """head_dim 128, bf16: both front ends take the Gluon kernel with NVFP4's exact bf16
    copies and with the E4M3 opt-in; it computes what the Triton kernel computes on the
    same operands."""
    from dma_jax import executor
    from triton_kernels import torch_executor

    q, k, v = inputs(lq + lk + 1, b, lq, lk, hq, hkv, 128)
    cfg = DMAConfig(diag_tiles=diag, sink_tiles=sink, nvfp4_copy=nvfp4_copy)
    assert executor.attention_plan(q, k, v, causal=causal, config=cfg, q_offset=q_offset).launches[-1].gluon
    f = jax.jit(lambda q, k, v: dma_jax.attention(q, k, v, causal=causal, config=cfg, q_offset=q_offset))
    out = np.asarray(f(q, k, v), np.float32)
    ref = cpu_reference(q, k, v, causal=causal, config=cfg, q_offset=q_offset)
    assert oracle.rel_l2(out, ref) <= tolerance(jnp.bfloat16)

    tq, tk, tv = (bridge.to_torch(x) for x in (q, k, v))
    t_out = torch_attention(tq, tk, tv, causal=causal, config=cfg, q_offset=q_offset)
    np.testing.assert_array_equal(t_out.float().cpu().numpy(), out)
    # The same plan with the Triton kernel as its attention launch, on key blocks of
    # the same size (the online softmax rounds P against the running row maximum).
    triton_out = torch_executor.dma_attention(tq, tk, tv, causal=causal, q_offset=q_offset, kernel="triton",
                                              launch=LaunchConfig(64, SM90_GLUON.block_n, 4, 2),
                                              **cfg.kernel_options(128))
    assert oracle.rel_l2(t_out.float().cpu().numpy(), triton_out.float().cpu().numpy()) <= 1e-4


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernel is for sm_90 (Hopper)")
@pytest.mark.parametrize("nvfp4_copy", ["bf16", "e4m3"])
def test_sm90_gluon_kernel_propagates_nan(nvfp4_copy):
    """A NaN in one query row makes that row NaN (its token scale is NaN) and no other."""
    q, k, v = inputs(5, 1, 256, 256, 2, 1, 128)
    q = q.at[0, 200, 1, 3].set(jnp.nan)
    cfg = DMAConfig(nvfp4_copy=nvfp4_copy)
    out = np.asarray(jax.jit(lambda q, k, v: dma_jax.attention(q, k, v, causal=True, config=cfg))(q, k, v),
                     np.float32)
    expected = np.isnan(cpu_reference(q, k, v, causal=True, config=cfg))
    assert expected[0, 200, 1].all() and expected.sum() == 128
    np.testing.assert_array_equal(np.isnan(out), expected)


RULE_CONFIGS = [DMAConfig(rotate="hadamard"), DMAConfig(high_rule="floor", low_rule="4/6"),
                DMAConfig(low="mxfp4", high_rule="nearest", low_rule="up", rotate="hadamard"),
                DMAConfig(low_rule="floor", high="mxfp8_e5m2")]


@pytest.mark.parametrize("cfg", RULE_CONFIGS, ids=lambda c: f"{c.high}-{c.low}-{c.scale_rules}-{c.rotate}")
@pytest.mark.parametrize("d", [64, 128])
def test_scale_rules_and_rotation_match_reference(cfg, d):
    """Every scale rule and the rotation on odd shapes (GQA, ragged lengths), through
    JAX and torch: the reference's numbers, and the same bits from both front ends."""
    q, k, v = inputs(11 + d, 1, 333, 333, 6, 2, d)
    out = np.asarray(jax.jit(lambda q, k, v: dma_jax.attention(q, k, v, causal=True, config=cfg))(q, k, v),
                     np.float32)
    assert oracle.rel_l2(out, cpu_reference(q, k, v, causal=True, config=cfg)) <= tolerance(jnp.bfloat16)
    t_out = torch_attention(*(bridge.to_torch(x) for x in (q, k, v)), causal=True, config=cfg)
    np.testing.assert_array_equal(t_out.float().cpu().numpy(), out)


@pytest.mark.parametrize("causal", [True, False])
def test_non_finite_key_poisons_only_the_rows_that_see_it(causal):
    q, k, v = inputs(6, 1, 400, 400, 4, 2, 128)
    k = k.at[0, 250, 1, 17].set(jnp.inf)
    out = np.asarray(jax.jit(lambda q, k, v: dma_jax.attention(q, k, v, causal=causal))(q, k, v), np.float32)
    bad = np.zeros(out.shape[:3], bool)
    bad[0, 250 if causal else 0:, 2:] = True  # kv head 1 serves query heads 2 and 3
    assert np.isnan(out[bad]).all() and np.isfinite(out[~bad]).all()


@pytest.mark.parametrize("low", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("causal", [True, False])
def test_default_numerics_equal_the_exact_reference(low, causal):
    """With the default nvfp4_copy="bf16" the GPU computes the reference's own numbers
    (exact MX and NVFP4 operands), up to summation order: parity with
    ``reference_attention(operands="exact")`` on odd shapes, head_dim 64 and 128."""
    for d in (64, 128):
        q, k, v = inputs(21 + d, 1, 517, 517, 6, 2, d)
        cfg = DMAConfig(low=low)
        out = np.asarray(jax.jit(lambda q, k, v: dma_jax.attention(q, k, v, causal=causal, config=cfg))(q, k, v),
                         np.float32)
        cpu = jax.devices("cpu")[0]
        with jax.default_device(cpu):
            args = [jax.device_put(np.asarray(x), cpu) for x in (q, k, v)]
            ref = np.asarray(reference_attention(*args, causal=causal, config=cfg), np.float32)
        assert oracle.rel_l2(out, ref) <= 5e-3


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_model_cudnn_attention_matches_exact(dtype):
    """The Llama's "cudnn" choice: causal prefill, and decode rows at their own
    positions with per-row key lengths, equal exact attention up to bf16 rounding."""
    from models.llama import AttentionSpec

    spec, exact = AttentionSpec.named("cudnn"), AttentionSpec.named("exact")
    q, k, v = inputs(23, 2, 300, 300, 9, 3, 64, dtype)
    got = spec.prefill_fn(q, k, v, sm_scale=0.125)
    assert got.dtype == dtype
    want = exact.prefill_fn(q, k, v, sm_scale=0.125)
    assert oracle.rel_l2(np.asarray(got, np.float32), np.asarray(want, np.float32)) <= 1e-2
    pos = jnp.asarray([120, 299], jnp.int32)
    qd = q[:, :1]
    got = spec.decode_fn(qd, k, v, q_offset=pos, kv_len=pos + 1, sm_scale=0.125)
    want = exact.decode_fn(qd, k, v, q_offset=pos, kv_len=pos + 1, sm_scale=0.125)
    assert oracle.rel_l2(np.asarray(got, np.float32), np.asarray(want, np.float32)) <= 1e-2


@pytest.mark.parametrize("index", range(20))
def test_fuzz_through_jax_and_torch(index):
    """Ten random inputs of one random structure (tests/fuzz_cases.py; 20 structures, 200
    cases in all) through both front ends, against the float64 oracle; the two front
    ends give the same bits. The oracle gets the smooth-K mean in the bits the GPU forms
    (``channel_mean``, checked against float64 in test_quantize_kernel): one ulp of a
    mean summed in another order can move a key across a 4-bit rounding boundary
    (fuzz_cases says why NVFP4's floor rule is not drawn)."""
    import dataclasses

    from fuzz_cases import compare, fp8_accumulation, inputs, oracle_keys, oracle_kwargs, structure

    from triton_kernels.torch_executor import channel_mean

    s = structure(100 + index)
    f = jax.jit(lambda q, k, v: dma_jax.attention(q, k, v, causal=s.causal, config=s.config, q_offset=s.q_offset))
    # sm_90 reads E4M3 copies of the MX tiles (exact but for E4M3 subnormals) and,
    # with nvfp4_copy="e4m3", of the NVFP4 tiles; their FP8 products accumulate in
    # fewer bits than float32 (fuzz_cases.fp8_accumulation).
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    operands = "fp8" if sm90 and (s.config.low != "nvfp4" or s.config.nvfp4_copy == "e4m3") else "exact"
    failures = []
    for j in range(10):
        kind, (q, k, v) = inputs(s, 7919 * index + j)
        args = [jnp.asarray(x).astype(s.dtype) for x in (q, k, v)]
        out = np.asarray(f(*args), np.float32)
        t_out = torch_attention(*(bridge.to_torch(x) for x in args), causal=s.causal, config=s.config,
                                q_offset=s.q_offset)
        mean = channel_mean(bridge.to_torch(args[1])).cpu().numpy()[:, None] if s.config.smooth_k else None
        want = oracle.dma_attention(q, oracle_keys(s, k, mean), v, operands=operands, **oracle_kwargs(s))
        problem = compare(out, want, s, fp8_accumulation(s, q, k) if operands == "fp8" else 0.0)
        if not problem and not np.array_equal(t_out.float().cpu().numpy(), out, equal_nan=True):
            problem = "torch and JAX differ"
        if problem:
            failures.append(f"input {j} ({kind}): {problem}")
    assert not failures, f"{dataclasses.astuple(s)[:9]} {s.config}:\n" + "\n".join(failures)


@pytest.mark.parametrize("case", decode_cases.CASES + [
    (2, (32768, 20000), 1, 32, 8, 128, 32768 + 64, DMAConfig(), "input", jnp.bfloat16)],
    ids=lambda c: (f"{c[0]}x{c[1]}+{c[2]}-{c[3]}:{c[4]}-d{c[5]}-{c[7].high}-{c[7].low}-{c[7].diag_tiles}-{c[8]}-"
                   f"{jnp.dtype(c[9]).name}"))
def test_decode_kernel_matches_full_sequence_reference(case):
    """The split-KV decode kernel through JAX equals reference_attention on each
    row's full sequence (with the cache's fixed smooth-K mean), rel-L2 <= 5e-3; the
    torch entry point gives the same bits."""
    q, cache, k, v = decode_cases.build(case)
    out = np.asarray(jax.jit(dma_jax.decode_attention)(q, cache), np.float32)
    ref = decode_cases.oracle_rows(q, cache, k, v, np.asarray(cache.length))
    assert np.isfinite(out).all()
    assert decode_cases.rel_l2(out, ref) <= 5e-3
    t_out = dma_jax.torch_decode_attention(bridge.to_torch(q), cache)
    np.testing.assert_array_equal(t_out.float().cpu().numpy(), out)


@pytest.mark.parametrize("case", decode_cases.APPEND_CASES, ids=decode_cases.APPEND_IDS)
def test_append_kernel_writes_the_jnp_bytes_on_gpu(case):
    """``LowBitKVCache.append`` on the GPU runs the one-launch Triton kernel, in place
    on a donated cache, and writes the bytes of the jnp path on the CPU; so does the
    torch executor."""
    cache, k_new, v_new = decode_cases.append_inputs(case)
    cpu = jax.devices("cpu")[0]
    want = jax.device_put(cache, cpu).append(jax.device_put(k_new, cpu), jax.device_put(v_new, cpu))
    torch_got = decode_cases.kernel_append(cache, k_new, v_new)
    step = jax.jit(lambda c, k, v: c.append(k, v), donate_argnums=0)
    assert "triton_kernel_call" in step.lower(cache, k_new, v_new).as_text()
    got = step(cache, k_new, v_new)
    for f, x in torch_got.items():
        w, g = np.asarray(getattr(want, f)), np.asarray(getattr(got, f))
        if w.dtype == jnp.bfloat16:
            w, g = w.view(np.uint16), g.view(np.uint16)
        np.testing.assert_array_equal(g, w, err_msg=f)
        np.testing.assert_array_equal(x, w, err_msg=f"torch {f}")
    np.testing.assert_array_equal(got.length, want.length)
