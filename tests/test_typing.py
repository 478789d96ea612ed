"""The annotations that ship with the package (PEP 561 ``py.typed``) type-check.

mypy reads ``[tool.mypy]`` of pyproject.toml (the packages and the third-party
modules that have no type information).
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_packages_type_check_with_mypy():
    run = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "Success: no issues found" in run.stdout
