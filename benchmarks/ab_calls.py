"""Whole DMA calls of several source trees, side by side on one GPU, as ratios.

For an A/B of a kernel change: each tree is a directory holding ``dma_jax/`` and
``triton_kernels/`` (for example ``git archive <ref> dma_jax triton_kernels | tar -x
-C DIR``). Every round runs each tree in its own process, in turn, so that clock
drift over the run touches all of them alike. Each process times
``jax.jit(dma_jax.attention)`` with the DMA default config and the Hopper preset,
and cuDNN bf16 as a control that no tree changes (B=1, 32:8 heads, bf16,
back-to-back calls, inputs rotated beyond L2: ``attention.time_jax``). Per cell the
best of the rounds is kept. Prints TFLOP/s with the ratio to the first tree and
writes ``results/ab_calls_<gpu>.json``.

    python benchmarks/ab_calls.py --tree main=/tmp/main --tree new=/tmp/new \\
        [--seqs 2048,4096,8192,16384] [--head-dim 128] [--rounds 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

from device_name import gpu_tag

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = ("dma_default", "dma_hopper_fast", "cudnn_bf16")


def worker(tree: str, seqs: list[int], dim: int) -> None:
    """Time every cell with the code of ``tree`` (first on the path): one JSON line each."""
    import jax

    import dma_jax
    from attention import CONFIGS, Q_HEADS, dma_fn, input_sets, time_jax

    if not os.path.abspath(dma_jax.__file__).startswith(os.path.abspath(tree) + os.sep):
        raise SystemExit(f"dma_jax came from {dma_jax.__file__}, not from the tree {tree}")
    print(json.dumps({"device": jax.devices()[0].device_kind}), flush=True)
    for seq in seqs:
        sets = input_sets(seq, dim)
        for causal in (True, False):
            flops = 4 * seq * seq * Q_HEADS * dim / (2 if causal else 1)
            fns = {name: dma_fn(cfg, causal) for name, cfg in CONFIGS.items()}
            fns["cudnn_bf16"] = jax.jit(lambda q, k, v, c=causal: jax.nn.dot_product_attention(
                q, k, v, is_causal=c, implementation="cudnn"))
            for name, f in fns.items():
                try:
                    ms = time_jax(f, sets, 0.3)
                except Exception:  # cuDNN where there is none (a CPU smoke run)
                    if name != "cudnn_bf16":
                        raise
                    continue
                print(json.dumps({"seq": seq, "causal": causal, "name": name, "tflops": flops / ms / 1e9}),
                      flush=True)
        del sets


def run_tree(tree: str, seqs: str, dim: int) -> list[dict]:
    """One worker process for ``tree``: its JSON lines."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.abspath(tree),
                                                                   os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", tree, "--seqs", seqs,
                          "--head-dim", str(dim)], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"the run of {tree} failed:\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], help="NAME=DIR; the first is the baseline")
    parser.add_argument("--seqs", default="2048,4096,8192,16384")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    if args.worker:
        worker(args.worker, seqs, args.head_dim)
        return
    if not args.tree or any("=" not in t for t in args.tree):
        parser.error("give each tree as --tree NAME=DIR, at least one")
    trees = dict(t.split("=", 1) for t in args.tree)
    best: dict[tuple, float] = {}
    device = "?"
    for r in range(args.rounds):
        for name, tree in trees.items():
            for cell in run_tree(tree, args.seqs, args.head_dim):
                if "device" in cell:
                    device = cell["device"]
                    continue
                key = (name, cell["seq"], cell["causal"], cell["name"])
                best[key] = max(best.get(key, 0.0), cell["tflops"])
            print(f"round {r + 1}: {name} done", flush=True)

    names = list(trees)
    print(f"\n{device}, B=1, 32:8 heads, D={args.head_dim}, bf16; TFLOP/s, best of {args.rounds} rounds "
          f"(ratio to {names[0]})")
    print("| S | causal | " + " | ".join(f"{k} {n}" for k in KINDS for n in names) + " |")
    print("|---:|---|" + "---:|" * (len(KINDS) * len(names)))
    rows = []
    for seq in seqs:
        for causal in (True, False):
            cells = []
            for k in KINDS:
                base = best.get((names[0], seq, causal, k))
                for n in names:
                    v = best.get((n, seq, causal, k))
                    ratio = f" ({v / base:.3f})" if v is not None and base and n != names[0] else ""
                    cells.append("n/a" if v is None else f"{v:.0f}{ratio}")
            print(f"| {seq} | {causal} | " + " | ".join(cells) + " |")
            rows.append({"seq": seq, "causal": causal, "tflops": {
                n: {k: best[(n, seq, causal, k)] for k in KINDS if (n, seq, causal, k) in best} for n in names}})
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"ab_calls_{gpu_tag(device)}.json")
    with open(path, "w") as fh:
        json.dump({"date": datetime.date.today().isoformat(), "device": device, "trees": trees,
                   "head_dim": args.head_dim, "rounds": args.rounds, "rows": rows}, fh, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
