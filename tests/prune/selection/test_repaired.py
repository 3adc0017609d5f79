"""Repaired selections: each candidate set measured as the run will ship it, removed and repaired by its method."""

import copy
import json
import math

import pytest
import torch

from prune.errors import LayercutError
from prune.measure.heldout import packed_perplexity
from prune.measure.moments import StateMoments
from prune.measure.perplexity import LOGPROB_POSITIONS
from prune.measure.scores import get_score
from prune.model.surgery import drop_blocks_
from prune.replace import ReplaceConfig, replace_blocks_
from prune.selection.map_errors import map_errors
from prune.selection.repaired import (
    RepairedCosts,
    _all_close,
    _log_probs,
    _nll_and_kl,
    crossfit_halves,
    split_rows,
    update_share,
)
from prune.selection.repaired_order import greedy_order
from prune.selection.strategies import SelectionInput, choose_blocks, select_blocks
from tests.helpers import make_tiny_model

IDS = torch.randint(3, 320, (16, 32), generator=torch.Generator().manual_seed(0))


def shipped_perplexity(model, blocks, method, **options):
    """What the measured cost must equal: a copy of the model repaired for good, on the measuring rows."""
    fit_ids, measure_ids = split_rows(IDS)
    shipped = copy.deepcopy(model)
    if method == "none":
        drop_blocks_(shipped, blocks)
    else:
        replace_blocks_(shipped, blocks, fit_ids, ReplaceConfig(method=method, progress=False, **options))
    return packed_perplexity(shipped, measure_ids, progress=False)


def _forward_rows(patch, model) -> list[int]:
    """Patch ``model.forward`` to note each call's rows (its batch size); the list fills as the model runs."""
    forward, rows = model.forward, []
    patch.setattr(model, "forward", lambda *a, **k: rows.append(k["input_ids"].shape[0]) or forward(*a, **k))
    return rows


def test_split_rows_measures_every_eighth_row_and_fits_on_the_others():
    fit, measure = split_rows(torch.arange(16)[:, None])
    assert measure[:, 0].tolist() == [7, 15]
    assert fit.shape[0] == 14 and not set(fit[:, 0].tolist()) & {7, 15}
    with pytest.raises(LayercutError, match="--samples 2"):
        split_rows(torch.zeros(1, 8, dtype=torch.long))


@pytest.mark.parametrize("method,options", [("linear", {}), ("none", {}), ("fold", {}), ("fold-rotate", {})])
def test_each_cost_is_the_perplexity_of_the_model_as_it_will_be_shipped(one_thread, method, options):
    model = make_tiny_model("llama", seed=1)
    costs = RepairedCosts(model, IDS, ReplaceConfig(method=method, progress=False, **options))
    measured = costs.measure([], [1, 2, 3])
    for block in (1, 2, 3):
        assert measured[block]["ppl"] == pytest.approx(shipped_perplexity(model, [block], method), rel=1e-4)
    # on top of a chosen block: a neighbour grows its span (one map for both), a far block gets its own
    grown = costs.measure([1], [0, 2, 3])
    assert grown[2]["ppl"] == pytest.approx(shipped_perplexity(model, [1, 2], method), rel=1e-4)
    assert grown[3]["ppl"] == pytest.approx(shipped_perplexity(model, [1, 3], method), rel=1e-4)
    assert model.config.num_hidden_layers == 4  # every view restored


def test_crossfit_halves_measure_every_row_once_and_never_on_its_own_fit():
    rows = torch.arange(6)[:, None]
    (fit_a, measure_a), (fit_b, measure_b) = crossfit_halves(rows)
    assert measure_a[:, 0].tolist() == [1, 3, 5] and measure_b[:, 0].tolist() == [0, 2, 4]
    assert fit_a.equal(measure_b) and fit_b.equal(measure_a)
    with pytest.raises(LayercutError, match="--samples 2"):
        crossfit_halves(torch.zeros(1, 8, dtype=torch.long))


@pytest.mark.parametrize("method", ["linear", "fold-rotate"])
def test_a_crossfit_cost_pools_both_halves_each_measured_by_the_other_halfs_repair(one_thread, method):
    model = make_tiny_model("llama", seed=1)
    costs = RepairedCosts(model, IDS, ReplaceConfig(method=method, progress=False), rows="crossfit")
    measured = costs.measure([], [1, 2])
    assert costs.measure_ids.shape[0] == IDS.shape[0]  # every row measures, against 2 of 16 for one in eight

    def shipped(blocks, fit_ids, measure_ids):
        copy_ = copy.deepcopy(model)
        replace_blocks_(copy_, blocks, fit_ids, ReplaceConfig(method=method, progress=False))
        return packed_perplexity(copy_, measure_ids, progress=False)

    for block in (1, 2):
        halves = [shipped([block], fit, measure) for fit, measure in crossfit_halves(IDS)]
        # equal halves (8 rows of 32 tokens each): the pooled perplexity is the halves' geometric mean
        assert measured[block]["ppl"] == pytest.approx(math.sqrt(halves[0] * halves[1]), rel=1e-4)
        # not the one-in-eight cost under another name: the rows differ, so do the numbers
        assert measured[block]["ppl"] != pytest.approx(RepairedCosts(model, IDS, ReplaceConfig(
            method=method, progress=False)).measure([], [block])[block]["ppl"], rel=1e-3)
    grown = costs.measure([1], [2])[2]  # a greedy step on top of a chosen block, with the shortcut
    halves = [shipped([1, 2], fit, measure) for fit, measure in crossfit_halves(IDS)]
    assert grown["ppl"] == pytest.approx(math.sqrt(halves[0] * halves[1]), rel=1e-4)


def test_crossfit_and_one_in_eight_keep_apart_in_a_shared_memo(one_thread):
    model = make_tiny_model("llama", seed=2)
    memo = {}
    config = ReplaceConfig(method="linear", progress=False)
    eighth = RepairedCosts(model, IDS, config, memo=memo).measure([], [1])[1]
    crossfit = RepairedCosts(model, IDS, config, memo=memo, rows="crossfit").measure([], [1])[1]
    assert eighth != crossfit
    assert RepairedCosts(model, IDS, config, memo=memo, rows="crossfit").measure([], [1])[1] == crossfit  # read back
    with pytest.raises(ValueError, match="crossfit"):
        RepairedCosts(model, IDS, config, rows="halves")


@pytest.mark.parametrize("method", ["linear", "fold-rotate"])
def test_the_shortcut_runs_the_same_numbers_as_whole_passes(one_thread, method):
    """fold-rotate included: its change of basis reaches the embedding, its hosted view starts at the cut."""
    model = make_tiny_model("llama", seed=3)
    config = ReplaceConfig(method=method, progress=False)
    shortcut = RepairedCosts(model, IDS, config)
    with pytest.MonkeyPatch.context() as patch:
        heads = _forward_rows(patch, model)
        fast = shortcut.measure([2], [0, 1, 3])
    assert shortcut._checked and not shortcut._plain  # the check against a whole pass ran and held
    # in float32 it read one row, not the batch (fold-rotate also finds each block's stream readers on one row)
    assert heads.count(1) == (2 if method == "fold-rotate" else 1)
    whole = RepairedCosts(model, IDS, config)
    whole._plain = True
    slow = whole.measure([2], [0, 1, 3])
    for block in (0, 1, 3):
        assert fast[block]["ppl"] == pytest.approx(slow[block]["ppl"], rel=1e-5)
        assert fast[block]["kl"] == pytest.approx(slow[block]["kl"], rel=1e-4, abs=1e-7)


def test_a_shortcut_that_differs_from_the_whole_pass_is_caught_on_one_row_and_whole_passes_measure(
        one_thread, monkeypatch, caplog):
    import prune.selection.repaired as repaired

    model = make_tiny_model("llama", seed=3)
    config = ReplaceConfig(method="linear", progress=False)
    whole = RepairedCosts(model, IDS, config)
    whole._plain = True
    expected = whole.measure([2], [0, 1, 3])
    real = repaired.logits_from
    # a block that reads more than its hidden state: starting part-way gives other logits
    monkeypatch.setattr(repaired, "logits_from", lambda *a, **k: real(*a, **k) + 0.5)
    broken = RepairedCosts(model, IDS, config)
    heads = _forward_rows(monkeypatch, model)
    with caplog.at_level("WARNING"):
        got = broken.measure([2], [0, 1, 3])
    assert broken._plain and "differs from the whole pass" in caplog.text
    assert 1 in heads  # the check read the batch's first row alone
    for block in (0, 1, 3):
        assert got[block]["ppl"] == pytest.approx(expected[block]["ppl"], rel=1e-5)
        assert got[block]["kl"] == pytest.approx(expected[block]["kl"], rel=1e-4, abs=1e-7)


def test_in_bfloat16_the_shortcut_is_checked_on_the_whole_batch_and_holds(one_thread, monkeypatch):
    """A row alone rounds its products otherwise than the batch: in 16 bits above the check's 1e-3."""
    model = make_tiny_model("llama", seed=3).to(torch.bfloat16)
    costs = RepairedCosts(model, IDS, ReplaceConfig(method="linear", progress=False))
    heads = _forward_rows(monkeypatch, model)
    costs.measure([2], [0, 1, 3])
    assert costs._checked and not costs._plain
    assert 1 not in heads and len(set(heads)) == 1  # every forward, the check's included, ran a whole batch


def test_in_bfloat16_the_shortcut_with_the_head_apart_is_checked_and_holds(one_thread):
    model = make_tiny_model("llama", seed=3).to(torch.bfloat16)
    costs = RepairedCosts(model, IDS, ReplaceConfig(method="linear", progress=False))
    costs.measure([2], [0, 1, 3])
    assert costs._apart == {"logits_to_keep": 1} and costs._checked and not costs._plain


def test_kl_is_the_divergence_from_the_original_models_next_token_distribution(one_thread):
    model = make_tiny_model("llama", seed=1)
    _, measure_ids = split_rows(IDS)
    shipped = copy.deepcopy(model)
    drop_blocks_(shipped, [2])
    with torch.no_grad():
        p = torch.log_softmax(model(measure_ids).logits[:, :-1].float(), -1)
        q = torch.log_softmax(shipped(measure_ids).logits[:, :-1].float(), -1)
    expected = float((p.exp() * (p - q)).sum(-1).mean())
    measured = RepairedCosts(model, IDS, ReplaceConfig(method="none")).measure([], [2])[2]
    assert measured["kl"] == pytest.approx(expected, rel=1e-4)
    assert measured["kl"] > 1e-4


def test_the_empty_set_is_the_original_measured_from_its_own_pass_without_another(one_thread, monkeypatch):
    model = make_tiny_model("llama", seed=1)
    _, measure_ids = split_rows(IDS)
    costs = RepairedCosts(model, IDS, ReplaceConfig(method="none"))
    rows = _forward_rows(monkeypatch, model)
    measured = costs.measure_sets([(), (2,)])
    calls = list(rows)
    assert measured[0] == {"ppl": pytest.approx(packed_perplexity(model, measure_ids, progress=False), rel=1e-6),
                           "kl": 0.0}
    assert measured[1]["kl"] > 1e-4
    # the two measuring rows: the original's pass, the states the set starts from, the set's pass from its block
    # and the one-row check of that shortcut; none for the empty set
    assert calls == [2, 2, 2, 1]


def test_greedy_takes_the_cheapest_repaired_set_and_a_larger_drop_continues_a_smaller_one(one_thread):
    model = make_tiny_model("llama", seed=1)
    memo = {}
    costs = RepairedCosts(model, IDS, ReplaceConfig(method="linear", progress=False), memo=memo)
    first = costs.measure([], [0, 1, 2, 3])
    order, steps = greedy_order(costs, 1, [], "ppl", memo)
    assert order == [min(first, key=lambda b: first[b]["ppl"])]
    measured = len(costs.costs)
    order3, steps3 = greedy_order(costs, 3, [], "ppl", memo)
    assert order3[0] == order[0] and len(set(order3)) == 3
    assert len(costs.costs) == measured + 3 + 2  # steps 2 and 3 only: step 1 read back
    second = steps3[1]
    assert second["chosen"] == order[:1]
    assert str(order3[1]) == min(second["costs"], key=lambda b: second["costs"][b]["ppl"])
    assert set(second["costs"]) == {str(b) for b in range(4)} - {str(order[0])}


def selection_input(model, count, protected=(), replace="linear", memo=None):
    values = [0.0] * model.config.num_hidden_layers
    return SelectionInput(get_score("linearity"), StateMoments(len(values) + 1, []), values, count, list(protected),
                          model, IDS, replace=ReplaceConfig(method=replace, progress=False), memo=memo)


def test_repaired_greedy_and_kl_and_once_respect_protection_and_record_their_steps(one_thread):
    model = make_tiny_model("llama", seed=4)
    memo = {}
    chosen = choose_blocks("repaired-greedy", selection_input(model, 2, [0, 3], memo=memo))
    assert chosen.blocks == [1, 2]
    steps = json.loads(json.dumps(chosen.trace))  # layercut.json carries it, a typed return (not the memo)
    assert "selection-steps" not in memo
    assert steps["selection"] == "repaired-greedy" and steps["repair"] == "linear"
    first, second = steps["steps"]
    assert set(first["costs"]) == {"1", "2"} and set(second["costs"]) == {str(second["drop"])}
    assert first["drop"] == int(min(first["costs"], key=lambda b: first["costs"][b]["ppl"]))
    once = select_blocks("repaired-once", selection_input(model, 1, [0]))
    kl = select_blocks("repaired-greedy-kl", selection_input(model, 1, [0]))
    assert once[0] in (1, 2, 3) and kl[0] in (1, 2, 3)


@pytest.mark.parametrize("name,criterion", [("repaired-greedy-crossfit", "ppl"), ("repaired-greedy-kl-crossfit", "kl")])
def test_a_crossfit_selection_takes_the_cheapest_set_on_every_row(one_thread, name, criterion):
    model = make_tiny_model("llama", seed=4)
    chosen = choose_blocks(name, selection_input(model, 2, [0], replace="fold-rotate"))
    trace = chosen.trace
    assert trace["selection"] == name and trace["criterion"] == criterion and trace["repair"] == "fold-rotate"
    first = trace["steps"][0]
    assert first["drop"] == int(min(first["costs"], key=lambda b: first["costs"][b][criterion]))
    # the costs it ranked are the cross-fitted ones
    costs = RepairedCosts(model, IDS, ReplaceConfig(method="fold-rotate", progress=False), rows="crossfit")
    assert first["costs"]["1"][criterion] == pytest.approx(costs.measure([], [1])[1][criterion], rel=1e-6)


def test_local_is_measured_through_the_map_it_trains_towards_and_its_refusals_still_hold(one_thread):
    model = make_tiny_model("llama", seed=4)
    local = RepairedCosts(model, IDS, ReplaceConfig(method="local", progress=False))
    # the map local's block is trained to give: linear at local's share of the update, on whole sequences
    teacher = RepairedCosts(model, IDS, ReplaceConfig(method="linear", update_scale=0.7, short=0, progress=False))
    measured, expected = local.measure([], [1, 2, 3]), teacher.measure([], [1, 2, 3])
    for block in (1, 2, 3):
        assert measured[block]["ppl"] == pytest.approx(expected[block]["ppl"], rel=1e-6)
        assert measured[block]["ppl"] == pytest.approx(shipped_perplexity(model, [block], "linear", update_scale=0.7,
                                                                          short=0), rel=1e-4)
    # local's own share of the update is the map's share
    half = RepairedCosts(model, IDS, ReplaceConfig(method="local", update_scale=0.5, progress=False))
    assert half.measure([], [1])[1]["ppl"] == pytest.approx(
        shipped_perplexity(model, [1], "linear", update_scale=0.5, short=0), rel=1e-4)
    assert half.measure([], [1])[1]["ppl"] != pytest.approx(measured[1]["ppl"], rel=1e-4)
    # local retrains the block before the span, so a span from block 0 stays refused, as local itself refuses it
    assert math.isinf(local.measure([], [0])[0]["ppl"]) and not math.isinf(teacher.measure([], [0])[0]["ppl"])
    chosen = choose_blocks("repaired-greedy-kl", selection_input(model, 2, [3], replace="local"))
    assert 0 not in chosen.blocks
    assert chosen.trace["repair"] == "local" and chosen.trace["measured_as"] == "linear"


def test_a_block_that_is_linear_has_no_map_error_and_repaired_fast_takes_it(one_thread):
    model = make_tiny_model("llama", seed=5)
    block = model.model.layers[2]
    with torch.no_grad():  # no update from block 2: its output is its input, exactly linear
        block.self_attn.o_proj.weight.zero_()
        block.mlp.down_proj.weight.zero_()
    errors = map_errors(model, IDS)
    assert errors[2] < 1e-8 < min(errors[b] for b in (0, 1, 3))
    assert select_blocks("repaired-fast", selection_input(model, 1, [0, 3])) == [2]


def test_the_map_error_applies_the_share_of_a_least_squares_method_and_the_whole_update_otherwise():
    assert update_share(ReplaceConfig(method="fold", update_scale=0.5)) == 0.5
    assert update_share(ReplaceConfig(method="linear")) == 0.7  # linear's default share
    assert update_share(ReplaceConfig(method="lowrank")) == update_share(None) == 1.0  # no share to apply


def test_a_set_the_method_cannot_replace_costs_inf_and_greedy_fails_in_one_line(one_thread):
    model = make_tiny_model("llama", seed=1)
    # LLM-Streamline's block stands for two blocks at least: a lone block cannot be its span
    costs = RepairedCosts(model, IDS, ReplaceConfig(method="block", progress=False, steps=0))
    assert all(math.isinf(c["ppl"]) for c in costs.measure([], [1, 2]).values())
    with pytest.raises(LayercutError, match="can replace none of the sets"):
        greedy_order(costs, 2, [0, 3], "ppl")


def test_prune_run_selects_for_the_repair_and_reports_each_step(tiny_folder, tmp_path, capsys):
    from tests.helpers import run_prune_cli

    out = tmp_path / "slim"
    code, _, err = run_prune_cli(capsys, "--model", tiny_folder, "--samples", "16", "--seq-len", "32", "--drop", "2",
                                 "--protect", "none", "--select", "repaired-greedy", "--replace", "linear",
                                 "--out", out)
    assert code == 0, err
    report = json.loads((out / "layercut.json").read_text())
    selection = report["selection"]
    assert selection["selection"] == "repaired-greedy" and selection["repair"] == "linear"
    assert {step["drop"] for step in selection["steps"]} == set(report["dropped"])
    assert len(selection["steps"][0]["costs"]) == 4 and len(selection["steps"][1]["costs"]) == 3
    chosen = selection["steps"][0]
    assert chosen["drop"] == int(min(chosen["costs"], key=lambda b: chosen["costs"][b]["ppl"]))


def _count_passes(model, monkeypatch) -> list[int]:
    """A list that grows by one at each call of the model's base (a capture or statistics pass)."""
    calls: list[int] = []
    base = model.base_model
    real = base.forward
    monkeypatch.setattr(base, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_several_repairs_fitted_together_read_the_rows_once_and_fit_what_each_alone_fits(one_thread, monkeypatch):
    from prune.selection.repaired import fit_together

    model = make_tiny_model("llama", seed=3)
    sets = [[1, 2], [2], [1]]
    alone = {}
    for method in ("fold", "fold-rotate", "cosine"):
        costs = RepairedCosts(model, IDS, ReplaceConfig(method=method, progress=False), batch_size=4)
        costs.fit_sets(sets)
        alone[method] = costs
    together = {m: RepairedCosts(model, IDS, ReplaceConfig(method=m, progress=False), batch_size=4) for m in alone}
    calls = _count_passes(model, monkeypatch)
    fit_together([(costs, sets) for costs in together.values()])
    assert len(calls) == -(-split_rows(IDS)[0].shape[0] // 4)  # one pass over the fitting rows, in batches of 4
    for method, costs in together.items():
        assert sorted(costs.fits) == sorted(alone[method].fits) == [(1,), (1, 2), (2,)]
        for span, fitted in costs.fits.items():
            before = alone[method].fits[span]
            assert fitted.method == method and fitted.record.get("scale") == before.record.get("scale")
            with costs.view(list(span)):
                mine = [p.detach().clone() for p in model.parameters()]
            with alone[method].view(list(span)):
                theirs = [p.detach().clone() for p in model.parameters()]
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)), (method, span)
        # fold-rotate's hosted form is hooks, not weights: the measured costs tell its fits apart
        assert costs.measure_sets(sets) == alone[method].measure_sets(sets), method


def test_fitting_together_shows_a_bar_for_its_pass_only_when_asked(one_thread, capsys):
    from prune.selection.repaired import fit_together

    model = make_tiny_model("llama", seed=3)
    for progress in (False, True):
        costs = [RepairedCosts(model, IDS, ReplaceConfig(method=m, progress=False), batch_size=4)
                 for m in ("fold", "cosine")]
        fit_together([(c, [[1, 2]]) for c in costs], progress=progress)
        bars = capsys.readouterr().err
        batches = -(-split_rows(IDS)[0].shape[0] // 4)
        assert (f"{batches}/{batches}" in bars) is progress, bars  # ship's shortlist: minutes at 1B scale
        assert ("fit fold, cosine" in bars) is progress, bars  # the one pass feeds both methods' fits


def test_repaired_fast_prepared_for_several_shares_reads_the_rows_once_and_ranks_as_alone(one_thread, monkeypatch):
    from prune.selection.strategies import SELECTIONS

    model = make_tiny_model("llama", seed=5)
    shares = {0.7: map_errors(model, IDS, 0.7), 1.0: map_errors(model, IDS, 1.0)}
    memo: dict = {}
    calls = _count_passes(model, monkeypatch)
    replaces = [ReplaceConfig(method=m) for m in ("fold", "fold-rotate", "cosine")]
    SELECTIONS.get("repaired-fast").prepare(memo, model, IDS, replaces, 4)
    fit, measure = split_rows(IDS)
    assert len(calls) == -(-fit.shape[0] // 4) + -(-measure.shape[0] // 4)  # the two row sets, once
    assert memo == {("map_errors", share): errors for share, errors in shares.items()}
    assert shares[0.7] != shares[1.0]


def test_a_scoring_pass_that_keeps_the_measuring_rows_apart_spares_repaired_fast_its_passes(one_thread,
                                                                                            monkeypatch):
    from prune.measure.moments import stream_moments
    from prune.selection.repaired import measuring_rows
    from prune.selection.strategies import SELECTIONS

    model = make_tiny_model("llama", seed=5)
    apart = stream_moments(model, IDS, batch_size=4, cosine_pairs="all", progress=False,
                           held_rows=measuring_rows(IDS))
    plain = stream_moments(model, IDS, batch_size=4, cosine_pairs="all", progress=False)
    # the whole pass's own statistics are untouched by what it keeps beside them
    assert all(torch.equal(a, b) for a, b in zip(apart.grams, plain.grams, strict=True))
    assert torch.equal(apart.cos_sum, plain.cos_sum)
    fit, measure = split_rows(IDS)
    assert apart.held.moments.n == measure.numel() and apart.minus(apart.held.moments).n == fit.numel()
    passes = {share: map_errors(model, IDS, share) for share in (0.7, 1.0)}
    memo: dict = {}
    calls = _count_passes(model, monkeypatch)
    SELECTIONS.get("repaired-fast").prepare(memo, model, IDS, [ReplaceConfig(method=m) for m in ("fold", "cosine")],
                                            4, apart)
    assert not calls  # no pass of its own
    for share, errors in passes.items():
        # the same sums, grouped into other float32 batch products
        torch.testing.assert_close(torch.tensor(memo[("map_errors", share)]), torch.tensor(errors), rtol=1e-5,
                                   atol=1e-7)
        assert sorted(range(len(errors)), key=errors.__getitem__) == sorted(
            range(len(errors)), key=memo[("map_errors", share)].__getitem__)
    # statistics of other tokens, or a pass that kept nothing apart, are never read as these rows'
    for other, moments in ((IDS.flip(0), apart), (IDS, plain)):
        calls.clear()
        map_errors(model, other, 1.0, moments=moments)
        assert len(calls) == -(-fit.shape[0] // 4) + -(-measure.shape[0] // 4)


def test_repairs_sharing_the_original_s_passes_measure_what_each_measures_alone(one_thread, monkeypatch):
    from prune.selection.repaired import fit_together, shared_references

    model = make_tiny_model("llama", seed=4)
    sets = [[1, 2], [2], [1]]
    methods = ("fold", "cosine", "none")
    alone = {m: RepairedCosts(model, IDS, ReplaceConfig(method=m, progress=False), batch_size=4).measure_sets(sets)
             for m in methods}
    memo: dict = {}
    with shared_references(memo):
        costs = {m: RepairedCosts(model, IDS, ReplaceConfig(method=m, progress=False), batch_size=4, memo=memo)
                 for m in methods}
        fit_together([(c, sets) for c in costs.values()])
        heads = _forward_rows(monkeypatch, model)
        shared = {m: c.measure_sets(sets) for m, c in costs.items()}
    assert shared == alone  # the same numbers, to the last bit
    measuring_batches = -(-split_rows(IDS)[1].shape[0] // 4)
    # the original's logits once per batch, not once per repair; then a pass per set from its cut, and each repair's
    # one check that such a pass gives the whole pass's logits
    assert len(heads) == measuring_batches + len(methods) * (measuring_batches * len(sets) + 1)
    assert "repaired-references" not in memo  # dropped at the end of the with


def test_a_copy_of_the_model_ships_its_own_fit_not_the_memos_of_another_copy(one_thread):
    from prune.selection.repaired import replace_as_measured_

    model = make_tiny_model("llama", seed=3)
    pristine = copy.deepcopy(model)
    memo: dict = {}
    config = ReplaceConfig(method="fold", fit_rows="fitting", progress=False)
    RepairedCosts(model, IDS, config, batch_size=4, memo=memo).fit_sets([[1, 2]])  # a first cell's selection
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    # another cell: a copy of the model, the same memo (eval.compare); and a run with no memo at all
    cell, alone = copy.deepcopy(pristine), copy.deepcopy(pristine)
    replace_as_measured_(cell, [1, 2], IDS, config, memo)
    replace_as_measured_(alone, [1, 2], IDS, config)
    # the fold's patch is the copy's own: the first model is untouched, the copy computes what a fresh fit does
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    with torch.no_grad():
        assert torch.equal(cell(input_ids=IDS[:2]).logits, alone(input_ids=IDS[:2]).logits)
    # the model that fitted them reuses them as they are (prune.ship's build)
    assert RepairedCosts(model, IDS, config, batch_size=4, memo=memo).owns_fits
    # a copy's selection measures its views with its own fits (the first model fitted these spans, unmeasured)
    RepairedCosts(model, IDS, config, batch_size=4, memo=memo).fit_sets([[0, 1]])
    other = RepairedCosts(copy.deepcopy(pristine), IDS, config, batch_size=4, memo=memo)
    assert not other.owns_fits and other.measure_sets([[0, 1]]) == RepairedCosts(
        copy.deepcopy(pristine), IDS, config, batch_size=4).measure_sets([[0, 1]])


def test_a_build_from_a_repaired_selection_s_fits_records_the_short_cut_that_fed_them(one_thread):
    # before 2026-12-03 the selection's fits carried no fit_short: a --fit-rows fitting build wrote none into
    # layercut.json though linear's default short cut (64 tokens) had fed its fit, as an ordinary build records
    from prune.model.surgery import RECORDS_ATTR
    from prune.selection.repaired import fit_together, replace_as_measured_

    ids = torch.randint(3, 320, (16, 128), generator=torch.Generator().manual_seed(1))  # longer than the cut
    config = ReplaceConfig(method="linear", fit_rows="fitting", progress=False)
    ordinary = make_tiny_model("llama", seed=3)
    assert [r["fit_short"] for r in replace_blocks_(ordinary, [1, 2], split_rows(ids)[0], config)] == [64]
    # the fits the selection keeps in its memo (fit_together: prune.ship's build), and those the build fits itself
    shortlisted, fresh, memo = make_tiny_model("llama", seed=3), make_tiny_model("llama", seed=3), {}
    fit_together([(RepairedCosts(shortlisted, ids, config, batch_size=4, memo=memo), [[1, 2]])])
    for model, from_memo in ((shortlisted, memo), (fresh, None)):
        records = replace_as_measured_(model, [1, 2], ids, config, from_memo)
        assert [r["fit_short"] for r in records] == [64]
        assert [r["fit_short"] for r in getattr(model.config, RECORDS_ATTR)] == [64]  # what layercut.json holds
    # a fit no short cut fed records none, as in an ordinary build
    fold = ReplaceConfig(method="fold", fit_rows="fitting", progress=False)
    assert all("fit_short" not in r for r in replace_as_measured_(make_tiny_model("llama", seed=3), [1, 2], ids, fold))


def test_log_probabilities_written_a_chunk_at_a_time_are_those_of_one_log_softmax():
    logits = torch.randn(2, 2 * LOGPROB_POSITIONS + 7, 50, generator=torch.Generator().manual_seed(1)) * 4
    expected = torch.log_softmax(logits[:, :-1], -1)
    assert torch.equal(_log_probs(logits.clone()), expected)
    # a half-precision model's logits are turned into float32 first, as one log_softmax of them would be
    assert torch.equal(_log_probs(logits.bfloat16()), torch.log_softmax(logits.bfloat16()[:, :-1].float(), -1))


def test_nll_and_kl_by_rows_chunks_are_those_of_whole_batches():
    generator = torch.Generator().manual_seed(3)
    # both sliced as the measuring passes slice them (their rows not contiguous)
    dense = torch.log_softmax(torch.randn(3, 2 * LOGPROB_POSITIONS + 8, 50, generator=generator) * 2, -1)[:, :-1]
    logits = (torch.randn(3, 2 * LOGPROB_POSITIONS + 8, 50, generator=generator) * 2)[:, :-1]
    kept = dense.clone(), logits.clone()
    targets = torch.randint(0, 50, dense.shape[:2], generator=generator)
    logp = torch.log_softmax(logits, -1)
    nll = -float(logp.gather(-1, targets[..., None]).double().sum())
    kl = float((dense.exp() * (dense - logp)).sum(-1).double().sum())
    assert kl > 10
    got = _nll_and_kl(logits, dense, targets)
    assert abs(got[0] - nll) < 1e-9 * abs(nll) and abs(got[1] - kl) < 1e-9 * kl
    # the logits and the original's log-probabilities are left as they were
    assert torch.equal(dense, kept[0]) and torch.equal(logits, kept[1])
    # 16-bit logits: each chunk turned into float32 first, as one log_softmax of them would be
    half = logits.bfloat16()
    logq = torch.log_softmax(half.float(), -1)
    expected = float((dense.exp() * (dense - logq)).sum(-1).double().sum())
    assert abs(_nll_and_kl(half, dense, targets)[1] - expected) < 1e-9 * expected
    assert abs(_nll_and_kl(dense, dense, targets)[1]) < 1e-5  # a model against itself


def test_logits_compared_a_chunk_at_a_time_agree_with_allclose():
    a = torch.randn(2, 2 * LOGPROB_POSITIONS + 7, 50, generator=torch.Generator().manual_seed(2))
    b = a + 5e-4
    assert _all_close(a, b) and torch.allclose(a, b, rtol=1e-3, atol=1e-3)
    b[1, 2 * LOGPROB_POSITIONS + 3, 10] += 0.1  # one value off, in the last chunk
    assert not _all_close(a, b) and not torch.allclose(a, b, rtol=1e-3, atol=1e-3)


def _head_positions(model) -> list[int]:
    """Note the positions the LM head's forward runs on, call by call."""
    from prune.model.adapters import lm_head

    seen = []
    lm_head(model).register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[1]))
    return seen


@pytest.mark.parametrize("method", ["none", "linear"])
def test_candidates_logits_are_made_a_rows_chunk_at_a_time_and_measure_what_whole_logits_measure(
        one_thread, monkeypatch, method):
    import prune.selection.repaired as repaired

    model = make_tiny_model("llama", seed=3)
    config = ReplaceConfig(method=method, progress=False)
    apart = RepairedCosts(model, IDS, config)
    positions = _head_positions(model)
    fast = apart.measure([], [0, 1, 3])
    assert apart._apart == {"logits_to_keep": 1}
    # the original's pass makes its whole logits (its log-probabilities are kept for every candidate); each
    # candidate's forward runs the head on its last position alone
    assert positions.count(IDS.shape[1]) == 1 and positions.count(1) >= 3
    monkeypatch.setattr(repaired, "head_apart", lambda _model: None)  # the whole logits, as before
    whole = RepairedCosts(model, IDS, config)
    positions.clear()
    slow = whole.measure([], [0, 1, 3])
    assert 1 not in positions
    for block in (0, 1, 3):
        assert fast[block]["ppl"] == pytest.approx(slow[block]["ppl"], rel=1e-6)
        assert fast[block]["kl"] == pytest.approx(slow[block]["kl"], rel=1e-5, abs=1e-8)


def test_divergence_leaves_the_models_head_apart_and_measures_the_same(one_thread, monkeypatch):
    import prune.selection.repaired as repaired

    original = make_tiny_model("llama", seed=3)
    model = copy.deepcopy(original)
    drop_blocks_(model, [1])
    positions = _head_positions(model)
    fast = repaired.divergence(model, original, IDS)
    assert set(positions) == {1}  # the model's head ran on last positions alone (the check's included)
    monkeypatch.setattr(repaired, "head_apart", lambda _model: None)
    slow = repaired.divergence(model, original, IDS)
    assert fast["ppl"] == pytest.approx(slow["ppl"], rel=1e-6) and fast["kl"] > 1e-4
    assert fast["kl"] == pytest.approx(slow["kl"], rel=1e-5)
