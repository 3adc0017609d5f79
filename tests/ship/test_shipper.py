"""``prune.ship``: the shortlist it measures, the checkpoint it builds, the card, and its one-line refusals.

The engine checks run in processes of their own; these tests skip them (``--no-verify``) where they are not the
point. ``tests/journeys/test_faults.py`` kills the command in each stage.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil

import pytest
import torch
from safetensors.torch import load_file

from prune.errors import EXIT_INTERRUPTED
from prune.replace import METHODS
from ship.config import servable_repairs
from tests.helpers import make_tiny_model, make_tiny_tokenizer, run_prune_cli


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model fails the test: the check under test must come before it."""
    from prune.checkpoint.load_config import LoadConfig

    monkeypatch.setattr(LoadConfig, "load", lambda self, model=None: pytest.fail("the model was loaded"))


@pytest.fixture
def text_file(tmp_path, sample_text):
    path = tmp_path / "text.txt"
    path.write_text(sample_text * 3)
    return path


def ship(capsys, *args) -> tuple[int, str, str]:
    from prune.ship import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def base_args(model, text_file) -> list:
    return ["--model", model, "--data", text_file, "--samples", "16", "--seq-len", "32", "--heldout-samples", "2",
            "--drop", "2", "--engine", "transformers", "--threads", "1", "--heal-steps", "0"]


@pytest.fixture
def shipped(tmp_path, tiny_folder, text_file, capsys, one_thread):
    out = tmp_path / "slim"
    code, stdout, err = ship(capsys, *base_args(tiny_folder, text_file), "--no-verify", "--out", out)
    assert code == 0, err
    return out, stdout


def test_ship_keeps_the_measured_candidate_of_lowest_kl_and_prune_run_rebuilds_it(shipped, tmp_path, capsys,
                                                                                    tiny_folder, text_file, one_thread):
    out, stdout = shipped
    shortlist = json.loads((out / "ship.json").read_text())["shortlist"]
    measured = [c for c in shortlist["candidates"] if c["kl"] is not None and math.isfinite(c["kl"])]
    assert len(measured) >= 3  # several repairs of the chosen blocks at least
    chosen = shortlist["candidates"][shortlist["chosen"]]
    assert chosen["kl"] == min(c["kl"] for c in measured)
    report = json.loads((out / "layercut.json").read_text())
    assert report["dropped"] == chosen["blocks"] and report["replace"] == chosen["repair"]
    assert report["num_blocks_after"] == report["num_blocks_before"] - 2
    # the card's prune.run command writes the same weights
    card = (out / "README.md").read_text()
    command = re.search(r"^python -m prune\.run .*$", card, re.M).group(0)
    argv = shlex.split(command)[3:]
    argv[argv.index("--out") + 1] = str(tmp_path / "again")
    # the card names files without this machine's folders
    argv[argv.index("--model") + 1], argv[argv.index("--data") + 1] = str(tiny_folder), str(text_file)
    code, _, err = run_prune_cli(capsys, *argv, "--threads", "1")
    assert code == 0, err
    again, first = load_file(tmp_path / "again" / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(again) == sorted(first)
    for name, tensor in first.items():
        assert torch.equal(again[name], tensor), name


def test_the_shortlist_is_planned_again_from_the_block_sets_the_scoring_pass_chose(shipped, tiny_folder, text_file,
                                                                                   tmp_path, one_thread):
    from ship.cli import build_parser, config_from_args
    from ship.config import duration_words
    from ship.plan import replan_shortlist, replanned_shortlist, replanned_shortlist_peak

    out, stdout = shipped
    found = json.loads((out / "ship.json").read_text())
    sets = list({tuple(c["blocks"]) for c in found["shortlist"]["candidates"]})
    config = config_from_args(build_parser().parse_args(
        [str(a) for a in base_args(tiny_folder, text_file)] + ["--no-verify", "--out", str(tmp_path / "other")]))
    model = config.prune.load.load().model
    again = replanned_shortlist(config, model, 2, [list(s) for s in sets])
    assert again > 0 and found["shortlist"]["planned_seconds"] == round(again, 1)
    assert found["planned"]["shortlist once its sets were known"] == round(again, 1)
    assert f"{len(sets)} block sets to fit and measure: the planner now gives the shortlist" in stdout
    # its memory too, counted with the same sets (shortlist.json, and said beside the guess made before loading)
    peak = replanned_shortlist_peak(config, model, 2, [list(s) for s in sets])
    some = replan_shortlist(config, model, 2, [list(s) for s in sets], ["fold"])
    assert some.peak is None and 0 < some.seconds < again  # one repair counted: its seconds, no stage's memory
    assert set(peak) == {"cpu"} and found["shortlist"]["planned_peak"] == pytest.approx(peak)
    said = next(line for line in stdout.splitlines() if "block sets to fit and measure" in line)
    assert f"the shortlist {duration_words(again)} and {peak['cpu'] / 1e9:.1f} GB" in said, said
    # every repair fits each span of each set: scattered sets cost more than one span, a set counted once
    one = replanned_shortlist(config, model, 2, [[1, 2]])
    assert replanned_shortlist(config, model, 2, [[1, 2], [2, 1]]) == one
    scattered, contiguous = (replanned_shortlist(config, model, 2, s) for s in ([[0, 2], [1, 3]], [[0, 1], [2, 3]]))
    assert scattered > contiguous > one


def test_the_heal_is_kept_only_when_it_lowers_the_kl_on_rows_it_never_trained_on_and_the_card_says_so(
        shipped, tmp_path, tiny_folder, text_file, capsys, one_thread, monkeypatch):
    import ship.heal as heal_stage

    unhealed, _ = shipped
    args = base_args(tiny_folder, text_file)
    args[args.index("--heal-steps") + 1] = "30"
    passes = []
    real = heal_stage.divergence
    monkeypatch.setattr(heal_stage, "divergence", lambda *a, **k: passes.append(1) or real(*a, **k))
    code, stdout, err = ship(capsys, *args, "--no-verify", "--out", tmp_path / "healed")
    assert code == 0, err
    heal = json.loads((tmp_path / "healed.work" / "heal.json").read_text())
    assert heal["steps"] == 30 and heal["train"] == "lora"
    assert heal["kept"] == (heal["kl_after"] < heal["kl_before"])
    # the KL before is the shortlist's of the candidate built (its fit, put in place): measured after only
    shortlist = json.loads((tmp_path / "healed" / "ship.json").read_text())["shortlist"]
    assert heal["kl_before"] == shortlist["candidates"][shortlist["chosen"]]["kl"] and len(passes) == 1
    assert heal["kept"], heal  # 30 steps towards the original on a tiny model do lower its KL
    out = tmp_path / "healed"
    report = json.loads((out / "layercut.json").read_text())
    assert report["heal"]["steps"] == 30 and report["heal"]["kl_after"] == heal["kl_after"]
    assert report["dropped"] == json.loads((unhealed / "layercut.json").read_text())["dropped"]
    # a plain checkpoint (LoRA merged), other weights than the unhealed one of the same blocks
    healed, before = load_file(out / "model.safetensors"), load_file(unhealed / "model.safetensors")
    assert sorted(healed) == sorted(before)
    assert any(not torch.equal(healed[name], before[name]) for name in before)
    card = (out / "README.md").read_text()
    assert "Healed: 30 steps of distillation towards the original" in card and "kept." in card
    assert "from the original's top-256 logits written once" in card and report["heal"]["teacher_cache"]
    # distillation holds nothing out: the 14 fitting rows are the cache's only rows, and the KL on the measuring
    # rows before and after is ship's own (the one pass above)
    assert report["heal"]["teacher_cache"]["sequences"] == 14 and report["heal"]["generalisation"] is None
    assert "--heal-steps 30" in card and "# the checkpoint before healing, without the shortlist:" in card
    assert "in transformers before healing:" in card  # prune.run measured its held-out rows before the heal
    assert (out / "scores.md").is_file() and (out / "linearity_profile.png").is_file()  # carried from the build
    # the shipped folder removed, as the tool's own message suggests: the same command heals again, to the same
    shutil.rmtree(out)
    import ship.shipper as shipper

    checked, real_check = [], shipper.check_disk_left  # a resumed run checks the disk for what it writes again
    monkeypatch.setattr(shipper, "check_disk_left", lambda *a: checked.append(a[2]) or real_check(*a))
    code, stdout, err = ship(capsys, *args, "--no-verify", "--out", out)
    assert code == 0, err
    assert "continuing the run kept in" in stdout and "healing: 30 steps" in stdout and checked == [True]
    again = load_file(out / "model.safetensors")
    assert all(torch.equal(again[name], healed[name]) for name in healed)


def test_heal_data_is_trained_on_beside_the_calibration_rows_and_judged_on_the_same_unseen_rows(
        shipped, tmp_path, tiny_folder, text_file, sample_text, capsys, one_thread):
    other = tmp_path / "other.txt"
    other.write_text(sample_text[::-1] * 2)
    args = base_args(tiny_folder, text_file)
    args[args.index("--heal-steps") + 1] = "20"
    code, stdout, err = ship(capsys, *args, "--heal-data", other, "--heal-samples", "8", "--no-verify",
                             "--out", tmp_path / "more")
    assert code == 0, err
    heal = json.loads((tmp_path / "more.work" / "heal.json").read_text())
    # 14 fitting rows of 32 tokens (every 8th of 16 measures), and 8 rows of 32 tokens of the other text
    assert heal["tokens"] == 14 * 32 + 8 * 32 and heal["data"] == str(other)
    shortlist = json.loads((tmp_path / "more" / "ship.json").read_text())["shortlist"]
    assert heal["kl_before"] == shortlist["candidates"][shortlist["chosen"]]["kl"]  # the same measuring rows
    card = (tmp_path / "more" / "README.md").read_text()
    assert f"on {14 * 32 + 8 * 32:,} tokens of the calibration and `--heal-data " in card and "other.txt`" in card
    assert "--heal-data" in card.split("## Reproduce")[1] and "--heal-samples 8" in card


def test_the_heal_trains_the_lora_adapters_asked_for_and_the_card_says_so(tmp_path, tiny_folder, text_file, capsys,
                                                                          one_thread):
    args = base_args(tiny_folder, text_file)
    args[args.index("--heal-steps") + 1] = "20"
    code, stdout, err = ship(capsys, *args, "--lora-r", "4", "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj",
                             "--no-verify", "--out", tmp_path / "ranked")
    assert code == 0, err
    heal = json.loads((tmp_path / "ranked.work" / "heal.json").read_text())
    assert (heal["lora_r"], heal["lora_alpha"], heal["lora_targets"]) == (4, 8.0, "q_proj,v_proj")
    card = (tmp_path / "ranked" / "README.md").read_text()
    assert "LoRA of rank 4 and alpha 8 on the q_proj, v_proj layers of the kept blocks, merged" in card
    assert "--lora-r 4 --lora-alpha 8 --lora-targets q_proj,v_proj" in card.split("## Reproduce")[1]


def test_only_a_float32_build_takes_the_shortlists_figures_as_the_checkpoints(shipped, tmp_path, tiny_folder,
                                                                              text_file, capsys, one_thread):
    out, _ = shipped
    assert json.loads((tmp_path / "slim.work" / "build.json").read_text())["as_measured"] is True
    # in bfloat16 the written weights are rounded where a view of the cut need not be: the heal measures again
    code, _, err = ship(capsys, *base_args(tiny_folder, text_file), "--dtype", "bfloat16", "--no-verify",
                        "--out", tmp_path / "bf16")
    assert code == 0, err
    assert json.loads((tmp_path / "bf16.work" / "build.json").read_text())["as_measured"] is False


def test_the_card_opens_with_the_hub_metadata_then_the_choice_and_its_table(shipped):
    out, _ = shipped
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers")
    assert card.index("# ") < card.index("## What was chosen, and why") < card.index("## Use") < card.index(
        "## Reproduce")
    # rendered once: every section once, the folder to load named as the user got it
    assert all(card.count(head) == 1 for head in ("## What was chosen", "## What was lost", "## Use", "## Reproduce"))
    assert f'from_pretrained("{out.name}")' in card and '"checkpoint"' not in card
    assert "| **chosen** |" in card
    assert "Not verified in an engine (--no-verify)." in card
    assert str(out.parent) not in card  # no path of this machine
    assert str(out.parent) not in (out / "ship.json").read_text()


def test_every_applicable_training_free_plain_repair_is_a_candidate(shipped):
    out, _ = shipped
    shortlist = json.loads((out / "ship.json").read_text())["shortlist"]
    repairs = {c["repair"] for c in shortlist["candidates"]} | set(shortlist["not_applicable"])
    assert repairs == {n for n, m in METHODS.items() if m.servable and m.closed_form} | {"none"}
    assert servable_repairs()[-1] == "none"


def test_a_second_call_finds_the_shipped_folder_and_a_changed_budget_is_refused(shipped, tiny_folder, text_file,
                                                                                   capsys, one_thread):
    out, _ = shipped
    args = base_args(tiny_folder, text_file)
    code, stdout, _ = ship(capsys, *args, "--no-verify", "--out", out)
    assert code == 0 and "shipped already" in stdout
    args[args.index("--drop") + 1] = "1"
    code, _, err = ship(capsys, *args, "--no-verify", "--out", out)
    assert code == 2 and "shipped with other settings" in err and len(err.strip().splitlines()) == 1


def test_repaired_fast_reads_its_statistics_from_the_scoring_pass(tiny_folder, text_file, tmp_path, capsys,
                                                                   one_thread, monkeypatch):
    # before 2026-12-03 it ran two passes of its own over the calibration (67 s of a 442 s drop-4 shortlist)
    monkeypatch.setattr("prune.selection.map_errors.stream_any", lambda *_, **__: pytest.fail("a pass of its own"))
    code, _, err = ship(capsys, *base_args(tiny_folder, text_file), "--no-verify", "--out", tmp_path / "o")
    assert code == 0, err
    shortlist = json.loads((tmp_path / "o" / "ship.json").read_text())["shortlist"]
    assert any("repaired-fast/linearity" in c["chosen_by"] for c in shortlist["candidates"])


def test_the_build_ships_the_fit_the_shortlist_measured_with_no_pass_of_its_own(tiny_folder, text_file, tmp_path,
                                                                                 capsys, one_thread, monkeypatch):
    # before 2026-12-03 the build fitted the chosen repair again on every row (37 s of a 358 s SmolLM2 drop-4
    # shortlist's 67 s build), so the checkpoint was not the candidate the shortlist measured
    from transformers import AutoModelForCausalLM

    import ship.build as build_stage
    from prune.selection.repaired import divergence, split_rows

    real = build_stage.run_prune

    def no_fit(*args, **kwargs):
        for where in ("prune.selection.repaired.fit_spans", "prune.replace.driver._fit_independent"):
            monkeypatch.setattr(where, lambda *_, **__: pytest.fail("the build fitted again"))
        return real(*args, **kwargs)

    monkeypatch.setattr(build_stage, "run_prune", no_fit)
    code, _, err = ship(capsys, *base_args(tiny_folder, text_file), "--no-verify", "--out", tmp_path / "o")
    assert code == 0, err
    shortlist = json.loads((tmp_path / "o" / "ship.json").read_text())["shortlist"]
    chosen = shortlist["candidates"][shortlist["chosen"]]
    assert chosen["repair"] != "none"
    record = json.loads((tmp_path / "o" / "layercut.json").read_text())["replacements"][0]
    assert record["fit_rows"] == 14  # of 16: the two measuring rows stay unseen
    # the checkpoint's KL on the rows no fit saw is the one the shortlist chose it by
    token_ids = load_file(tmp_path / "o.work" / "calibration.safetensors")["token_ids"]
    measuring = split_rows(token_ids)[1]
    built = AutoModelForCausalLM.from_pretrained(tmp_path / "o").float()
    original = AutoModelForCausalLM.from_pretrained(tiny_folder).float()
    assert math.isclose(divergence(built, original, measuring)["kl"], chosen["kl"], rel_tol=1e-4)


def test_a_repair_that_unties_a_tied_head_is_not_a_candidate_when_it_makes_the_model_bigger(tmp_path, text_file,
                                                                                              capsys, one_thread):
    folder = tmp_path / "tied"
    make_tiny_model("llama", tie_word_embeddings=True, vocab_size=2000).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    code, _, err = ship(capsys, *base_args(folder, text_file), "--drop", "1", "--no-verify", "--out", tmp_path / "o")
    assert code == 0, err
    shortlist = json.loads((tmp_path / "o" / "ship.json").read_text())["shortlist"]
    rotated = [c for c in shortlist["candidates"] if c["repair"] == "fold-rotate"]
    assert rotated and all(c["kl"] is None and "more than removing the same blocks" in c["note"] for c in rotated)
    assert all(c["params"] > shortlist["params_before"] for c in rotated)
    assert shortlist["candidates"][shortlist["chosen"]]["repair"] != "fold-rotate"


def test_a_skeleton_ships_the_in_memory_pick_and_checkpoint_and_says_what_it_skipped(tmp_path, text_file, capsys,
                                                                                        one_thread, monkeypatch):
    """``--offload sequential``: the same candidates, KLs and pick as in memory, the same tensors to 1e-6 (the
    default repair of an untied head, fold-rotate, among them), verified in transformers one block at a time;
    the heal runs block by block (the card says so) and the speed check, which needs the whole model in memory,
    is skipped and the card says why.
    Neither run's repaired-fast takes a pass of its own: block by block its map errors are taken in the scoring
    pass (before 2026-12-03 a skeleton ran two more passes for them: 161 s of a 1B shape's shortlist)."""
    monkeypatch.setattr("prune.selection.map_errors.stream_any", lambda *_, **__: pytest.fail("a pass of its own"))
    folder = tmp_path / "untied"
    make_tiny_model("llama", tie_word_embeddings=False, num_hidden_layers=6).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    found = {}
    for offload in ("none", "sequential"):
        out = tmp_path / offload
        code, stdout, err = ship(capsys, *base_args(folder, text_file), "--heal-steps", "5", "--prompt-len", "16",
                                 "--new-tokens", "4", "--repeats", "1", "--offload", offload, "--out", out)
        assert code == 0, err
        # the built checkpoint: kept in the work folder where a heal shipped, else shipped itself
        built = next(f for f in (tmp_path / f"{offload}.work" / "checkpoint" / "model.safetensors",
                                 out / "model.safetensors") if f.is_file())
        found[offload] = (json.loads((out / "ship.json").read_text()), load_file(built),
                          (out / "README.md").read_text(), stdout)
    (memory, weights, card, _), (skeleton, streamed, streamed_card, said) = found["none"], found["sequential"]
    listed = [(c["blocks"], c["repair"], c["kl"]) for c in memory["shortlist"]["candidates"]]
    assert [(b, r) for b, r, _ in listed] == [(c["blocks"], c["repair"]) for c in skeleton["shortlist"]["candidates"]]
    for (_, _, kl), other in zip(listed, skeleton["shortlist"]["candidates"], strict=True):
        assert (kl is None) == (other["kl"] is None) and (kl is None or math.isclose(kl, other["kl"], rel_tol=1e-4))
    assert memory["shortlist"]["chosen"] == skeleton["shortlist"]["chosen"]
    assert "fold-rotate" in {r for _, r, _ in listed}
    assert weights.keys() == streamed.keys()
    assert max(float((weights[k] - streamed[k]).abs().max()) for k in weights) <= 1e-6
    assert "Healed block by block: 5 steps a cut" in streamed_card and "block by block" not in card
    assert json.loads((tmp_path / "sequential.work" / "heal.json").read_text())["train"] == "blocks"
    assert not (tmp_path / "sequential.work" / "healed.work").exists()  # the cuts kept while healing: gone
    assert "no speed check" in said and "No speed figures, --offload sequential" in streamed_card
    assert "| calibration held-out rows |" in streamed_card  # the perplexities, measured on the skeletons


def test_a_ship_killed_in_its_heal_block_by_block_goes_on_from_the_cuts_it_kept(tmp_path, tiny_folder, text_file,
                                                                                 capsys, one_thread, monkeypatch):
    """Killed once its cuts were trained, the same command trains none again, goes on with the steps the heal began
    with though the plan now gives others, and ships the weights of a run never killed; the kept cuts go once the
    healed checkpoint is written."""
    import distill.local_heal
    import ship.heal as heal_stage
    import ship.shipper as shipper

    args = [*base_args(tiny_folder, text_file), "--heal-steps", "5", "--offload", "sequential", "--no-verify"]
    code, _, err = ship(capsys, *args, "--out", tmp_path / "unbroken")
    assert code == 0, err
    healed_blocks = heal_stage.heal_built

    def trained_then_killed(*a, **k):
        healed_blocks(*a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(heal_stage, "heal_built", trained_then_killed)
    code, _, err = ship(capsys, *args, "--out", tmp_path / "killed")
    assert code == EXIT_INTERRUPTED and "interrupted" in err
    kept = tmp_path / "killed.work" / "healed.work" / "blocks"
    assert sorted(kept.glob("cut-*.safetensors")) and (kept / "steps.json").is_file()
    monkeypatch.setattr(heal_stage, "heal_built", healed_blocks)
    trained, steps = [], distill.local_heal.adam_steps
    monkeypatch.setattr(distill.local_heal, "adam_steps", lambda *a, **k: trained.append(k["desc"]) or steps(*a, **k))
    monkeypatch.setattr(shipper, "heal_steps", lambda *_, **__: (3, "a budget planned again"))
    code, stdout, err = ship(capsys, *args, "--out", tmp_path / "killed")
    assert code == 0, err
    assert trained == [] and "healed before: their trained weights read from" in stdout
    assert "the heal began with 5 steps a cut (--heal-steps 5) and kept cuts of them" in stdout
    assert json.loads((tmp_path / "killed.work" / "heal.json").read_text())["steps"] == 5
    unbroken, resumed = (load_file(tmp_path / name / "model.safetensors") for name in ("unbroken", "killed"))
    assert unbroken.keys() == resumed.keys() and all(torch.equal(unbroken[k], resumed[k]) for k in unbroken)
    assert not (tmp_path / "killed.work" / "healed.work").exists()


@pytest.mark.parametrize(("extra", "words"), [
    (["--time-budget", "1s"], "--time-budget 1s: the planner gives"),
    (["--time-budget", "soon"], "give a duration such as 30m"),
    (["--unit", "mlp"], "unrecognized"),
    (["--heal-steps", "10", "--lora-targets", "q_porj"], "--lora-targets: the blocks have no Linear layer named q_p"),
])
def test_bad_input_is_one_line_before_any_weight_is_read(tiny_folder, text_file, tmp_path, capsys, extra, words,
                                                         monkeypatch, no_model_load):
    # the tiny model's plan is well under a second
    monkeypatch.setattr("ship.plan.stage_seconds", lambda *_: {"shortlist": 3600.0, "heal": 60.0})
    args = base_args(tiny_folder, text_file)
    with pytest.raises(SystemExit) if extra[0] == "--unit" else _nothing():
        code, _, err = ship(capsys, *args, *extra, "--no-verify", "--out", tmp_path / "o")
        assert code == 2 and len(err.strip().splitlines()) == 1 and words in err, err
    assert not (tmp_path / "o").exists()
    assert not (tmp_path / "o.work" / "ship.json").exists()  # nothing that would refuse the corrected command


def test_a_gguf_seen_for_the_first_time_is_planned_and_held_to_its_budget_from_its_header(
        tmp_path, text_file, capsys, monkeypatch, no_model_load):
    from tests.prune.loading.test_loader import _byte_level_tokenizer, _tiny_llama, _write_tiny_gguf

    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path / "cache"))
    tokenizer = _byte_level_tokenizer()
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, _tiny_llama(len(tokenizer), tie=True), tokenizer)
    monkeypatch.setattr("ship.plan.stage_seconds", lambda *_: {"shortlist": 3600.0, "heal": 60.0})
    args = base_args(path, text_file)
    args[args.index("--drop") + 1:args.index("--drop") + 2] = ["1", "--protect", "none"]  # the tiny GGUF has 2 blocks
    code, _, err = ship(capsys, *args, "--time-budget", "30m", "--no-verify", "--out", tmp_path / "o")
    # before 2026-12-03 a first run of a .gguf had no plan: no stage times, and --time-budget went unchecked
    assert code == 2 and "--time-budget 30m: the planner gives this run 60m before any healing" in err, err
    assert not (tmp_path / "cache").exists()  # refused from the header: nothing converted


def test_a_target_the_blocks_cannot_reach_is_refused_before_any_weight_is_read(tiny_folder, text_file, tmp_path,
                                                                               capsys, no_model_load):
    args = base_args(tiny_folder, text_file)
    args[args.index("--drop"):args.index("--drop") + 2] = ["--target-params", "1K"]
    code, _, err = ship(capsys, *args, "--no-verify", "--out", tmp_path / "o")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--target-params 1K needs 4 of the 4 blocks removed, and only 2 may go (--protect 0,-1)" in err


@pytest.mark.parametrize("damage", ["plan.json", "ship.json"])
def test_a_damaged_work_folder_is_one_line_that_says_how_to_start_over(tiny_folder, text_file, tmp_path, capsys,
                                                                       no_model_load, damage):
    from ship.cli import build_parser, config_from_args
    from ship.work import WorkFolder

    args = [str(arg) for arg in (*base_args(tiny_folder, text_file), "--no-verify", "--out", tmp_path / "o")]
    WorkFolder(tmp_path / "o.work").mark(config_from_args(build_parser().parse_args(args)).settings())
    (tmp_path / "o.work" / damage).write_text("{garbage")
    code, _, err = ship(capsys, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"o.work/{damage} is damaged (JSONDecodeError)" in err and "to start over" in err


def test_no_budget_and_a_missing_engine_are_refused_in_one_line(tiny_folder, text_file, tmp_path, capsys,
                                                               monkeypatch):
    args = base_args(tiny_folder, text_file)
    del args[args.index("--drop"):args.index("--drop") + 2]
    code, _, err = ship(capsys, *args, "--out", tmp_path / "o")
    assert code == 2 and "needs a budget" in err
    monkeypatch.delenv("LLAMA_CPP_CONVERTER", raising=False)
    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path / "cache"))  # no converter fetched there
    args = base_args(tiny_folder, text_file)
    args[args.index("--engine") + 1] = "llamacpp"
    code, _, err = ship(capsys, *args, "--no-verify", "--out", tmp_path / "o")
    assert code == 2 and "convert_hf_to_gguf.py" in err and len(err.strip().splitlines()) == 1


def test_a_work_folder_of_other_settings_is_refused(tiny_folder, text_file, tmp_path, capsys):
    work = tmp_path / "o.work"
    work.mkdir()
    (work / "ship.json").write_text(json.dumps({"settings": {"model": "another"}}))
    code, _, err = ship(capsys, *base_args(tiny_folder, text_file), "--no-verify", "--out", tmp_path / "o")
    assert code == 2 and "holds a run with other settings" in err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_scoring_pass_and_the_surgered_model_are_freed_once_built(tmp_path, tiny_folder, text_file, one_thread):
    """Nothing after the build reads the scoring pass's statistics or the shortlist's fits: on a GPU they would sit
    beside the heal's two models. Freed means no reference is left, not only the attribute cleared."""
    import weakref

    from ship.cli import build_parser, config_from_args
    from ship.shipper import Shipper
    from ship.shortlist import Shortlist
    from ship.work import SHORTLIST

    args = build_parser().parse_args([str(a) for a in base_args(tiny_folder, text_file)]
                                     + ["--no-verify", "--out", str(tmp_path / "slim")])
    shipper = Shipper(config_from_args(args), say=lambda _: None)
    plan = shipper.plan()
    shortlist = shipper.work.stage(SHORTLIST, Shortlist, lambda: shipper.shortlist(plan))
    scored, model = weakref.ref(shipper.scored), weakref.ref(shipper.loaded.model)
    tokens = shipper.scored.calibration.token_ids.clone()
    shipper.build(shortlist)
    assert shipper.scored is None and shipper.loaded is None
    assert scored() is None and model() is None
    assert torch.equal(shipper._calibration(), tokens)  # the heal's rows, read back from OUT.work/


def test_chat_heal_data_without_a_chat_template_is_refused_before_the_shortlist(tmp_path, tiny_folder, text_file,
                                                                                capsys, one_thread):
    code, _, err = ship(capsys, *base_args(tiny_folder, text_file), "--heal-data", "self:chat", "--no-verify",
                        "--out", tmp_path / "chat")
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("error: --heal-data self:chat opens the model's conversations with its "
                                            "chat template and this tokenizer has none: use self, or load a "
                                            "tokenizer with a chat template")
    assert not (tmp_path / "chat.work" / "shortlist.json").exists() and not (tmp_path / "chat").exists()
