"""The GPU paths users run on: bf16, accelerate device maps, blocks split over devices, bitsandbytes 4/8-bit.

CI has no GPU, so these skip there; run ``pytest tests/journeys/test_cuda.py`` on a CUDA machine. Each run prunes,
replaces and exports on the GPU, then reloads the export and checks it is the same model as on the CPU,
maps included: a GPU path that silently dropped a map or a block would measure another model.
"""

import json
import math

import pytest
import torch

from eval.quality.perplexity import text_perplexity
from prune.checkpoint.load_config import LoadConfig
from prune.checkpoint.save_load import load
from prune.data.calibration import DataConfig
from prune.errors import LayercutError
from prune.loading.loader import LoadedModel, check_resident, load_model
from prune.pipeline.config import PruneConfig
from prune.pipeline.runner import run_prune
from tests.helpers import run_prune_cli

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

WORDS = "it is a truth universally acknowledged that a single man in possession of a good fortune".split()
TEXT = " ".join(WORDS[(7 * i) % len(WORDS)] for i in range(600))
SMALL = ["--drop", "1", "--samples", "8", "--seq-len", "32", "--heldout-samples", "4"]


def ppl(loaded) -> float:
    return text_perplexity(loaded.model, loaded.tokenizer, TEXT, seq_len=32, progress=False).perplexity


def devices(model) -> set[str]:
    return {p.device.type for p in model.parameters()}


@pytest.mark.parametrize(("flags", "load_kwargs", "rel"), [
    (["--device", "cuda", "--dtype", "bfloat16"], {"device": "cuda", "dtype": "bfloat16"}, 0.05),
    (["--device", "auto"], {"device": "auto"}, 1e-3),
], ids=["cuda-bf16", "device-map-auto"])  # fmt: skip
def test_replace_distill_export_reload_on_gpu(tiny_folder, tmp_path, capsys, flags, load_kwargs, rel):
    out = tmp_path / "slim"
    code, _, err = run_prune_cli(capsys, "--model", tiny_folder, *flags, *SMALL, "--replace", "linear",
                                 "--distill-steps", "4", "--out", out)  # fmt: skip
    assert code == 0, err
    report = json.loads((out / "layercut.json").read_text())
    assert math.isfinite(report["heldout"]["pruned"]) and report["replacements"]

    on_gpu = load(str(out), **load_kwargs)
    assert devices(on_gpu.model) == {"cuda"}
    on_cpu = load(str(out))
    without_maps = load_model(str(out), allow_maps=True)
    assert ppl(on_gpu) == pytest.approx(ppl(on_cpu), rel=rel)
    assert not math.isclose(ppl(without_maps), ppl(on_cpu), rel_tol=1e-3), "the maps must matter here"


@pytest.mark.parametrize("flag", ["--load-in-4bit", "--load-in-8bit"])
def test_bitsandbytes_prune_replace_export_reload(tiny_folder, tmp_path, capsys, flag):
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "slim"
    code, _, err = run_prune_cli(capsys, "--model", tiny_folder, "--device", "cuda", flag, *SMALL,
                                 "--replace", "linear", "--out", out)  # fmt: skip
    assert code == 0, err
    report = json.loads((out / "layercut.json").read_text())
    dense = load_model(str(tiny_folder))
    # quantization error on a random tiny model is small next to removing a block and mapping it
    assert 0.5 < report["heldout"]["pruned"] / report["heldout"]["original"] < 5
    assert report["replacements"]
    reloaded = load(str(out), device="cuda")
    assert devices(reloaded.model) == {"cuda"}
    assert math.isfinite(ppl(reloaded)) and ppl(reloaded) < 5 * ppl(dense)


def test_blocks_split_over_gpu_and_cpu_give_the_cpu_result(tiny_folder, tmp_path):
    """Blocks on two devices (accelerate's hooks move the hidden states): same blocks chosen, same figures."""
    from accelerate import dispatch_model

    reference = load_model(str(tiny_folder))
    split = load_model(str(tiny_folder)).model
    blocks = split.config.num_hidden_layers
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map |= {f"model.layers.{i}": 0 if i < blocks // 2 else "cpu" for i in range(blocks)}
    split = dispatch_model(split, device_map, main_device="cpu")  # cpu entries run on the CPU, not offloaded
    assert devices(split) == {"cuda", "cpu"}

    def config(out):
        data = DataConfig(data="builtin", samples=8, seq_len=32, heldout_samples=4)
        return PruneConfig(load=LoadConfig(model=str(tiny_folder)), data=data, drop=1, replace="linear", out=str(out))

    on_split = run_prune(config(tmp_path / "split"), loaded=LoadedModel(split, reference.tokenizer, "tiny", "tiny"))
    on_cpu = run_prune(config(tmp_path / "cpu"), loaded=reference)
    assert on_split.report["dropped"] == on_cpu.report["dropped"]
    assert on_split.report["heldout"]["pruned"] == pytest.approx(on_cpu.report["heldout"]["pruned"], rel=1e-3)
    assert ppl(load(str(tmp_path / "split"))) == pytest.approx(ppl(load(str(tmp_path / "cpu"))), rel=1e-3)


def test_weights_offloaded_by_accelerate_are_refused_in_one_line(tiny_folder):
    from transformers import AutoModelForCausalLM

    blocks = load_model(str(tiny_folder)).model.config.num_hidden_layers
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 0, "lm_head": 0}
    device_map |= {f"model.layers.{i}": 0 if i < blocks // 2 else "cpu" for i in range(blocks)}
    offloaded = AutoModelForCausalLM.from_pretrained(str(tiny_folder), device_map=device_map)
    assert "meta" in devices(offloaded), "accelerate no longer offloads here: the test proves nothing"
    with pytest.raises(LayercutError, match="offloaded .* to CPU or disk") as err:
        check_resident(offloaded, "tiny")
    assert "\n" not in str(err.value)


def test_compare_and_bench_on_gpu(tiny_folder, tmp_path, capsys):
    from eval.bench.cli import main as bench_main
    from eval.compare.cli import main as compare_main

    heldout = tmp_path / "heldout.txt"
    heldout.write_text(TEXT)
    out = tmp_path / "cmp"
    assert compare_main(["--model", str(tiny_folder), "--device", "cuda", "--dtype", "bfloat16", "--drop", "1",
                         "--methods", "gromov,layercut-linear", "--samples", "8", "--seq-len", "32",
                         "--heldout", str(heldout), "--speed-tokens", "2", "--keep-checkpoints",
                         "--out", str(out)]) == 0  # fmt: skip
    cells = json.loads((out / "results.json").read_text())["cells"]
    assert set(cells) == {"gromov@1", "layercut-linear@1"}
    assert all(math.isfinite(row["heldout_ppl"]) for row in cells.values())
    assert bench_main(["speed", "--baseline", str(tiny_folder), "--model", str(out / "cells" / "layercut-linear-drop1"),
                       "--device", "cuda", "--prompt-len", "8", "--new-tokens", "4", "--repeats", "2",
                       "--memory", "inprocess", "--out", str(tmp_path / "speed")]) == 0  # fmt: skip
    speed = json.loads((tmp_path / "speed" / "speed.json").read_text())
    assert speed
