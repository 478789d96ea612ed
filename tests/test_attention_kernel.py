"""The Triton DMA kernel against dma_jax.reference_attention.

On CPU the kernel runs in Triton's interpreter (conftest); on a GPU natively.
Tiles that are not native (``tl.dot_scaled``) read the FP8 copies (Q per token, K per tile), so
the reference runs with ``operands="fp8"`` there, ``"exact"`` for native tiles.
Tolerances: fp16 inputs ≤ 2e-3 relative L2. bf16 keeps 8 significant bits, and a
flash kernel rounds P relative to its running row max while the reference
rounds it relative to the final max: two bf16 roundings of P and of the output
put bf16 agreement at 1–2.5e-3, so bf16 cases allow 4e-3.
"""

import dataclasses
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dma_jax import DMAConfig
from dma_jax.reference import dma_reference
from dma_jax.config import ALL_TILES
from triton_kernels.geometry import all_high, band_covering_all
from triton_kernels.torch_executor import dma_attention, input_attention
from triton_kernels.tuning import LaunchConfig

import oracle
from conftest import HAS_CUDA, TRITON_39, compiler_env, ptx_dot_scaled_semantics

DEVICE = "cuda" if HAS_CUDA else "cpu"
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
JAX_DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


def make(seed, b, lq, lk, hq, hkv, d, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, lq, hq, d, generator=g)
    q[..., :2] *= 5.0  # outlier channels
    k = torch.randn(b, lk, hkv, d, generator=g) + 2.0 * torch.randn(1, 1, hkv, d, generator=g)
    v = torch.randn(b, lk, hkv, d, generator=g)
    return [x.to(TORCH_DTYPES[dtype]) for x in (q, k, v)]


def kernel_vs_reference(q, k, v, *, causal, config, q_offset=None, native=None, launch=None):
    lq, lk, d = q.shape[1], k.shape[1], q.shape[3]
    offset = lk - lq if q_offset is None else q_offset
    if native is not None:
        config = dataclasses.replace(config, native=native)
    out = dma_attention(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), causal=causal, q_offset=offset, launch=launch,
        **config.kernel_options(d),
    ).float().cpu().numpy()
    operands = "exact" if native else "fp8"
    with jax.default_device(jax.devices("cpu")[0]):
        args = [jnp.asarray(x.float().numpy()).astype(JAX_DTYPES["bf16" if q.dtype == torch.bfloat16 else "fp16"])
                for x in (q, k, v)]
        # The unvalidated reference: kernel tests also reach offsets the public API refuses.
        ref = np.asarray(dma_reference(*args, causal=causal, config=config, q_offset=offset, operands=operands),
                         np.float32)
    return out, ref


SLOW = pytest.mark.slow
CASES = [
    # (b, lq, lk, hq, hkv, d, causal, diag, sink): the smallest shapes that reach every
    # run of key tiles (sink, far, band, far side), masked and unmasked blocks, GQA and
    # MQA, ragged lengths, a KV cache (lq < lk), batches; the larger ones are the slow tier.
    (1, 1, 1, 2, 1, 64, True, 1, 1),
    (1, 127, 127, 2, 2, 128, True, 1, 1),
    (1, 128, 128, 3, 1, 64, False, 1, 1),
    (2, 300, 300, 2, 1, 64, True, 1, 1),
    pytest.param(1, 300, 300, 2, 1, 128, False, 2, 1, marks=SLOW),
    pytest.param(1, 130, 400, 2, 1, 128, True, 2, 1, marks=SLOW),
    (1, 200, 200, 4, 1, 64, True, 0, 0),
    (1, 300, 300, 4, 1, 64, True, ALL_TILES, 1),
    (1, 300, 300, 4, 1, 64, False, ALL_TILES, 0),
    pytest.param(1, 1, 385, 2, 1, 128, True, 1, 1, marks=SLOW),
    pytest.param(2, 300, 300, 9, 3, 64, True, 1, 1, marks=SLOW),
    pytest.param(1, 300, 300, 9, 3, 128, False, 2, 1, marks=SLOW),
    pytest.param(1, 1000, 1000, 2, 1, 64, True, 1, 1, marks=SLOW),
    pytest.param(1, 1000, 1000, 2, 2, 128, False, 0, 0, marks=SLOW),
    pytest.param(1, 200, 1000, 2, 1, 128, True, 2, 1, marks=SLOW),
    pytest.param(1, 129, 300, 32, 8, 64, True, 1, 1, marks=SLOW),
]


@pytest.mark.parametrize("b,lq,lk,hq,hkv,d,causal,diag,sink", CASES)
def test_kernel_matches_reference_fp16(b, lq, lk, hq, hkv, d, causal, diag, sink):
    q, k, v = make(lq + lk, b, lq, lk, hq, hkv, d, "fp16")
    cfg = DMAConfig(diag_tiles=diag, sink_tiles=sink)
    out, ref = kernel_vs_reference(q, k, v, causal=causal, config=cfg)
    assert out.shape == ref.shape
    assert oracle.rel_l2(out, ref) <= 2e-3


@pytest.mark.parametrize("low,high,causal", [
    ("nvfp4", "mxfp8_e4m3", True), ("mxfp4", "mxfp8_e5m2", False),
    pytest.param("nvfp4", "mxfp8_e4m3", False, marks=SLOW), pytest.param("mxfp4", "mxfp8_e5m2", True, marks=SLOW)])
def test_kernel_matches_reference_bf16(low, high, causal):
    q, k, v = make(3, 1, 300, 300, 2, 1, 128, "bf16")
    cfg = DMAConfig(low=low, high=high, sm_scale=0.1)
    out, ref = kernel_vs_reference(q, k, v, causal=causal, config=cfg)
    assert oracle.rel_l2(out, ref) <= 4e-3


@pytest.mark.parametrize("causal,q_offset", [(True, 40), (False, -50), (False, 200)])
def test_explicit_q_offset(causal, q_offset):
    q, k, v = make(4, 1, 150, 300, 2, 1, 64, "fp16")
    out, ref = kernel_vs_reference(q, k, v, causal=causal, config=DMAConfig(), q_offset=q_offset)
    assert oracle.rel_l2(out, ref) <= 2e-3


def test_rows_without_valid_keys_are_zero():
    q, k, v = make(5, 1, 200, 100, 2, 1, 64, "fp16")
    out, ref = kernel_vs_reference(q, k, v, causal=True, config=DMAConfig(), q_offset=-130)
    assert (out[:, :130] == 0).all()
    assert oracle.rel_l2(out, ref) <= 2e-3


def test_nan_propagates_to_its_rows():
    q, k, v = make(6, 1, 130, 130, 2, 1, 64, "fp16")
    q[0, 7, 1, 3] = float("nan")
    out, _ = kernel_vs_reference(q, k, v, causal=True, config=DMAConfig())
    assert np.isnan(out[0, 7, 1]).all()
    mask = np.ones(out.shape[:3], bool)
    mask[0, 7, 1] = False
    assert np.isfinite(out[mask]).all()


@pytest.mark.parametrize("config", [DMAConfig(rotate="hadamard", low_rule="4/6"),
                                    DMAConfig(low="mxfp4", high_rule="floor", low_rule="up", rotate="hadamard")],
                         ids=["hadamard-4/6", "hadamard-mxfp4-floor-up"])
def test_rotation_and_scale_rules_match_reference(config):
    q, k, v = make(9, 1, 200, 200, 2, 1, 64, "bf16")
    out, ref = kernel_vs_reference(q, k, v, causal=True, config=config)
    assert oracle.rel_l2(out, ref) <= 4e-3


def test_nvfp4_tiles_give_the_reference_numbers_unless_rounded_to_e4m3():
    """NVFP4 tiles on the non-native path multiply exact bf16 copies of e·sb: the
    kernel then differs from the reference (exact operands) by summation order and the
    rounding of P only. The E4M3 opt-in rounds e·sb and moves further away."""
    q, k, v = make(10, 1, 300, 300, 2, 1, 64, "bf16")
    exact_out, exact_ref = kernel_vs_reference(q, k, v, causal=False, config=DMAConfig.all_low())
    e4m3_out, e4m3_ref = kernel_vs_reference(q, k, v, causal=False, config=DMAConfig.all_low(nvfp4_copy="e4m3"))
    assert oracle.rel_l2(exact_out, exact_ref) <= 2e-3
    assert oracle.rel_l2(e4m3_out, e4m3_ref) <= 4e-3
    assert oracle.rel_l2(e4m3_out, exact_ref) > 3 * oracle.rel_l2(exact_out, exact_ref)


def test_non_finite_key_poisons_only_the_rows_that_see_it():
    """Smooth-K's mean skips the Inf key: only the rows at or after it (causal) of its
    head group turn NaN, and every other row matches the reference. All pairs NVFP4:
    Triton's interpreter decodes the E4M3 NaN byte of the high copies as 480, so the
    MXFP8 tiles' NaN rows are checked on the GPU (tests/test_gpu.py)."""
    q, k, v = make(8, 1, 200, 200, 2, 1, 64, "fp16")
    k[0, 150, 0, 9] = float("inf")
    out, ref = kernel_vs_reference(q, k, v, causal=True, config=DMAConfig.all_low())
    assert np.isnan(out[0, 150:]).all() and np.isfinite(out[0, :150]).all()
    assert oracle.rel_l2(out[0, :150], ref[0, :150]) <= 2e-3


SM100_CASES = [
    # (b, lq, lk, hq, hkv, d, causal, config): every format pair, scale rule and the
    # rotation on the block-scaled path, GQA, ragged lengths, head_dim 64 and 128.
    (1, 300, 300, 2, 1, 128, True, DMAConfig()),
    (1, 130, 260, 4, 2, 64, False, DMAConfig(low="mxfp4", diag_tiles=2)),
    (2, 150, 150, 2, 1, 64, True, DMAConfig(high="mxfp8_e5m2", low_rule="4/6", rotate="none", diag_tiles=0,
                                            sink_tiles=0)),
    pytest.param(1, 300, 300, 6, 2, 128, False, DMAConfig(high_rule="floor", low_rule="nearest"), marks=SLOW),
    pytest.param(1, 257, 400, 4, 1, 128, True, DMAConfig(low="mxfp4", high_rule="nearest", low_rule="up",
                                                         rotate="none"), marks=SLOW),
    pytest.param(1, 129, 129, 2, 2, 64, True, DMAConfig(low_rule="floor", sink_tiles=0), marks=SLOW),
]


@pytest.mark.parametrize("b,lq,lk,hq,hkv,d,causal,cfg", SM100_CASES)
def test_sm100_block_scaled_path_matches_reference(b, lq, lk, hq, hkv, d, causal, cfg):
    """The sm_100 path (``tl.dot_scaled`` for every tile: the kernel source and format
    constexprs a B200 compiles; the interpreter's own emulation switches aside) under
    PTX's scale semantics (conftest: E8M0 per 32 for MX, unsigned E4M3 per 16 for
    NVFP4) computes the reference's exact numbers."""
    q, k, v = make(lq + d, b, lq, lk, hq, hkv, d, "fp16")
    with ptx_dot_scaled_semantics():
        out, ref = kernel_vs_reference(q, k, v, causal=causal, config=cfg, native=True)
    assert oracle.rel_l2(out, ref) <= 2e-3


def test_sm100_nvfp4_check_depends_on_the_scale_semantics():
    """Decoding NVFP4's scales as E8M0 (the interpreter's unpatched behaviour) would be
    caught: the NVFP4 tiles then miss the reference by far."""
    q, k, v = make(8, 1, 300, 300, 2, 1, 64, "fp16")
    out, ref = kernel_vs_reference(q, k, v, causal=True, config=DMAConfig(), native=True)
    assert oracle.rel_l2(out, ref) > 0.1


def sink_dominated(seed, lq, lk, hq, hkv, d):
    """Inputs whose every query row peaks at key 0: a flash kernel's running max is
    then final from the first key block, so it rounds P exactly like the reference."""
    q, k, v = make(seed, 1, lq, lk, hq, hkv, d, "fp16")
    q, k = q.float(), k.float()
    q[..., 0] = q[..., 0].abs() + 2.0
    k[:, 0, :, 0] = 60.0
    return q.half(), k.half(), v


@pytest.mark.parametrize("causal,low", [(True, "nvfp4"), pytest.param(False, "mxfp4", marks=SLOW)])
def test_fp8_pv_matches_reference(causal, low):
    q, k, v = sink_dominated(11, 300, 300, 2, 1, 64)
    cfg = DMAConfig(low=low, pv="fp8")
    out, ref = kernel_vs_reference(q, k, v, causal=causal, config=cfg)
    assert oracle.rel_l2(out, ref) <= 2e-3
    _, ref_input_pv = kernel_vs_reference(q, k, v, causal=causal, config=DMAConfig(low=low))
    assert oracle.rel_l2(out, ref_input_pv) > 4e-3  # it is an FP8 P·V, not the default one


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_fp8_pv_on_diffuse_attention(dtype):
    """Without a dominant key the kernel rounds P against its running max and the
    reference against the final one; E4M3's 3 mantissa bits make that ~1e-2."""
    q, k, v = make(12, 1, 260, 260, 2, 1, 64, dtype)
    cfg = DMAConfig.all_high(pv="fp8")
    out, ref = kernel_vs_reference(q, k, v, causal=False, config=cfg)
    assert oracle.rel_l2(out, ref) <= 3e-2
    assert np.isfinite(out).all()


@pytest.mark.parametrize("block_m,block_n", [(64, 64), pytest.param(64, 128, marks=SLOW),
                                             pytest.param(128, 128, marks=SLOW)])
def test_launch_shapes(block_m, block_n):
    """Every launch shape the tuning table may pick gives the same attention."""
    q, k, v = make(13, 1, 300, 300, 2, 1, 64, "fp16")
    cfg = DMAConfig(diag_tiles=2)
    launch = LaunchConfig(block_m, block_n, 4, 2)
    for causal, offset in ((True, 0), (False, -70)):
        out, ref = kernel_vs_reference(q, k, v, causal=causal, config=cfg, q_offset=offset, launch=launch)
        assert oracle.rel_l2(out, ref) <= 2e-3, (causal, offset)


COMPILE_PTX = """
import sys
from triton_kernels.aot import block_scaled_mmas, compile_kernel, ptxas_usage, wgmma_kinds
from triton_kernels.plan import Buffer, attention_plan
from triton_kernels.target import Target

arch, low, native, pv_fp8, copy = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1", sys.argv[5]
q, kv = Buffer("q", (1, 1024, 8, 128), "bfloat16"), Buffer("k", (1, 1024, 2, 128), "bfloat16")
plan = attention_plan(q, kv, Buffer("v", kv.shape, "bfloat16"), Target((arch // 10, arch % 10)), causal=True,
                      q_offset=0, diag_tiles=1, sink_tiles=1, high="mxfp8_e4m3", low=low, smooth_k=True,
                      sm_scale=0.1, pv="fp8" if pv_fp8 else "input", nvfp4_copy=copy, native=True if native else None,
                      kernel="triton")
ptx = compile_kernel(plan, plan.launches[-1], {"q": "bfloat16", "k": "bfloat16", "v": "bfloat16"}, arch).asm["ptx"]
print(block_scaled_mmas(ptx))  # (kind, scale block, scale type from the instruction descriptor)
print(wgmma_kinds(ptx))
usage = ptxas_usage(ptx)
print(usage["spill_stores"] + usage["spill_loads"])
"""


def _compiled_mma_kinds(arch: int, low: str, native_low: bool, pv_fp8: bool = False, nvfp4_copy: str = "bf16") -> str:
    # A compiled (not interpreted) kernel is needed: run without TRITON_INTERPRET.
    env = compiler_env()
    root = pathlib.Path(__file__).parents[1]
    args = [str(arch), low, "1" if native_low else "0", "1" if pv_fp8 else "0", nvfp4_copy]
    done = subprocess.run([sys.executable, "-c", COMPILE_PTX, *args],
                          cwd=root, env=env, capture_output=True, text=True, check=True)
    return done.stdout


NEEDS_TRITON_39 = pytest.mark.skipif(not TRITON_39,
                                     reason="AOT compilation for sm_100 needs triton >= 3.9 (the device image has 3.6)")


@NEEDS_TRITON_39
@SLOW
def test_sm90_ptx_uses_fp8_wgmma():
    """Without a GPU: compile for H100/H200 (sm_90). Q·Kᵀ of the MX tiles runs on E4M3
    wgmma, of the NVFP4 tiles on bf16 wgmma (their exact copies) or, with
    nvfp4_copy="e4m3", on E4M3; P·V on bf16 wgmma by default and on E4M3 with pv="fp8"."""
    tcgen05, wgmma, _ = _compiled_mma_kinds(90, "nvfp4", False).splitlines()
    assert tcgen05 == "[]" and wgmma == "['bf16', 'e4m3']"
    assert _compiled_mma_kinds(90, "nvfp4", False, pv_fp8=True).splitlines()[1] == "['bf16', 'e4m3']"
    assert _compiled_mma_kinds(90, "nvfp4", False, pv_fp8=True, nvfp4_copy="e4m3").splitlines()[1] == "['e4m3']"


@NEEDS_TRITON_39
def test_sm100_ptx_uses_block_scaled_tcgen05_mma():
    """Without a GPU: compile the default configuration for B200 (sm_100): every tile
    on block-scaled MMAs, MXFP8 with E8M0 scales per 32, NVFP4 with unsigned E4M3
    scales per 16, no wgmma, and no register spills (ptxas); MXFP4 low tiles with E8M0
    per 32. benchmarks/sm100_static.py reports every configuration."""
    tcgen05, wgmma, spills = _compiled_mma_kinds(100, "nvfp4", False).splitlines()
    assert tcgen05 == "[('mxf4nvf4', 'block16', 'ue4m3'), ('mxf8f6f4', 'block32', 'ue8m0')]"
    assert wgmma == "[]" and spills == "0"
    tcgen05, _, spills = _compiled_mma_kinds(100, "mxfp4", False).splitlines()
    assert tcgen05 == "[('mxf4', 'block32', 'ue8m0'), ('mxf8f6f4', 'block32', 'ue8m0')]" and spills == "0"


@pytest.mark.parametrize("dtype,tol", [("fp16", 5e-4), ("bf16", 4e-3)])
@pytest.mark.parametrize("b,lq,lk,hq,hkv,d,causal,q_offset", [
    (1, 300, 300, 4, 2, 64, True, 0),
    (2, 130, 257, 4, 1, 128, False, 127),
    (1, 200, 390, 8, 8, 128, True, 190),
])
def test_input_attention_matches_float64(dtype, tol, b, lq, lk, hq, hkv, d, causal, q_offset):
    """The unquantized baseline (Q·Kᵀ on the inputs) is plain attention: only P's and
    the output's rounding to the input dtype separate it from float64."""
    q, k, v = make(15 + lq, b, lq, lk, hq, hkv, d, dtype)
    sm_scale = d**-0.5
    out = input_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), causal=causal, q_offset=q_offset,
                          sm_scale=sm_scale)
    ref = oracle.dma_attention(*(x.float() for x in (q, k, v)), causal=causal, diag=None, sm_scale=sm_scale,
                               q_offset=q_offset)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert oracle.rel_l2(out.float().cpu().numpy(), ref) <= tol


def test_input_attention_rejects_mixed_dtypes():
    q, k, v = make(16, 1, 10, 10, 2, 1, 64, "fp16")
    with pytest.raises(ValueError, match="share a dtype"):
        input_attention(q, k, v.bfloat16(), causal=True, q_offset=0, sm_scale=1.0)


@pytest.mark.parametrize("launch", [LaunchConfig(128, 128, 8, 3), LaunchConfig(64, 64, 4, 3)])
def test_input_attention_launch_shapes(launch):
    """The launch settings the sm_90 table picks for the unquantized baseline."""
    q, k, v = make(17, 1, 200, 300, 4, 2, 128, "fp16")
    for causal in (True, False):
        out = input_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), causal=causal, q_offset=100,
                              sm_scale=0.1, launch=launch)
        ref = oracle.dma_attention(*(x.float() for x in (q, k, v)), causal=causal, diag=None, sm_scale=0.1,
                                   q_offset=100)
        assert oracle.rel_l2(out.float().cpu().numpy(), ref) <= 5e-4, causal


@pytest.mark.parametrize("q_len,kv_len,q_offset", [
    (1, 1, 0), (300, 300, 0), (128, 1000, 872), (150, 300, -50), (200, 300, 200), (1, 385, 384),
    (100, 50, -300), (64, 129, 1000),
])
def test_band_covering_all_is_the_narrowest(q_len, kv_len, q_offset):
    """all_high (which lets the quantizer skip the low copies) holds from exactly the band
    width at which the oracle's rule makes every (query, key) pair high, causal or not."""
    p = q_offset + np.arange(q_len)[:, None]
    t = np.arange(kv_len)[None, :]
    need = next(d for d in range(1, 64) if oracle.is_high(p, t, False, d, 0).all())
    assert band_covering_all(q_len, kv_len, q_offset) == need
    assert all_high(q_len, kv_len, q_offset, need) and not all_high(q_len, kv_len, q_offset, need - 1)


@pytest.mark.parametrize("causal", [True, False])
def test_narrowest_all_high_band_skips_the_low_copies(causal):
    """At diag == band_covering_all the front end writes no low copies (has_lo=False) and
    the kernel's high runs alone must still cover every key."""
    q, k, v = make(18, 1, 150, 300, 2, 1, 64, "fp16")
    diag = band_covering_all(150, 300, 150)
    assert all_high(150, 300, 150, diag)
    out, ref = kernel_vs_reference(q, k, v, causal=causal, config=DMAConfig(diag_tiles=diag, sink_tiles=0))
    assert oracle.rel_l2(out, ref) <= 2e-3
