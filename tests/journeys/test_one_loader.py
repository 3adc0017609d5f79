"""Every tool measures the model it names: a checkpoint with replacement maps is evaluated with its maps.

The first test caught a silent wrong number: ``eval.run`` opened a ``--replace linear`` checkpoint with
the plain loader, which drops the maps, and reported the perplexity of the removal-only model.
"""

import json
import math

import pytest
import torch

from eval.quality.perplexity import text_perplexity, wikitext2_test_text
from eval.run import main as eval_main
from prune.checkpoint.save_load import load
from prune.loading.loader import load_model
from tests.helpers import run_prune_cli

WORDS = "it is a truth universally acknowledged that a single man in possession of a good fortune".split()


@pytest.fixture(scope="module")
def replaced(tmp_path_factory, tiny_folder):
    """A ``prune.run --drop 1 --replace linear`` checkpoint of the tiny llama, and a local WikiText-2 folder."""
    root = tmp_path_factory.mktemp("one-loader")
    data = root / "data" / "wikitext-2-raw-v1"
    data.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    lines = [" " + " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (40,), generator=generator).tolist())
             for _ in range(20)]  # fmt: skip
    (data / "wiki.test.raw").write_text("\n".join(lines) + "\n")
    from prune.run import main

    out = root / "slim-lin"
    assert main([
        "--model", str(tiny_folder), "--drop", "1", "--replace", "linear", "--samples", "16", "--seq-len", "32",
        "--out", str(out),
    ]) == 0  # fmt: skip
    return root, out


def test_eval_run_measures_a_replaced_checkpoint_with_its_maps(replaced, tiny_folder, one_thread, capsys):
    root, slim = replaced
    report = root / "report"
    argv = ["--baseline", str(tiny_folder), "--model", str(slim), "--tasks", "wikitext", "--data-dir",
            str(root / "data"), "--seq-len", "32", "--out", str(report), "--no-progress"]  # fmt: skip
    assert eval_main(argv) == 0
    measured = json.loads((report / "results.json").read_text())["models"][-1]["metrics"]["wikitext/perplexity"]

    text = wikitext2_test_text(root / "data")
    with_maps = load(str(slim))
    expected = text_perplexity(with_maps.model, with_maps.tokenizer, text, seq_len=32, progress=False).perplexity
    plain = load_model(str(slim), allow_maps=True)  # the blocks without their maps: the removal-only model
    removed = text_perplexity(plain.model, plain.tokenizer, text, seq_len=32, progress=False).perplexity

    assert measured == pytest.approx(expected, rel=1e-9)
    assert not math.isclose(removed, expected, rel_tol=1e-3), "the map must matter, or the test proves nothing"


def test_eval_run_ppl_file_without_baseline(replaced, one_thread, capsys):
    root, slim = replaced
    heldout = root / "heldout.txt"
    heldout.write_text(" ".join(WORDS * 30))
    report = root / "report-alone"
    assert eval_main(["--model", str(slim), "--tasks", f"ppl:{heldout}", "--seq-len", "32", "--out", str(report),
                      "--no-progress"]) == 0  # fmt: skip
    results = json.loads((report / "results.json").read_text())
    assert results["baseline"] is None and len(results["models"]) == 1
    loaded = load(str(slim))
    expected = text_perplexity(loaded.model, loaded.tokenizer, heldout.read_text(), seq_len=32, progress=False)
    assert results["models"][0]["metrics"]["ppl:heldout/perplexity"] == pytest.approx(expected.perplexity, rel=1e-9)
    assert "ppl:heldout/perplexity" in capsys.readouterr().out


def test_eval_run_missing_ppl_file_is_one_line(tmp_path, capsys, tiny_folder):
    code = eval_main(["--model", str(tiny_folder), "--tasks", f"ppl:{tmp_path / 'nope.txt'}", "--out",
                      str(tmp_path / "r")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "no such file" in err


def test_every_tool_loads_through_prune_load():
    """No tool opens a model with the plain loader (only prune.checkpoint.save_load and the loader itself may)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    offenders = []
    for path in list(root.glob("eval/**/*.py")) + list(root.glob("distill/*.py")) + list(root.glob("prune/*.py")):
        text = path.read_text(encoding="utf-8")
        if "load_model(" in text and path.name not in ("loading.py", "checkpoint.py"):
            offenders.append(str(path.relative_to(root)))
    assert offenders == []


def test_recipe_values_yield_to_typed_flags(tmp_path):
    from prune.options import explicit_flags
    from prune.run import build_parser, config_from_args

    recipe = tmp_path / "r.yaml"
    recipe.write_text("load: {model: smollm2-135m, device: cuda}\ndata: {samples: 64, seq_len: 512}\ndrop: 4\n"
                      "replace: linear\n")  # fmt: skip
    argv = ["--recipe", str(recipe), "--samples", "8", "--device", "cpu", "--fit", "sequential"]
    parser = build_parser()
    config = config_from_args(parser.parse_args(argv), explicit_flags(parser, argv))
    assert (config.data.samples, config.data.seq_len, config.load.device) == (8, 512, "cpu")
    assert (config.replace.method, config.replace.fit, config.drop) == ("linear", "sequential", 4)


@pytest.mark.parametrize("key, spelling", [("distill_steps", "distill: {steps: ...}"), ("fit", "replace: {fit: ...}"),
                                           ("replace_steps", "replace: {steps: ...}")])
def test_moved_recipe_keys_name_their_new_spelling(tmp_path, capsys, key, spelling):
    recipe = tmp_path / "old.yaml"
    recipe.write_text(f"drop: 4\nreplace: linear\n{key}: 1\n")
    code, _, err = run_prune_cli(capsys, "--recipe", recipe)
    assert code == 2 and f"'{key}' moved; write it as {spelling}" in err


def test_post_surgery_steps_compose_without_prune_naming_them(tiny_folder, tmp_path):
    """A step registered by name runs on the surgered model and writes its report section; prune imports none."""
    from prune.pipeline.config import PruneConfig
    from prune.pipeline.runner import run_prune
    from prune.pipeline.steps import StepResult, register_step, unregister_step

    seen = {}

    class Probe:
        name = "distill"

        def __init__(self, options, config):
            seen["options"] = options

        def __call__(self, loaded, config):
            seen["blocks"] = len(loaded.model.model.layers)
            return StepResult({"probe": True, "steps": 7})

    register_step("distill", Probe)
    try:
        config = PruneConfig(load={"model": str(tiny_folder)}, data={"samples": 8, "seq_len": 32}, drop=1,
                             distill={"steps": 7}, out=str(tmp_path / "o"))  # fmt: skip
        result = run_prune(config, steps=config.build_steps())
    finally:
        unregister_step("distill")
    assert seen == {"options": {"steps": 7}, "blocks": 3}
    assert result.report["distill"] == {"probe": True, "steps": 7}
    assert json.loads((tmp_path / "o" / "layercut.json").read_text())["distill"]["steps"] == 7
