"""The peer methods as recipes (``recipes/methods/``): each names a method only, the command line the rest."""

import dataclasses
import json
import re

import pytest
import yaml

from distill.config import DistillConfig
from prune.errors import EXIT_BAD_INPUT, LayercutError
from prune.pipeline.recipes import (
    METHOD_KEYS,
    METHODS_DIR,
    config_from_recipe,
    find_recipe,
    method_recipes,
    method_summary,
    read_recipe,
    resolve_method,
)
from prune.replace import METHODS
from prune.selection.strategies import SELECTIONS
from tests.helpers import BLOCKS, make_tiny_model, make_tiny_tokenizer
from tests.helpers import run_prune_cli as run

PEERS = {"shortgpt": "2403.03853", "gromov": "2403.17887", "gromov-heal": "2403.17887", "sleb": "2402.09025",
         "llm-streamline": "2403.19135", "replaceme-ls": "2505.02819", "replaceme-cosine": "2505.02819",
         "linearpatch": "2505.24680", "linearpatch-distill": "2505.24680", "prune-comp": "2507.18212",
         "reassessing": "2411.15558"}
OURS = ("layercut-linear", "layercut-linear-distill", "layercut-sublayer", "layercut-linear-vanilla",
        "layercut-linear-distill-vanilla", "layercut-best", "layercut-best-vanilla", "layercut-rotate",
        "layercut-local", "layercut-rotate-heal", "layercut-local-heal", "layercut-local-kl")


def small(folder):
    return ["--model", folder, "--samples", "8", "--seq-len", "32", "--batch-size", "4", "--heldout-samples", "0"]


def test_every_peer_and_ours_has_a_recipe_that_names_the_method_only():
    recipes = method_recipes()
    assert set(recipes) == set(PEERS) | set(OURS)
    for name, path in recipes.items():
        text = path.read_text()
        values = yaml.safe_load(text)
        assert set(values) <= set(METHOD_KEYS), name
        header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
        if name in PEERS:  # the header names the paper, what is exact, what is approximated
            assert f"arXiv {PEERS[name]}" in header and "Reproduced exactly" in header, name
            assert "Approximated" in header or "Not here" in header, name
        assert f"--recipe recipes/methods/{name}.yaml" in header, name
        assert values["select"] in SELECTIONS, name
        replace = values.get("replace", "none")
        assert (replace if isinstance(replace, str) else replace["method"]) in METHODS, name
        config = config_from_recipe(path, {"drop": 2, "load": {"model": "tiny"}})
        assert config.drop == 2 and config.load.model == "tiny"
        assert [s.name for s in config.build_steps()] == (["distill"] if "distill" in values else [])
        assert method_summary(path) == values["method"] and "\n" not in values["method"]


def test_every_layercut_recipe_with_maps_has_a_vanilla_twin_on_the_same_blocks():
    """What ships to an engine: the same selection and distillation, the map folded into standard weights."""
    recipes = method_recipes()
    for name in OURS:
        values = yaml.safe_load(recipes[name].read_text())
        replace = values.get("replace", "none")
        method = METHODS[replace if isinstance(replace, str) else replace["method"]]
        if method.serving != "layercut":
            continue
        twin = yaml.safe_load(recipes[f"{name}-vanilla"].read_text())
        twin_method = METHODS[twin["replace"] if isinstance(twin["replace"], str) else twin["replace"]["method"]]
        assert twin_method.serving == "vanilla" and twin_method.servable, name
        assert (twin["score"], twin["select"]) == (values["score"], values["select"]), name
        assert twin.get("distill") == values.get("distill"), name


def test_method_recipe_without_drop_is_one_line_exit_2(tiny_folder, capsys):
    code, _, err = run(capsys, "--recipe", METHODS_DIR / "linearpatch.yaml", *small(tiny_folder))
    assert code == EXIT_BAD_INPUT
    assert err.strip().count("\n") == 0
    assert re.fullmatch(r"error: .*linearpatch\.yaml is a method recipe: say how much to remove with --drop N.*",
                        err.strip())


def test_method_recipe_runs_with_model_and_drop_from_the_command_line(tiny_folder, tmp_path, capsys):
    out = tmp_path / "slim"
    code, stdout, err = run(capsys, "--recipe", METHODS_DIR / "linearpatch.yaml", *small(tiny_folder), "--drop", "2",
                            "--out", out)
    assert code == 0, err
    report = json.loads((out / "layercut.json").read_text())
    assert report["replace"] == "linearpatch" and report["score"] == "bi" and len(report["dropped"]) == 2
    assert report["num_blocks_after"] == 2 and "by linearpatch" in stdout
    # an explicit flag wins over the recipe
    out2 = tmp_path / "slim2"
    code, _, _ = run(capsys, "--recipe", METHODS_DIR / "shortgpt.yaml", *small(tiny_folder), "--drop", "1",
                     "--score", "cosine", "--replace", "linear", "--out", out2)
    report = json.loads((out2 / "layercut.json").read_text())
    assert code == 0 and report["score"] == "cosine" and report["replace"] == "linear"
    assert report["protect"] == []  # the recipe's protect: none stays where no flag says otherwise


def test_method_recipe_may_not_name_the_model_or_the_drop(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("method: mine\nscore: bi\ndrop: 4\nload: {model: gpt2}\n")
    with pytest.raises(LayercutError, match="names a method only: remove drop, load and pass them on the command"):
        config_from_recipe(path, {"drop": 2})


@pytest.mark.parametrize(("line", "named"), [
    ("protect: 5", "protect must be text or a list (or none), got 5 (int): write block indices as text"),
    ("protect: 0.5", "protect must be text or a list (or none), got 0.5 (float)"),
    ("load: {dtype: 7}", "load: dtype must be text, got 7 (int): write one of auto, float32, bfloat16, float16"),
    ("load: {load_in_4bit: 'no'}", "load: load_in_4bit must be true or false, got 'no' (str)"),
    ("data: {text_field: 5}", "data: text_field must be text, got 5 (int)"),
    ("drop: [1, 2]", "drop must be text or an integer (or none), got [1, 2] (list): write a count like 4"),
    ("distill: 5", "distill must be a mapping, got 5 (int): write DistillConfig keys"),
])
def test_a_value_of_the_wrong_type_is_one_line_naming_the_key(tmp_path, line, named):
    # these were a TypeError in parse_protect, a KeyError in the planner, or accepted and run
    path = tmp_path / "typed.yaml"
    path.write_text(f"drop: 1\n{line}\n")
    with pytest.raises(LayercutError) as error:
        config_from_recipe(path)
    assert str(error.value).startswith(named) and "\n" not in str(error.value)


def test_numbers_written_as_text_and_block_lists_are_taken(tmp_path):
    path = tmp_path / "typed.yaml"
    path.write_text("drop: '25%'\nbatch_size: '2'\ntarget_speedup:\nprotect: [0, -1]\nload: {dtype: float32}\n")
    config = config_from_recipe(path)
    assert (config.drop, config.batch_size, config.protect, config.load.dtype) == ("25%", 2, [0, -1], "float32")


def test_resolve_method_by_name_or_path_and_unknown_lists_the_known(tmp_path):
    assert resolve_method("sleb") == METHODS_DIR / "sleb.yaml"
    path = tmp_path / "mine.yaml"
    path.write_text("method: mine\nscore: bi\nselect: topk\n")
    assert resolve_method(str(path)) == path
    with pytest.raises(LayercutError, match="unknown method 'squash': choose one of gromov, gromov-heal, "):
        resolve_method("squash")


def test_a_recipe_is_found_by_name_or_shipped_path_from_any_folder(tmp_path, monkeypatch):
    """``--recipe layercut-linear-vanilla`` and ``--recipe recipes/smollm2-drop4.yaml`` work outside the checkout."""
    monkeypatch.chdir(tmp_path)
    assert find_recipe("layercut-linear-vanilla") == METHODS_DIR / "layercut-linear-vanilla.yaml"
    assert find_recipe("recipes/smollm2-drop4.yaml") == METHODS_DIR.parent / "smollm2-drop4.yaml"
    assert find_recipe("repairs/fold") == METHODS_DIR.parent / "repairs" / "fold.yaml"
    assert resolve_method("recipes/repairs/remove.yaml") == METHODS_DIR.parent / "repairs" / "remove.yaml"
    own = tmp_path / "layercut-linear.yaml"  # a file of the user's wins over a shipped name
    own.write_text("method: mine\nscore: bi\nselect: topk\n")
    assert find_recipe("layercut-linear.yaml") == own.relative_to(tmp_path)
    assert config_from_recipe("layercut-linear-vanilla", {"drop": 2}).replace.method == "fold"
    with pytest.raises(LayercutError, match="recipe 'squash' not found: pass a YAML file, a method name") as error:
        read_recipe("squash")
    assert "\n" not in str(error.value)


def test_repair_baselines_are_method_recipes_outside_the_all_grid():
    repairs = method_recipes(METHODS_DIR.parent / "repairs")
    assert set(repairs) == {"remove", "fold", "linear-long", "linear-distill-2000", "linear-distill-mixed",
                            "linear-distill-kl", "linear-distill-kl-lora", "linear-distill-kl-lora-1000",
                            "linear-distill-2000-wide", "linear-distill-wide", "streamline-distill",
                            "linear-distill-kl-lora-2000-wide", "linear-scaled",
                            "linear-scaled-distill", "fold-scaled", "fold-scaled-0.3", "linear-ls", "fold-ls",
                            "remove-span", "fold-topk", "best-kl", "best-sequential"}
    assert not set(repairs) & set(method_recipes())

    def config(path):
        return config_from_recipe(path, {"drop": 4, "load": {"model": "tiny"}})

    linear = config(METHODS_DIR / "layercut-linear.yaml")
    remove = config(repairs["remove"])
    # the baseline removes what layercut-linear replaces: same score, same selection, no map
    assert (remove.score, remove.select) == (linear.score, linear.select)
    assert remove.replace.method == "none" and linear.replace.method == "linear"
    fold = config(repairs["fold"])
    assert fold.replace.method == "fold" and fold.select == "span"
    # fold's baseline removes what fold replaces
    remove_span = config(repairs["remove-span"])
    assert (remove_span.score, remove_span.select) == (fold.score, fold.select)
    assert remove_span.replace.method == "none"
    # the same fold on layercut-linear's blocks
    fold_topk = config(repairs["fold-topk"])
    assert (fold_topk.score, fold_topk.select, fold_topk.replace) == (linear.score, linear.select, fold.replace)
    # the share chosen in d2e7227 is the default since 92941a6; fold-ls is the fold of before, the whole update
    fold_scaled, fold_ls = config(repairs["fold-scaled"]), config(repairs["fold-ls"])
    assert fold_scaled.replace == fold.replace and fold.replace.options.update_scale == 0.7
    assert dataclasses.replace(fold_ls.replace, update_scale=0.7) == fold.replace
    assert fold_ls.replace.options.update_scale == 1
    assert (fold_scaled.score, fold_scaled.select) == (fold_ls.score, fold_ls.select) == (fold.score, fold.select)
    # drop 8's share: the same fold, 0.3 of its update
    assert dataclasses.replace(config(repairs["fold-scaled-0.3"]).replace, update_scale=0.7) == fold.replace
    # issue 17's "before": layercut-linear's blocks and map, without the short-sequence fit
    long = config(repairs["linear-long"])
    assert (long.score, long.select, long.replace.method) == (linear.score, linear.select, "linear")
    assert long.replace.short == 0 and linear.replace.short != 0 and long.replace.options.update_scale == 1
    # the 0.7 of the update chosen in 3d14f10 is linear's default since 92941a6; linear-ls is the map of before
    scaled, least_squares = config(repairs["linear-scaled"]), config(repairs["linear-ls"])
    assert scaled.replace == linear.replace and linear.replace.options.update_scale == 0.7
    assert dataclasses.replace(least_squares.replace, update_scale=0.7) == linear.replace
    assert least_squares.replace.options.update_scale == 1
    assert (scaled.score, scaled.select) == (least_squares.score, least_squares.select) == (linear.score, linear.select)
    # the distillation budget the issue allows, on layercut-linear-distill's blocks and maps
    short = config(METHODS_DIR / "layercut-linear-distill.yaml")
    budget = config(repairs["linear-distill-2000"])
    assert budget.distill["steps"] == 2000 and short.distill["steps"] == 200
    assert (budget.score, budget.select, budget.replace, budget.distill["train"]) == \
        (short.score, short.select, short.replace, short.distill["train"])
    # the same run with its text and objective pinned: today's default (KL) and that of 2c94291 (layerwise MSE)
    default = DistillConfig.from_dict(short.distill)
    kl = DistillConfig.from_dict(config(repairs["linear-distill-kl"]).distill)
    assert [s.spec for s in kl.data.sources] == [None, "self"] and kl.data.samples == 512 and kl == default
    mixed = DistillConfig.from_dict(config(repairs["linear-distill-mixed"]).distill)
    assert mixed.loss_weights() == {"layerwise_mse": 1.0}
    assert dataclasses.replace(mixed, losses={"teacher_student_kl": 1.0}) == default
    lora = DistillConfig.from_dict(config(repairs["linear-distill-kl-lora"]).distill)
    assert lora.train == "lora" and dataclasses.replace(lora, train="replacements") == default
    # five times the steps and nothing else
    longer = DistillConfig.from_dict(config(repairs["linear-distill-kl-lora-1000"]).distill)
    assert longer.steps == 1000 and lora.steps == 200 and dataclasses.replace(longer, steps=200) == lora
    # the full budget on four times the distinct text, sampled in larger batches, and nothing else
    wide = DistillConfig.from_dict(config(repairs["linear-distill-2000-wide"]).distill)
    assert wide.data.samples == 2048 and dict(wide.data.sources[1].sampling)["batch"] == 64
    full = DistillConfig.from_dict(budget.distill)
    assert dataclasses.replace(wide, data=full.data) == full and full.data.samples == 512
    # and at the default's 200 steps
    wide_200 = DistillConfig.from_dict(config(repairs["linear-distill-wide"]).distill)
    assert dataclasses.replace(wide_200, steps=2000) == wide
    assert dataclasses.replace(wide_200, data=default.data) == default
    # that budget and text with the maps + LoRA set, and nothing else
    lora_wide = DistillConfig.from_dict(config(repairs["linear-distill-kl-lora-2000-wide"]).distill)
    assert lora_wide.train == "lora" and dataclasses.replace(lora_wide, train="replacements") == wide
    # LLM-Streamline's span and trained block, then the default distillation of that block
    streamline = config(METHODS_DIR / "llm-streamline.yaml")
    both = config(repairs["streamline-distill"])
    assert (both.score, both.select, both.replace) == (streamline.score, streamline.select, streamline.replace)
    assert not streamline.distill and DistillConfig.from_dict(both.distill) == default
    # the default distillation started from linear-scaled's maps, and nothing else
    scaled_distill = config(repairs["linear-scaled-distill"])
    assert scaled_distill.replace == scaled.replace and scaled_distill.distill == short.distill
    assert (scaled_distill.score, scaled_distill.select) == (short.score, short.select)


@pytest.mark.parametrize("name", ["reassessing", "gromov-heal", "layercut-linear-distill", "linearpatch-distill",
                                  "layercut-rotate-heal", "layercut-local-heal"])
def test_every_distilling_recipe_has_something_to_learn_where_its_selection_cuts(name, tiny_folder, tmp_path, capsys):
    out = tmp_path / "slim"
    # 8 sequences of distillation text, not the recipe's 512 (half of them sampled from the model, ~40 s here): what
    # is learnt where the selection cuts does not depend on how much text there is to learn it from
    code, _, err = run(capsys, "--recipe", METHODS_DIR / f"{name}.yaml", *small(tiny_folder), "--drop", "1",
                       "--distill-steps", "2", "--distill-samples", "8", "--out", out)
    assert code == 0, err
    report = json.loads((out / "layercut.json").read_text())["distill"]
    assert report["steps"] == 2 and report["first_loss"] > 0


@pytest.fixture
def gemma2_folder(tmp_path, capsys):
    """A tiny sandwich-norm (Gemma-2) checkpoint folder, the layout no fold takes."""
    folder = tmp_path / "gemma2"
    make_tiny_model("gemma2").save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    capsys.readouterr()  # the save's progress bar is not the run's
    return folder


def test_the_local_heal_serves_a_sandwich_norm_model_that_the_rotate_heal_refuses(gemma2_folder, tmp_path, capsys):
    code, _, err = run(capsys, "--recipe", METHODS_DIR / "layercut-rotate-heal.yaml", *small(gemma2_folder),
                       "--drop", "1", "--out", tmp_path / "rotated")
    # refused from the config alone, before any weight is read, and the fix names the recipe that serves it
    assert code == EXIT_BAD_INPUT and err.count("\n") == 1 and "no linear map folds" in err
    assert "layercut-local-heal" in err
    assert not (tmp_path / "rotated").exists()
    out = tmp_path / "slim"
    # 16 sequences of distillation text (the loss halves over 30 steps), not 512 of which 256 sampled from the model
    code, _, err = run(capsys, "--recipe", METHODS_DIR / "layercut-local-heal.yaml", *small(gemma2_folder),
                       "--drop", "1", "--distill-steps", "30", "--distill-samples", "16", "--out", out)
    assert code == 0, err
    report = json.loads((out / "layercut.json").read_text())
    assert report["distill"]["steps"] == 30 and report["distill"]["final_loss"] < 0.9 * report["distill"]["first_loss"]
    saved = json.loads((out / "config.json").read_text())  # the original architecture, one block fewer: plain
    assert saved["model_type"] == "gemma2" and saved["num_hidden_layers"] == BLOCKS - 1
    assert saved["architectures"] == ["Gemma2ForCausalLM"] and "auto_map" not in saved


def test_the_local_kl_recipe_is_local_on_the_blocks_a_repaired_kl_loop_picks(gemma2_folder, tmp_path, capsys):
    local = config_from_recipe(METHODS_DIR / "layercut-local.yaml", {"drop": 2, "load": {"model": "tiny"}})
    kl = config_from_recipe(METHODS_DIR / "layercut-local-kl.yaml", {"drop": 2, "load": {"model": "tiny"}})
    assert kl.select == "repaired-greedy-kl" and local.select == "topk"
    assert dataclasses.replace(kl, select="topk") == local
    # a sandwich-norm model, the layout it was chosen for: a plain checkpoint of the chosen blocks' count
    out = tmp_path / "slim"
    code, _, err = run(capsys, "--recipe", METHODS_DIR / "layercut-local-kl.yaml", *small(gemma2_folder), "--drop", "1",
                       "--replace-steps", "5", "--out", out)
    assert code == 0, err
    report = json.loads((out / "layercut.json").read_text())
    assert report["select"] == "repaired-greedy-kl" and len(report["dropped"]) == 1
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "gemma2" and saved["num_hidden_layers"] == BLOCKS - 1 and "auto_map" not in saved
