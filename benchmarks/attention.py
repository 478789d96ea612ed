"""The reference attention benchmark: DMA next to every attention a JAX user has.

In one run on one GPU, on the same bf16 inputs (batch 1, 32 query heads, 8 kv
heads): DMA's default config and the Hopper preset (``DMAConfig.hopper_fast()``)
through ``jax.jit(dma_jax.attention)`` (their time includes the smooth-K mean
and the quantization; those launches are also timed alone, through JAX as the call
makes them: the launch plan's launches before its attention launch), our own bf16 path (the same
kernel with Q·Kᵀ on the bf16 inputs, ``dma_jax.executor.triton_input_attention``), cuDNN and XLA through
``jax.nn.dot_product_attention``, cuDNN FP8 through JAX's private
``fused_attention_stablehlo`` API (FP8 inputs prepared outside the timing, FP8
output; K/V heads repeated to 32 because it has no GQA), and torch SDPA.
JAX functions are timed as back-to-back asynchronous calls (dispatch N, block on
the last); torch with ``triton.testing.do_bench``. Inputs rotate through enough
copies to exceed the 60 MB L2. TFLOP/s = 4·B·Hq·S²·D / t, halved when causal.

Then, on structured LLM-like inputs (``dma_jax.synthetic.llm_like_qkv``, S=4096,
D=128, causal), the error of each against exact float32 attention.

    python benchmarks/attention.py [--seqs 1024,...,32768] [--head-dims 128,64] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import triton

import dma_jax
from device_name import gpu_tag
from plotting import pyplot
from dma_jax import DMAConfig, bridge
from dma_jax import executor
from dma_jax.executor import triton_input_attention
from dma_jax.metrics import error_metrics
from dma_jax.synthetic import llm_like_qkv

Q_HEADS, KV_HEADS = 32, 8
L2_BYTES = 60 * 2**20
XLA_MAX_SEQ = 8192  # XLA materialises the S×S scores: 32 heads at 16k need 34 GB+
# DMA default (rotation; NVFP4 tiles exact: bf16 copies on Hopper), without the rotation
# (its cost), the E4M3 opt-in for NVFP4 tiles, and the Hopper preset.
CONFIGS = {"dma_default": DMAConfig(), "dma_no_rotation": DMAConfig(rotate="none"),
           "dma_nvfp4_e4m3": DMAConfig(nvfp4_copy="e4m3"), "dma_hopper_fast": DMAConfig.hopper_fast()}


def copies_needed(seq: int, dim: int) -> int:
    per_set = seq * (Q_HEADS + 2 * KV_HEADS) * dim * 2
    return max(1, min(8, -(-2 * L2_BYTES // per_set)))


def input_sets(seq: int, dim: int) -> list[list[jax.Array]]:
    """Random bf16 (q, k, v) at B=1, 32:8 heads, in enough copies to rotate beyond L2."""
    key = jax.random.PRNGKey(seq + dim)
    sets = []
    for i in range(copies_needed(seq, dim)):
        ks = jax.random.split(jax.random.fold_in(key, i), 3)
        sets.append([jax.random.normal(kk, (1, seq, h, dim), jnp.bfloat16)
                     for kk, h in zip(ks, (Q_HEADS, KV_HEADS, KV_HEADS))])
    return sets


def time_jax(f, sets, min_seconds=0.2) -> float:
    jax.block_until_ready(f(*sets[0]))  # compile and warm up
    n, elapsed = 2, 0.0
    while elapsed < min_seconds:
        n *= 2
        start = time.perf_counter()
        for i in range(n):
            out = f(*sets[i % len(sets)])
        jax.block_until_ready(out)
        elapsed = time.perf_counter() - start
    return elapsed / n * 1e3


def time_torch(fn, sets) -> float:
    cycle = itertools.cycle(sets)
    return triton.testing.do_bench(lambda: fn(*next(cycle)), warmup=25, rep=200)


def dma_fn(cfg, causal):
    return jax.jit(lambda q, k, v: dma_jax.attention(q, k, v, causal=causal, config=cfg))


def ours_bf16_fn(causal, sm_scale):
    return jax.jit(lambda q, k, v: triton_input_attention(q, k, v, causal=causal, sm_scale=sm_scale,
                                                          q_offset=k.shape[1] - q.shape[1]))


def quantize_fn(cfg: DMAConfig):
    """The launches of a DMA call before its attention kernel (smooth-K mean, Q and K
    copies, V's FP8 transpose), through JAX as the call makes them."""
    def quantize(q, k, v):
        plan = executor.attention_plan(q, k, v, causal=True, config=cfg, q_offset=k.shape[1] - q.shape[1])
        env = executor.run(plan.launches[:-1], {"q": q, "k": k, "v": v})
        return {name: x for name, x in env.items() if name not in ("q", "k", "v")}

    return jax.jit(quantize)


def cudnn_fp8_setup(q, k, v):
    """FP8 inputs with per-tensor amax scales, and the scale parameters, for cuDNN FP8
    (P scaled by 256 into E4M3, output scaled by 448 / amax(v))."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    def to_fp8(x):
        s = jnp.max(jnp.abs(x.astype(jnp.float32))) / 448.0
        return (x.astype(jnp.float32) / s).astype(jnp.float8_e4m3fn), s

    rep = Q_HEADS // KV_HEADS
    (q8, sq), (k8, sk), (v8, sv) = to_fp8(q), to_fp8(jnp.repeat(k, rep, 2)), to_fp8(jnp.repeat(v, rep, 2))
    scale_o = 1.0 / sv  # |O| <= amax(v) = 448 sv
    one = jnp.ones((1, 1, 1, 1), jnp.float32)
    params = {name: one for name in fa.fp8_params_keys}
    params.update(descale_q=sq * one, descale_k=sk * one, descale_v=sv * one, descale_s=one / 256.0,
                  scale_s=one * 256.0, scale_o=scale_o * one)
    return (q8, k8, v8), params, scale_o


def cudnn_fp8_fn(causal, sm_scale):
    from jax._src.cudnn import fused_attention_stablehlo as fa

    mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK

    @jax.jit
    def f(q8, k8, v8, params):
        return fa.dot_product_attention(q8, k8, v8, fp8_params=params, scale=sm_scale, mask_type=mask,
                                        use_fp8=True, qkv_layout="BTNH")[0]
    return f


def speed(dims, seqs, save) -> list[dict]:
    print(f"{torch.cuda.get_device_name()}, batch 1, {Q_HEADS}:{KV_HEADS} heads, bf16; "
          "TFLOP/s (ratio to cudnn_bf16); DMA quantization alone in ms")
    names = [*CONFIGS, "ours_bf16", "cudnn_bf16", "cudnn_fp8", "xla_bf16", "torch_sdpa_bf16"]
    print("| D | causal | S | " + " | ".join(names) + f" | quantize ms ({' / '.join(CONFIGS)}) |")
    print("|---|---|---:|" + "---:|" * (len(names) + 1))
    rows = []
    for dim, causal, seq in itertools.product(dims, (False, True), seqs):
        sets = input_sets(seq, dim)
        flops = 4 * seq * seq * Q_HEADS * dim / (2 if causal else 1)
        row = {"head_dim": dim, "causal": causal, "seq": seq, "ms": {}, "tflops": {}, "quantize_ms": {},
               "notes": {}}

        def record(name, run):
            try:
                row["ms"][name] = run()
                row["tflops"][name] = flops / row["ms"][name] / 1e9
            except Exception as err:  # a baseline that does not support this shape
                row["notes"][name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"

        for name, cfg in CONFIGS.items():
            record(name, lambda: time_jax(dma_fn(cfg, causal), sets))
            row["quantize_ms"][name] = time_jax(quantize_fn(cfg), sets)
        record("ours_bf16", lambda: time_jax(ours_bf16_fn(causal, dim**-0.5), sets))
        record("cudnn_bf16", lambda: time_jax(jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn")), sets))

        def fp8_run():
            prepared = [cudnn_fp8_setup(*s)[:2] for s in sets[:2]]
            f = cudnn_fp8_fn(causal, dim**-0.5)
            return time_jax(lambda a, p: f(*a, p), prepared)
        record("cudnn_fp8", fp8_run)
        if seq <= XLA_MAX_SEQ:
            record("xla_bf16", lambda: time_jax(jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation="xla")), sets))
        torch_sets = [[bridge.to_torch(x).transpose(1, 2) for x in s] for s in sets]
        record("torch_sdpa_bf16", lambda: time_torch(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=True), torch_sets))
        base = row["tflops"].get("cudnn_bf16")
        cells = [f"{row['tflops'][n]:.0f} ({row['tflops'][n] / base:.2f}×)" if n in row["tflops"] and base
                 else "n/a" for n in names]
        quant = " / ".join(f"{row['quantize_ms'][n]:.3f}" for n in CONFIGS)
        print(f"| {dim} | {causal} | {seq} | " + " | ".join(cells) + f" | {quant} |", flush=True)
        for name, note in row["notes"].items():
            print(f"    {name}: {note}")
        rows.append(row)
        save(rows)
        del sets, torch_sets
    return rows


def accuracy(seq=4096, dim=128) -> dict[str, dict]:
    """Errors against exact float32 attention on structured inputs (causal)."""
    q, k, v = llm_like_qkv(jax.random.PRNGKey(0), q_len=seq, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=dim)
    exact = np.asarray(dma_jax.exact_attention(q, k, v, causal=True), np.float64)
    outs = {name: dma_fn(cfg, True)(q, k, v) for name, cfg in CONFIGS.items()}
    outs["dma_pv_fp8"] = dma_fn(DMAConfig(pv="fp8"), True)(q, k, v)
    outs["dma_all_mxfp8"] = dma_fn(DMAConfig.all_high(), True)(q, k, v)
    outs["dma_all_nvfp4"] = dma_fn(DMAConfig.all_low(), True)(q, k, v)
    outs["ours_bf16"] = ours_bf16_fn(True, dim**-0.5)(q, k, v)
    outs["cudnn_bf16"] = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    (q8, k8, v8), params, scale_o = cudnn_fp8_setup(q, k, v)
    out8 = cudnn_fp8_fn(True, dim**-0.5)(q8, k8, v8, params)
    outs["cudnn_fp8"] = out8.astype(jnp.float32) / scale_o
    tq, tk, tv = (bridge.to_torch(x).transpose(1, 2) for x in (q, k, v))
    outs["torch_sdpa_bf16"] = bridge.from_torch(torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, is_causal=True, enable_gqa=True).transpose(1, 2).contiguous())
    errors = {name: error_metrics(np.asarray(o, np.float64), exact) for name, o in outs.items()}
    base = errors["dma_default"]["rel_l1"]
    print(f"\nerror vs exact float32 attention, llm_like_qkv, B=1, S={seq}, {Q_HEADS}:{KV_HEADS} heads, D={dim}, causal")
    print("| attention | rel_l1 | × DMA default | cosine | rmse |")
    print("|---|---:|---:|---:|---:|")
    for name, m in errors.items():
        print(f"| {name} | {m['rel_l1']:.5f} | {m['rel_l1'] / base:.2f} | {m['cosine']:.6f} | {m['rmse']:.5f} |")
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--quick", action="store_true", help="seqs 1024,8192, head_dim 128")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py needs a CUDA GPU")
    seqs = [1024, 8192] if args.quick else [int(s) for s in args.seqs.split(",")]
    dims = [128] if args.quick else [int(d) for d in args.head_dims.split(",")]
    os.makedirs(args.out, exist_ok=True)
    gpu = gpu_tag()
    path = os.path.join(args.out, f"{gpu}.json")
    errors = accuracy()

    def save(rows):  # after every row: a run cut short keeps what it measured
        with open(path, "w") as fh:
            json.dump({"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                       "jax": jax.__version__, "torch": torch.__version__, "triton": triton.__version__,
                       "heads": [Q_HEADS, KV_HEADS], "dtype": "bfloat16",
                       "configs": {n: c.__dict__ for n, c in CONFIGS.items()},
                       "errors_llm_like_s4096_d128_causal": errors, "rows": rows}, fh, indent=2)

    rows = speed(dims, seqs, save)
    print(f"wrote {path}")
    _plot(rows, os.path.join(args.out, f"{gpu}.png"))


def _plot(rows, path) -> None:
    plt = pyplot()
    if plt is None:
        return
    panels = sorted({(r["head_dim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (dim, causal) in zip(axes[0], panels):
        sel = [r for r in rows if r["head_dim"] == dim and r["causal"] == causal]
        names = sorted({n for r in sel for n in r["tflops"]})
        for name in names:
            pts = [(r["seq"], r["tflops"][name]) for r in sel if name in r["tflops"]]
            ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"D={dim}, {'causal' if causal else 'non-causal'}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
