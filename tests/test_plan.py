"""One launch plan, two executors: the JAX front end (``dma_jax.executor``, the CUDA
lowering through jax-triton) and the torch front end (``triton_kernels.torch_executor``)
plan the same launches for the same call, and each executor runs a plan's launches as
written. Checked on CPU, for the launch settings of an sm_90 and an sm_100 GPU;
``tests/test_gpu.py`` runs both executors on a GPU, the kernel tests run the torch
executor in Triton's interpreter.
"""

import dataclasses
import types

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dma_jax import DMAConfig, executor
from triton_kernels import plan as plans
from triton_kernels import torch_executor
from triton_kernels.attention import _dma_attention_kernel
from triton_kernels.attention_sm90 import _dma_attention_sm90_kernel
from triton_kernels.format_table import FORMATS
from triton_kernels.geometry import TILE, all_high
from triton_kernels.plan import Buffer, Launch, Plan, Scalar
from triton_kernels.target import Target

CONFIGS = {
    "default": DMAConfig(),
    "hopper_fast": DMAConfig.hopper_fast(),
    "mxfp4_no_smooth": DMAConfig(low="mxfp4", smooth_k=False, diag_tiles=2, sink_tiles=0),
    "pv_fp8_e5m2": DMAConfig(high="mxfp8_e5m2", pv="fp8"),
    "all_low": DMAConfig.all_low(),
    "sm_scale_4": DMAConfig(sm_scale=4.0),
    "e4m3_nvfp4_rotated_rules": DMAConfig(nvfp4_copy="e4m3", rotate="hadamard", high_rule="floor", low_rule="4/6"),
}
SHAPES = [(300, 300, (4, 2), 64), (1, 700, (6, 3), 128), (200, 456, (4, 4), 64)]
TARGETS = {"sm90": Target((9, 0)), "sm100": Target((10, 0))}


def _front_end_plans(target, config, causal, q_len, kv_len, heads, dim):
    """The plans of the JAX and the torch front end for one call (bf16 inputs)."""
    (q_heads, kv_heads), offset = heads, kv_len - q_len
    shapes = [(1, q_len, q_heads, dim), (1, kv_len, kv_heads, dim), (1, kv_len, kv_heads, dim)]
    jq, jk, jv = (jnp.zeros(s, jnp.bfloat16) for s in shapes)
    tq, tk, tv = (torch.zeros(s, dtype=torch.bfloat16) for s in shapes)
    jax_plan = executor.attention_plan(jq, jk, jv, causal=causal, config=config, q_offset=offset, target=target)
    torch_plan = torch_executor.attention_plan(tq, tk, tv, target=target, causal=causal, q_offset=offset,
                                               **config.kernel_options(dim))
    return jax_plan, torch_plan


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_front_ends_plan_the_same_launches(target, name, causal):
    for q_len, kv_len, heads, dim in SHAPES:
        jax_plan, torch_plan = _front_end_plans(TARGETS[target], CONFIGS[name], causal, q_len, kv_len, heads, dim)
        assert jax_plan == torch_plan


def _check_wiring(plan: Plan, inputs: dict[str, Buffer]):
    """Every named argument is an input or an earlier launch's output, and every output
    is new: the executors can run the launches in order."""
    known = dict(inputs)
    for launch in plan.launches:
        for arg in launch.args:
            assert isinstance(arg, Scalar) or arg in known, (launch.kernel.fn.__name__, arg)
        for out in launch.outputs:
            assert out.name not in known
            known[out.name] = out
    assert known[plan.result].shape == inputs["q"].shape


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_attention_plan_structure(target, name):
    config = CONFIGS[name]
    for causal in (False, True):
        for q_len, kv_len, (hq, hkv), dim in SHAPES:
            q = Buffer("q", (1, q_len, hq, dim), "bfloat16")
            k = Buffer("k", (1, kv_len, hkv, dim), "bfloat16")
            v = Buffer("v", k.shape, "bfloat16")
            plan = plans.attention_plan(q, k, v, TARGETS[target], causal=causal, q_offset=kv_len - q_len,
                                        **config.kernel_options(dim))
            _check_wiring(plan, {"q": q, "k": k, "v": v})
            attention = plan.launches[-1]
            # Before sm_100, NVFP4 tiles read exact bf16 copies with per-token scales
            # unless nvfp4_copy="e4m3"; from sm_100 on every tile is native.
            has_lo = not all_high(q_len, kv_len, kv_len - q_len, config.diag_tiles)
            lo_bf16 = has_lo and config.low == "nvfp4" and config.nvfp4_copy == "bf16" and target == "sm90"
            for x, length in (("q", q_len), ("k", kv_len)):
                if plan.buffer(f"{x}.lo_f8").written:
                    assert plan.buffer(f"{x}.lo_f8").dtype == ("bfloat16" if lo_bf16 else "uint8")
                    if lo_bf16:
                        assert plan.buffer(f"{x}.lo_ts").shape == (1, length, hkv if x == "k" else hq)
            # The Gluon kernel exactly where documented: Hopper, head_dim 128, P·V in bf16;
            # NVFP4's exact bf16 copies (LO_BF16) or E4M3 copies.
            gluon = target == "sm90" and dim == 128 and config.pv == "input"
            assert attention.kernel is (_dma_attention_sm90_kernel if gluon else _dma_attention_kernel)
            assert attention.gluon == gluon
            # Smooth-K's sums only with smooth_k; V's FP8 copy only with the FP8 P·V.
            names = [o.name for launch in plan.launches for o in launch.outputs]
            assert ("k_sums" in names) == config.smooth_k and ("vt" in names) == (config.pv == "fp8")
            # K's FP8 copies carry one scale per key tile.
            k_ts = plan.buffer("k.hi_ts")
            if k_ts.written:
                assert k_ts.shape == (1, -(-kv_len // TILE), hkv)
            if gluon:
                assert attention.meta["LO_BF16"] == lo_bf16
            else:
                assert attention.meta["LO_FMT"] == ("bf16" if lo_bf16 else "e2m1")
            # On sm_100 every tile is native: codes and scale bytes are written, no
            # FP8 copies.
            assert plan.buffer("q.hi_codes").written == (target == "sm100")
            assert plan.buffer("q.hi_f8").written == (target != "sm100")
            assert (attention.meta.get("NATIVE_HI"), attention.meta.get("NATIVE_LO")) == (
                (True, True) if target == "sm100" else (None, None) if gluon else (False, False))


def test_all_high_calls_skip_the_low_copies():
    q = Buffer("q", (1, 100, 2, 64), "float16")
    k = Buffer("k", (1, 100, 2, 64), "float16")
    plan = plans.attention_plan(q, k, Buffer("v", k.shape, "float16"), Target((9, 0)), causal=True, q_offset=0,
                                diag_tiles=1, sink_tiles=1, high="mxfp8_e4m3", low="nvfp4", smooth_k=True,
                                sm_scale=0.125)
    for field in ("lo_codes", "lo_scales", "lo_token_scale", "lo_f8", "lo_ts"):
        assert plan.buffer(f"q.{field}").shape == (1,) and not plan.buffer(f"q.{field}").written
    assert plan.launches[-1].meta["HAS_LO"] is False


def test_quantize_outputs_follow_the_format_table():
    x = Buffer("x", (2, 40, 3, 128), "bfloat16")
    for high, low in (("mxfp8_e4m3", "nvfp4"), ("mxfp8_e5m2", "mxfp4")):
        launch = plans.quantize_plan(x, Target((10, 0)), high=high, low=low, codes=True, fp8=True).launches[-1]
        shapes = {o.name: o.shape for o in launch.outputs}
        assert shapes["x.hi_scales"] == (2, 40, 3, 128 // FORMATS[high].block)
        assert shapes["x.lo_scales"] == (2, 40, 3, 128 // FORMATS[low].block)
        assert shapes["x.lo_codes"] == (2, 40, 3, 64)  # two E2M1 codes per byte
        assert launch.meta["LO_MAX"] == FORMATS[low].max_value and launch.meta["HI_EMAX"] == FORMATS[high].emax


def test_bf16_high_copies_are_values_and_only_for_decode():
    """``high="bf16"``: Q's decode copy is bf16 values without block scales (HI_E = 8,
    bf16's exponent bits, in every launch that reads it); the attention kernels and the
    FP8 copies refuse it."""
    x = Buffer("x", (2, 3, 4, 64), "bfloat16")
    launch = plans.quantize_plan(x, Target((9, 0)), high="bf16", low="nvfp4", codes=True).launches[-1]
    out = {o.name: o for o in launch.outputs}
    assert (out["x.hi_codes"].shape, out["x.hi_codes"].dtype) == ((2, 3, 4, 64), "bfloat16")
    assert not out["x.hi_scales"].written and launch.meta["HI_E"] == 8
    with pytest.raises(ValueError, match="writes codes only"):
        plans.quantize_plan(x, Target((9, 0)), high="bf16", low="nvfp4", fp8=True)
    with pytest.raises(ValueError, match="high='bf16' has no block scales"):
        plans.quantize_plan(x, Target((9, 0)), high="bf16", low="nvfp4", high_rule="up")
    with pytest.raises(ValueError, match="a decode cache's format"):
        plans.attention_plan(x, x, x, Target((9, 0)), causal=True, q_offset=0, diag_tiles=1, sink_tiles=1,
                             high="bf16", low="nvfp4", smooth_k=True, sm_scale=0.125)


def test_plan_rejects_extents_beyond_int32():
    q = Buffer("q", (1, 1, 1, 128), "bfloat16")
    k = Buffer("k", (1, 2**24, 1, 128), "bfloat16")
    with pytest.raises(ValueError, match="must be < 2\\^31 per batch item"):
        plans.attention_plan(q, k, k, Target((9, 0)), causal=True, q_offset=0, diag_tiles=1, sink_tiles=1,
                             high="mxfp8_e4m3", low="nvfp4", smooth_k=True, sm_scale=1.0)


# -- the executors run what the plan says -----------------------------------------------

class _Kernel:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **meta)`` is logged."""

    def __init__(self, name, log, arg_names):
        self.fn = types.SimpleNamespace(__name__=name)
        self.log = log
        self.arg_names = arg_names

    def __getitem__(self, grid):
        def launch(*args, num_warps, num_stages, **meta):
            self.log.append((self.fn.__name__, tuple(grid), [_describe(a) for a in args], meta, num_warps,
                             num_stages))
        return launch


def _describe(x):
    """A launch argument as compared across frameworks."""
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), str(x.dtype).removeprefix("torch.")
    if hasattr(x, "shape") and np.ndim(x) > 0:
        return tuple(x.shape), np.dtype(x.dtype).name
    return ("i32", x) if isinstance(x, int) else ("fp32", x)


def _toy_plan(log):
    """Two launches: the second reads the first's output and an input, and updates the
    first's output in place; typed scalars, one of them an integer 1."""
    first = Launch(_Kernel("first", log, ["x", "n", "s", "a", "unused", "D", "FLAG"]), (3, 1, 1),
                   ("x", Scalar(7, "i32"), Scalar(0.5, "fp32")),
                   (Buffer("a", (4, 5), "float32"), Buffer("unused", (1,), "uint8", written=False)),
                   (("D", 64), ("FLAG", True)), num_warps=8, num_stages=2)
    second = Launch(_Kernel("second", log, ["x", "one", "a_in", "out", "a_out", "MODE"]), (1, 2, 3),
                    ("x", Scalar(1, "i32"), "a"),
                    (Buffer("out", (2, 3), "bfloat16"), Buffer("a", (4, 5), "float32", updates="a")),
                    (("MODE", "e4m3"),))
    return Plan((first, second), "out")


def _fake_triton_call(log, calls):
    """Stands in for ``dma_jax.triton_call.triton_call``: logs the launch as the torch
    stand-in kernel does, its positional arguments rebuilt in kernel order from the
    signature (the outputs are the last of them); ``calls`` gets the other parameters."""

    def call(*arrays, kernel, signature, constexprs, scalars, out_shape, grid, num_warps, num_stages, gluon=False,
             divisible=(), aliases=None):
        buffers = [*arrays, *out_shape]
        args, meta, used = [], dict(constexprs), 0
        for name in kernel.arg_names:
            if used == len(buffers):
                break
            kind = signature[name]
            if kind.startswith("*"):
                args.append(_describe(buffers[used]))
                used += 1
            elif kind == "constexpr":  # a specialised integer among the positional arguments
                args.append(("i32", meta.pop(name)))
            else:
                args.append((kind, scalars[name]))
        log.append((kernel.fn.__name__, tuple(grid), args, meta, num_warps, num_stages))
        calls.append({"gluon": gluon, "divisible": divisible, "aliases": aliases})
        return [jnp.zeros(o.shape, o.dtype) for o in out_shape]

    return call


def test_executors_run_the_plan_as_written(monkeypatch):
    from dma_jax import triton_call

    torch_log, jax_log, calls = [], [], []
    toy = _toy_plan(torch_log)
    env = torch_executor.run(toy.launches, {"x": torch.zeros((6,), dtype=torch.float16)})
    out = env[toy.result]
    assert out.shape == (2, 3) and out.dtype == torch.bfloat16

    monkeypatch.setattr(triton_call, "triton_call", _fake_triton_call(jax_log, calls))
    toy = _toy_plan(jax_log)
    env = executor.run(toy.launches, {"x": jnp.zeros((6,), jnp.float16)})
    assert env["out"].shape == (2, 3) and env["out"].dtype == jnp.bfloat16
    assert jax_log == torch_log
    assert torch_log[0] == ("first", (3, 1, 1), [((6,), "float16"), ("i32", 7), ("fp32", 0.5), ((4, 5), "float32"),
                                                 ((1,), "uint8")], {"D": 64, "FLAG": True}, 8, 2)
    assert torch_log[1][2][:3] == [((6,), "float16"), ("i32", 1), ((4, 5), "float32")]
    # The in-place output: array argument 1 ("a") is aliased to output 1.
    assert [c["aliases"] for c in calls] == [{}, {1: 1}]


def test_jax_launches_specialise_scalars_as_tritons_launcher():
    """The JAX executor compiles a launch as Triton's launcher (the torch executor's)
    would for the same arguments: integers equal to 1 as constants, multiples of 16 as
    such, floats as arguments (``native_specialize_impl`` is Triton's own rule)."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import native_specialize_impl

    from triton_kernels.aot import launcher_specialisation

    values = [0, 1, 2, 15, 16, 48, 1000, 1024, -1, -16, 2**31 - 16, 2**31 - 1, 1.0, 0.5, 16.0]
    names = [f"a{i}" for i in range(len(values))]
    args = tuple(Scalar(v, "fp32" if isinstance(v, float) else "i32") for v in values)
    ones, divisible = launcher_specialisation(Launch(_Kernel("k", [], names), (1, 1, 1), args, (), ()))
    for name, v in zip(names, values):
        kind, attr = native_specialize_impl(CUDABackend, v, False, True, True)
        assert (name in ones) == (kind == "constexpr"), (v, kind)
        assert (name in divisible) == (attr == "D"), (v, attr)
    assert ones == {"a1": 1}


def test_jax_launch_refuses_integers_outside_int32():
    """A scalar the kernel takes as i32 must fit it: the JAX launch says which one does not."""
    from dma_jax.triton_call import triton_call

    with pytest.raises(ValueError, match=r"argument n of k must fit int32; got 2147483648"):
        triton_call(jnp.zeros((2,), jnp.float32), kernel=_Kernel("k", [], ["x", "n"]),
                    signature={"x": "*fp32", "n": "i32"}, constexprs={}, scalars={"n": 2**31}, out_shape=[],
                    grid=(1, 1, 1), num_warps=4, num_stages=3)


def test_torch_executor_updates_in_place():
    """An output that ``updates`` an input is that very tensor, not a new one."""
    log = []
    launch = Launch(_Kernel("k", log, ["a"]), (1, 1, 1), ("a",), (Buffer("a", (3,), "float32", updates="a"),), ())
    a = torch.zeros(3)
    env = torch_executor.run((launch,), {"a": a})
    assert env["a"] is a


def test_gluon_launches_go_through_the_same_call(monkeypatch):
    """The JAX executor stages Gluon launches (warp-specialised, more warps than
    launched) through the same ``triton_call``, marked as Gluon, in-place outputs
    aliased as for Triton launches."""
    from dma_jax import triton_call

    log, calls = [], []
    monkeypatch.setattr(triton_call, "triton_call", _fake_triton_call(log, calls))
    launch = Launch(_Kernel("g", [], ["x", "out", "S"]), (2, 1, 1), ("x",),
                    (Buffer("x", (2,), "float32", updates="x"),), (("S", 3),), num_warps=4, gluon=True)
    executor.run((launch,), {"x": jnp.zeros((2,), jnp.float32)})
    assert log == [("g", (2, 1, 1), [((2,), "float32"), ((2,), "float32")], {"S": 3}, 4, 3)]
    assert calls == [{"gluon": True, "divisible": (), "aliases": {0: 0}}]


def test_cache_append_plan_updates_the_cache_in_place():
    """The append launch's outputs are the cache's arrays but ``length``, each updating
    the input of its own name; new tokens whose names collide with the cache's, or too
    many of them, are refused."""
    from triton_kernels.geometry import CACHE_FIELDS

    cache = {f: Buffer(f, (2, 512, 3, 32), "uint8") for f in CACHE_FIELDS}
    k = Buffer("new_k", (2, 5, 3, 64), "bfloat16")
    plan = plans.cache_append_plan(k, dataclasses.replace(k, name="new_v"), cache, Target((9, 0)), sink_len=128,
                                   ring_len=256, v_fp8=False, high="mxfp8_e4m3", low="nvfp4")
    (launch,) = plan.launches
    assert [(o.name, o.updates) for o in launch.outputs] == [(f, f) for f in CACHE_FIELDS[:-1]]
    assert set(launch.args) >= {"new_k", "new_v", "k_mean", *CACHE_FIELDS}
    assert launch.grid == (1, 3, 2)
    bf16 = plans.cache_append_plan(k, dataclasses.replace(k, name="new_v"), cache, Target((9, 0)), sink_len=128,
                                   ring_len=256, v_fp8=False, high="bf16", low="nvfp4")
    assert bf16.launches[0].meta["HI_E"] == 8
    with pytest.raises(ValueError, match="names of their own"):
        plans.cache_append_plan(dataclasses.replace(k, name="v"), k, cache, Target((9, 0)), sink_len=128,
                                ring_len=256, v_fp8=False, high="mxfp8_e4m3", low="nvfp4")
    many = dataclasses.replace(k, shape=(2, 129, 3, 64))
    with pytest.raises(ValueError, match="1 to 128 tokens"):
        plans.cache_append_plan(many, dataclasses.replace(many, name="new_v"), cache, Target((9, 0)), sink_len=128,
                                ring_len=256, v_fp8=False, high="mxfp8_e4m3", low="nvfp4")
