"""benchmarks/ab_calls.py on CPU: it runs each tree's own code and tabulates the cells.

The timings mean nothing here (DMA runs the jnp reference, cuDNN is absent); what is
checked is the plumbing an A/B on the GPU relies on: each worker imports dma_jax from
its tree and refuses otherwise, and every tree gets every DMA cell."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
SCRIPT = ROOT / "benchmarks" / "ab_calls.py"


def _tree(path: pathlib.Path) -> pathlib.Path:
    for pkg in ("dma_jax", "triton_kernels"):
        shutil.copytree(ROOT / pkg, path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return path


def _run(*args, cwd):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("PYTHONPATH", None)  # the trees must be what supplies dma_jax
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True)


@pytest.mark.slow
def test_ab_calls_times_each_tree(tmp_path):
    a, b = _tree(tmp_path / "a"), _tree(tmp_path / "b")
    out = _run("--tree", f"base={a}", "--tree", f"new={b}", "--seqs", "256", "--rounds", "1",
               "--out", str(tmp_path / "res"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "res" / "ab_calls_gpu.json").read_text())
    assert result["trees"] == {"base": str(a), "new": str(b)}
    assert [(r["seq"], r["causal"]) for r in result["rows"]] == [(256, True), (256, False)]
    for row in result["rows"]:
        for tree in ("base", "new"):
            cells = row["tflops"][tree]
            assert set(cells) == {"dma_default", "dma_hopper_fast"}  # no cuDNN on CPU
            assert all(v > 0 for v in cells.values())
    assert "| 256 | True | " in out.stdout


def test_ab_calls_refuses_a_tree_without_the_code(tmp_path):
    (tmp_path / "empty").mkdir()
    out = _run("--tree", f"empty={tmp_path / 'empty'}", "--seqs", "256", "--rounds", "1",
               "--out", str(tmp_path / "res"), cwd=ROOT)
    assert out.returncode != 0
    assert "not from the tree" in out.stderr + out.stdout
