"""A model of how the order of causal tiles sets the attention kernels' tail.

Causal query tiles differ in length: the tile of query block m reads m unmasked key
blocks and one masked one. The GPU starts programs in launch order as SMs free up,
so a launch behaves like greedy list scheduling of its tiles, in that order, onto
one slot per SM (the Gluon kernel holds an SM alone). This script computes that
schedule's makespan against the ideal (total work / slots) for two orders:

* head-major: (batch, head) slowest, longest tile first within each head (the
  kernels before session 16);
* longest first across the heads of each batch item (query block slowest within a
  batch item), which the kernels use now.

A tile costs ``m + mask_cost + overhead`` key-block units (the masked block's loop
is about twice an unmasked one's instructions, ``sm90_spills.py``; the overhead
stands for the per-tile set-up and the output store). No GPU needed; prints a
table and writes nothing.

    python benchmarks/experiments/causal_order_model.py [--sms 132] [--block 128]
"""

from __future__ import annotations

import argparse
import heapq


def makespan(costs: list[float], slots: int) -> float:
    """Greedy list scheduling: each tile, in order, goes to the slot that frees first."""
    free = [0.0] * slots
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def tile_costs(seq: int, heads: int, batch: int, block: int, order: str, mask_cost: float,
               overhead: float) -> list[float]:
    n = seq // block
    cost = [m + mask_cost + overhead for m in range(n)]
    if order == "head_major":
        return [cost[n - 1 - i] for _ in range(batch) for _ in range(heads) for i in range(n)]
    return [cost[n - 1 - i] for _ in range(batch) for i in range(n) for _ in range(heads)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--block", type=int, default=128, help="query and key rows per tile")
    parser.add_argument("--mask-cost", type=float, default=2.0)
    parser.add_argument("--overhead", type=float, default=1.0)
    args = parser.parse_args()
    print(f"causal tiles of {args.block} rows on {args.sms} SMs: makespan / ideal")
    print("| S | batch | heads | head-major | longest first | head-major / longest first |")
    print("|---:|---:|---:|---:|---:|---:|")
    for seq in (1024, 2048, 4096, 8192, 16384, 32768):
        for batch, heads in ((1, 32), (4, 32), (1, 8)):
            ideal = sum(tile_costs(seq, heads, batch, args.block, "head_major", args.mask_cost, args.overhead))
            ideal /= args.sms
            a, b = (makespan(tile_costs(seq, heads, batch, args.block, o, args.mask_cost, args.overhead), args.sms)
                    / ideal for o in ("head_major", "longest_first"))
            print(f"| {seq} | {batch} | {heads} | {a:.3f} | {b:.3f} | {a / b:.3f} |")


if __name__ == "__main__":
    main()
