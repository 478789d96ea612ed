"""The wheel that `pip install dma-jax` would get: every source module, the PEP 561
markers, the license. Built with the venv's own setuptools from a copy of this
checkout's project files (a build in place leaves a ``build/`` whose stale modules
would go into later wheels)."""

import email
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dma_jax", "triton_kernels", "models")


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


def test_wheel_marks_typed_packages(wheel):
    # The public API is type-hinted; without the marker type checkers ignore the hints.
    assert {"dma_jax/py.typed", "triton_kernels/py.typed"} <= set(wheel.namelist())


def test_wheel_carries_the_license(wheel):
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    fields = email.message_from_bytes(wheel.read(meta))
    assert fields["License-Expression"] == "Apache-2.0"
    license_name = meta.replace("METADATA", "licenses/LICENSE")
    assert wheel.read(license_name) == (ROOT / "LICENSE").read_bytes()
    assert b"Apache License" in wheel.read(license_name)
