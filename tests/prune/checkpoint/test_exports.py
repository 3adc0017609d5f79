"""Export targets declare their flags, check and writer where they register; prune.run reads them from there."""

import json
from dataclasses import dataclass

import pytest

from prune.checkpoint.exports import EXPORTS, ExportTarget, export_option, export_targets, register_export
from prune.errors import LayercutError
from prune.run import build_parser, config_values
from tests.helpers import run_prune_cli

SMALL = ["--drop", "1", "--samples", "8", "--seq-len", "32", "--heldout-samples", "2"]


def test_the_gguf_target_registers_itself_with_its_flags():
    targets = export_targets()
    assert "gguf" in targets
    args = build_parser().parse_args(["--export", "gguf", "--gguf-type", "q8_0", "--converter", "x.py"])
    assert (args.export, args.gguf_type, args.converter) == ("gguf", "q8_0", "x.py")
    assert not {"export", "gguf_type", "converter"} & set(config_values(args))  # flags of the export, not the run


@pytest.fixture
def toy_target(tmp_path):
    """A toy target in one registration: a flag, a check that refuses a run without removal, a file it writes."""
    calls = []

    @dataclass(frozen=True)
    class ToyOptions:
        suffix: str = export_option("txt", "the file's suffix", flag="--toy-suffix")

    def check(config, options):
        if not config.removes:
            raise LayercutError("--export toy needs --drop")
        calls.append("check")

    def write(folder, options):
        report = json.loads((folder / "layercut.json").read_text())
        (folder / f"toy.{options.suffix}").write_text(str(report["dropped"]))
        return f"wrote toy.{options.suffix}"

    register_export(ExportTarget("toy", "a list of the dropped blocks", ToyOptions, check, write))
    yield calls
    EXPORTS.unregister("toy")


def test_a_new_target_is_one_registration(toy_target, tiny_folder, tmp_path, capsys):
    out = tmp_path / "slim"
    code, stdout, _ = run_prune_cli(capsys, "--model", tiny_folder, *SMALL, "--out", out, "--export", "toy",
                                    "--toy-suffix", "md")
    assert code == 0 and toy_target == ["check"] and "wrote toy.md" in stdout
    report = json.loads((out / "layercut.json").read_text())
    assert (out / "toy.md").read_text() == str(report["dropped"])
    code, _, err = run_prune_cli(capsys, "--model", tiny_folder, "--samples", "8", "--seq-len", "32", "--export",
                                 "toy")
    assert code == 2 and "--export toy needs --drop" in err


def test_gguf_refuses_a_run_that_only_scores_before_any_work(tiny_folder, capsys):
    code, _, err = run_prune_cli(capsys, "--model", tiny_folder, "--samples", "8", "--seq-len", "32",
                                 "--export", "gguf")
    assert code == 2 and "--export gguf converts the pruned checkpoint: pass --drop K" in err


def test_a_targets_flags_and_keywords_come_from_its_options_dataclass():
    target = export_targets()["gguf"]
    assert list(target.specs()) == ["gguf_type", "converter"]
    assert target.options_of({"gguf_type": "q8_0"}).gguf_type == "q8_0"
    with pytest.raises(LayercutError, match="export 'gguf' takes no option quant; its options: gguf_type, converter"):
        target.options_of({"quant": "q8_0"})
    with pytest.raises(LayercutError, match="export 'gguf': gguf_type 'q5' is not one of f32, f16"):
        target.options_of({"gguf_type": "q5"})
    from prune.run import build_parser

    args = build_parser().parse_args(["--export", "gguf", "--gguf-type", "f16"])
    assert target.options_from_args(args) == target.options(gguf_type="f16")
