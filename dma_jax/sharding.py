"""How ``dma_attention`` splits across devices under ``jax.jit`` with sharded inputs.

XLA cannot look inside the Triton kernels: without a rule it gathers q, k and v
onto every device and runs the whole attention on each. Attention is independent
per batch item and per head, so the call is wrapped in ``custom_partitioning``
and each device runs it on its own shard, with no communication, when q is
sharded along batch and/or heads:

- batch: q, k, v and the output share q's batch sharding.
- heads: k and v take q's head sharding (a device's q heads then use exactly its
  kv heads: head ``h`` reads kv head ``h // (q_heads // kv_heads)``) when
  ``kv_heads`` divides evenly; with one kv head (MQA) k and v are replicated;
  otherwise the heads are gathered.
- sequence and head_dim are always gathered: the high/low tile of every pair and
  the causal mask depend on absolute positions, and smooth-K averages K over all
  tokens.

A dimension sharded unevenly is gathered too. The result is the same, bit for
bit, as the unsharded call.
"""

from __future__ import annotations

import math
from typing import Callable

from jax.experimental.custom_partitioning import (
    ArrayMapping,
    CompoundFactor,
    SdyShardingRule,
    custom_partitioning,
)
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["partitioned"]


def _axes_size(mesh, spec_entry) -> int:
    if spec_entry is None:
        return 1
    names = (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)
    return math.prod(mesh.shape[name] for name in names)


def _spec(sharding, ndim: int) -> tuple:
    spec = tuple(getattr(sharding, "spec", ()) or ())
    return spec + (None,) * (ndim - len(spec))


def _plan(mesh, q_shape, k_shape, q_sharding) -> tuple[PartitionSpec, PartitionSpec]:
    """(spec of q and the output, spec of k and v) from q's sharding."""
    batch, _, q_heads, _ = q_shape
    kv_heads = k_shape[2]
    b, _, h, _ = _spec(q_sharding, 4)
    if batch % _axes_size(mesh, b):
        b = None
    kh = h
    n = _axes_size(mesh, h)
    if q_heads % n:
        h = kh = None
    elif kv_heads % n:
        if kv_heads == 1:
            kh = None
        else:
            h = kh = None
    return PartitionSpec(b, None, h, None), PartitionSpec(b, None, kh, None)


def _infer(causal, config, q_offset, mesh, arg_shapes, result_shape):
    q, k, _ = arg_shapes
    return NamedSharding(mesh, _plan(mesh, q.shape, k.shape, q.sharding)[0])


def _rule(causal, config, q_offset, mesh, value_types, result_types):
    """Shardy's view of the same plan: batch and kv-head factors pass through; the
    group factor (q heads per kv head) may be sharded only with a single kv head;
    lengths and head_dim stay whole."""
    q_heads = value_types[0].shape[2]
    kv_heads = value_types[1].shape[2]
    group = q_heads // kv_heads
    whole = {"ql", "kl", "d", "dv"}
    sizes = {}
    if group == 1:
        q_head_factor = "kh"
    elif kv_heads == 1:  # a compound factor may not hold a factor of size 1
        q_head_factor = "g"
    else:
        q_head_factor = CompoundFactor("kh", "g")
        sizes = {"g": group}
        whole.add("g")
    q_map = ArrayMapping("b", "ql", q_head_factor, "d")
    k_map = ArrayMapping("b", "kl", "kh", "d")
    v_map = ArrayMapping("b", "kl", "kh", "dv")
    out_map = ArrayMapping("b", "ql", q_head_factor, "dv")
    # The verifier wants special factors in the order the factors first appear.
    order = ["b", "ql", "kh", "g", "d", "kl", "dv"]
    return SdyShardingRule((q_map, k_map, v_map), (out_map,),
                           need_replication_factors=tuple(f for f in order if f in whole), **sizes)


def partitioned(local: Callable) -> Callable:
    """``local(q, k, v, causal, config, q_offset)`` (positional; the last three
    static) wrapped so that XLA's SPMD partitioner runs it per shard, as the module
    docstring says. On one device it is ``local`` itself."""

    def partition(causal, config, q_offset, mesh, arg_shapes, result_shape):
        q, k, _ = arg_shapes
        q_spec, kv_spec = _plan(mesh, q.shape, k.shape, q.sharding)
        q_sharding, kv_sharding = NamedSharding(mesh, q_spec), NamedSharding(mesh, kv_spec)

        def per_shard(q, k, v):
            return local(q, k, v, causal, config, q_offset)

        return mesh, per_shard, q_sharding, (q_sharding, kv_sharding, kv_sharding)

    wrapped = custom_partitioning(local, static_argnums=(3, 4, 5))
    wrapped.def_partition(partition=partition, infer_sharding_from_operands=_infer, sharding_rule=_rule)
    return wrapped
