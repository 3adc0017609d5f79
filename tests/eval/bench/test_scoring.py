"""The scoring benchmark's three methods agree, and the report says what was measured."""

import pytest
import torch

from eval.bench.scoring import MemoryRow, run_method, scoring_markdown
from tests.helpers import make_tiny_model


def test_streamed_and_stored_scores_agree():
    model = make_tiny_model("llama")
    ids = torch.randint(3, 320, (8, 32))
    assert run_method("plain", model, ids, 4) is None
    streamed = run_method("streamed", model, ids, 4)
    stored = run_method("stored", model, ids, 3)
    assert streamed == pytest.approx(stored, abs=1e-6)  # float32 batch products (prune.measure.moments), float64 lstsq
    with pytest.raises(ValueError, match="unknown method"):
        run_method("other", model, ids, 4)


def test_markdown_reports_ratios():
    timing = {"tokens": 8192, "plain_seconds": [2.0, 2.2], "streamed_seconds": [2.4, 2.6],
              "ratio_median": 1.2, "ratio_min": 1.18, "ratio_max": 1.2}
    rows = [MemoryRow("streamed", 8192, 3.0, 100.0), MemoryRow("streamed", 32768, 12.0, 101.0),
            MemoryRow("stored", 8192, 4.0, 600.0), MemoryRow("stored", 32768, 16.0, 2400.0)]
    e2e = {"drop": 4, "tokens": 32768, "remove_seconds": [80.0], "linear_seconds": [100.0], "ratio_median": 1.25,
           "ratio_min": 1.25, "ratio_max": 1.25}
    text = scoring_markdown("m", timing, rows, e2e)
    assert "**1.200x**" in text and "`--drop 4 --replace linear` / `--drop 4`" in text and "**1.250x**" in text
    assert "streamed: peak memory at 32768 tokens / at 8192 tokens = 1.01x" in text
    assert "stored: peak memory at 32768 tokens / at 8192 tokens = 4.00x" in text


def test_bench_scoring_cli_writes_its_report(tiny_folder, tmp_path, capsys):
    import json

    from eval.bench.cli import main

    out = tmp_path / "scoring"
    assert main(["scoring", "--model", str(tiny_folder), "--tokens", "256", "--time-tokens", "256", "--seq-len", "32",
                 "--repeats", "1", "--methods", "streamed", "--threads", "1", "--end-to-end", "1",
                 "--out", str(out)]) == 0  # fmt: skip
    report = json.loads((out / "scoring.json").read_text())
    assert report["timing"]["tokens"] == 256 and report["timing"]["ratio_median"] > 0
    e2e = report["end_to_end"]
    assert e2e["drop"] == 1 and e2e["tokens"] == 64 * 32 and e2e["ratio_median"] > 0
    # one block removed: its map comes from the scoring pass's statistics, no capture pass
    assert [r["from_scoring_pass"] for r in e2e["linear_fits"][0]["replacements"]] == [True]
    assert [(row["method"], row["tokens"]) for row in report["memory"]] == [("streamed", 256)]
    assert "streamed" in capsys.readouterr().out
