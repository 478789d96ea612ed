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


def test_causal_order_model_schedules_like_a_list_scheduler():
    sys.path.insert(0, str(ROOT / "benchmarks" / "experiments"))
    import causal_order_model as model

    # Two slots, tiles in order: 1 -> slot 0, 1 -> slot 1, 4 -> slot 0 (free at 1): ends at 5.
    assert model.makespan([1, 1, 4], 2) == 5
    assert model.makespan([4, 1, 1], 2) == 4  # longest first
    # Two heads of two query blocks (costs m + 1): head-major deals 2, 1, 2, 1;
    # longest first 2, 2, 1, 1.
    assert model.tile_costs(256, 2, 1, 128, "head_major", 1.0, 0.0) == [2, 1, 2, 1]
    assert model.tile_costs(256, 2, 1, 128, "longest_first", 1.0, 0.0) == [2, 2, 1, 1]
