"""A seeded fuzz of dma_jax.attention against the float64 oracle: random structures
(shapes, dtypes, causal, q_offset, every DMAConfig knob) with random inputs of several
kinds each (tests/fuzz_cases.py). The fast tier runs 100 cases, the slow tier 1000."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dma_jax
from dma_jax.reference import smoothing_mean

import oracle
from fuzz_cases import compare, inputs, oracle_keys, oracle_kwargs, structure

PER_STRUCTURE = 25


def run_structures(structures: range) -> list[str]:
    """Every case of the given structures; the failures, described."""
    failures = []
    for sid in structures:
        s = structure(sid)
        f = jax.jit(functools.partial(dma_jax.attention, causal=s.causal, config=s.config, q_offset=s.q_offset))
        for j in range(PER_STRUCTURE):
            kind, (q, k, v) = inputs(s, 1000 * sid + j)
            args = [jnp.asarray(x).astype(s.dtype) for x in (q, k, v)]
            out = f(*args)
            mean = np.asarray(smoothing_mean(args[1].astype(jnp.float32)))
            want = oracle.dma_attention(q, oracle_keys(s, k, mean), v, **oracle_kwargs(s))
            problem = compare(out, want, s)
            if problem:
                failures.append(f"structure {sid} {s}, input {j} ({kind}): {problem}")
    return failures


@pytest.mark.parametrize("first", [0, 2])
def test_fuzz_fast(first):
    """4 structures x 25 inputs."""
    failures = run_structures(range(first, first + 2))
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("first", range(4, 44, 10))
def test_fuzz(first):
    """40 structures x 25 inputs = 1000 cases (structures 4-43)."""
    failures = run_structures(range(first, first + 10))
    assert not failures, "\n".join(failures)
