"""Block-by-block calibration (``--offload sequential``): the same statistics, scores, maps and checkpoints
as the in-memory path, with one block's weights in memory at a time."""

from __future__ import annotations

import json

import pytest
import torch

from prune.checkpoint.load_config import LoadConfig
from prune.checkpoint.save_load import load
from prune.data.calibration import DataConfig
from prune.errors import LayercutError
from prune.loading.offload import load_offloaded
from prune.measure.blockwise import stream_moments_blockwise
from prune.measure.moments import stream_moments
from prune.measure.scores import SCORES, block_scores
from prune.model.adapters import OFFLOAD_ATTR, get_blocks, is_offloaded
from prune.pipeline.config import PruneConfig
from prune.pipeline.runner import run_prune
from tests.helpers import TINY_TYPES, make_tiny_model, make_tiny_tokenizer, run_prune_cli

IDS = torch.arange(6 * 24).reshape(6, 24) % 290 + 3


def _saved(model_type: str, folder):
    model = make_tiny_model(model_type)
    model.save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return model


@pytest.mark.parametrize("model_type", sorted(TINY_TYPES))
def test_block_by_block_statistics_equal_the_in_memory_pass(model_type, one_thread):
    model = make_tiny_model(model_type)
    whole = stream_moments(model, IDS, batch_size=4, progress=False)
    layered = stream_moments_blockwise(model, IDS, batch_size=4, progress=False)
    assert layered.n == whole.n == IDS.numel()
    for i in range(whole.num_states):
        assert torch.equal(layered.grams[i], whole.grams[i])
    for pair, cross in whole.cross.items():
        assert torch.equal(layered.cross[pair], cross)
    assert torch.equal(layered.cos_sum, whole.cos_sum)
    assert torch.equal(layered.last_angle_sum, whole.last_angle_sum)


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "opt", "gpt2"])
def test_a_skeleton_scores_as_the_loaded_model(model_type, tmp_path, one_thread):
    model = _saved(model_type, tmp_path)
    skeleton = load_offloaded(str(tmp_path), dtype="float32").model
    assert is_offloaded(skeleton)
    assert all(p.is_meta for p in get_blocks(skeleton)[1].parameters())
    whole = block_scores(stream_moments(model, IDS, batch_size=4, progress=False))
    early = stream_moments_blockwise(skeleton, IDS, batch_size=4, progress=False, scores=list(SCORES))
    assert block_scores(early) == whole
    # each state's statistics were freed once its block was scored; the blocks went back to the meta device
    assert all(gram is None for gram in early.grams[:-1]) and not early.cross
    assert all(p.is_meta for p in get_blocks(skeleton)[1].parameters())


REPAIRS_OFFLOADED = ("fold", "fold-rotate", "magcomp", "cosine", "local", "lowrank", "linearpatch")


@pytest.fixture(scope="module")
def removal(tmp_path_factory, tiny_folder, sample_text) -> tuple[list[int], torch.Tensor]:
    """The in-memory run that removes 2 blocks and repairs nothing: its blocks and its checkpoint's logits on IDS.

    Every repair below is set against it; it is the same run for each, so it runs once.
    """
    folder = tmp_path_factory.mktemp("removal")
    text = folder / "calibration.txt"
    text.write_text(sample_text, encoding="utf-8")
    data = DataConfig(data=str(text), samples=8, seq_len=32, heldout_samples=0)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests that compare with it (one_thread)
    try:
        result = run_prune(PruneConfig(load=LoadConfig(model=str(tiny_folder)), data=data, drop=2, protect="0,-1",
                                       out=str(folder / "removal")))
        return result.dropped, load(str(folder / "removal")).model(IDS[:2]).logits
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("method", ["none", "linear", *REPAIRS_OFFLOADED])
def test_in_memory_and_skeleton_runs_export_the_same_checkpoint(tmp_path, tiny_folder, sample_text, one_thread,
                                                                 removal, method):
    text = tmp_path / "calibration.txt"
    text.write_text(sample_text, encoding="utf-8")
    data = DataConfig(data=str(text), samples=8, seq_len=32, heldout_samples=0)
    found = {}
    for offload in ("none", "sequential"):
        out = tmp_path / offload
        result = run_prune(PruneConfig(load=LoadConfig(model=str(tiny_folder), offload=offload), data=data,
                                       drop=2, protect="0,-1", replace={"method": method}, out=str(out)))
        found[offload] = (result.dropped, result.scores, load(str(out)).model(IDS[:2]).logits)
    assert found["none"][:2] == found["sequential"][:2]
    torch.testing.assert_close(found["sequential"][2], found["none"][2], rtol=0, atol=1e-5)
    removed, removal_logits = removal
    if method == "none":  # the same run as the shared removal: the same blocks, the same checkpoint
        assert removed == found["none"][0]
        torch.testing.assert_close(found["none"][2], removal_logits, rtol=0, atol=1e-5)
    else:  # the repair changed the checkpoint: the comparison is not one of two removals
        assert removed == found["none"][0]
        assert (removal_logits - found["none"][2]).abs().max() > 1e-3


def test_a_repair_changes_a_skeleton_only_where_it_is_read(tmp_path, one_thread):
    """A fold's new projection is what the skeleton's passes and export read; its undo restores the checkpoint's."""
    from prune.loading.offload import current_tensor
    from prune.replace.fitter import WeightPatch
    from prune.replace.fold import mlp_output_projection

    model = _saved("llama", tmp_path)
    skeleton = load_offloaded(str(tmp_path), dtype="float32").model
    projection = mlp_output_projection(skeleton, get_blocks(skeleton)[1][1])
    stored = mlp_output_projection(model, get_blocks(model)[1][1]).weight.detach()
    new = torch.randn_like(stored)
    undo = WeightPatch(projection, new).apply()
    assert projection.weight.is_meta and torch.equal(current_tensor(projection, "weight"), new)
    with getattr(skeleton, OFFLOAD_ATTR).loaded(1, get_blocks(skeleton)[1][1]):  # a pass reads the new weights
        assert torch.equal(projection.weight, new)
    undo()
    assert torch.equal(current_tensor(projection, "weight"), stored)


def test_greedy_selection_runs_block_by_block(tmp_path, tiny_folder, sample_text, one_thread):
    text = tmp_path / "calibration.txt"
    text.write_text(sample_text, encoding="utf-8")
    data = DataConfig(data=str(text), samples=8, seq_len=32, heldout_samples=0)
    chosen = {offload: run_prune(PruneConfig(load=LoadConfig(model=str(tiny_folder), offload=offload), data=data,
                                             drop=2, select="greedy", score="linearity-nores",
                                             out=str(tmp_path / offload))).dropped
              for offload in ("none", "sequential")}
    assert chosen["none"] == chosen["sequential"] and len(chosen["none"]) == 2


@pytest.mark.parametrize(("select", "method"), [("repaired-fast", "fold"), ("repaired-greedy", "fold"),
                                              ("repaired-greedy-kl", "linear"), ("greedy-ppl", "none"),
                                              ("repaired-greedy-crossfit", "fold")])
def test_measuring_selections_run_block_by_block(tmp_path, tiny_folder, sample_text, one_thread, select, method):
    """A selection that measures perplexity or map errors chooses the same blocks on a skeleton, and the same
    checkpoint comes out."""
    text = tmp_path / "calibration.txt"
    text.write_text(sample_text, encoding="utf-8")
    data = DataConfig(data=str(text), samples=8, seq_len=32, heldout_samples=0)
    found = {}
    for offload in ("none", "sequential"):
        result = run_prune(PruneConfig(load=LoadConfig(model=str(tiny_folder), offload=offload), data=data, drop=2,
                                       protect="0,-1", select=select, replace={"method": method},
                                       out=str(tmp_path / offload)))
        found[offload] = (result.dropped, load(str(tmp_path / offload)).model(IDS[:2]).logits)
    assert found["none"][0] == found["sequential"][0] and len(found["none"][0]) == 2
    torch.testing.assert_close(found["sequential"][1], found["none"][1], rtol=0, atol=1e-5)


def test_the_oracle_measures_a_skeleton_as_the_loaded_model(tmp_path, tiny_folder, sample_text, one_thread):
    text = tmp_path / "calibration.txt"
    text.write_text(sample_text, encoding="utf-8")
    data = DataConfig(data=str(text), samples=8, seq_len=32, heldout_samples=0)
    oracles = [run_prune(PruneConfig(load=LoadConfig(model=str(tiny_folder), offload=offload), data=data, drop=2,
                                     oracle=True, out=str(tmp_path / offload))).report["oracle"]
               for offload in ("none", "sequential")]
    assert oracles[0]["removed"] and oracles[0]["removed"] == pytest.approx(oracles[1]["removed"], rel=1e-5)
    assert oracles[0]["dense"] == pytest.approx(oracles[1]["dense"], rel=1e-5)


def test_a_streamed_skeleton_runs_whole_passes_with_one_block_in_memory(tmp_path, one_thread):
    """Whole forward passes of a skeleton, with blocks removed and a fold's patch in place, give the loaded
    model's logits, and never hold two blocks."""
    from prune.loading.offload import streamed
    from prune.model.surgery import blocks_removed
    from prune.replace.fitter import WeightPatch
    from prune.replace.fold import mlp_output_projection

    model = _saved("llama", tmp_path)
    skeleton = load_offloaded(str(tmp_path), dtype="float32").model
    _, blocks = get_blocks(skeleton)
    resident = []
    for block in blocks:
        block.register_forward_hook(
            lambda *_: resident.append(sum(not p.is_meta for b in blocks for p in b.parameters())))
    new = torch.randn_like(mlp_output_projection(model, get_blocks(model)[1][0]).weight)
    WeightPatch(mlp_output_projection(model, get_blocks(model)[1][0]), new).apply()
    undo = WeightPatch(mlp_output_projection(skeleton, blocks[0]), new).apply()
    with torch.no_grad(), blocks_removed(model, [1]), blocks_removed(skeleton, [1]), streamed(skeleton):
        torch.testing.assert_close(skeleton(IDS[:2]).logits, model(IDS[:2]).logits, rtol=0, atol=1e-5)
    undo()
    assert resident and max(resident) == sum(1 for _ in blocks[0].parameters())
    assert all(p.is_meta for p in blocks.parameters())  # nothing stays once the passes end


def test_a_skeleton_run_holds_three_hidden_squared_matrices_at_most(tmp_path, tiny_folder, sample_text, monkeypatch,
                                                                    one_thread):
    """Scoring and fitting free each state's statistics once read: at most two Grams and one cross Gram live."""
    from prune.measure.moments import StateMoments

    live = []
    observe = StateMoments.observe

    def counted(self, index, state):
        observe(self, index, state)
        live.append(sum(g is not None for g in self.grams) + len(self.cross))

    monkeypatch.setattr(StateMoments, "observe", counted)
    text = tmp_path / "calibration.txt"
    text.write_text(sample_text, encoding="utf-8")
    data = DataConfig(data=str(text), samples=8, seq_len=32, heldout_samples=0)
    result = run_prune(PruneConfig(load=LoadConfig(model=str(tiny_folder), offload="sequential"), data=data, drop=2,
                                   replace={"method": "linear"}, out=str(tmp_path / "out")))
    assert result.report["replacements"] and live and max(live) <= 3


def test_skeleton_keeps_one_block_in_memory_at_a_time(tmp_path, one_thread):
    _saved("llama", tmp_path)
    skeleton = load_offloaded(str(tmp_path), dtype="float32").model
    _, blocks = get_blocks(skeleton)
    resident = []

    def count(_module, _args):
        resident.append(sum(not p.is_meta for b in blocks for p in b.parameters()))

    for block in blocks:
        block.register_forward_pre_hook(count)
    stream_moments_blockwise(skeleton, IDS, batch_size=4, progress=False)
    per_block = sum(1 for _ in blocks[0].parameters())
    assert resident and max(resident) == per_block


@pytest.mark.parametrize(("flags", "named"), [
    (["--replace", "linear", "--fit", "sequential"], "original model's states"),
    (["--replace", "block"], "new block"),
    (["--distill-steps", "5"], "--distill-steps"),
    (["--unit", "mlp"], "--unit"),
    (["--select", "span", "--score", "cosine"], "--select"),
])
def test_what_a_skeleton_cannot_run_is_refused_before_loading(capsys, tiny_folder, flags, named):
    code, _, err = run_prune_cli(capsys, "--model", tiny_folder, "--drop", 2, "--offload", "sequential", *flags)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and named in lines[0] and "--offload none" in lines[0]


def test_span_cosines_and_quantized_skeletons_are_refused(tmp_path):
    _saved("llama", tmp_path)
    with pytest.raises(LayercutError, match="every pair"):
        stream_moments_blockwise(make_tiny_model("llama"), IDS, cosine_pairs="all")
    with pytest.raises(LayercutError, match="load-in-4bit"):
        load_offloaded(str(tmp_path), load_in_4bit=True)


def test_a_checkpoint_without_safetensors_is_one_line(tmp_path):
    make_tiny_model("llama").config.save_pretrained(tmp_path)  # a config and no weights file
    make_tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(LayercutError, match="safetensors"):
        load_offloaded(str(tmp_path))


@pytest.mark.slow
def test_smollm2_scores_block_by_block_as_in_memory():
    """The embedded SmolLM2-135M: every score of the skeleton's pass equals the in-memory one to 1e-6."""
    whole = load("smollm2-135m")
    skeleton = LoadConfig(model="smollm2-135m", offload="sequential").load()
    ids = torch.randint(0, 49152, (8, 256), generator=torch.Generator().manual_seed(0))
    expected = block_scores(stream_moments(whole.model, ids, batch_size=4, progress=False))
    got = block_scores(stream_moments_blockwise(skeleton.model, ids, batch_size=4, progress=False,
                                                 scores=list(SCORES)))
    worst = max(abs(a - b) for name in expected for a, b in zip(expected[name], got[name], strict=True))
    assert worst <= 1e-6


@pytest.mark.slow
def test_smollm2_block_by_block_exports_the_in_memory_checkpoint(tmp_path):
    """The embedded SmolLM2-135M, a measuring selection and the default servable repair: the skeleton's run picks
    the same blocks and exports a checkpoint whose logits equal the in-memory run's to 1e-5 (``local`` is
    compared on the tiny models: its Adam steps cost minutes here)."""
    data = DataConfig(data="builtin", samples=10, seq_len=256, heldout_samples=0)
    found = {}
    for offload in ("none", "sequential"):
        result = run_prune(PruneConfig(load=LoadConfig(model="smollm2-135m", offload=offload), data=data, drop=4,
                                       select="repaired-fast", replace={"method": "fold"},
                                       out=str(tmp_path / offload)))
        found[offload] = (result.dropped, load(str(tmp_path / offload)).model(IDS[:2] * 7).logits)
    assert found["none"][0] == found["sequential"][0]
    torch.testing.assert_close(found["sequential"][1], found["none"][1], rtol=0, atol=1e-5)


def test_a_skeleton_fit_runs_no_block_behind_its_last_span(tmp_path, one_thread):
    from prune.replace import ReplaceConfig, fit_replacements

    _saved("llama", tmp_path)
    skeleton = load_offloaded(str(tmp_path), dtype="float32").model
    _, blocks = get_blocks(skeleton)
    ran = []
    for index, block in enumerate(blocks):  # a block that ran with its weights (the stubbed first pass has none)
        block.register_forward_hook(lambda module, *_, index=index: ran.append(index)
                                    if not next(module.parameters()).is_meta else None)
    fit_replacements(skeleton, [1], IDS, ReplaceConfig(method="fold", progress=False))
    assert len(blocks) > 2 and sorted(set(ran)) == [0, 1]


def test_fold_rotate_on_a_skeleton_writes_the_in_memory_checkpoint_tied_head_included(tmp_path, one_thread):
    """Two composed cuts of fold-rotate on a tied model: the change of basis reaches every block before each cut
    and the embedding; the skeleton's export (its head untied from memory) gives the in-memory checkpoint's logits,
    and finding the blocks' roles read no block behind the last cut's host."""
    from transformers import AutoModelForCausalLM

    from prune.loading.offload import write_offloaded
    from prune.replace import ReplaceConfig, fit_replacements, install_replacements_
    from prune.replace.rotate import stream_roles

    model = make_tiny_model("llama", tie_word_embeddings=True, num_hidden_layers=7)
    model.save_pretrained(tmp_path / "source")
    make_tiny_tokenizer().save_pretrained(tmp_path / "source")
    config = json.loads((tmp_path / "source" / "config.json").read_text())
    del config["architectures"]  # as a config-only folder (eval.bench scale's shapes before 2026-12-06) has it
    (tmp_path / "source" / "config.json").write_text(json.dumps(config))
    skeleton = load_offloaded(str(tmp_path / "source"), dtype="float32").model
    _, blocks = get_blocks(skeleton)
    ran = []
    handles = [block.register_forward_hook(lambda module, *_, index=index: ran.append(index)
                                           if not next(module.parameters()).is_meta else None)
               for index, block in enumerate(blocks)]
    assert len(stream_roles(skeleton, upto=4)) == 4 and sorted(set(ran)) == [0, 1, 2, 3]
    for handle in handles:
        handle.remove()
    config = ReplaceConfig(method="fold-rotate", progress=False)
    for target in (model, skeleton):
        install_replacements_(target, fit_replacements(target, [2, 4], IDS, config))
        assert not target.config.tie_word_embeddings
    model.save_pretrained(tmp_path / "memory")
    (tmp_path / "skeleton").mkdir()
    write_offloaded(skeleton, tmp_path / "skeleton")
    # the class named as save_pretrained names it, even where the source's config named none (llama.cpp's
    # converter refused such a checkpoint of the 8B shape on 2026-12-06)
    assert json.loads((tmp_path / "skeleton" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    logits = {}
    for out in ("memory", "skeleton"):
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / out).eval()
        assert reloaded.config.num_hidden_layers == 5
        assert reloaded.lm_head.weight.data_ptr() != reloaded.model.embed_tokens.weight.data_ptr()
        with torch.no_grad():
            logits[out] = reloaded(IDS[:2]).logits
    assert (logits["memory"] - model(IDS[:2]).logits).abs().max() < 1e-6
    torch.testing.assert_close(logits["skeleton"], logits["memory"], rtol=0, atol=1e-5)
    with torch.no_grad():
        unrepaired = AutoModelForCausalLM.from_pretrained(tmp_path / "source").eval()(IDS[:2]).logits
    assert (unrepaired[..., :5] - logits["memory"][..., :5]).abs().max() > 1e-3  # (a different model: sanity)


def test_a_skeleton_fits_several_methods_spans_in_one_block_by_block_pass(tmp_path, one_thread):
    """prune.ship fits every repair's candidates: block by block, one pass feeds them all (the methods' fits of one
    span share its recorded values), each fit what the in-memory pass gives it."""
    from prune.replace import ReplaceConfig
    from prune.replace.driver import fit_spans_of_methods

    model = _saved("llama", tmp_path)
    skeleton = load_offloaded(str(tmp_path), dtype="float32").model
    wanted = [(ReplaceConfig(method=method, progress=False), [(1,), (1, 2), (2,)])
              for method in ("fold", "cosine", "magcomp", "linear")]
    passes = []
    get_blocks(skeleton)[1][0].register_forward_hook(
        lambda module, *_: passes.append(1) if not next(module.parameters()).is_meta else None)
    streamed_fits = fit_spans_of_methods(skeleton, wanted, IDS)
    assert len(passes) == len(IDS) // 4 + (len(IDS) % 4 > 0)  # block 0 ran each batch once: a single pass
    for got, expected in zip(streamed_fits, fit_spans_of_methods(model, wanted, IDS), strict=True):
        assert got.keys() == expected.keys() == {(1,), (1, 2), (2,)}
        for span, fit in expected.items():
            patch, other = fit.patch, got[span].patch
            if patch is None:  # a map (linear): its module's weights
                for a, b in zip(fit.module.state_dict().values(), got[span].module.state_dict().values(), strict=True):
                    torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
            elif hasattr(patch, "factor"):  # magcomp: a scale of later writers
                assert abs(other.factor - patch.factor) <= 1e-6 * abs(patch.factor)
            else:  # fold, cosine: the host's new projection
                torch.testing.assert_close(other.weight, patch.weight, rtol=0, atol=1e-6)
