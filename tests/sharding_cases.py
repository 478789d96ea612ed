"""Sharded calls on four CPU devices, run as a script by ``tests/test_sharding.py``.

XLA's CPU device count is fixed when JAX starts, so these cases run in their own
process (``python tests/sharding_cases.py [shardy|gspmd]``) and print one JSON
object: per case, the shapes each function was traced with, the output's
sharding, whether the compiled program gathers, and its error against a float64
numpy oracle (or whether it equals the unsharded call bit for bit).
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

if sys.argv[1:] == ["gspmd"]:
    jax.config.update("jax_use_shardy_partitioner", False)

import dma_jax  # noqa: E402
from dma_jax import primitive  # noqa: E402
from dma_jax.sharding import partitioned  # noqa: E402

import oracle  # noqa: E402  (tests/, this script's folder)

MESH = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
L, D = 32, 16


traced = []


def local_attention(q, k, v, causal, config, q_offset):
    """What a kernel would do on one shard (in jnp, recording its shapes)."""
    traced.append([list(q.shape), list(k.shape)])
    group = q.shape[2] // k.shape[2]
    return jax.nn.dot_product_attention(q, jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2))


def _put(x, spec):
    return jax.device_put(x, NamedSharding(MESH, spec))


def _inputs(batch, q_heads, kv_heads, seed=0, length=L, dim=D):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, length, q_heads, dim), np.float32)
    k = rng.standard_normal((batch, length, kv_heads, dim), np.float32)
    v = rng.standard_normal((batch, length, kv_heads, dim), np.float32)
    return q, k, v


def _gathers(fn, *args) -> bool:
    return "all-gather" in fn.lower(*args).compile().as_text()


def partitioned_case(q_heads, kv_heads, q_spec, kv_spec):
    q, k, v = _inputs(2, q_heads, kv_heads)
    per_shard = partitioned(local_attention)
    fn = jax.jit(lambda q, k, v: per_shard(q, k, v, False, None, 0))
    args = (_put(q, q_spec), _put(k, kv_spec), _put(v, kv_spec))
    traced.clear()
    out = fn(*args)
    return {
        "traced": traced[:],
        "out_spec": [list(a) if isinstance(a, tuple) else a for a in out.sharding.spec],
        "gathers": _gathers(fn, *args),
        "error": float(np.abs(np.asarray(out, np.float64) - oracle.dma_attention(q, k, v, causal=False,
                                                                                  diag=None)).max()),
    }


def dma_case(causal, config=None):
    """dma_jax.attention on inputs sharded over batch and heads, against the unsharded call."""
    # 256 tokens: two tiles, so both formats are used.
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _inputs(2, 8, 4, seed=1, length=256, dim=64))
    call = jax.jit(lambda q, k, v: dma_jax.attention(q, k, v, causal=causal, config=config))
    want = np.asarray(call(q, k, v).astype(jnp.float32))
    spec = P("data", None, "model")
    args = (_put(q, spec), _put(k, spec), _put(v, spec))
    seen = []
    reference = primitive.dma_reference

    def recording(q, k, v, **kw):
        seen.append([list(q.shape), list(k.shape)])
        return reference(q, k, v, **kw)

    primitive.dma_reference = recording
    try:
        out = call(*args)
        lowered = call.lower(*args).as_text()
    finally:
        primitive.dma_reference = reference
    in_shard_map = jax.jit(jax.shard_map(
        lambda q, k, v: dma_jax.attention(q, k, v, causal=causal, config=config),
        mesh=MESH, in_specs=(spec, spec, spec), out_specs=spec))(*args)
    return {
        "traced": seen,
        "out_spec": list(out.sharding.spec),
        "partitioned": "CustomSPMDPartitioning" in lowered,
        "gathers": _gathers(call, *args),
        "equal": bool(np.array_equal(np.asarray(out.astype(jnp.float32)), want)),
        "shard_map_equal": bool(np.array_equal(np.asarray(in_shard_map.astype(jnp.float32)), want)),
    }


def main():
    both = P("data", None, "model")
    results = {
        "gqa_sharded_alike": partitioned_case(8, 4, both, both),
        "gqa_kv_replicated": partitioned_case(8, 4, both, P()),
        "mqa": partitioned_case(8, 1, both, P()),
        "kv_heads_indivisible": partitioned_case(4, 2, P(None, None, ("data", "model")), P()),
        "sequence_sharded": partitioned_case(8, 4, P("data", "model"), P()),
    }
    if sys.argv[1:] != ["gspmd"]:
        results["dma_causal"] = dma_case(True)
        results["dma_noncausal_preset"] = dma_case(False, dma_jax.DMAConfig.hopper_fast())
    print(json.dumps(results))


if __name__ == "__main__":
    main()
