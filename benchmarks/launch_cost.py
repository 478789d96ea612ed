"""What one kernel launch costs inside a JAX program, host side: a chain of ``--chain``
dependent launches of a one-block kernel in one ``jax.jit`` (their work is negligible,
their order fixed), microseconds per launch, for

* an XLA fusion (the model's own operations),
* a Triton kernel through ``dma_jax``'s launcher (``dma_jax.triton_call``: jaxlib's FFI
  custom call ``triton_kernel_call_ffi``), the path of every DMA launch,
* the same kernel through jax-triton's ``triton_call`` (jaxlib's legacy custom call
  ``triton_kernel_call``), where jax-triton is installed;

and what the arguments of a call cost: one small program called with ``--buffers`` N
arrays, read-only (as a model's weights) or donated and returned (as its KV cache),
microseconds per call.

XLA records runs of launches into command buffers (CUDA graphs) where it can;
``--no-command-buffers`` turns that off, to show what a launch costs without them. The
median of ``--rounds`` rounds of ``--calls`` calls. NVIDIA GPUs only. Prints a table and
writes ``results/launch_cost_<gpu>.json``.

    python benchmarks/launch_cost.py [--chain 100] [--buffers 2,64,256,512] [--calls 30] [--rounds 5]
        [--no-command-buffers]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import triton
import triton.language as tl

BLOCK = 128


@triton.jit
def _one_block(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) * 1.0001 + 0.5)


def median_us(call, calls: int, rounds: int) -> float:
    """Microseconds per ``call()`` (which returns what it dispatched), the median of
    ``rounds`` rounds of ``calls`` calls back to back, after one warm-up call."""
    import jax

    jax.block_until_ready(call())
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = call()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def per_launch_us(step, chain: int, calls: int, rounds: int) -> float:
    """Microseconds per launch of ``step`` (an array to an array of the same shape),
    ``chain`` of them in one jitted program, ``calls`` programs back to back."""
    import jax
    import jax.numpy as jnp

    def program(x):
        for _ in range(chain):
            x = step(x)
        return x

    run = jax.jit(program).lower(jnp.ones((BLOCK,), jnp.float32)).compile()
    y = jnp.ones((BLOCK,), jnp.float32)

    def call():
        nonlocal y
        y = run(y)
        return y

    return median_us(call, calls, rounds) / chain


def per_call_us(buffers: int, donate: bool, calls: int, rounds: int) -> float:
    """Microseconds per call of a one-fusion program given ``buffers`` small arrays:
    read only, or donated and returned (updated in place)."""
    import jax
    import jax.numpy as jnp

    if donate:
        run = jax.jit(lambda xs: (xs[0] + 1, *xs[1:]), donate_argnums=0)
    else:
        run = jax.jit(lambda xs, y: y + xs[0])
    xs = tuple(jnp.zeros((16,), jnp.float32) for _ in range(buffers))
    y = jnp.zeros((16,), jnp.float32)

    def call():
        nonlocal xs, y
        if donate:
            xs = run(xs)
        else:
            y = run(xs, y)
        return xs, y

    return median_us(call, calls, rounds)


def launches() -> dict:
    """The launches to time, by name (jax-triton's only where it is installed)."""
    import jax
    import jax.numpy as jnp

    from dma_jax.triton_call import triton_call

    out = jax.ShapeDtypeStruct((BLOCK,), jnp.float32)
    found = {
        "XLA fusion": lambda x: jax.lax.optimization_barrier(jnp.sin(x) * 1.0001 + 0.5),
        "Triton, FFI call (dma_jax)": lambda x: triton_call(
            x, kernel=_one_block, signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "BLOCK": "constexpr"},
            constexprs={"BLOCK": BLOCK}, scalars={}, out_shape=[out], grid=(1, 1, 1), num_warps=4,
            num_stages=3)[0],
    }
    cache_dir = os.environ.get("TRITON_CACHE_DIR")
    try:
        import jax_triton
    except ImportError:
        return found
    finally:  # jax-triton 0.3.1 blanks Triton's cache directory on import
        if cache_dir:
            os.environ["TRITON_CACHE_DIR"] = cache_dir
    found["Triton, legacy custom call (jax-triton)"] = lambda x: jax_triton.triton_call(
        x, kernel=_one_block, out_shape=out, grid=(1,), BLOCK=BLOCK)
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chain", type=int, default=100, help="dependent launches in one program")
    p.add_argument("--buffers", default="2,64,256,512", help="argument counts of the second table")
    p.add_argument("--calls", type=int, default=30, help="programs per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-command-buffers", action="store_true", help="XLA without command buffers (CUDA graphs)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    if args.no_command_buffers:  # read when JAX starts its GPU backend, so set before the first use
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    import jax

    if jax.default_backend() != "gpu":
        sys.exit("launch_cost.py times GPU launches: it needs an NVIDIA GPU")
    rows = {name: per_launch_us(step, args.chain, args.calls, args.rounds) for name, step in launches().items()}
    counts = [int(n) for n in args.buffers.split(",")]
    arguments = {f"{n} {kind}": per_call_us(n, kind == "donated", args.calls, args.rounds)
                 for kind in ("read-only", "donated") for n in counts}
    device = jax.devices()[0].device_kind
    buffers = "off" if args.no_command_buffers else "XLA's default"
    print(f"{device}, JAX {jax.__version__}, command buffers {buffers}; {args.chain} dependent launches per "
          f"program, median of {args.rounds} rounds of {args.calls} programs")
    print("| launch | µs per launch |")
    print("|---|---:|")
    for name, us in rows.items():
        print(f"| {name} | {us:.2f} |")
    print("\n| arrays passed to one small program | µs per call |")
    print("|---|---:|")
    for name, us in arguments.items():
        print(f"| {name} | {us:.1f} |")
    from device_name import gpu_tag

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"launch_cost_{gpu_tag(device)}{'_no_cb' if args.no_command_buffers else ''}.json")
    with open(path, "w") as fh:
        json.dump({"date": datetime.date.today().isoformat(), "device": device, "jax": jax.__version__,
                   "command_buffers": not args.no_command_buffers, "chain": args.chain, "calls": args.calls,
                   "rounds": args.rounds, "us_per_launch": rows, "us_per_call_by_arguments": arguments}, fh, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
