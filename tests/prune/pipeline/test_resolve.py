import dataclasses

import pytest

import prune.pipeline.resolve
from prune.errors import LayercutError
from prune.pipeline.config import PruneConfig
from prune.pipeline.resolve import Amounts
from prune.replace import parameter_count
from prune.selection.sublayers import Unit
from tests.helpers import make_tiny_model

PARAMS = parameter_count(make_tiny_model("llama"))  # 4 blocks


def resolve(**fields) -> Amounts:
    return PruneConfig(out="unused", data={"seq_len": 32}, **fields).resolve(make_tiny_model("llama"))


def test_resolve_reads_every_amount_once_into_numbers():
    amounts = resolve(drop="25%", protect="0,-1")
    assert amounts == Amounts(num_blocks=4, params=PARAMS, units=("block",), protected=(0, 3), drop=1)
    assert amounts.removes and not amounts.is_sublayer and amounts.free == 2
    assert resolve(protect="none").protected == () and not resolve().removes
    with pytest.raises(dataclasses.FrozenInstanceError):
        amounts.drop = 2


def test_resolve_sublayer_units_and_their_candidates():
    amounts = resolve(unit="attention,mlp", drop=3, protect="0")
    assert amounts.units == ("attention", "mlp") and amounts.is_sublayer and amounts.drop == 3
    # block 0 is protected (and holds the first attention, which the KV cache needs)
    assert amounts.candidates == tuple(Unit(b, k) for b in (1, 2, 3) for k in ("attention", "mlp"))
    assert resolve(unit="block", drop=1).candidates == ()


def test_resolve_targets():
    amounts = resolve(target_params="90%")
    assert amounts.target_params == round(PARAMS * 0.9) and amounts.drop is None and amounts.removes
    assert resolve(target_params="50K").target_params == 50_000
    assert amounts.with_drop(2) == dataclasses.replace(amounts, drop=2, target_params=None)
    speedup = resolve(target_speedup=1.25)  # 4 / (4 - 1) = 1.33 >= 1.25
    assert speedup.target_speedup == 1.25 and speedup.drop == 1


@pytest.mark.parametrize("fields,message", [
    (dict(drop="abc"), "--drop must be a count like 4 or a share like 25%, got 'abc'"),
    (dict(drop=4), "--drop 4 asks for 4 of the model's 4 blocks: drop at most 2 (blocks [0, 3] are protected; "
                   "--protect none allows 3)"),
    (dict(drop="0"), "--drop 0 removes no block: ask for at least 1"),
    (dict(drop=3), "cannot drop 3 blocks: only 2 of 4 are not protected ([0, 3]); lower --drop or pass --protect "
                   "none"),
    (dict(drop=1, protect="9"), "--protect 9: the model has blocks 0..3"),
    (dict(drop=1, protect="a,b"), "--protect takes block indices like 0,-1 or 'none', got 'a,b'"),
    (dict(target_params="10B"), f"--target-params 10B is not below the model's {PARAMS:,} parameters"),
    (dict(target_params="many"), "--target-params must be a count like 110M, 1.2B or 110000000, or a share like "
                                 "85%; got 'many'"),
    (dict(target_speedup=9), "--target-speedup 9.0 needs all 4 blocks removed: ask for less"),
    (dict(target_speedup=2.5), "cannot drop 3 blocks: only 2 of 4 are not protected"),
    (dict(unit="attention", drop=7), "cannot remove 7 sub-layers: only 2 can go"),
    (dict(unit="attention", drop=8), "--drop 8 asks for 8 of the model's 8 blocks: drop at most 7"),
])
def test_bad_amounts_raise_the_one_line_errors_they_always_did(fields, message):
    with pytest.raises(LayercutError) as error:
        resolve(**fields)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_bad_units_are_refused_with_the_config():
    with pytest.raises(LayercutError, match=r"--unit takes block, attention, mlp or a comma list of them, got 'heads'"):
        PruneConfig(unit="heads", drop=1)
    assert PruneConfig(unit=" mlp , attention", drop=1, out="o").unit == "attention,mlp"


def test_a_run_parses_each_amount_once(tmp_path, sample_text, tiny_folder, monkeypatch, one_thread):
    from prune.pipeline.runner import run_prune

    calls = {"parse_drop": 0, "parse_protect": 0, "parse_units": 0}
    for name in calls:
        real = getattr(prune.pipeline.resolve, name)
        monkeypatch.setattr(prune.pipeline.resolve, name, lambda *a, _real=real, _name=name: calls.__setitem__(
            _name, calls[_name] + 1) or _real(*a))
    text = tmp_path / "text.txt"
    text.write_text(sample_text)
    config = PruneConfig(load={"model": str(tiny_folder)}, drop=1, select="span", score="angular",
                         data={"data": str(text), "samples": 16, "seq_len": 32, "heldout_samples": 0})
    config.out = None  # nothing written
    result = run_prune(config, loaded=config.load.load())
    assert calls == {"parse_drop": 1, "parse_protect": 1, "parse_units": 1}
    assert len(result.dropped) == 1 and result.report["protect"] == [0, 3] and result.report["num_blocks_before"] == 4
    assert sorted(s["blocks"] for s in result.report["span_scores"]) == [[1, 1], [2, 2]]
