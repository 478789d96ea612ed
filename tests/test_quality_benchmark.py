"""benchmarks/quality.py and benchmarks/passkey.py run end to end at a tiny size
and write well-formed JSON. (They do not assert quality numbers: those are
measurements, in the README.)"""

import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import pytest

from conftest import TRITON_39, compiler_env

ROOT = pathlib.Path(__file__).parents[1]


def load(name):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


QUICK = ["DMA default (diag 1, sink 1)"]


@pytest.mark.parametrize("configs", [
    pytest.param(QUICK, id="default_only", marks=pytest.mark.slow),
    pytest.param(None, id="every_config", marks=pytest.mark.slow),
])
def test_quality_benchmark_tiny(tmp_path, capsys, configs):
    quality = load("quality")
    chunk = 1 if configs else quality.CHUNK
    quality.main(["--window", "40", "--windows", "1", "--prompts", "2", "--new-tokens", "3", "--chunk", str(chunk),
                  "--out", str(tmp_path)] + (["--configs", *configs] if configs else []))
    report = json.loads((tmp_path / "quality_cpu_w40.json").read_text())
    assert report["tokens_evaluated"] == 39 and report["greedy"]["chunk"] == chunk
    rows = {r["attention"]: r for r in report["rows"]}
    assert list(rows) == (["exact", *configs] if configs else
                          [n for n in quality.CONFIGS if n not in quality.RULE_CONFIGS])
    assert rows["exact"]["top1_agreement"] == 1.0 and rows["exact"]["windows"] == 1
    for r in rows.values():
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1.0
        assert 0.0 <= r["top1_agreement"] <= 1.0 and 0.0 <= r["high_fraction"] <= 1.0
    greedy = report["greedy"]["results"]
    assert list(greedy) == [n for n in quality.GREEDY if n in rows or (n in quality.DECODE_VARIANTS and not configs)]
    assert greedy["exact"]["identical"] == 2 and greedy["exact"]["first_divergence"] == [None, None]
    for g in greedy.values():
        assert g["prompts"] == 2 and 0 <= g["identical"] <= 2 and len(g["answers"]) == 2
    layers = report["per_layer"]["DMA default"]
    assert len(layers) == 30 and len(layers[0]["rel_l1_per_head"]) == 9
    assert all(0.0 <= entry["rel_l1"] < 1.0 and entry["cosine"] > 0.5 for entry in layers)
    out = capsys.readouterr().out
    assert "| exact |" in out and "identical answers" in out
    # The split is fixed: the held-out text is the last 20% of topics by name.
    topics = quality.pydoc_data.topics.topics
    assert quality.held_out_text().startswith(topics[sorted(topics)[int(0.8 * len(topics))]])


@pytest.mark.slow
def test_passkey_benchmark_tiny(tmp_path, capsys):
    passkey = load("passkey")
    chosen = ["exact", "DMA default + DMA decode, FP8 V", "DMA default + DMA decode, bf16 band"]
    passkey.main(["--lengths", "120", "--depths", "0.5", "--configs", *chosen, "--out", str(tmp_path)])
    report = json.loads((tmp_path / "passkey_cpu.json").read_text())
    (cell,) = report["cells"]
    assert 10000 <= cell["key"] < 100000 and cell["depth"] == 0.5
    assert 100 <= cell["prompt_tokens"] <= 120
    assert list(cell["results"]) == chosen and set(report["hit_rate"]) == set(report["configs"]) == set(chosen)
    assert report["configs"]["DMA default + DMA decode, bf16 band"]["decode_high"] == "bf16"
    for r in cell["results"].values():
        assert r["hit"] == passkey.found(r["answer"], cell["key"])
    assert "| attention | hits |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        passkey.main(["--configs", "flash"])


def test_rules_table_covers_every_rule_with_and_without_rotation():
    """--rules measures each family with every block-scale rule of the format that decides
    its error, once without and once with rotation, plus the previous numerics."""
    quality = load("quality")
    from dma_jax import DMAConfig
    from triton_kernels.format_table import FORMATS

    configs = quality.RULE_CONFIGS
    expected = {"DMA default": ("low_rule", "nvfp4"), "all MXFP8": ("high_rule", "mxfp8_e4m3"),
                "all NVFP4": ("low_rule", "nvfp4"), "all MXFP4": ("low_rule", "mxfp4")}
    for family, (field, fmt) in expected.items():
        for rotate in ("none", "hadamard"):
            for rule in FORMATS[fmt].rules:
                cfg = configs[f"{family} · {rule} · {rotate}"]
                assert getattr(cfg, field) == rule and cfg.rotate == rotate
    assert len(configs) == 1 + 2 * (4 + 3 + 4 + 3)
    previous = configs["DMA default · OCP scales (floor, nearest) · none"]
    assert previous == DMAConfig(high_rule="floor", low_rule="nearest", rotate="none")


@pytest.mark.slow
def test_quality_benchmark_rules_table_tiny(tmp_path, capsys):
    quality = load("quality")
    quality.main(["--rules", "--window", "40", "--windows", "1", "--prompts", "1", "--new-tokens", "2",
                  "--out", str(tmp_path)])
    report = json.loads((tmp_path / "quality_cpu_w40_rules.json").read_text())
    assert [r["attention"] for r in report["rows"]] == ["exact", *quality.RULE_CONFIGS]
    assert list(report["greedy"]["results"]) == ["exact", *[n for n in quality.RULE_CONFIGS
                                                            if n.startswith("DMA default ·")]]


def test_quality_benchmark_rejects_unknown_configs(capsys):
    with pytest.raises(SystemExit):
        load("quality").main(["--configs", "no such config"])
    assert "unknown --configs ['no such config']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load("quality").main(["--chunk", "0"])
    assert "--chunk must be >= 1; got 0" in capsys.readouterr().err


def test_passkey_needle_is_found_only_when_the_key_matches():
    passkey = load("passkey")
    assert passkey.found("The pass key is 12345.", 12345)
    assert not passkey.found("The pass key is 12346.", 12345)
    assert not passkey.found("I do not know.", 12345)


def test_fp8_copies_benchmark_tiny(tmp_path, capsys):
    fp8_copies = load("fp8_copies")
    fp8_copies.main(["--seq", "64", "--no-model", "--out", str(tmp_path)])
    (result,) = json.loads((tmp_path / "fp8_copies_cpu.json").read_text())["results"].values()
    for copy in ("Q per token", "K per tile (kernel)", "K per token"):
        assert result["mxfp4"][copy]["changed_fraction"] == 0.0  # MXFP4 re-expresses exactly
        assert 0.0 < result["nvfp4"][copy]["changed_fraction"] <= 1.0
        assert result["nvfp4"][copy]["max_rel_change"] <= 2.0**-4  # the documented bound
    # One scale for 128 NVFP4 tokens re-rounds more elements than one per token.
    k_tile, k_token = result["nvfp4"]["K per tile (kernel)"], result["nvfp4"]["K per token"]
    assert k_tile["changed_fraction"] > k_token["changed_fraction"]
    assert "| inputs | format |" in capsys.readouterr().out


def test_accuracy_benchmark_reports_the_sm90_numerics(tmp_path, capsys):
    """Every configuration has the same error on sm_90 by default (exact E4M3 copies of
    MX values, exact bf16 copies of NVFP4's); NVFP4's re-rounding to E4M3 shows up in
    the opt-in's column only."""
    accuracy = load("accuracy")
    accuracy.main(["--seq", "256", "--heads", "2", "--kv-heads", "1", "--head-dim", "64", "--out", str(tmp_path)])
    rows = {r["config"]: r for r in json.loads((tmp_path / "accuracy_cpu_s256_h2x1_d64.json").read_text())["rows"]}
    for name, row in rows.items():
        assert abs(row["sm90"]["rel_l1"] - row["rel_l1"]) < 1e-5 * row["rel_l1"], name
    for name in ("all MXFP8 (e4m3)", "all MXFP4", "DMA default with MXFP4 low"):
        assert abs(rows[name]["sm90_nvfp4_e4m3"]["rel_l1"] - rows[name]["rel_l1"]) < 1e-5 * rows[name]["rel_l1"], name
    nv = rows["all NVFP4"]["sm90_nvfp4_e4m3"]["rel_l1"]
    assert nv != rows["all NVFP4"]["rel_l1"] and abs(nv - rows["all NVFP4"]["rel_l1"]) < 0.5 * nv
    assert "sm_90 E4M3 NVFP4 rel_l1" in capsys.readouterr().out


@pytest.mark.skipif(not TRITON_39, reason="compiling for sm_90 without a GPU needs triton >= 3.9")
def test_quantize_instructions_counts_the_sm90_instructions():
    """On a GPU every E4M3 rounding is the conversion instruction (one per two elements):
    from float32 for the MXFP8 elements (both modes) and, in the FP8 mode, the low
    copy's bytes; from float16 pairs for the MXFP8 copy's bytes (FP8 mode). Only NVFP4
    divides, once per token and block (not per element). Compiled in a subprocess: the
    test session interprets kernels."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quantize_instructions.py"), "--head-dim", "64"],
                          cwd=ROOT, env=compiler_env(), capture_output=True, text=True, check=True)
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith(("| fp8", "| codes"))]
    assert len(rows) == 4
    per_thread = 16 * 64 // 128  # tokens x head_dim / threads
    for mode, low, total, per_element, divs, cvts, cvts16, _ in (map(str.strip, r) for r in rows):
        assert int(total) > 0 and round(int(total) / per_thread) == int(per_element)
        assert int(cvts) == (2 if mode == "fp8" else 1) * per_thread // 2, (mode, low)
        assert int(cvts16) == (per_thread // 2 if mode == "fp8" else 0), (mode, low)
        # NVFP4 divides for its token and block scales and their reciprocals, fewer
        # times than it has elements (two correctly rounded quotients each).
        assert (0 < int(divs) < per_thread) if low == "nvfp4" else int(divs) == 0, (mode, low)
