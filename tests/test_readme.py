"""The README's quickstart runs as pasted (in a fresh interpreter, from an empty folder)."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]


def test_readme_is_short_and_has_one_quickstart():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert len(re.findall(r"```python\n", text)) == 1


@pytest.mark.slow
def test_quickstart_runs_as_pasted(tmp_path):
    code = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[0]
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    shape, error = done.stdout.split(") ")
    assert shape == "(1, 512, 8, 128" and 0 < float(error) < 0.05
