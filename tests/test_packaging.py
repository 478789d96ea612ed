"""The wheel that `pip install dma-jax` would get: every source module of the two
packages and nothing else (no generic top-level ``models``), the PEP 561 markers, the
license, and core dependencies that a CPU machine needs (no torch, no Triton). Built with the venv's own setuptools from a copy of this
checkout's project files (a build in place leaves a ``build/`` whose stale modules
would go into later wheels)."""

import email
import email.message
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dma_jax", "triton_kernels")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        check=True, capture_output=True,
    )
    (path,) = out.glob("dma_jax-*.whl")
    with zipfile.ZipFile(path) as archive:
        yield archive


def test_wheel_holds_every_module_and_nothing_else(wheel):
    sources = {p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    modules = {n for n in wheel.namelist() if n.endswith(".py")}
    assert modules == sources
    # The example application stays in the repository: a wheel must not claim the
    # generic top-level name `models` in site-packages.
    assert not any(n.startswith("models/") for n in wheel.namelist())


def _metadata(wheel) -> email.message.Message:
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.message_from_bytes(wheel.read(meta))


def test_core_dependencies_are_what_the_cpu_path_needs(wheel):
    requires = _metadata(wheel).get_all("Requires-Dist")
    core = sorted(r.split(">")[0].split("=")[0].strip() for r in requires if "extra ==" not in r)
    assert core == ["jax", "ml_dtypes", "numpy"]
    extras = {r.split("extra == ")[1].strip("'\"") for r in requires if "extra ==" in r}
    assert {"gpu", "torch", "models", "test", "plot"} <= extras
    torch_in = [r for r in requires if r.startswith("torch")]
    assert torch_in and all("extra == " in r for r in torch_in)


BLOCKED_IMPORTS = """
import sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton", "flax", "transformers"):
            raise ImportError(f"{name} is not installed (blocked)")

sys.meta_path.insert(0, Blocked())
import jax.numpy as jnp
import dma_jax

q = jnp.ones((1, 130, 2, 64), jnp.bfloat16)
out = dma_jax.attention(q, q, q)
assert out.shape == q.shape and bool(jnp.isfinite(out).all())
x = dma_jax.dequantize(dma_jax.quantize(q, "nvfp4"), "nvfp4")
assert "torch" not in sys.modules and "triton" not in sys.modules
print("ok")
"""


def test_cpu_path_needs_no_torch_or_triton():
    """What a CPU install has (the core dependencies): attention, quantize and the
    reference run with torch, Triton and the model libraries absent."""
    done = subprocess.run([sys.executable, "-c", BLOCKED_IMPORTS], cwd=ROOT / "tests", capture_output=True,
                          text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_wheel_marks_typed_packages(wheel):
    # The public API is type-hinted; without the marker type checkers ignore the hints.
    assert {"dma_jax/py.typed", "triton_kernels/py.typed"} <= set(wheel.namelist())


def test_wheel_carries_the_license(wheel):
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    fields = _metadata(wheel)
    assert fields["License-Expression"] == "Apache-2.0"
    license_name = meta.replace("METADATA", "licenses/LICENSE")
    assert wheel.read(license_name) == (ROOT / "LICENSE").read_bytes()
    assert b"Apache License" in wheel.read(license_name)
