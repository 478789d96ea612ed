"""Token generation at device speed: jitted prefill and decode over the model's split
state, sampling inside the program, the KV cache donated, decode steps run in chunks
on the device, and the host reading each chunk's tokens while the device already
runs the next chunk.

``nnx.jit`` walks the model's graph on every call; here the model is split once into
a graph definition (static) and its state (a pytree of arrays), and each program is a
plain ``jax.jit`` function of the state. A call hands over every weight and cache
array, and a donated array costs the host microseconds to prepare (on an H100 about
4 µs each, ``benchmarks/launch_cost.py``), so one call runs ``chunk`` decode steps in
a ``lax.scan``. The programs are compiled ahead of time per input shape, so that
compile time is measured apart from run time (``Timings``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .llama import AttentionSpec, Llama, new_cache

__all__ = ["CHUNK", "Sampling", "Timings", "generate", "generate_batch", "jitted_steps", "sample"]

# Decode steps per call of the decode program (``generate_batch``'s default).
CHUNK = 8


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Greedy when ``temperature == 0``; else temperature and top-p (nucleus) sampling.
    Frozen: a compiled step is specialised to it."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0; got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")


def sample(logits: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
    """Next token ids ``[B]`` from logits ``[B, vocab]``."""
    if s.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / s.temperature
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (always the first token).
    keep = (jnp.cumsum(probs, axis=-1) - probs) < s.top_p
    choice = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


@dataclasses.dataclass
class Timings:
    """Where a generation's time went. ``compile_s``: compiling steps not compiled
    before (0 when every shape was seen); ``prefill_s``: from the prefill's dispatch
    to the first tokens on the host (time to first token, compilation excluded);
    ``decode_s``: from then to the last token on the host, for ``new_tokens - 1``
    decode steps of ``batch`` rows."""

    batch: int = 1
    prompt_tokens: int = 0
    new_tokens: int = 0
    compile_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Steady-state decode rate of one row (tokens per second)."""
        return max(self.new_tokens - 1, 0) / self.decode_s if self.decode_s > 0 else 0.0


def _prefill_step(graphdef, spec: AttentionSpec, sampling: Sampling, state, tokens, lengths, cache, key):
    model = nnx.merge(graphdef, state)
    logits, cache = model.prefill(tokens, cache, spec, lengths=lengths, last_only=True)
    key, sub = jax.random.split(key)
    return sample(logits, sub, sampling), cache, key


def _decode_steps(graphdef, spec: AttentionSpec, sampling: Sampling, steps: int, state, token, cache, key):
    model = nnx.merge(graphdef, state)

    def step(carry, _):
        token, cache, key = carry
        logits, cache = model.decode(token[:, None], cache, spec)
        key, sub = jax.random.split(key)
        token = sample(logits[:, -1], sub, sampling)
        return (token, cache, key), token

    (token, cache, key), tokens = jax.lax.scan(step, (token, cache, key), length=steps)
    return tokens.T, token, cache, key


@functools.lru_cache(maxsize=None)
def jitted_steps(graphdef, spec: AttentionSpec, sampling: Sampling, chunk: int = CHUNK):
    """(prefill, decode) as ``jax.jit`` functions of (state, ...), the cache donated
    where the backend can reuse it (not on CPU, where JAX would warn):
    ``prefill(state, tokens [B, T], lengths [B], cache, key)`` returns (first new tokens
    [B], cache, key); ``decode(state, token [B], cache, key)`` runs ``chunk`` steps from
    ``token`` and returns (their tokens [B, chunk], the last of them [B], cache, key)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1; got {chunk!r}")
    donate = jax.default_backend() != "cpu"
    prefill = jax.jit(functools.partial(_prefill_step, graphdef, spec, sampling),
                      donate_argnums=(3,) if donate else ())
    decode = jax.jit(functools.partial(_decode_steps, graphdef, spec, sampling, chunk),
                     donate_argnums=(2,) if donate else ())
    return prefill, decode


_COMPILED: dict[Any, Any] = {}


def _compiled(fn, args, timings: Timings):
    """``fn`` (one of ``jitted_steps``', so one per model graph, spec and sampling) compiled
    for the shapes of ``args``, once per process; the time of a new compilation goes to
    ``timings.compile_s``."""
    shapes = tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(args))
    key = (fn, jax.tree.structure(args), shapes)
    if key not in _COMPILED:
        start = time.perf_counter()
        _COMPILED[key] = fn.lower(*args).compile()
        timings.compile_s += time.perf_counter() - start
    return _COMPILED[key]


def generate_batch(
    model: Llama, prompts: Sequence[Sequence[int]], *, spec: AttentionSpec, max_new_tokens: int,
    sampling: Sampling = Sampling(), stop_ids: tuple[int, ...] = (), timings: Timings | None = None,
    cache_len: int | None = None, chunk: int = CHUNK,
) -> Iterator[list[int | None]]:
    """Generate for several prompts at once: yield, step by step, each row's new token
    (``None`` once the row has produced a stop token or is done).

    Prompts of different lengths are right-padded into one prefill; each row then
    decodes at its own position. ``cache_len``: KV-cache length, at least the longest
    prompt + new tokens (the default); one length for many calls lets them share the
    compiled programs. ``chunk``: decode steps per call; the host reads a chunk's
    tokens while the next chunk runs, and the last chunk's steps past
    ``max_new_tokens`` (at most ``chunk - 1``, written into as many extra cache
    positions) are discarded. The tokens do not depend on ``chunk``.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    timings = timings if timings is not None else Timings()
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    longest = int(lengths.max())
    needed = longest + max_new_tokens
    if cache_len is not None and cache_len < needed:
        raise ValueError(f"cache_len must be >= longest prompt + new tokens ({needed}); got {cache_len}")
    tokens = np.zeros((len(prompts), longest), np.int32)
    for row, p in enumerate(prompts):
        tokens[row, :len(p)] = p
    timings.batch, timings.prompt_tokens, timings.new_tokens = len(prompts), int(lengths.sum()), 0
    timings.compile_s = timings.prefill_s = timings.decode_s = 0.0

    graphdef, state = nnx.split(model)
    prefill, decode = jitted_steps(graphdef, spec, sampling, chunk)
    cache = new_cache(model.config, spec, len(prompts), (cache_len or needed) + chunk - 1, model.dtype)
    key = jax.random.PRNGKey(sampling.seed)
    args = (state, jnp.asarray(tokens), jnp.asarray(lengths), cache, key)
    # Both programs compiled (or found compiled) before the clock of the prefill starts.
    prefill_fn = _compiled(prefill, args, timings)
    decode_fn = _compiled(decode, (state, jnp.zeros(len(prompts), jnp.int32), cache, key), timings)
    start = time.perf_counter()
    token, cache, key = prefill_fn(*args)
    done = np.zeros(len(prompts), bool)
    stops = np.asarray(stop_ids, np.int32)
    produced = 0
    pending = token[:, None]  # tokens the host has not read yet, [B, n]
    while True:
        if produced + pending.shape[1] < max_new_tokens:
            # Dispatched before the pending tokens are read: the device runs ahead.
            ahead, token, cache, key = decode_fn(state, token, cache, key)
        host = np.asarray(pending)
        now = time.perf_counter()
        if produced == 0:
            timings.prefill_s = now - start
            start = now  # decode time runs from the first token on the host
        timings.decode_s = now - start
        for column in host.T[:max_new_tokens - produced]:
            produced += 1
            timings.new_tokens = produced
            yield [None if d else int(t) for t, d in zip(column, done)]
            done |= np.isin(column, stops)
            if done.all():
                return
        if produced == max_new_tokens:
            return
        pending = ahead


def generate(
    model: Llama, prompt_ids: Sequence[int], *, spec: AttentionSpec, max_new_tokens: int,
    sampling: Sampling = Sampling(), stop_ids: tuple[int, ...] = (), timings: Timings | None = None,
    cache_len: int | None = None, chunk: int = CHUNK,
) -> Iterator[int]:
    """Yield one prompt's new token ids one by one, the stop token included
    (``generate_batch`` with one row)."""
    for step in generate_batch(model, [prompt_ids], spec=spec, max_new_tokens=max_new_tokens, sampling=sampling,
                               stop_ids=stop_ids, timings=timings, cache_len=cache_len, chunk=chunk):
        if step[0] is None:
            return
        yield step[0]
