"""The one-command check for a Blackwell GPU (sm_100: B200, GB200): the GPU test suite
(the kernels against the reference through JAX and torch, every tile on block-scaled
MMAs), then the speed table of ``benchmarks/attention.py`` against cuDNN bf16 and FP8
attention at 8k-32k tokens, head_dim 64 and 128, causal and not, with JSON and PNG.
It also says whether this JAX offers cuDNN's MXFP8 attention (block-scaled), which the
speed table would then include.

    python benchmarks/b200.py [--seqs 8192,16384,32768] [--head-dims 128,64] [--out DIR]
    python benchmarks/b200.py --interpreter    # the parity part only, on the CPU

Refuses to run on other GPUs: the point is the sm_100 path. Send the printed summary
and ``b200_check.json`` (with ``b200.json`` / ``b200.png`` from attention.py) back.
``--interpreter`` runs the same kernel path's parity tests without a GPU, in Triton's
interpreter with PTX's scale semantics (``tests/test_attention_kernel.py -k sm100``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def capability() -> tuple[str, tuple[int, int] | None]:
    """(device name, compute capability) of CUDA device 0, or ("none", None)."""
    import torch

    if not torch.cuda.is_available():
        return "none", None
    return torch.cuda.get_device_name(), torch.cuda.get_device_capability()


def refusal(name: str, cap: tuple[int, int] | None) -> str | None:
    """Why this script does not run on a GPU ``name`` of capability ``cap`` (None: no
    GPU), or None on sm_100."""
    if cap is not None and cap[0] == 10:
        return None
    return (f"benchmarks/b200.py checks the sm_100 (B200/GB200) path; this machine's GPU is {name} "
            f"(compute capability {cap}). On Hopper run tests/test_gpu.py and benchmarks/attention.py.")


def cudnn_mxfp8_available() -> bool:
    """Whether JAX's cuDNN attention bindings mention block-scaled (MXFP8) inputs."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError:
        return False
    return any("mx" in name.lower() or "block_scale" in name.lower() for name in dir(fa))


def run_tests(*args: str) -> dict:
    """``pytest`` on ``args``: the counts and the failures' names."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, capture_output=True, text=True)
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}
    failed = re.findall(r"^FAILED (\S+)", done.stdout, re.M)
    return {"returncode": done.returncode, "summary": tail, "counts": counts, "failed": failed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="8192,16384,32768")
    p.add_argument("--head-dims", default="128,64")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--skip-tests", action="store_true", help="only the speed table")
    p.add_argument("--interpreter", action="store_true",
                   help="no GPU: the sm_100 parity tests in Triton's interpreter, then stop")
    args = p.parse_args()
    if args.interpreter:
        result = run_tests("tests/test_attention_kernel.py", "-k", "sm100", "-m", "slow or not slow")
        print(f"sm_100 parity in the interpreter: {result['summary']}")
        sys.exit(result["returncode"])
    name, cap = capability()
    why = refusal(name, cap)
    if why is not None:
        raise SystemExit(why)
    os.makedirs(args.out, exist_ok=True)
    result = {"date": datetime.date.today().isoformat(), "device": name, "capability": list(cap),
              "cudnn_mxfp8_in_jax": cudnn_mxfp8_available()}
    if not args.skip_tests:
        print("running tests/test_gpu.py ...", flush=True)
        result["tests"] = run_tests("tests/test_gpu.py")
        print(f"tests: {result['tests']['summary']}")
    print("running benchmarks/attention.py ...", flush=True)
    speed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention.py"), "--seqs", args.seqs,
                            "--head-dims", args.head_dims, "--out", args.out], cwd=ROOT)
    result["speed_returncode"] = speed.returncode
    path = os.path.join(args.out, "b200_check.json")
    with open(path, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"\ncuDNN MXFP8 attention in this JAX: {'yes' if result['cudnn_mxfp8_in_jax'] else 'no'}")
    print(f"wrote {path}")
    failed = result.get("tests", {}).get("returncode", 0) != 0 or speed.returncode != 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
