"""Where a decode step of the model goes: for each attention choice and chunk size,
the time per step and the operations XLA runs in a step.

For SmolLM2-135M (the embedded GGUF, ``--checkpoint``, or ``--random-weights``: its
shape with random weights, which times the same, for a machine without the checkpoint)
at one prompt length and batch size: prefill once, then time the generation loop's
decode program (``models.decoding.jitted_steps``: greedy, jitted over the split model,
the cache donated on a GPU, ``chunk`` steps per call) as back-to-back calls, in rounds
where the choices take turns (the median round counts: from one process to the next,
and within one, the step time of this small model moves by up to a third), and count
the operations of one step in the optimized HLO by kind: fusions, custom calls
(Triton kernels, cuDNN), scatters and the rest. Each is at least one kernel launch,
so the counts show whether a step is bound by its kernels or by launching them;
``--chunks 1,8`` shows what a call's own cost (its arguments, the donated cache
among them) adds to a step.
With ``--profile`` the same steps also run under JAX's profiler: the kernels the GPU
ran per step, the time it was busy running them (against the step's time, how far the
step is bound by launching rather than running kernels) and the kernels that took
longest; and the host's longest activities per step (dispatch, argument handling,
XLA's thunks), which show where a step that leaves the GPU idle spends its time.
Prints a table and writes ``results/decode_step_<gpu>.json``.

    python benchmarks/decode_step.py [--prompt 2048] [--batch 1] [--steps 32] [--rounds 5]
        [--chunks 1,8] [--attention cudnn,dma,dma+dma,dma+dma-fp8v] [--checkpoint PATH | --random-weights]
        [--profile]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # models/, the repository's example

import jax
import jax.numpy as jnp
from flax import nnx

from device_name import gpu_tag
from generation import SPECS, attention_names  # the attention choices, named as there
from models.decoding import CHUNK, Sampling, jitted_steps
from models.llama import AttentionSpec, Llama, LlamaConfig, load_checkpoint, new_cache

# SmolLM2-135M-Instruct's shape (as its GGUF describes it), for --random-weights.
SMOLLM2_135M = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                           num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                           tie_word_embeddings=True, max_position_embeddings=8192)
# HLO instructions that launch nothing.
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id"}
_OPCODE = re.compile(r"=\s*(?:\([^=]*?\)|\S+)\s+([a-z][a-z0-9-]*)\(")
_WHILE_BODY = re.compile(r"body=%?([\w.\-]+)")


def _computation(hlo: str, header: str) -> list[str]:
    """The instruction lines of the computation whose header line starts with ``header``."""
    start = hlo.index("\n" + header)
    text = hlo[start:]
    return text[text.index("{") + 1:text.index("\n}")].splitlines()


def _ops(lines: list[str]) -> collections.Counter:
    found = (_OPCODE.search(line) for line in lines)
    return collections.Counter(m.group(1) for m in found if m and m.group(1) not in _FREE)


def entry_ops(hlo: str) -> collections.Counter:
    """Opcodes of the ENTRY computation's instructions in an HLO module's text,
    without those that launch nothing."""
    return _ops(_computation(hlo, "ENTRY"))


def step_ops(hlo: str) -> collections.Counter:
    """The opcodes of one decode step: of the ENTRY computation or, where a while loop
    runs the steps (a decode program's chunk), of that loop's body; the larger of the
    two (a random key's split may be a small loop of its own)."""
    bodies = [m.group(1) for m in map(_WHILE_BODY.search, hlo.splitlines()) if m and " while(" in m.string]
    candidates = [entry_ops(hlo)] + [_ops(_computation(hlo, f"%{b} ")) for b in bodies]
    return max(candidates, key=lambda ops: sum(ops.values()))


def busy_ns(spans: list[tuple[int, int]]) -> int:
    """Length of the union of ``(start, end)`` intervals: the time a GPU ran any kernel."""
    total = 0
    start = end = None
    for s, e in sorted(spans):
        if end is not None and s <= end:  # overlaps the current run: extend it
            end = max(end, e)
            continue
        if end is not None:
            total += end - start
        start, end = s, e
    return total if end is None else total + end - start


def gpu_kernels(trace_dir: str) -> list[tuple[str, int, int]]:
    """(name, start ns, end ns) of every kernel on a GPU stream in a profiler trace."""
    found = []
    for path in pathlib.Path(trace_dir).rglob("*.xplane.pb"):
        for plane in jax.profiler.ProfileData.from_file(str(path)).planes:
            if plane.name.startswith("/device:GPU"):
                found += [(ev.name, ev.start_ns, ev.end_ns) for line in plane.lines if line.name.startswith("Stream")
                          for ev in line.events]
    return found


def host_events(trace_dir: str) -> list[tuple[str, int, int]]:
    """(name, start ns, end ns) of every activity the host's threads recorded in a
    profiler trace (dispatch, argument handling, XLA's thunks, launches), without the
    Python frames (named ``$file:line function``; the profiler's own among them)."""
    found = []
    for path in pathlib.Path(trace_dir).rglob("*.xplane.pb"):
        for plane in jax.profiler.ProfileData.from_file(str(path)).planes:
            if plane.name.startswith("/host:CPU"):
                found += [(ev.name, ev.start_ns, ev.end_ns) for line in plane.lines for ev in line.events
                          if not ev.name.startswith("$")]
    return found


def top_activities(events: list[tuple[str, int, int]], steps: int, top: int = 8) -> list[dict]:
    """The ``top`` event names by total time: microseconds and occurrences per step.
    Events nest (a call contains its argument handling), so the times overlap."""
    total: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for name, s, e in events:
        total[name] += e - s
        count[name] += 1
    return [{"name": n, "us_per_step": t / steps / 1e3, "per_step": count[n] / steps}
            for n, t in total.most_common(top)]


def kernel_report(kernels: list[tuple[str, int, int]], steps: int, top: int = 6) -> dict:
    """Per step: kernels run, GPU busy time, and the ``top`` kernels by total time."""
    return {"kernels_per_step": len(kernels) / steps,
            "busy_ms": busy_ns([(s, e) for _, s, e in kernels]) / steps / 1e6,
            "top": [{"kernel": t["name"], "us_per_step": t["us_per_step"], "per_step": t["per_step"]}
                    for t in top_activities(kernels, steps, top)]}


class Stepper:
    """One attention choice's compiled greedy decode program (``models.decoding.jitted_steps``:
    jitted over the split model, the cache donated on a GPU, ``chunk`` steps per call)
    after a prefill, with the loop's carry (token, cache, key), so that choices can be
    timed in turn."""

    def __init__(self, model, spec: AttentionSpec, prompt: int, batch: int, capacity: int, chunk: int):
        graphdef, self.state = nnx.split(model)
        prefill, decode = jitted_steps(graphdef, spec, Sampling(), chunk)
        tokens = jax.random.randint(jax.random.key(prompt), (batch, prompt), 100, model.config.vocab_size)
        lengths = jnp.full((batch,), prompt, jnp.int32)
        cache = new_cache(model.config, spec, batch, capacity, model.dtype)
        self.chunk = chunk
        self.carry = prefill(self.state, tokens, lengths, cache, jax.random.key(0))
        self.compiled = decode.lower(self.state, *self.carry).compile()
        self.run(chunk)  # warm-up

    def run(self, steps: int) -> float:
        """Run ``steps`` steps (a multiple of the chunk) back to back; milliseconds per step."""
        start = time.perf_counter()
        for _ in range(steps // self.chunk):
            _, *self.carry = self.compiled(self.state, *self.carry)
        jax.block_until_ready(self.carry)
        return 1e3 * (time.perf_counter() - start) / steps


def measure(steppers: dict[str, Stepper], layers: int, steps: int, rounds: int, profile: bool = False) -> dict:
    """Each choice's step time, the median of ``rounds`` rounds of ``steps`` steps with
    the choices taking turns (so that a slow spell of the machine hits all of them),
    and its optimized HLO's operations; with ``profile``, a trace of ``steps`` more."""
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(rounds):
        for name, stepper in steppers.items():
            times[name].append(stepper.run(steps))
    rows = {}
    for name, stepper in steppers.items():
        ms = statistics.median(times[name])
        ops = step_ops(stepper.compiled.as_text())
        token, cache, key = stepper.carry
        rows[name] = {"chunk": stepper.chunk, "step_ms": ms, "step_ms_rounds": times[name], "ms_per_layer": ms / layers,
                      "ops": sum(ops.values()), "ops_per_layer": sum(ops.values()) / layers,
                      "by_kind": dict(ops.most_common()),
                      # What each call hands over: the weights, the token and key, and the cache
                      # (donated on a GPU), each array an argument to prepare.
                      "arrays_in": len(jax.tree.leaves((stepper.state, token, cache, key))),
                      "cache_arrays": len(jax.tree.leaves(cache))}
        if profile:
            with tempfile.TemporaryDirectory() as trace:
                with jax.profiler.trace(trace):
                    stepper.run(steps)
                kernels = gpu_kernels(trace)
                rows[name]["host"] = top_activities(host_events(trace), steps)
            rows[name]["profile"] = kernel_report(kernels, steps) if kernels else None
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=32, help="steps per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds; the choices take turns, the median is reported")
    p.add_argument("--chunks", default=f"1,{CHUNK}",
                   help="decode steps per call, each a choice of its own (each divides --steps)")
    p.add_argument("--attention", default="cudnn,dma,dma+dma,dma+dma-fp8v")
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--checkpoint", default=None,
                         help="HF directory or .gguf (default: the embedded SmolLM2-135M)")
    weights.add_argument("--random-weights", action="store_true", help="SmolLM2-135M's shape with random weights")
    p.add_argument("--profile", action="store_true",
                   help="also trace the steps: kernels per step, GPU busy time, longest kernels (GPUs)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    names = attention_names(p, args.attention)
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    if args.random_weights:
        model = Llama(SMOLLM2_135M, dtype=dtype)
    else:
        model, _ = load_checkpoint(args.checkpoint, dtype=dtype)
    chunks = [int(c) for c in args.chunks.split(",")]
    if any(c < 1 or args.steps % c for c in chunks):
        p.error(f"every chunk must be >= 1 and divide --steps={args.steps}; got {args.chunks}")
    capacity = args.prompt + (args.rounds + 2) * args.steps + 2
    steppers = {f"{name}, chunk {c}": Stepper(model, SPECS[name], args.prompt, args.batch, capacity, c)
                for name in names for c in chunks}
    rows = measure(steppers, model.config.num_layers, args.steps, args.rounds, args.profile)
    device = jax.devices()[0].device_kind
    print(f"{device}, prompt {args.prompt}, batch {args.batch}, {model.config.num_layers} layers, "
          f"median of {args.rounds} rounds of {args.steps} steps back to back, the choices in turn"
          f"{', random weights' if args.random_weights else ''}")
    print("| attention | ms per step | rounds' range | ms per layer | operations per step | per layer "
          "| arrays in (cache) | main kinds |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, r in rows.items():
        kinds = ", ".join(f"{k} {n}" for k, n in list(r["by_kind"].items())[:4])
        spread = f"{min(r['step_ms_rounds']):.2f}–{max(r['step_ms_rounds']):.2f}"
        print(f"| {name} | {r['step_ms']:.2f} | {spread} | {r['ms_per_layer']:.3f} | {r['ops']} "
              f"| {r['ops_per_layer']:.1f} | {r['arrays_in']} ({r['cache_arrays']}) | {kinds} |")
    if args.profile:
        print("\n| attention | kernels per step | GPU busy ms per step | busy / step time "
              "| longest kernels (us per step) |")
        print("|---|---:|---:|---:|---|")
        for name, r in rows.items():
            prof = r["profile"]
            if prof is None:
                print(f"| {name} | no GPU kernels in the trace | | | |")
                continue
            top = ", ".join(f"{t['kernel'][:40]} {t['us_per_step']:.0f}" for t in prof["top"][:4])
            print(f"| {name} | {prof['kernels_per_step']:.0f} | {prof['busy_ms']:.2f} | "
                  f"{prof['busy_ms'] / r['step_ms']:.2f} | {top} |")
        print("\n| attention | the host's longest activities (µs per step; nested ones overlap) |")
        print("|---|---|")
        for name, r in rows.items():
            acts = ", ".join(f"{a['name'][:48]} {a['us_per_step']:.0f}" for a in r["host"][:6])
            print(f"| {name} | {acts} |")
    os.makedirs(args.out, exist_ok=True)
    tag = gpu_tag(device) if jax.default_backend() == "gpu" else "cpu"
    path = os.path.join(args.out, f"decode_step_{tag}.json")
    with open(path, "w") as fh:
        json.dump({"date": datetime.date.today().isoformat(), "device": device, "jax": jax.__version__,
                   "prompt": args.prompt, "batch": args.batch, "steps": args.steps, "chunks": chunks,
                   "rounds": args.rounds, "random_weights": args.random_weights, "rows": rows}, fh, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
