"""benchmarks/experiments: each kernel patch still applies to main's kernel, so the
script that checks and times it against main can run on the next GPU session."""

import inspect
import pathlib
import sys

ROOT = pathlib.Path(__file__).parents[1]


def test_persistent_sm90_patch_applies_to_main():
    sys.path.insert(0, str(ROOT / "benchmarks" / "experiments"))
    import persistent_sm90

    from triton_kernels import attention_sm90

    patched = persistent_sm90.persistent_module()
    assert patched.__file__ != attention_sm90.__file__
    # The patch's own pieces arrived: the tile loop and the launcher's program count.
    assert hasattr(patched, "_my_tiles") and not hasattr(attention_sm90, "_my_tiles")
    assert "programs" in inspect.signature(patched.sm90_attention).parameters
    assert patched.launch_meta(128, True, True)["LOADER_REGS"] == 80
    assert attention_sm90.launch_meta(128, True, True)["LOADER_REGS"] == 64
