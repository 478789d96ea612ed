"""Every script under benchmarks/ imports on CPU. Most of them run only on a GPU, so
nothing else in the suite loads them: a broken import line would otherwise wait for
the next run on a GPU. Also: the scripts that check what they can on the CPU."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))

IMPORT_ALL = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException:
        failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def run_python(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python *argv`` (in ``env``, default this process's) with the benchmark scripts
    and the repository importable, as the scripts import their neighbours and
    ``models``; output captured as text."""
    path = os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)])
    return subprocess.run([sys.executable, *argv], env=dict(os.environ if env is None else env, PYTHONPATH=path),
                          capture_output=True, text=True)


def test_every_benchmark_script_imports():
    assert len(SCRIPTS) >= 10  # the glob found the scripts
    done = run_python("-c", IMPORT_ALL, *(s.stem for s in SCRIPTS))
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


def test_b200_check_refuses_other_gpus():
    """benchmarks/b200.py is for sm_100: elsewhere it stops with a message that says so,
    and on a machine that is not sm_100 (this one, unless it is a B200) the script exits
    with that message."""
    done = run_python("-c", "import b200, json; print(json.dumps([b200.refusal(*c) for c in ("
                      "('none', None), ('NVIDIA H100 80GB HBM3', (9, 0)), ('NVIDIA B200', (10, 0)))] + "
                      "[b200.refusal(*b200.capability())]))")
    assert done.returncode == 0, done.stderr[-2000:]
    no_gpu, hopper, blackwell, here = json.loads(done.stdout)
    assert "this machine's GPU is none (compute capability None)" in no_gpu
    assert "this machine's GPU is NVIDIA H100 80GB HBM3 (compute capability (9, 0))" in hopper
    assert blackwell is None
    if here is not None:
        done = run_python(str(ROOT / "benchmarks" / "b200.py"))
        assert done.returncode != 0 and here in done.stderr


def test_launch_cost_needs_a_gpu():
    """benchmarks/launch_cost.py times GPU launches; without a GPU it stops and says so."""
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("this machine has a GPU: the script runs (python benchmarks/launch_cost.py)")
    done = run_python(str(ROOT / "benchmarks" / "launch_cost.py"))
    assert done.returncode != 0 and "it needs an NVIDIA GPU" in done.stderr


def test_launch_cost_times_calls_by_their_arguments():
    """launch_cost.py's second table runs on any backend: calls with read-only and with
    donated arguments are timed."""
    done = run_python("-c", "import launch_cost, json; print(json.dumps("
                      "[launch_cost.per_call_us(n, d, 3, 2) for n in (2, 8) for d in (False, True)]))")
    assert done.returncode == 0, done.stderr[-2000:]
    assert all(us > 0 for us in json.loads(done.stdout))


@pytest.mark.slow
def test_sm100_static_report(tmp_path):
    """benchmarks/sm100_static.py compiles a DMA call for sm_100 on the CPU and reports
    block-scaled MMAs, no spills and the launch settings (here: the default config, D=64)."""
    from conftest import TRITON_39, compiler_env

    if not TRITON_39:
        pytest.skip("compiling for sm_100 without a GPU needs triton >= 3.9")
    done = run_python(str(ROOT / "benchmarks" / "sm100_static.py"), "--configs", "default", "--head-dims", "64",
                      "--no-sm120", "--out", str(tmp_path), env=compiler_env())
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "sm100_static.json").read_text())["rows"]
    attention = [r for r in rows if r["launch"].endswith("_dma_attention_kernel")]
    assert len(attention) == 2  # causal and not
    for r in attention:
        assert "tcgen05 mxf4nvf4 block16 ue4m3" in r["mma"] and "tcgen05 mxf8f6f4 block32 ue8m0" in r["mma"]
        assert r["spill_stores"] == r["spill_loads"] == 0 and r["registers"] > 0 and r["warps"] == 8


@pytest.mark.slow
def test_b200_check_parity_part_runs_in_the_interpreter():
    """``b200.py --interpreter``: the sm_100 kernel path's parity tests on the CPU."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the interpreter is not in use")
    done = run_python(str(ROOT / "benchmarks" / "b200.py"), "--interpreter")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "sm_100 parity in the interpreter: " in done.stdout and " passed" in done.stdout


HLO = """HloModule step

%fused (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  ROOT %s = f32[2]{0} sine(%p)
}

ENTRY %main (a: f32[2], b: u8[4]) -> (f32[2], u8[4]) {
  %a = f32[2]{0} parameter(0)
  %b = u8[4]{0} parameter(1)
  %k = f32[] constant(1)
  %f = f32[2]{0} fusion(%a), kind=kLoop, calls=%fused
  %c = (f32[2]{0}, u8[4]{0}) custom-call(%f, %b), custom_call_target="triton_kernel_call"
  %g = f32[2]{0} get-tuple-element(%c), index=0
  %u = u8[4]{0} get-tuple-element(%c), index=1
  %w = u8[4]{0} scatter(%u, %b, %b), update_window_dims={}, to_apply=%fused
  ROOT %t = (f32[2]{0}, u8[4]{0}) tuple(%g, %w)
}
"""


def test_decode_step_counts_launching_operations():
    """benchmarks/decode_step.py's parser counts the ENTRY computation's instructions
    by opcode, without those that launch nothing (parameters, constants, tuples) and
    without the fused computations' bodies."""
    done = run_python("-c", "import decode_step, json, sys; print(json.dumps(decode_step.entry_ops(sys.argv[1])))",
                      HLO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == {"fusion": 1, "custom-call": 1, "scatter": 1}


def test_decode_step_kernel_report_counts_busy_time_once():
    """decode_step.py --profile: the GPU's busy time is the union of its kernels'
    intervals (overlaps counted once), against a brute-force count over integer time
    steps; per-kernel totals and counts per step."""
    rng = np.random.default_rng(0)
    starts = rng.integers(0, 500, 60)
    kernels = [(f"k{i % 3}", int(s), int(s + rng.integers(1, 40))) for i, s in enumerate(starts)]
    covered = np.zeros(600, bool)
    for _, s, e in kernels:
        covered[s:e] = True
    done = run_python("-c", "import decode_step, json, sys; "
                      "print(json.dumps(decode_step.kernel_report(json.loads(sys.argv[1]), 2, top=3)))",
                      json.dumps(kernels))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["busy_ms"] == pytest.approx(covered.sum() / 2 / 1e6)
    assert report["kernels_per_step"] == 30
    for row in report["top"]:
        mine = [(s, e) for n, s, e in kernels if n == row["kernel"]]
        assert row["us_per_step"] == pytest.approx(sum(e - s for s, e in mine) / 2 / 1e3)
        assert row["per_step"] == len(mine) / 2
    assert [r["us_per_step"] for r in report["top"]] == sorted((r["us_per_step"] for r in report["top"]), reverse=True)


def test_decode_step_random_model_has_smollm2_shape():
    """decode_step.py's --random-weights model has the embedded checkpoint's shape."""
    import gguf

    from models.llama import loaders

    done = run_python("-c", "import dataclasses, decode_step, json; "
                      "print(json.dumps(dataclasses.asdict(decode_step.SMOLLM2_135M)))")
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)
    want = json.loads(json.dumps(dataclasses.asdict(loaders._gguf_config(gguf.GGUFReader(
        loaders.embedded_model_path())))))
    assert got.pop("rms_norm_eps") == pytest.approx(want.pop("rms_norm_eps"), rel=1e-6)  # a float32 there
    assert got == want


@pytest.mark.slow
def test_decode_step_runs_on_cpu(tmp_path):
    """benchmarks/decode_step.py runs on the CPU and writes one row per attention
    choice and chunk whose counts add up, whose step time is the median of its rounds
    and whose profile names the host's activities; the low-bit cache's step runs more
    operations and passes the arrays its layers hold, with one length; a chunk of
    steps counts one step's operations, and updates the cache in place where a
    program of one step copies it (the CPU donates nothing)."""
    done = run_python(str(ROOT / "benchmarks" / "decode_step.py"), "--prompt", "16", "--steps", "2", "--rounds", "3",
                      "--chunks", "1,2", "--attention", "exact,dma+dma", "--profile", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    chunked = json.loads((tmp_path / "decode_step_cpu.json").read_text())["rows"]
    assert set(chunked) == {f"{name}, chunk {c}" for name in ("exact", "dma+dma") for c in (1, 2)}
    for name in ("exact", "dma+dma"):
        one, two = chunked[f"{name}, chunk 1"], chunked[f"{name}, chunk 2"]
        assert (one["chunk"], two["chunk"]) == (1, 2)
        assert one["by_kind"]["dot"] == two["by_kind"]["dot"] > 0
        assert one["by_kind"]["copy"] >= one["cache_arrays"] - 1 > two["by_kind"].get("copy", 0)
    rows = {name: chunked[f"{name}, chunk 1"] for name in ("exact", "dma+dma")}
    for row in chunked.values():
        assert row["step_ms"] > 0 and row["ops"] == sum(row["by_kind"].values()) > 0
        assert len(row["step_ms_rounds"]) == 3 and row["step_ms"] == sorted(row["step_ms_rounds"])[1]
        assert row["arrays_in"] > row["cache_arrays"] > 0
        assert row["profile"] is None  # the CPU's trace has no GPU streams
        # The host's activities: XLA's and PJRT's, not the profiler's Python frames.
        assert row["host"] and all(a["us_per_step"] > 0 and not a["name"].startswith("$") for a in row["host"])
    assert rows["dma+dma"]["ops"] > rows["exact"]["ops"]
    # The exact cache: K and V per layer and one length; the low-bit one: eight arrays per
    # layer (codes, scales, values, smooth-K's mean) and one length shared by the layers.
    layers = round(rows["exact"]["ops"] / rows["exact"]["ops_per_layer"])
    assert rows["exact"]["cache_arrays"] == 2 * layers + 1
    assert rows["dma+dma"]["cache_arrays"] == 8 * layers + 1
