"""Offline sm_90 compile of the Gluon attention kernel: spills and where they are.

No GPU needed, but Triton 3.6 (the Gluon API the kernel is written for; the CPU
venv's Triton 3.9 renamed it): ``pip install --no-deps --target /tmp/t36lib
triton==3.6.0`` and run with ``PYTHONPATH=/tmp/t36lib:.``. Compiles main's kernel
(or, with ``--persistent``, the one of ``persistent_sm90.patch``) for causal and
non-causal DMA default tiles at head_dim 128, with the integer arguments specialised
as divisible by 16 the way Triton's runtime does for 8k-token calls, runs ``ptxas
-v`` on the PTX and prints the spill bytes and, for each spill instruction in the
SASS, whether it sits inside a loop (a backward branch jumps over it; and its length) and whether a
``HGMMA`` (consumer code) or an ``LDGSTS`` (loader code) lies within 60 instructions.

    PYTHONPATH=/tmp/t36lib:. python benchmarks/experiments/sm90_spills.py [--persistent] \\
        [LOADER_REGS=40 CONSUMER_REGS=232 ...]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon._runtime import GluonASTSource

HERE = os.path.dirname(os.path.abspath(__file__))
SPECIALISED = {"Lq", "Lk", "HQ", "n_m", "q_offset", "block0"}  # multiples of 16 at 8k, 32 heads


def compile_kernel(module, causal: bool, overrides: dict):
    kernel = module._dma_attention_sm90_kernel
    meta = {**module.launch_meta(128, causal, True), **overrides}
    sig = {n: "*u8" if n.endswith("f8") else "*fp32" if n.endswith("ts") else "*bf16" if n in ("v_ptr", "o_ptr")
           else "i32" for n in kernel.arg_names}
    sig.update({n: "constexpr" for n in meta})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if sig[n].startswith("*") or n in SPECIALISED}
    return triton.compile(GluonASTSource(kernel, sig, meta, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4))


def ptxas_report(ptx: str) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as fh:
        fh.write(ptx)
    log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", fh.name, "-o", os.devnull],
                         capture_output=True, text=True)
    return " ".join(line.split(":", 1)[-1].strip() for line in (log.stdout + log.stderr).splitlines()
                    if "spill" in line or "Used" in line)


def spill_sites(cubin: bytes) -> list[str]:
    """Each spill instruction as ``op@address:where``: ``loopN`` when a backward branch
    jumps over it (N: instructions in the innermost such loop), then ``HGMMA`` /
    ``LDGSTS`` when one lies within 60 instructions."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(cubin)
    cuobjdump = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    sass = subprocess.run([cuobjdump, "-sass", fh.name], capture_output=True, text=True, check=True).stdout
    ops = [(int(a, 16), op, target) for a, op, target in re.findall(
        r"/\*([0-9a-f]{4,5})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(0x[0-9a-f]+)?", sass)]
    loops = [(int(t, 16), a) for a, op, t in ops if op == "BRA" and t and int(t, 16) < a]
    sites = []
    for i, (addr, op, _) in enumerate(ops):
        if op.startswith(("STL", "LDL")):
            near = {o.split(".")[0] for _, o, _ in ops[max(0, i - 60):i + 60] if o.startswith(("HGMMA", "LDGSTS"))}
            spans = [(hi - lo) // 16 for lo, hi in loops if lo <= addr <= hi]
            where = [f"loop{min(spans)}"] * bool(spans) + sorted(near)
            sites.append(f"{op}@{addr:#x}:{'+'.join(where) or 'straight'}")
    return sites


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("overrides", nargs="*", help="constexpr=value, e.g. LOADER_REGS=40")
    args = parser.parse_args()
    overrides = {k: int(v) for k, v in (o.split("=") for o in args.overrides)}
    if args.persistent:
        sys.path.insert(0, HERE)
        from persistent_sm90 import persistent_module
        module = persistent_module()
    else:
        from triton_kernels import attention_sm90 as module
    for causal in (False, True):
        compiled = compile_kernel(module, causal, overrides)
        print(f"causal={causal}: {ptxas_report(compiled.asm['ptx'])}")
        print("   spills:", " ".join(spill_sites(compiled.asm["cubin"])) or "none")


if __name__ == "__main__":
    main()
