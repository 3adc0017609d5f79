"""``eval.bench.checks``: a typed engine check runs in a process of its own and hands back its figures, or one line."""

from __future__ import annotations

import pytest

from eval.bench.checks import ServingCheck, run_in_child
from prune.errors import LayercutError


def test_a_serving_check_scores_every_model_on_every_text_with_one_load_each(tiny_folder, tmp_path, sample_text):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text(sample_text)
    second.write_text(sample_text[::-1])
    check = ServingCheck(models=(("original", str(tiny_folder), "transformers"),
                                 ("again", str(tiny_folder), "transformers")),
                         texts=(("first", str(first)), ("second", str(second))), tokenizer=str(tiny_folder),
                         seq_len=16, tokens=64, greedy_tokens=4, threads=1)
    figures = run_in_child(check, tmp_path / "check" / "serving.log")
    assert sorted(figures) == ["first", "second"]
    for text, result in figures.items():
        assert result["setup"]["windows"] == 4 and result["setup"]["predicted"] == 4 * 15
        rows = result["rows"]
        original, again = rows["original"]["transformers"], rows["again"]["transformers"]
        assert original["runs"] and original["ppl"] == again["ppl"] > 1, text  # the same model, the same ids
        assert len(original["greedy"]) == 4 and original["greedy"] == again["greedy"]
    assert figures["first"]["rows"]["original"]["transformers"]["ppl"] != \
        figures["second"]["rows"]["original"]["transformers"]["ppl"]
    assert sorted(p.name for p in (tmp_path / "check").iterdir()) == ["serving.log"]  # request and result read


def test_a_failed_check_is_one_line_naming_its_log(tiny_folder, tmp_path):
    check = ServingCheck(models=(("original", str(tiny_folder), "transformers"),),
                         texts=(("gone", str(tmp_path / "missing.txt")),), tokenizer=str(tiny_folder), seq_len=16,
                         tokens=64, threads=1)
    with pytest.raises(LayercutError) as raised:
        run_in_child(check, tmp_path / "serving.log")
    message = str(raised.value)
    assert "\n" not in message and "missing.txt" in message and "serving.log" in message
    assert "exit 2" in message  # the check's own one-line refusal, not a crash
