"""``python -m prune.run --replace ...`` end to end on a tiny saved model, recipes, and the bad inputs."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import prune
from prune.checkpoint.load_config import LoadConfig
from prune.data.calibration import DEFAULT_DATA
from prune.errors import EXIT_BAD_INPUT, LayercutError
from prune.pipeline.config import PruneConfig
from prune.pipeline.recipes import config_from_recipe
from prune.pipeline.runner import run_prune
from tests.helpers import run_prune_cli as run

RECIPES = sorted((Path(__file__).resolve().parents[3] / "recipes").glob("*.yaml"))


def in_memory(config):
    config.out = None  # set after construction: PruneConfig names a default folder when dropping
    return config


def assert_loads_with_the_same_logits(folder, model):
    ids = torch.randint(3, 320, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(prune.load(folder).model(ids).logits, model(ids).logits, rtol=0, atol=1e-6)


def small(folder):
    return ["--model", folder, "--samples", "8", "--seq-len", "32", "--batch-size", "4", "--protect", "0"]


def test_linear_replacement_cli_round_trip(tiny_folder, tmp_path, capsys):
    out = tmp_path / "slim-lin"
    code, stdout, err = run(capsys, *small(tiny_folder), "--drop", "2", "--replace", "linear", "--out", out)
    assert code == 0, err
    assert "replaced blocks" in stdout and "by linear (1056 parameters, 0.7 of the fitted update, independent fit" \
        in stdout
    assert (out / "replacements.safetensors").is_file() and (out / "linearity_profile.png").is_file()
    report = json.loads((out / "layercut.json").read_text())
    assert report["replace"] == "linear" and report["fit"] == "independent"
    covered = sorted(i for r in report["replacements"] for i in r["replaces"])
    assert covered == report["dropped"]
    for record in report["replacements"]:
        assert record["method"] == "linear" and record["params"] == 32 * 32 + 32 and record["fit_seconds"] >= 0
        assert "fit_short" not in record and record["update_scale"] == 0.7  # the default share
    assert sorted(i for group in report["layout"] for i in group) == [0, 1, 2, 3]
    # the same run in memory gives the logits prune.load reproduces
    config = PruneConfig(load=LoadConfig(str(tiny_folder)), data={"samples": 8, "seq_len": 32}, drop=2,
                         protect="0", replace="linear")
    result = run_prune(in_memory(config))
    assert_loads_with_the_same_logits(out, result.loaded.model)


def test_fit_short_and_update_scale_are_recorded(tiny_folder, tmp_path, capsys):
    out = tmp_path / "slim-short"
    code, _, err = run(capsys, *small(tiny_folder), "--drop", "2", "--replace", "linear", "--fit-short", "8",
                       "--update-scale", "0.5", "--out", out)
    assert code == 0, err
    report = json.loads((out / "layercut.json").read_text())
    assert [(r["fit_short"], r["update_scale"]) for r in report["replacements"]] == \
        [(8, 0.5)] * len(report["replacements"])


def test_fold_cli_writes_a_vanilla_checkpoint(tiny_folder, tmp_path, capsys):
    out = tmp_path / "slim-fold"
    code, stdout, err = run(capsys, *small(tiny_folder), "--drop", "1", "--replace", "fold", "--fit", "sequential",
                            "--out", out)
    assert code == 0, err
    assert "by fold (folded into the previous block's mlp.down_proj, 0.7 of the fitted update, sequential fit" in stdout
    assert not (out / "replacements.safetensors").exists()
    report = json.loads((out / "layercut.json").read_text())
    assert report["replacements"][0]["method"] == "fold" and report["replacements"][0]["fit"] == "sequential"
    plain = AutoModelForCausalLM.from_pretrained(out)
    assert plain.config.num_hidden_layers == 3


def test_default_out_names_the_replacement(tiny_folder):
    config = PruneConfig(load=LoadConfig(str(tiny_folder)), drop=2, replace="lowrank")
    assert config.out == f"{Path(str(tiny_folder)).name}-drop2-lowrank"
    assert PruneConfig(load=LoadConfig(str(tiny_folder)), drop=2).out == f"{Path(str(tiny_folder)).name}-drop2"


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--drop", "1", "--replace", "squash"], "unknown replacement 'squash': choose one of none, linear"),
        (["--drop", "1", "--replace", "lowrank", "--rank", "0"], "--rank must be a positive integer, got 0"),
        (["--drop", "1", "--replace", "lowrank", "--rank", "-2"], "--rank must be a positive integer, got -2"),
        (["--drop", "1", "--replace", "linear", "--rank", "3"], "--rank applies to --replace lowrank only"),
        (["--drop", "1", "--replace", "linear", "--fit", "greedy"], "unknown --fit 'greedy'"),
        (["--drop", "1", "--fit", "sequential"], "--fit sequential applies to replacements"),
        (["--replace", "linear"], "--replace needs blocks to remove: pass --drop"),
        (["--drop", "1", "--distill-steps", "-1"], "--distill-steps (distill.steps) must be an integer >= 0"),
        (["--drop", "1", "--replace", "linear", "--distill-samples", "64"], "--distill-samples sizes the "
         "distillation text: pass --distill-steps N (> 0) too"),
        (["--drop", "1", "--distill-steps", "2", "--distill-samples", "0"],
         "--distill-samples must be a positive integer, got 0"),
        (["--drop", "1", "--replace", "linear", "--replace-steps", "3"], "--replace-steps applies to --replace"),
        (["--drop", "1", "--replace", "linear", "--fit-short", "1"], "--fit-short takes a sequence length of at least"),
        (["--drop", "1", "--update-scale", "0.5"],
         "--update-scale applies to --replace linear, fold, local, fold-rotate only"),
        (["--drop", "1", "--replace", "linear", "--update-scale", "0"], "--update-scale takes a share in (0, 1]"),
        (["--drop", "1", "--replace", "fold", "--protect", "none", "--select", "span", "--score", "bi", "--drop",
          "3"], "span starting at block 0"),
    ],
)
def test_bad_replacement_input(tiny_folder, tmp_path, capsys, extra, message):
    args = ["--model", tiny_folder, "--samples", "8", "--seq-len", "32", "--out", tmp_path / "o", *extra]
    code, _, err = run(capsys, *args)
    assert code == EXIT_BAD_INPUT, err
    assert message in err and err.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_fold_without_mlp_projection_fails_before_scoring(tiny_folder, tmp_path, capsys, monkeypatch):
    from prune.model import adapters

    spec = dataclasses.replace(adapters.ARCHITECTURES["llama"], mlp_out="")
    monkeypatch.setitem(adapters.ARCHITECTURES, "llama", spec)
    monkeypatch.setattr("prune.pipeline.runner.score_model", lambda *a: pytest.fail("scored before the check"))
    code, _, err = run(capsys, *small(tiny_folder), "--drop", "1", "--replace", "fold", "--out", tmp_path / "o")
    assert code == EXIT_BAD_INPUT and "MLP output projection, which is unknown for 'llama'" in err


def test_distill_samples_sizes_the_distillation_text_and_keeps_the_runs_source(tiny_folder, tmp_path):
    from distill.step import step_config
    from prune.run import build_parser, config_from_args

    text = tmp_path / "text.txt"
    text.write_text("calibration words. " * 50)
    parser = build_parser()
    base = ["--model", str(tiny_folder), "--drop", "1", "--replace", "linear", "--distill-steps", "3"]
    config = config_from_args(parser.parse_args([*base, "--distill-samples", "24", "--data", str(text)]))
    assert config.distill == {"steps": 3, "data": {"samples": 24}}
    resolved = step_config(config.distill, config)
    assert (resolved.data.data, resolved.data.samples, resolved.data.seq_len) == (str(text), 24, 128)
    # without the flag the count is distillation's own, and so is the text without --data
    resolved = step_config(config_from_args(parser.parse_args(base)).distill, config_from_args(parser.parse_args(base)))
    assert (resolved.data.data, resolved.data.samples) == ("builtin@0.5,self@0.5", 512)
    # a recipe's distillation text wins over the run's --data; the flag still sizes it
    recipe = tmp_path / "r.yaml"
    recipe.write_text("replace: linear\ndistill: {steps: 5, data: {data: builtin, samples: 8}}\n")
    argv = ["--recipe", str(recipe), "--model", str(tiny_folder), "--drop", "1", "--data", str(text),
            "--distill-samples", "40"]
    config = config_from_args(parser.parse_args(argv), {"recipe", "model", "drop", "data", "distill.data.samples"})
    resolved = step_config(config.distill, config)
    assert (resolved.steps, resolved.data.data, resolved.data.samples) == (5, "builtin", 40)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_maps_onto_prune_config(recipe):
    config = config_from_recipe(recipe)
    assert isinstance(config, PruneConfig) and config.out
    steps = config.build_steps()  # builds (and so validates) the distill section too
    assert [step.name for step in steps] == config.step_sections()


def test_linear_distill_recipe():
    config = config_from_recipe(RECIPES[0].parent / "smollm2-drop4-linear-distill.yaml")
    assert (config.replace.method, config.drop, config.distill["steps"]) == ("linear", 4, 100)
    (step,) = config.build_steps()
    distill = step.config
    assert (distill.steps, distill.batch_size, distill.data.seq_len, distill.train) == (100, 4, 128, "replacements")
    assert (distill.data.samples, distill.data.data) == (512, DEFAULT_DATA)  # distillation's own count, not the 64


def test_bad_distill_keys():
    with pytest.raises(LayercutError, match="distill: unknown key.*learning_rate.*known: "):
        PruneConfig(drop=1, replace="linear", distill={"steps": 5, "learning_rate": 1}).build_steps()
    with pytest.raises(LayercutError, match="'seq_len' moved; write it as distill: {data: {seq_len: ...}}"):
        PruneConfig(drop=1, replace="linear", distill={"steps": 5, "seq_len": 64}).build_steps()


def test_distill_steps_wiring(tiny_folder, tmp_path):
    """--distill-steps trains the replacement maps against the reloaded original, then exports."""
    out = tmp_path / "lin-distilled"
    config = PruneConfig(
        load=LoadConfig(str(tiny_folder)), data={"samples": 8, "seq_len": 32}, drop=2, protect="0",
        replace="linear", distill={"steps": 3, "batch_size": 2, "lr": 1e-3, "data": {"samples": 16, "seq_len": 16}},
        out=str(out))
    before = run_prune(in_memory(dataclasses.replace(config, distill={}))).loaded.model
    result = run_prune(config)
    report = result.report
    assert report["distill"]["steps"] == 3 and report["distill"]["final_loss"] is not None
    assert (out / "train_log.jsonl").is_file() and not (tmp_path / "lin-distilled.work").exists()
    card = (out / "README.md").read_text()
    assert "## Distillation" in card
    # the card names the teacher by its folder name, never the local path it was read from
    assert f"towards `{tiny_folder.name}` on `teacher_student_kl` for 3 steps (`--train replacements`" in card
    assert str(tiny_folder) not in card
    # 8 held-out sequences of the distillation text (4 of each half); 3 steps of 2 draw at most 6 to set beside them
    fit = report["distill"]["generalisation"]
    assert fit["sequences"]["held_out"] == 8 and 0 < fit["sequences"]["training"] <= 6
    assert f"held-out loss {fit['held_out']['before']['loss']:.4g} -> " in card
    maps_before = [m.proj.weight for m in prune.replace.replacement_modules(before)]
    maps_after = [m.proj.weight for m in prune.replace.replacement_modules(result.loaded.model)]
    assert any(not torch.allclose(a, b) for a, b in zip(maps_before, maps_after, strict=True))
    assert_loads_with_the_same_logits(out, result.loaded.model)


def test_lowrank_cli_reports_its_share_of_a_linear_map(tiny_folder, tmp_path, capsys):
    out = tmp_path / "slim-lowrank"
    code, stdout, err = run(capsys, *small(tiny_folder), "--drop", "1", "--replace", "lowrank", "--rank", "2",
                            "--replace-steps", "2", "--out", out)
    assert code == 0, err
    record = json.loads((out / "layercut.json").read_text())["replacements"][0]
    # BatchNorm (weight, bias) + down (32 x 2) + up (2 x 32 + bias): far below the 32 x 32 + 32 map
    assert record["params"] == 2 * 32 + 32 * 2 + 2 * 32 + 32 and record["linear_params"] == 32 * 32 + 32
    assert f"by lowrank ({record['params']} parameters, {record['params'] / 1056:.1%} of a linear map's 1056" in stdout
    assert prune.load(out).model.config.num_hidden_layers == 3
