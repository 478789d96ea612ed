"""Runs launch plans (``plan``) on torch tensors: the torch front end of the kernels
(``dma_jax.torch_attention``), and what the kernel tests and benchmarks call. CUDA
tensors, or CPU tensors under Triton's interpreter (TRITON_INTERPRET=1).
The only module of ``triton_kernels`` that imports torch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import plan as plans
from .geometry import CACHE_FIELDS
from .plan import Buffer, Launch, Plan, Scalar
from .target import Target, interpreting
from .tuning import LaunchConfig

__all__ = ["Operand", "attention_plan", "cache_append", "channel_mean", "dma_attention", "dma_decode", "dual_quantize",
           "fp8_transpose", "input_attention", "run", "target_of"]


def target_of(device: torch.device) -> Target:
    """What kernels on ``device`` compile for."""
    if interpreting() or device.type != "cuda":
        return Target.interpreter()
    return Target(torch.cuda.get_device_capability(device))


def buffer(name: str, x: torch.Tensor) -> Buffer:
    """The plan's description of tensor ``x``."""
    return Buffer(name, tuple(x.shape), str(x.dtype).removeprefix("torch."))


def _argument(arg: str | Scalar, env: dict[str, torch.Tensor]) -> Any:
    if isinstance(arg, Scalar):
        return arg.value
    return env[arg]


def run(launches: tuple[Launch, ...] | list[Launch], env: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Launch each of ``launches`` in order on the tensors of ``env`` (buffer name ->
    tensor, the call's inputs and earlier outputs); returns ``env`` with every
    launch's outputs added."""
    env = dict(env)
    device = next(iter(env.values())).device
    for launch in launches:
        outs = [env[o.updates] if o.updates else torch.empty(o.shape, dtype=getattr(torch, o.dtype), device=device)
                for o in launch.outputs]
        args = [_argument(a, env) for a in launch.args]
        launch.kernel[launch.grid](*args, *outs, **launch.meta, num_warps=launch.num_warps,
                                   num_stages=launch.num_stages)
        env.update((o.name, t) for o, t in zip(launch.outputs, outs))
    return env


def execute(plan: Plan, **inputs: torch.Tensor) -> torch.Tensor:
    """Run ``plan`` on its named inputs and return its result."""
    return run(plan.launches, inputs)[plan.result]


def _contiguous(name: str, x: torch.Tensor) -> torch.Tensor:
    if not x.is_contiguous():
        raise ValueError(f"{name} must be a contiguous [B, L, H, D] tensor; got strides {tuple(x.stride())}")
    return x


class Operand(NamedTuple):
    """A dual quantization's outputs (named as ``plan.OPERAND_FIELDS``); None where not
    written.

    ``hi_codes``/``hi_scales`` and ``lo_codes``/``lo_scales``/``lo_token_scale`` (uint8; NVFP4's
    float32 per-token scale) feed ``tl.dot_scaled``; ``*_f8`` (E4M3 bytes) and ``*_ts``
    (float32 per token ``[B, L, H]``, or per key tile ``[B, cdiv(L, TILE), H]`` when
    quantized with ``per_tile``) are the FP8 copies that sm_90 reads."""

    hi_codes: torch.Tensor | None
    hi_scales: torch.Tensor | None
    lo_codes: torch.Tensor | None
    lo_scales: torch.Tensor | None
    lo_token_scale: torch.Tensor | None
    hi_f8: torch.Tensor | None
    hi_ts: torch.Tensor | None
    lo_f8: torch.Tensor | None
    lo_ts: torch.Tensor | None


def dual_quantize(x: torch.Tensor, *, mean: torch.Tensor | None = None, smooth: bool = False,
                  chunk: int | None = None, **options: Any) -> Operand:
    """Quantize ``(x - mean) * fold`` into ``high`` and ``low`` in one launch (a second
    one first for ``smooth=True``, which forms K's mean from partial sums over ``chunk``
    tokens in the quantize launch itself). ``mean``: a float32 ``[B, H, D]`` mean instead.
    ``options``: ``high``, ``low``, ``fold``, ``codes``, ``fp8``, ``write_lo``,
    ``per_tile``, ``tile_t``, ``high_rule``, ``low_rule``, ``rotate``, ``block_t``,
    ``num_warps`` (``plan.quantize_plan``)."""
    x = _contiguous("x", x)
    env = {"x": x}
    smoothing: bool | str = smooth
    if mean is not None:
        env["mean"], smoothing = mean.contiguous(), "mean"
    plan = plans.quantize_plan(buffer("x", x), target_of(x.device), smooth=smoothing, chunk=chunk, **options)
    out = run(plan.launches, env)
    quantize = plan.launches[-1]
    return Operand(*[out[o.name] if o.written else None for o in quantize.outputs])


def channel_mean(x: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Float32 mean of ``x [B, L, H, D]`` over L, ``[B, H, D]`` (deterministic; ``chunk``
    tokens per partial sum, by default ``tuning.mean_chunk``)."""
    x = _contiguous("x", x)
    return execute(plans.channel_mean_plan(buffer("x", x), chunk=chunk), x=x)


def fp8_transpose(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 bytes of ``v [B, L, H, D]`` transposed to ``[B, H, D, padded_length(L)]`` (the
    padding columns hold zeros) and the float32 per-channel scales ``[B, H, D]``."""
    v = _contiguous("v", v)
    out = run(plans.fp8_transpose_plan(buffer("v", v), target_of(v.device)).launches, {"v": v})
    return out["vt"], out["v_scale"]


def attention_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, target: Target | None = None,
                   **options: Any) -> Plan:
    """``plan.attention_plan`` for these tensors on their device (or ``target``);
    ``options``: its keywords (``causal``, ``q_offset``, ``diag_tiles``, ...)."""
    return plans.attention_plan(buffer("q", q), buffer("k", k), buffer("v", v), target or target_of(q.device),
                                **options)


def dma_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, q_offset: int,
                  diag_tiles: int, sink_tiles: int, high: str, low: str, smooth_k: bool, sm_scale: float,
                  pv: str = "input", high_rule: str | None = None, low_rule: str | None = None,
                  rotate: bool = False, nvfp4_copy: str = "bf16", native: bool | None = None,
                  kernel: str | None = None, launch: LaunchConfig | None = None) -> torch.Tensor:
    """DMA on ``q [B, Lq, HQ, D]``, ``k, v [B, Lk, HKV, D]`` (checked by the caller):
    ``plan.attention_plan``'s launches."""
    q, k, v = (_contiguous(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
    plan = attention_plan(q, k, v, causal=causal, q_offset=q_offset, diag_tiles=diag_tiles, sink_tiles=sink_tiles,
                          high=high, low=low, smooth_k=smooth_k, sm_scale=sm_scale, pv=pv, high_rule=high_rule,
                          low_rule=low_rule, rotate=rotate, nvfp4_copy=nvfp4_copy, native=native, kernel=kernel,
                          launch=launch)
    return execute(plan, q=q, k=k, v=v)


def input_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, q_offset: int,
                    sm_scale: float, launch: LaunchConfig | None = None) -> torch.Tensor:
    """The DMA kernel with Q·Kᵀ on the unquantized inputs (``plan.input_attention_plan``)."""
    q, k, v = (_contiguous(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
    plan = plans.input_attention_plan(buffer("q", q), buffer("k", k), buffer("v", v), target_of(q.device),
                                      causal=causal, q_offset=q_offset, sm_scale=sm_scale, launch=launch)
    return execute(plan, q=q, k=k, v=v)



def dma_decode(q: torch.Tensor, cache: dict[str, torch.Tensor], *, sink_len: int, ring_len: int, v_fp8: bool,
               **options: Any) -> torch.Tensor:
    """A decode step of ``q [B, n, HQ, D]`` over a low-bit KV cache's tensors
    (``geometry.CACHE_FIELDS``): ``plan.decode_plan``'s launches. ``options``: its keywords
    (``diag_tiles``, ``sink_tiles``, ``high``, ``low``, ``sm_scale``, ...)."""
    q = _contiguous("q", q)
    cache = {f: _contiguous(f, cache[f]) for f in CACHE_FIELDS}
    plan = plans.decode_plan(buffer("q", q), {f: buffer(f, t) for f, t in cache.items()}, target_of(q.device),
                             sink_len=sink_len, ring_len=ring_len, v_fp8=v_fp8, **options)
    return execute(plan, q=q, **cache)


def cache_append(k: torch.Tensor, v: torch.Tensor, k_mean: torch.Tensor, cache: dict[str, torch.Tensor], *,
                 sink_len: int, ring_len: int, v_fp8: bool, **options: Any) -> dict[str, torch.Tensor]:
    """New tokens ``k``, ``v [B, n, H, D]`` written into a low-bit KV cache's tensors
    (``geometry.CACHE_FIELDS``) in place, ``length`` not advanced: ``plan.cache_append_plan``'s
    launch. Returns the updated tensors (the same objects). ``options``: ``high``,
    ``low``, ``high_rule``, ``low_rule``, ``rotate``, ``smooth_k``."""
    k, v, k_mean = _contiguous("k", k), _contiguous("v", v), k_mean.contiguous()
    cache = {f: _contiguous(f, cache[f]) for f in CACHE_FIELDS}
    plan = plans.cache_append_plan(buffer("new_k", k), buffer("new_v", v), {f: buffer(f, t) for f, t in cache.items()},
                                   target_of(k.device), sink_len=sink_len, ring_len=ring_len, v_fp8=v_fp8, **options)
    out = run(plan.launches, {"new_k": k, "new_v": v, "k_mean": k_mean, **cache})
    return {f: out[f] for f in CACHE_FIELDS[:-1]}
