"""dma_jax.sharding: under jax.jit with inputs sharded over four (CPU) devices, the
attention runs per shard (traced with the local shapes), gathers only what its
plan says must be whole, and gives the same result as one device.

The cases run in a subprocess (``tests/sharding_cases.py``): the CPU device count
is fixed when JAX starts. ``local_attention`` there stands in for a kernel XLA
cannot look into, as the Triton kernels are; its result is checked against a
float64 oracle, and ``dma_jax.attention``'s against the unsharded call.
"""

import functools
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PARTITIONERS = ("shardy", "gspmd")


@functools.cache
def _run(partitioner: str) -> dict:
    run = subprocess.run([sys.executable, os.path.join(HERE, "sharding_cases.py"), partitioner],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(params=PARTITIONERS)
def cases(request) -> dict:
    """The cases of ``sharding_cases.py`` under Shardy (JAX's default) and GSPMD."""
    return _run(request.param)


GLOBAL = [2, 32, 8, 16]


@pytest.mark.parametrize("name, local_q, local_k, out_spec", [
    # Batch on "data", heads on "model": each device holds one item and half the heads,
    # and k/v follow q's head sharding whether given sharded or replicated.
    ("gqa_sharded_alike", [1, 32, 4, 16], [1, 32, 2, 16], ["data", None, "model"]),
    ("gqa_kv_replicated", [1, 32, 4, 16], [1, 32, 2, 16], ["data", None, "model"]),
    # One kv head: every device keeps it and takes its share of the q heads.
    ("mqa", [1, 32, 4, 16], [1, 32, 1, 16], ["data", None, "model"]),
])
def test_batch_and_heads_run_per_shard_without_gathering(cases, name, local_q, local_k, out_spec):
    case = cases[name]
    assert [local_q, local_k] in case["traced"]
    assert case["out_spec"] == out_spec
    assert not case["gathers"]
    assert case["error"] < 1e-5


def test_heads_that_do_not_split_evenly_over_kv_heads_are_gathered(cases):
    # 4 q heads over 4 devices would give each device one q head but half a kv head.
    case = cases["kv_heads_indivisible"]
    assert case["traced"] == [[[2, 32, 4, 16], [2, 32, 2, 16]]] * 2
    assert case["gathers"]
    assert case["error"] < 1e-5


def test_a_sharded_sequence_is_gathered(cases):
    # Tile formats, the causal mask and smooth-K need every position; batch stays split.
    case = cases["sequence_sharded"]
    assert [[1, 32, 8, 16], [1, 32, 4, 16]] in case["traced"]
    assert case["gathers"]
    assert case["error"] < 1e-5


@pytest.mark.parametrize("name", ["dma_causal", "dma_noncausal_preset"])
def test_dma_attention_is_partitioned_and_equals_one_device(name):
    case = _run("shardy")[name]
    assert case["partitioned"]
    assert [[1, 256, 4, 64], [1, 256, 2, 64]] in case["traced"]
    assert case["out_spec"] == ["data", None, "model"]
    assert not case["gathers"]
    assert case["equal"]
    assert case["shard_map_equal"]
