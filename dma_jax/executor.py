"""Runs launch plans (``triton_kernels.plan``) inside JAX programs: the CUDA lowerings of
``dma_attention``, ``dma_decode`` and ``dma_cache_append``. Each launch, Triton or
Gluon, is one ``triton_call``. Codes and scales travel as uint8 (the plans' buffers
have no float8/E8M0/FP4 dtypes).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from triton_kernels import plan as plans
from triton_kernels.geometry import CACHE_FIELDS
from triton_kernels.plan import Buffer, Launch, Plan, Scalar
from triton_kernels.target import Target

from .config import DMAConfig

__all__ = ["attention_plan", "decode_plan", "gpu_target", "input_attention_plan", "run",
           "triton_attention", "triton_decode", "triton_input_attention"]


def gpu_target() -> Target:
    """The compute capability of JAX's first GPU (None without one)."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus or not hasattr(gpus[0], "compute_capability"):
        return Target(None)
    major, minor = str(gpus[0].compute_capability).split(".")
    return Target((int(major), int(minor)))


def buffer(name: str, x: Any) -> Buffer:
    """The plan's description of array ``x`` (a ``jax.Array`` or a tracer)."""
    return Buffer(name, tuple(x.shape), jnp.dtype(x.dtype).name)


def run(launches: tuple[Launch, ...] | list[Launch], env: dict[str, Any]) -> dict[str, Any]:
    """Stage each of ``launches`` in order on the arrays of ``env`` (buffer name ->
    array, the call's inputs and earlier outputs); returns ``env`` with every
    launch's outputs added."""
    from triton_kernels.aot import launcher_specialisation, signature

    from .triton_call import triton_call

    env = dict(env)
    for launch in launches:
        # Specialised as Triton's own launcher (the torch executor's) would: the same kernel.
        ones, divisible = launcher_specialisation(launch)
        names = launch.kernel.arg_names
        scalars = {n: float(a.value) if a.dtype == "fp32" else int(a.value)
                   for n, a in zip(names, launch.args) if isinstance(a, Scalar) and n not in ones}
        inputs = [a for a in launch.args if not isinstance(a, Scalar)]
        outs = triton_call(*(env[a] for a in inputs), kernel=launch.kernel,
                           signature=signature(launch, {n: jnp.dtype(x.dtype).name for n, x in env.items()}, ones),
                           constexprs={**launch.meta, **ones}, scalars=scalars, divisible=divisible,
                           out_shape=[jax.ShapeDtypeStruct(o.shape, jnp.dtype(o.dtype)) for o in launch.outputs],
                           grid=launch.grid, num_warps=launch.num_warps, num_stages=launch.num_stages,
                           gluon=launch.gluon,
                           aliases={inputs.index(o.updates): i for i, o in enumerate(launch.outputs) if o.updates})
        env.update((o.name, x) for o, x in zip(launch.outputs, outs))
    return env


def attention_plan(q, k, v, *, causal: bool, config: DMAConfig, q_offset: int, target: Target | None = None,
                   **overrides: Any) -> Plan:
    """The launches of ``dma_attention`` on JAX's GPU (or ``target``) for arrays shaped
    like ``q``, ``k``, ``v``; ``overrides`` as for ``plan.attention_plan``."""
    return plans.attention_plan(buffer("q", q), buffer("k", k), buffer("v", v), target or gpu_target(),
                                causal=causal, q_offset=q_offset, **config.kernel_options(q.shape[3]), **overrides)


def triton_attention(q, k, v, *, causal: bool, config: DMAConfig, q_offset: int):
    """DMA through the Triton kernels; same contract as ``reference.dma_reference``
    (with ``operands="fp8"`` for the tiles that are not native)."""
    plan = attention_plan(q, k, v, causal=causal, config=config, q_offset=q_offset)
    return run(plan.launches, {"q": q, "k": k, "v": v})[plan.result]


def input_attention_plan(q, k, v, *, causal: bool, sm_scale: float, q_offset: int) -> Plan:
    """The launch of ``triton_input_attention`` on JAX's GPU."""
    return plans.input_attention_plan(buffer("q", q), buffer("k", k), buffer("v", v), gpu_target(),
                                      causal=causal, q_offset=q_offset, sm_scale=sm_scale)


def triton_input_attention(q, k, v, *, causal: bool, sm_scale: float, q_offset: int):
    """The DMA kernel with Q·Kᵀ on the unquantized inputs: our own bf16/fp16 flash
    attention, one launch, the baseline of ``benchmarks/attention.py``. Same shapes
    and ``q_offset`` as ``dma_jax.attention``; no smoothing, no quantization."""
    plan = input_attention_plan(q, k, v, causal=causal, sm_scale=sm_scale, q_offset=q_offset)
    return run(plan.launches, {"q": q, "k": k, "v": v})[plan.result]


def decode_plan(q, *cache, config: DMAConfig, v_fp8: bool, sink_len: int, ring_len: int,
                target: Target | None = None, **overrides: Any) -> Plan:
    """The launches of ``dma_decode`` for ``q`` and the cache's arrays
    (``geometry.CACHE_FIELDS`` order) on JAX's GPU (or ``target``); ``overrides`` as for
    ``plan.decode_plan`` (``launch``)."""
    buffers = {f: buffer(f, x) for f, x in zip(CACHE_FIELDS, cache)}
    return plans.decode_plan(buffer("q", q), buffers, target or gpu_target(), sink_len=sink_len, ring_len=ring_len,
                             v_fp8=v_fp8, **config.decode_options(q.shape[3]), **overrides)


def triton_decode(q, *cache, config: DMAConfig, v_fp8: bool, sink_len: int, ring_len: int):
    """DMA decode through the Triton kernels; same contract as ``decode.decode_reference``."""
    plan = decode_plan(q, *cache, config=config, v_fp8=v_fp8, sink_len=sink_len, ring_len=ring_len)
    return run(plan.launches, {"q": q, **dict(zip(CACHE_FIELDS, cache))})[plan.result]


def cache_append_plan(k, v, *cache, config: DMAConfig, v_fp8: bool, sink_len: int, ring_len: int,
                      target: Target | None = None) -> Plan:
    """The launch of ``dma_cache_append`` for new tokens ``k``, ``v`` and the cache's
    arrays (``geometry.CACHE_FIELDS`` order) on JAX's GPU (or ``target``)."""
    buffers = {f: buffer(f, x) for f, x in zip(CACHE_FIELDS, cache)}
    return plans.cache_append_plan(buffer("new_k", k), buffer("new_v", v), buffers, target or gpu_target(),
                                   sink_len=sink_len, ring_len=ring_len, v_fp8=v_fp8, **config.append_options())


def triton_cache_append(k, v, k_mean, *cache, config: DMAConfig, v_fp8: bool, sink_len: int, ring_len: int):
    """The cache's arrays but ``length``, with new tokens written in place by the Triton
    kernel; same contract as ``kv_cache.append_reference``."""
    plan = cache_append_plan(k, v, *cache, config=config, v_fp8=v_fp8, sink_len=sink_len, ring_len=ring_len)
    env = run(plan.launches, {"new_k": k, "new_v": v, "k_mean": k_mean, **dict(zip(CACHE_FIELDS, cache))})
    return [env[f] for f in CACHE_FIELDS[:-1]]
