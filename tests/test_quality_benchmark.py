"""benchmarks/quality.py runs end to end at a tiny size and writes well-formed JSON.
(It does not assert quality numbers: those are measurements, in the README.)"""

import importlib.util
import json
import math
import pathlib

ROOT = pathlib.Path(__file__).parents[1]


def test_quality_benchmark_tiny(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("quality", ROOT / "benchmarks" / "quality.py")
    quality = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quality)
    quality.main(["--window", "40", "--windows", "1", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "quality_cpu_w40.json").read_text())
    assert report["tokens_evaluated"] == 39 and report["windows"] == 1
    rows = {r["attention"]: r for r in report["rows"]}
    assert list(rows) == list(quality.CONFIGS)
    assert rows["exact"]["top1_agreement"] == 1.0
    for r in rows.values():
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1.0
        assert 0.0 <= r["top1_agreement"] <= 1.0 and 0.0 <= r["high_fraction"] <= 1.0
    layers = report["per_layer"]["DMA default"]
    assert len(layers) == 30 and len(layers[0]["rel_l1_per_head"]) == 9
    assert all(0.0 <= entry["rel_l1"] < 1.0 and entry["cosine"] > 0.5 for entry in layers)
    assert "| exact |" in capsys.readouterr().out
    # The split is fixed: the held-out text is the last 20% of topics by name.
    assert quality.held_out_text().startswith(quality.pydoc_data.topics.topics[
        sorted(quality.pydoc_data.topics.topics)[int(0.8 * len(quality.pydoc_data.topics.topics))]])
