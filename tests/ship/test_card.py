"""``ship.card``: the card names and measures the file that ships, and its commands carry every option given."""

from __future__ import annotations

import shlex

from prune.pipeline.config import PruneConfig
from ship.card import prune_command, ship_card, ship_command
from ship.config import ShipConfig
from ship.heal import Healing
from ship.shortlist import Candidate, Shortlist
from ship.verify import Verified

REPORT = {"source_model": "HuggingFaceTB/SmolLM2-135M", "model_name": "smollm2-135m", "num_blocks_before": 30,
          "num_blocks_after": 22, "architecture": "LlamaForCausalLM", "dropped": [1, 2], "select": "topk",
          "score": "linearity", "data": {"source": "builtin", "tokens": 1000}, "serving": {"layout": "vanilla"},
          "heldout": {"tokens": 4096, "seq_len": 512, "original": 10.0, "pruned": 20.0, "ratio": 2.0,
                      "stage": "before-distill"}}


def config(tmp_path, **changes) -> ShipConfig:
    prune = PruneConfig(load={"model": "smollm2-135m", "dtype": "bfloat16"}, drop="8", protect="0,1,-1",
                        batch_size=2, data={"samples": 32})
    settings = {"engine": "llamacpp", "gguf_type": "q4_k_m", "time_budget": 150.0, "speed_repeats": 1, **changes}
    return ShipConfig(prune=prune, out=str(tmp_path / "slim8"), **settings)


def shortlist() -> Shortlist:
    return Shortlist(count=8, params_before=134_515_008, chosen=0, dense_ppl=9.5, measuring_rows=[8, 512],
                     candidates=[Candidate([1, 2], "fold", ["topk/linearity"], params=106_000_000, kl=0.5, ppl=19.0)])


def serving_rows(greedy_shipped: list[int], greedy_original: tuple = (1, 2, 3, 4)) -> dict:
    row = {"runs": True, "greedy": [1, 2, 3, 4]}
    return {"rows": {"original": {"transformers": {**row, "ppl": 10.0, "greedy": list(greedy_original)}},
                     "slim": {"transformers": {**row, "ppl": 20.0}},
                     "shipped": {"llamacpp": {"runs": True, "ppl": 20.5, "greedy": greedy_shipped}}}}


def test_every_engine_row_names_and_measures_the_file_that_ships(tmp_path):
    verified = Verified(domains={"news": serving_rows([1, 2, 3, 4], (1, 5, 3, 4)), "wiki": serving_rows([1, 2, 9, 9])},
                        speed={"ratios": []}, heldout=["news.txt", "wiki.txt"],
                        files={"shipped": "gguf/slim8-q4_k_m.gguf", "engine": "llamacpp", "gguf_type": "q4_k_m"})
    healed = Healing(steps=50, why="--heal-steps 50", kept=True, kl_before=0.5, kl_after=0.3, ppl_before=19.0,
                     ppl_after=15.0, tokens=10_000)
    card = ship_card(config(tmp_path), REPORT, shortlist(), verified, PruneConfig(drop=8, replace="fold"),
                     {"plan": 1.0, "verify": 2.0}, healed, gguf="gguf/slim8-q4_k_m.gguf")
    assert "| held-out text | original | this checkpoint | ratio | gguf/slim8-q4_k_m.gguf in llama.cpp |" in card
    # the last column: the shipped file's greedy ids against the original's (not transformers' slim ones)
    assert "| news | 10.000 | 20.000 | x2.000 | 20.500 | +2.500 % | yes (4 tokens) | 1 of 4 |" in card
    assert "| wiki | 10.000 | 20.000 | x2.000 | 20.500 | +2.500 % | **no**: from token 2 of 4 | 2 of 4 |" in card
    assert "| vs transformers | same greedy ids | original's greedy tokens kept |" in card
    # untimed (no ratios): nothing said of how the original was timed
    assert "quantized the same way" not in card and "No speed figures" in card
    timed = Verified(domains=verified.domains, heldout=verified.heldout, files=verified.files,
                     speed={"ratios": [{"prefill": 1.1, "decode": 1.2, "prefill_paired": {"min": 1.0, "max": 1.2},
                                        "decode_paired": {"min": 1.1, "max": 1.3}}], "options": {"repeats": 3}})
    card = ship_card(config(tmp_path), REPORT, shortlist(), timed, PruneConfig(drop=8, replace="fold"),
                     {"plan": 1.0, "verify": 2.0}, healed, gguf="gguf/slim8-q4_k_m.gguf")
    assert "`gguf/slim8-q4_k_m.gguf` (q4_k_m, against the original converted and quantized the same way" in card
    assert "decode x1.200" in card
    # one card: the held-out figures come from the verified rows alone, the folder is named as the user has it
    assert "10.000 -> 20.000" not in card and "## Held-out perplexity" not in card
    assert card.count("## Use") == 1 and 'from_pretrained("slim8")' in card
    assert 'repo_id="<you>/slim8"' in card  # prune's sections as prune renders them
    assert "Healed: 50 steps" in card and "The GGUF for llama.cpp is `gguf/slim8-q4_k_m.gguf`." in card
    assert "extra buffer types off" not in card
    why = "the serving check crashed (SIGSEGV) with them on"
    crashed = Verified(domains=verified.domains, heldout=verified.heldout, speed=timed.speed,
                       files={**verified.files, "no_repack": dict.fromkeys(("serving", "speed"), why)})
    card = ship_card(config(tmp_path), REPORT, shortlist(), crashed, PruneConfig(drop=8, replace="fold"),
                     {"plan": 1.0, "verify": 2.0}, healed, gguf="gguf/slim8-q4_k_m.gguf")
    assert ("llama.cpp loaded its files with its extra buffer types off in the serving check and the speed check (the "
            "serving check crashed (SIGSEGV) with them on): the weights as stored" in card)


def test_the_card_commands_carry_every_option_that_is_not_its_default(tmp_path):
    command = ship_command(config(tmp_path, heal_steps=50, prompt_len=128, verify=False))
    argv = shlex.split(command)
    for flag, value in (("--time-budget", "150s"), ("--protect", "0,1,-1"), ("--dtype", "bfloat16"),
                        ("--batch-size", "2"), ("--samples", "32"), ("--repeats", "1"), ("--heal-steps", "50"),
                        ("--prompt-len", "128"), ("--gguf-type", "q4_k_m"), ("--out", "slim8")):
        assert argv[argv.index(flag) + 1] == value, flag
    assert "--no-verify" in argv and "--new-tokens" not in argv and "--seq-len" not in argv
    rebuild = shlex.split(prune_command(config(tmp_path).prune))
    for flag, value in (("--protect", "0,1,-1"), ("--dtype", "bfloat16"), ("--batch-size", "2"), ("--samples", "32")):
        assert rebuild[rebuild.index(flag) + 1] == value, flag


def test_the_ship_command_of_the_cli_parses_back_to_the_same_config(tmp_path):
    from ship.cli import build_parser, config_from_args

    original = config(tmp_path, heal_steps=50, verify=False, heal_data="builtin", heal_samples=16, no_repack=True,
                      heal_train={"lora_r": 16, "lora_alpha": 0.1234567, "lora_targets": "q_proj,v_proj"})
    argv = shlex.split(ship_command(original))[3:]
    assert argv[argv.index("--heal-data") + 1] == "builtin" and argv[argv.index("--heal-samples") + 1] == "16"
    assert [argv[argv.index(flag) + 1] for flag in ("--lora-r", "--lora-alpha", "--lora-targets")] == [
        "16", "0.1234567", "q_proj,v_proj"]
    argv[argv.index("--out") + 1] = original.out
    again = config_from_args(build_parser().parse_args(argv))
    assert again.settings() == original.settings() != config(tmp_path, heal_steps=50, verify=False).settings()
    assert again.settings() != config(tmp_path, heal_steps=50, verify=False, heal_data="builtin",
                                      heal_samples=16).settings()  # the adapters are a setting
    assert (again.time_budget, again.speed_repeats, again.verify, again.no_repack) == (150.0, 1, False, True)


def test_in_transformers_the_kept_greedy_tokens_are_the_checkpoint_s_against_the_original(tmp_path):
    rows = serving_rows([], (1, 2, 7, 4))
    del rows["rows"]["shipped"]
    verified = Verified(domains={"news": rows}, speed={"ratios": []}, heldout=["news.txt"],
                        files={"engine": "transformers"})
    card = ship_card(config(tmp_path, engine="transformers", gguf_type="f32"), REPORT, shortlist(), verified,
                     PruneConfig(drop=8, replace="fold"), {"plan": 1.0, "verify": 2.0}, None, gguf=None)
    assert "| held-out text | original | this checkpoint | ratio | original's greedy tokens kept |" in card
    assert "| news | 10.000 | 20.000 | x2.000 | 2 of 4 |" in card  # [1, 2, 3, 4] against the original's [1, 2, 7, 4]
    assert "how many tokens this checkpoint writes the same" in card


def test_the_card_says_what_the_checkpoint_writes_as_the_original_judges_it(tmp_path):
    fidelity = {"prompts": 32, "prompt_tokens": 64, "new_tokens": 32, "nll": 1.2814, "nll_stderr": 0.0712,
                "own_nll": 1.1391, "kept": 0.0641, "kept_stderr": 0.02, "texts": ["news"]}
    card = {}
    for label, figures in (("measured", fidelity), ("skeleton", {"skipped": "--offload sequential"}), ("old", {})):
        verified = Verified(domains={"news": serving_rows([1, 2, 3, 4])}, speed={"ratios": []}, heldout=["news.txt"],
                            files={"shipped": "gguf/slim8-q4_k_m.gguf", "engine": "llamacpp"}, fidelity=figures)
        card[label] = ship_card(config(tmp_path), REPORT, shortlist(), verified, PruneConfig(drop=8, replace="fold"),
                                {"plan": 1.0}, gguf="gguf/slim8-q4_k_m.gguf")
    assert ("after 32 prompts of 64 tokens cut from the held-out texts, this checkpoint (in transformers) and the "
            "original each wrote 32 greedy tokens") in card["measured"]
    assert "negative log-likelihood of 1.281 ± 0.071 per token, against 1.139 for its own" in card["measured"]
    assert "writes 6.4% of the original's tokens before the first that differs" in card["measured"]
    assert "Generation fidelity not measured (--offload sequential" in card["skeleton"]
    assert "What it writes" not in card["old"] and "Generation fidelity" not in card["old"]


TASK_FIGURES = {
    "tasks": {"arc_easy": {"metric": "acc_norm", "original": 0.6, "model": 0.5, "original_stderr": 0.1633,
                           "model_stderr": 0.1667, "rows": 10, "kept": 5 / 6, "gap": -0.1, "gap_stderr": 0.1,
                           "paired": True, "chat": False},
              "ifeval": {"metric": "prompt_level_strict_acc", "original": 0.35, "model": 0.28,
                         "original_stderr": 0.0338, "model_stderr": 0.0318, "rows": 200, "kept": 0.8, "gap": -0.07,
                         "gap_stderr": 0.0241, "paired": True, "chat": True, "max_gen_toks": 256}},
    "retention_tasks": ["arc_easy", "ifeval"], "excluded_tasks": {}, "retention": 0.72, "retention_stderr": 0.05,
    "limit": 200, "rows": "the first 200 rows of each task", "original_kept": False}


def test_the_card_gives_each_lm_eval_task_s_scores_what_is_kept_and_the_paired_gap(tmp_path):
    def card(figures: dict, **changes) -> str:
        verified = Verified(domains={"news": serving_rows([1, 2, 3, 4])}, speed={"ratios": []}, heldout=["news.txt"],
                            files={"shipped": "gguf/slim8-q4_k_m.gguf", "engine": "llamacpp"}, tasks=figures)
        return ship_card(config(tmp_path, **changes), REPORT, shortlist(), verified,
                         PruneConfig(drop=8, replace="fold"), {"plan": 1.0}, gguf="gguf/slim8-q4_k_m.gguf")

    text = card(TASK_FIGURES)
    assert ("lm-eval tasks, in transformers on this checkpoint (not `gguf/slim8-q4_k_m.gguf`) and on the original, on "
            "the same rows (the first 200 rows of each task): kept is the checkpoint's score over the original's, and "
            "the gap is paired, its standard error from the row-by-row differences.") in text
    assert "| task | metric | original | this checkpoint | kept | gap ± SE (points) | rows |" in text
    assert "| arc_easy | acc_norm | 0.600 ± 0.163 | 0.500 ± 0.167 | 83.3% | -10.0 ± 10.0 | 10 |" in text
    assert "| ifeval | prompt_level_strict_acc | 0.350 ± 0.034 | 0.280 ± 0.032 | 80.0% | -7.0 ± 2.4 | 200 |" in text
    assert ("Accuracy above chance kept over arc_easy, ifeval: 72.0% ± 5.0% (the sum of score - chance, over the "
            "original's).") in text
    assert ("ifeval answers each prompt through the chat template, greedily, within 256 new tokens: an answer cut "
            "there fails the checks that need a longer one.") in text
    assert text.index("## What was lost") < text.index("lm-eval tasks, in transformers") < text.index("## Speed")
    # a task the original is not clearly above chance on is named, and with none left there is no retention
    near = {**TASK_FIGURES, "tasks": {"arc_easy": TASK_FIGURES["tasks"]["arc_easy"]}, "retention_tasks": [],
            "excluded_tasks": {"arc_easy": "the original's 0.300 is within 2 standard errors of chance 0.25"}}
    del near["retention"], near["retention_stderr"]
    text = card(near, engine="transformers", gguf_type="f32")
    assert ("No retention above chance: no task counts (arc_easy: the original's 0.300 is "
            "within 2 standard errors of chance 0.25).") in text
    assert "on this checkpoint and on the original" in text and "answers each prompt" not in text
    assert "lm-eval tasks" not in card({})  # no --tasks, no section


def test_the_task_flags_reach_the_card_s_command_and_parse_back(tmp_path):
    from ship.cli import build_parser, config_from_args
    from tests.helpers import write_piqa

    data = write_piqa(tmp_path / "data")
    original = config(tmp_path, tasks=["piqa"], limit="-3:", data_dir=str(data))
    argv = shlex.split(ship_command(original))[3:]
    assert "--tasks" in argv and argv[argv.index("--tasks") + 1] == "piqa" and "--limit=-3:" in argv
    assert argv[argv.index("--data-dir") + 1] == "data"  # as the card names every local path: not this machine's
    argv[argv.index("--out") + 1], argv[argv.index("--data-dir") + 1] = original.out, str(data)
    again = config_from_args(build_parser().parse_args(argv))
    assert (again.tasks, again.limit, again.data_dir) == (["piqa"], "-3:", str(data))
    assert again.settings() == original.settings() != config(tmp_path).settings()  # the card's figures are the run's
    assert "--tasks" not in ship_command(config(tmp_path)) and "tasks" not in config(tmp_path).settings()
