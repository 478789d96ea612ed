"""Where the time of one DMA call goes on the GPU, launch by launch.

GPU only. At B=1, S=8192, 32 query and 8 kv heads, D=128, bf16, for the DMA
default config and the Hopper preset, causal and not, it times

* each launch of the call's plan alone (the torch executor, ``triton.testing.do_bench``)
  on the outputs of the launches before it: the smooth-K partial sums, the
  quantization of Q and of K (which forms the mean from them), V's FP8 transpose (the
  preset), and the attention kernel;
* the whole call through torch and through ``jax.jit`` (back-to-back calls), and
  through JAX the plan's quantize launches alone and its attention launch alone on
  their outputs, back to back. ``do_bench`` times one launch at a time after an L2
  flush, which reads about 7% faster than back-to-back runs of the same kernel;

and reports the attention kernel's registers per thread, spilled bytes and
shared memory as Triton compiled it (torch launch; for the Gluon kernel, which DMA
default runs at D=128, ptxas's count before ``setmaxnreg`` gives each warpgroup its
share). Prints a table and writes ``results/profile_attention_<gpu>.json``.

``--once`` launches each attention kernel once and exits, for a hardware
profile of exactly those launches::

    python benchmarks/profile_attention.py [--seq 8192]
    ncu --clock-control none -k regex:_dma_attention -c 4 --metrics "$METRICS" \\
        python benchmarks/profile_attention.py --once

with METRICS the comma-separated list in ``results/ncu_attention_h200.txt`` (issue
activity, the MUFU/FMA/ALU/shared (MMA) pipes, active warps, occupancy limits, the main
stall reasons). The launches come in the order default non-causal, default causal, preset
non-causal, preset causal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import jax
import jax.numpy as jnp
import torch
import triton

from device_name import gpu_tag
from attention import CONFIGS, KV_HEADS, Q_HEADS, copies_needed, dma_fn, quantize_fn, time_jax
from dma_jax import bridge, executor
from triton_kernels import attention as attn
from triton_kernels import attention_sm90 as attn90
from triton_kernels import torch_executor


def compiled_kernels() -> dict[int, object]:
    """The attention kernels' compiled variants in Triton's JIT caches (the Triton
    kernel and the Gluon one), by id."""
    found = {}
    for kernel in (attn._dma_attention_kernel, attn90._dma_attention_sm90_kernel):
        for cache in getattr(kernel, "device_caches", {}).values():
            for part in cache if isinstance(cache, tuple) else (cache,):
                if isinstance(part, dict):
                    found.update({id(k): k for k in part.values() if hasattr(k, "n_regs")})
    return found


def resources(kernel) -> dict:
    return {"registers": kernel.n_regs, "spilled_bytes": kernel.n_spills,
            "shared_bytes": getattr(kernel.metadata, "shared", None)}


def plan_of(cfg, causal, q, k, v):
    return torch_executor.attention_plan(q, k, v, causal=causal, q_offset=0, **cfg.kernel_options(q.shape[-1]))


def launches(cfg, causal, q, k, v):
    """Each launch of one DMA call's plan as a torch closure, on the outputs of the
    launches before it (prepared once), named by the buffer it writes first."""
    plan = plan_of(cfg, causal, q, k, v)
    env = torch_executor.run(plan.launches, {"q": q, "k": k, "v": v})
    stages = {}
    for launch in plan.launches:
        name = "attention" if launch is plan.launches[-1] else launch.outputs[0].name.split(".")[0]
        stages[name] = lambda launch=launch: torch_executor.run((launch,), env)
    return stages


def whole_call_torch(cfg, causal, q, k, v):
    return torch_executor.execute(plan_of(cfg, causal, q, k, v), q=q, k=k, v=v)


def attention_alone_fn(cfg, causal):
    """The plan's attention launch through JAX, on the quantize launches' outputs."""
    def attend(q, k, v, operands):
        plan = executor.attention_plan(q, k, v, causal=causal, config=cfg, q_offset=0)
        return executor.run(plan.launches[-1:], {"q": q, "k": k, "v": v, **operands})[plan.result]

    return jax.jit(attend)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--once", action="store_true", help="launch each attention once (for ncu) and exit")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/profile_attention.py needs a CUDA GPU")
    s, d = args.seq, args.head_dim
    key = jax.random.PRNGKey(s + d)
    sets = []
    for i in range(copies_needed(s, d)):
        ks = jax.random.split(jax.random.fold_in(key, i), 3)
        sets.append([jax.random.normal(kk, (1, s, h, d), jnp.bfloat16) for kk, h in zip(ks, (Q_HEADS, KV_HEADS, KV_HEADS))])
    torch_sets = [[bridge.to_torch(x) for x in st] for st in sets]
    q, k, v = torch_sets[0]
    rows = []
    for (name, cfg), causal in ((c, causal) for c in CONFIGS.items() for causal in (False, True)):
        stages = launches(cfg, causal, q, k, v)
        if args.once:
            stages["attention"]()
            torch.cuda.synchronize()
            continue
        flops = 4 * s * s * Q_HEADS * d / (2 if causal else 1)
        before = compiled_kernels()
        ms = {stage: triton.testing.do_bench(fn, warmup=10, rep=100) for stage, fn in stages.items()}
        new = [kern for kid, kern in compiled_kernels().items() if kid not in before]
        ms["sum_of_launches"] = sum(ms.values())
        ms["torch_call"] = triton.testing.do_bench(lambda: whole_call_torch(cfg, causal, q, k, v), warmup=10, rep=100)
        ms["jax_call"] = time_jax(dma_fn(cfg, causal), sets)
        quantize_jax = quantize_fn(cfg)
        ms["jax_quantize"] = time_jax(quantize_jax, sets)
        prepared = [(*st, quantize_jax(*st)) for st in sets]
        ms["jax_attention"] = time_jax(attention_alone_fn(cfg, causal), prepared)
        row = {"config": name, "causal": causal, "ms": ms,
               "attention_tflops": flops / ms["attention"] / 1e9, "jax_call_tflops": flops / ms["jax_call"] / 1e9,
               "jax_attention_tflops": flops / ms["jax_attention"] / 1e9,
               "kernel": resources(new[0]) if new else None}
        rows.append(row)
        res = row["kernel"] or {}
        print(f"{name} causal={causal}: " + ", ".join(f"{k} {v:.3f}" for k, v in ms.items()) +
              f" ms; attention {row['attention_tflops']:.0f} TFLOP/s (JAX, back to back: "
              f"{row['jax_attention_tflops']:.0f}), JAX call {row['jax_call_tflops']:.0f}; "
              f"registers {res.get('registers')}, spilled {res.get('spilled_bytes')} B, "
              f"shared {res.get('shared_bytes')} B", flush=True)
    if args.once:
        return
    print(f"\n{torch.cuda.get_device_name()}, B=1, S={s}, {Q_HEADS}:{KV_HEADS} heads, D={d}, bf16; ms")
    names = list(dict.fromkeys(k for r in rows for k in r["ms"]))
    print("| config | causal | " + " | ".join(names) + " | attention TFLOP/s (do_bench / JAX) | regs | spill B |")
    print("|---|---|" + "---:|" * (len(names) + 3))
    for r in rows:
        res = r["kernel"] or {}
        print(f"| {r['config']} | {r['causal']} | " + " | ".join(f"{r['ms'][n]:.3f}" if n in r["ms"] else "" for n in names)
              + f" | {r['attention_tflops']:.0f} / {r['jax_attention_tflops']:.0f} | {res.get('registers')} | "
              f"{res.get('spilled_bytes')} |")
    os.makedirs(args.out, exist_ok=True)
    gpu = gpu_tag()
    path = os.path.join(args.out, f"profile_attention_{gpu}.json")
    with open(path, "w") as fh:
        json.dump({"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                   "triton": triton.__version__, "seq": s, "head_dim": d, "heads": [Q_HEADS, KV_HEADS],
                   "rows": rows}, fh, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
