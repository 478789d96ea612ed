"""End-to-end generation speed: our loop (``models.decoding``) with each attention
choice, and Hugging Face transformers' ``generate`` on the same checkpoint, GPU and
prompts, in one run.

For each prompt length and batch size: time to first token (prefill of the whole
batch, sampling included, compilation excluded) and steady-state decode rate
(tokens per second per row, and for the batch), greedy, no early stop. Prompts are
seeded random token ids: speed does not depend on the text. Also the KV cache's
bytes per token. Prints a table with the ratios to transformers and writes JSON and
a PNG.

    python benchmarks/generation.py [--prompts 512,2048,8192] [--batches 1,8] [--new-tokens 128] [--chunk 8]
        [--attention exact,cudnn,dma] [--no-hf] [--checkpoint PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
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

from device_name import gpu_tag
from plotting import pyplot
from models.decoding import CHUNK, Timings, generate_batch
from models.generate import device_name
from models.llama import AttentionSpec, load_checkpoint, new_cache
from models.llama.loaders import embedded_model_path

# Our attention choices: name -> spec (prefill / decode).
SPECS = {
    "exact": AttentionSpec.named("exact"),
    "cudnn": AttentionSpec.named("cudnn"),
    "dma": AttentionSpec.named("dma", decode="cudnn"),
    "dma+dma": AttentionSpec.named("dma", decode="dma"),
    "dma+dma-fp8v": AttentionSpec.named("dma", decode="dma", kv_cache="fp8"),
    "dma+dma-bf16band": AttentionSpec.named("dma", decode="dma", decode_high="bf16"),
}


def attention_names(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The comma-separated names of ``--attention``, each a key of ``SPECS`` (else the
    parser's error)."""
    names = text.split(",")
    unknown = sorted(set(names) - set(SPECS))
    if unknown:
        parser.error(f"unknown attention {unknown}; expected some of {list(SPECS)}")
    return names


def prompts(vocab: int, length: int, batch: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed + length)
    return [rng.integers(100, vocab, length).tolist() for _ in range(batch)]


def ours(model, spec: AttentionSpec, ids: list[list[int]], new_tokens: int, chunk: int) -> dict:
    """Second of two identical runs (the first compiles)."""
    for _ in range(2):
        t = Timings()
        for _ in generate_batch(model, ids, spec=spec, max_new_tokens=new_tokens, timings=t, chunk=chunk):
            pass
    length = len(ids[0]) + new_tokens
    cache = new_cache(model.config, spec, 1, length, model.dtype)
    return {"ttft_ms": 1e3 * t.prefill_s, "decode_tok_s": t.decode_tokens_per_s,
            "batch_tok_s": t.batch * t.decode_tokens_per_s, "new_tokens": t.new_tokens,
            "kv_bytes_per_token": cache.nbytes() / length}


def hf_model(checkpoint: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": os.path.basename(checkpoint)} if checkpoint.endswith(".gguf") else {}
    directory = os.path.dirname(checkpoint) if checkpoint.endswith(".gguf") else checkpoint
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype), **kwargs)
    return model.to("cuda").eval()


def hf(model, ids: list[list[int]], new_tokens: int) -> dict:
    """transformers' greedy ``generate``: time to first token from a one-token
    generate, the decode rate from a full one minus it (median of 3 after a warm-up)."""
    import torch

    x = torch.tensor(ids, device="cuda")

    def run(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(2)
    first = float(np.median([run(1) for _ in range(3)]))
    full = float(np.median([run(new_tokens) for _ in range(3)]))
    rate = (new_tokens - 1) / (full - first)
    return {"ttft_ms": 1e3 * first, "decode_tok_s": rate, "batch_tok_s": len(ids) * rate, "new_tokens": new_tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", default="512,2048,8192")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--chunk", type=int, default=CHUNK, help="our loop's decode steps per device call")
    p.add_argument("--attention", default=",".join(SPECS))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--checkpoint", default=None, help="HF directory or .gguf (default: the embedded SmolLM2-135M)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers (e.g. without a CUDA torch)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    names = attention_names(p, args.attention)
    if args.new_tokens < 2:
        p.error(f"--new-tokens must be >= 2 (one prefill token and a decode step); got {args.new_tokens}")
    if args.chunk < 1:
        p.error(f"--chunk must be >= 1; got {args.chunk}")
    checkpoint = args.checkpoint or embedded_model_path()
    model, _ = load_checkpoint(checkpoint, dtype=getattr(jnp, args.dtype))
    torch_model = None if args.no_hf else hf_model(checkpoint, args.dtype)
    os.makedirs(args.out, exist_ok=True)
    tag = gpu_tag(device_name()) if jax.default_backend() == "gpu" else "cpu"
    path = os.path.join(args.out, f"generation_{tag}.json")
    rows = []
    for length in (int(x) for x in args.prompts.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            ids = prompts(model.config.vocab_size, length, batch)
            row = {"prompt": length, "batch": batch, "results": {}}
            for name in names:
                try:
                    row["results"][name] = ours(model, SPECS[name], ids, args.new_tokens, args.chunk)
                except Exception as e:  # e.g. out of memory for exact attention's scores
                    row["results"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            if torch_model is not None:
                row["results"]["transformers"] = hf(torch_model, ids, args.new_tokens)
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(path, "w") as fh:  # after every row: a run cut short keeps what it measured
                json.dump({"date": datetime.date.today().isoformat(), "device": device_name(),
                           "jax": jax.__version__, "checkpoint": os.path.basename(checkpoint), "dtype": args.dtype,
                           "new_tokens": args.new_tokens, "chunk": args.chunk, "rows": rows}, fh, indent=2)
    _table(rows)
    print(f"wrote {path}")
    _plot(rows, path[:-5] + ".png")


def _table(rows) -> None:
    names = [n for n in rows[0]["results"]]
    base = "transformers" if "transformers" in names else None
    print(f"\n{'prompt':>6} {'batch':>5} | " + " | ".join(f"{n:>22}" for n in names))
    print(f"{'':>6} {'':>5} | " + " | ".join(f"{'TTFT ms  tok/s/row':>22}" for _ in names))
    for r in rows:
        cells = []
        for n in names:
            res = r["results"][n]
            if "error" in res:
                cells.append(f"{'error':>22}")
                continue
            cell = f"{res['ttft_ms']:7.1f} {res['decode_tok_s']:7.1f}"
            if base and n != base and "error" not in r["results"][base]:
                cell += f" ({res['decode_tok_s'] / r['results'][base]['decode_tok_s']:.1f}x)"
            cells.append(f"{cell:>22}")
        print(f"{r['prompt']:>6} {r['batch']:>5} | " + " | ".join(cells))


def _plot(rows, path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = list(rows[0]["results"])
    labels = [f"{r['prompt']}x{r['batch']}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        xs = np.arange(len(rows)) + i * width
        for ax, field in zip(axes, ("ttft_ms", "decode_tok_s")):
            ax.bar(xs, [r["results"][n].get(field, 0) for r in rows], width, label=n)
    for ax, title in zip(axes, ("time to first token (ms)", "decode tokens/s per row")):
        ax.set_xticks(np.arange(len(rows)) + 0.4 - width / 2, labels)
        ax.set_xlabel("prompt tokens x batch")
        ax.set_title(title)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
