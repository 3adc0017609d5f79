"""``ship.config``: durations and the settings a run is refused for, before anything is read."""

from __future__ import annotations

import math
import re

import pytest

from prune.errors import LayercutError
from prune.pipeline.config import PruneConfig
from ship.config import ShipConfig, parse_duration, ship_engines


def test_durations():
    assert parse_duration("30m") == 1800 and parse_duration("1h") == 3600 and parse_duration("90") == 90
    assert parse_duration("150s") == 150


@pytest.mark.parametrize("text", ["0s", "-5m", "nan", "inf", "1e400", "nanm", "soon", ""])
def test_a_duration_that_is_not_positive_and_finite_is_refused(text):
    with pytest.raises(LayercutError) as raised:
        parse_duration(text)
    assert "\n" not in str(raised.value) and "such as 30m" in str(raised.value)


@pytest.mark.parametrize("budget", [math.nan, math.inf, -1.0, 0.0])
def test_the_config_refuses_a_budget_parse_duration_would(tmp_path, budget):
    with pytest.raises(LayercutError, match="--time-budget must be a positive, finite duration"):
        ShipConfig(PruneConfig(drop=2), out=str(tmp_path / "o"), engine="transformers", time_budget=budget)


@pytest.mark.parametrize(("field", "flag"), [("prompt_len", "--prompt-len"), ("new_tokens", "--new-tokens")])
def test_the_speed_check_sizes_must_be_positive(tmp_path, field, flag):
    with pytest.raises(LayercutError, match=f"{flag} must be at least 1, got 0"):
        ShipConfig(PruneConfig(drop=2), out=str(tmp_path / "o"), engine="transformers", **{field: 0})
    # --repeats 0 is no speed check (ship.verify), and said so where the card would give the speed
    assert ShipConfig(PruneConfig(drop=2), out=str(tmp_path / "o"), speed_repeats=0).no_speed == "--repeats 0"


def test_a_missing_heldout_file_is_refused_before_any_stage(tmp_path):
    present = tmp_path / "news.txt"
    present.write_text("some text")
    with pytest.raises(LayercutError, match="--heldout news=missing.txt: no file missing.txt"):
        ShipConfig(PruneConfig(drop=2), out=str(tmp_path / "o"), engine="transformers",
                   heldout=[str(present), "news=missing.txt"])
    # a datasets spec is read by the verify stage, as eval.bench reads it
    ShipConfig(PruneConfig(drop=2), out=str(tmp_path / "o"), engine="transformers",
               heldout=[f"novel={present}", "wikitext:wikitext-2-raw-v1:test"])


def test_the_engines_are_the_registered_ones_that_run_a_plain_checkpoint(tmp_path):
    engines = ship_engines()  # the reference first; an engine module added later joins by its declared layouts
    assert engines[0] == "transformers" and {"llamacpp", "vllm"} <= set(engines)
    with pytest.raises(LayercutError, match=f"--engine llama.cpp: choose one of {', '.join(engines)}"):
        ShipConfig(PruneConfig(drop=2), out=str(tmp_path / "o"), engine="llama.cpp")


def test_the_settings_a_resumed_run_must_match_hold_the_budget_and_the_engine(tiny_folder):
    config = ShipConfig(PruneConfig(load={"model": str(tiny_folder)}, drop=2), out="o", engine="transformers")
    assert config.settings()["drop"] == 2 and config.settings()["engine"] == "transformers"
    assert config.settings()["gguf_type"] is None  # only llama.cpp's GGUF depends on it
    assert config.work.name == "o.work" and len(config.digest()) == 10


def test_what_the_heal_trains_is_a_setting_of_a_healed_run_only(tiny_folder, monkeypatch):
    from distill.heal import HEAL_OPTIONS

    def config(steps):
        return ShipConfig(PruneConfig(load={"model": str(tiny_folder)}, drop=2), out="o", engine="transformers",
                          heal_steps=steps)

    healed, unhealed = config(100), config(0)
    assert healed.settings()["heal"] == {"train": "lora", "lr": 3e-4, "lora_r": HEAL_OPTIONS["lora_r"],
                                         "lora_alpha": HEAL_OPTIONS["lora_alpha"]}
    assert "heal" not in unhealed.settings()
    digests = healed.digest(), unhealed.digest()
    # a heal at another rank (another version's default) trains other weights: its work folder is not this run's
    monkeypatch.setitem(HEAL_OPTIONS, "lora_r", 8)
    assert healed.digest() != digests[0] and unhealed.digest() == digests[1]


def test_a_shipped_checkpoint_adds_at_most_two_percent_over_removing_its_blocks():
    from ship.config import oversize_note, params_cap

    removal = 106_194_240  # SmolLM2-135M with 8 blocks removed
    assert params_cap(removal, None) == 108_318_124
    assert oversize_note(108_318_124, removal, None, "fold-rotate") is None
    # fold-rotate at drop 8 unties the tied head: below the original's 134,515,008, yet 27 % over removal
    note = oversize_note(134_505_792, removal, None, "fold-rotate")
    assert note == ("not a candidate: 134,505,792 parameters, 27% more than removing the same blocks (106,194,240); "
                    "a shipped checkpoint adds at most 2% (prune.run --replace fold-rotate builds it)")
    # a --target-params the user gives is the cap, above or below removal's + 2 %
    assert oversize_note(134_505_792, removal, 135_000_000, "fold-rotate") is None
    assert oversize_note(107_000_000, removal, 106_500_000, "fold") == ("not a candidate: 107,000,000 parameters, "
                                                                         "above --target-params 106,500,000")


@pytest.mark.parametrize(("changes", "words"), [
    ({"heal_samples": 0}, "--heal-samples must be positive, got 0"),
    ({"heal_data": "a.txt@0.5,b.txt@0.5", "heal_samples": 1}, "--heal-data mixes 2 sources but --heal-samples is 1"),
])
def test_heal_data_is_refused_with_its_own_flags_before_any_stage(tmp_path, changes, words):
    changes = {"heal_data": "builtin", **changes}
    with pytest.raises(LayercutError, match=words):
        ShipConfig(PruneConfig(drop=2), out=str(tmp_path / "o"), engine="transformers", **changes)


def test_the_heals_lora_options_are_settings_checked_before_any_stage(tiny_folder, tmp_path):
    def config(load=None, **changes):
        prune = PruneConfig(load={"model": str(tiny_folder), **(load or {})}, data={"data": "builtin"}, drop=2)
        return ShipConfig(prune, out=str(tmp_path / "o"), engine="transformers", **changes)

    default, ranked = config(), config(heal_train={"lora_r": 8, "lora_alpha": 16.0})
    assert ranked.settings()["heal"] == {"train": "lora", "lr": 3e-4, "lora_r": 8, "lora_alpha": 16.0}
    assert ranked.digest() != default.digest()  # another rank trains other weights: another run's work folder
    # every Linear is the default: said or not, one run
    assert config(heal_train={"lora_targets": "all-linear"}).digest() == default.digest()
    spaced = config(heal_train={"lora_targets": " q_proj, v_proj,q_proj"})
    assert spaced.heal_train == {"lora_targets": "q_proj,v_proj"}
    assert spaced.settings()["heal"]["lora_targets"] == "q_proj,v_proj"
    for changes, words in (({"heal_train": {"lora_r": 0}}, "--lora-r must be a positive integer, got 0"),
                           ({"heal_train": {"lora_alpha": -1.0}}, "--lora-alpha must be positive, got -1"),
                           ({"heal_train": {"lora_targets": "mlp.up_proj"}}, "--lora-targets takes all-linear or"),
                           ({"heal_train": {"lora_r": 8}, "heal_steps": 0},
                            "--heal-steps 0 heals nothing, so --lora-r (the heal's adapters) change nothing"),
                           ({"heal_train": {"lora_r": 8, "lora_targets": "q_proj"}, "load": {"offload": "sequential"}},
                            "--lora-r, --lora-targets with --offload sequential: the heal block by block")):
        with pytest.raises(LayercutError, match=re.escape(words)):
            config(**changes)


DATA = "{data}"  # the case's data folder: four PIQA rows and one IFEval prompt


@pytest.mark.parametrize(("extra", "words"), [
    (["--tasks", "piqa", "--no-verify"], "error: --tasks with --no-verify: the tasks are scored in the verify stage; "
                                         "drop one of them"),
    (["--limit", "5", "--data-dir", DATA], "error: --limit and --data-dir without --tasks: they choose the rows and "
                                           "the data of lm-eval tasks; pass --tasks (arc_easy,piqa) or drop them"),
    (["--tasks", "piqa", "--offload", "sequential"], "error: --tasks with --offload sequential: each forward pass of a "
                                                     "task would read every block from disk; drop --tasks and score "
                                                     "the shipped folder with python -m eval.run"),
    (["--tasks", "piqa,pqia", "--data-dir", DATA], "error: unknown task 'pqia': not an offline task ("),
    (["--tasks", "piqa", "--data-dir", "{data}/missing"], "(--data-dir) does not exist; point it at a folder laid out "
                                                          "like shared/data"),
    (["--tasks", "ifeval", "--data-dir", DATA],
     'error: ifeval needs langdetect (lm-eval\'s IFEval checks import them); pip install "layercut[ifeval]"'),
    (["--tasks", "ifeval", "--data-dir", DATA, "needs met"],
     "error: ifeval runs its prompts through the model's chat template, and this tokenizer has none; evaluate an "
     "instruct/chat model"),
    (["--tasks", "piqa", "--limit", "1.5"], "error: argument --limit: a row count must be a whole number, got 1.5"),
    # in lm-eval's registry, but its metric unknown: scored for hours, then left off the card
    (["--tasks", "piqa,gsm8k"], "error: --tasks gsm8k: layercut knows neither the metric to quote nor the chance "
                                "level of it (it knows arc_challenge, arc_easy, boolq, copa, hellaswag, ifeval, "
                                "lambada, lambada_openai, lambada_standard, mmlu, openbookqa, piqa, sciq, "
                                "winogrande); add a task YAML with a layercut: block to a folder on $LAYERCUT_TASKS "
                                "(eval/tasks/README.md), or score it with python -m eval.run"),
])
def test_bad_task_flags_are_one_line_before_any_model_loads(tiny_folder, tmp_path, capsys, monkeypatch, extra,
                                                            words, sample_text):
    import importlib.util
    import types

    from eval.quality import lmeval
    from eval.quality.needs import ifeval
    from prune.checkpoint.load_config import LoadConfig
    from prune.ship import main
    from tests.helpers import write_piqa

    monkeypatch.setattr(LoadConfig, "load", lambda self, model=None: pytest.fail("the model was loaded"))
    # not lm-eval's index: gsm8k is in lm-eval's, and layercut knows no metric of it
    monkeypatch.setattr(lmeval, "_registry", lambda: types.SimpleNamespace(all_tasks=["copa", "gsm8k", "piqa"]))
    if "needs met" in extra:  # ifeval's packages and data found: the tokenizer is what is missing
        monkeypatch.setattr(lmeval, "check_task_needs", lambda names: None)
    else:  # the ifeval extra missing, whatever this environment holds
        found = importlib.util.find_spec
        monkeypatch.setattr(ifeval.importlib.util, "find_spec",
                            lambda name: None if name == "langdetect" else found(name))
    data = write_piqa(tmp_path / "data")
    (data / "ifeval").mkdir()
    (data / "ifeval" / "input_data.jsonl").write_text('{"key": 1, "prompt": "Write a haiku.", '
                                                      '"instruction_id_list": [], "kwargs": []}\n')
    text = tmp_path / "text.txt"
    text.write_text(sample_text * 3)
    args = ["--model", tiny_folder, "--data", text, "--samples", "16", "--seq-len", "32", "--drop", "2", "--engine",
            "transformers", "--heal-steps", "0", "--out", tmp_path / "o",
            *[value.format(data=data) for value in extra if value != "needs met"]]
    try:
        code = main([str(arg) for arg in args])
    except SystemExit as exited:  # argparse's own refusal of a value
        code = exited.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and words in err and "Traceback" not in err, err
    assert not (tmp_path / "o.work" / "ship.json").exists()  # nothing that would refuse the corrected command
