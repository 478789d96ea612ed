"""Every script under benchmarks/ imports on CPU. Most of them run only on a GPU, so
nothing else in the suite loads them: a broken import line would otherwise wait for
the next run on a GPU."""

import os
import pathlib
import subprocess
import sys

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


def test_every_benchmark_script_imports():
    assert len(SCRIPTS) >= 10  # the glob found the scripts
    path = os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)])
    env = dict(os.environ, PYTHONPATH=path)
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL, *(s.stem for s in SCRIPTS)], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
