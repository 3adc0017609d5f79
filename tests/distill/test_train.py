"""Tests for distill: loss terms against direct computations, training modes, LoRA merge, checkpoints, errors."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn

from distill import trainable as trainable_module
from distill.batches import BatchOrder
from distill.checkpoints import list_checkpoints, load_checkpoint, rng_state, set_rng_state
from distill.checks import check_models, check_tokenizers
from distill.config import DistillConfig
from distill.layout import layout_from_dropped, resolve_layout, teacher_targets
from distill.losses import (
    LOSSES,
    LossInputs,
    consecutive_cosine_distance,
    get_loss,
    layerwise_mse,
    teacher_student_kl,
    total_loss,
)
from distill.train import LOG_FILE, distill, evaluate_losses
from distill.trainable import apply_lora, lora_target_names, merge_lora
from prune.errors import LayercutError
from prune.model.capture import block_output
from prune.model.surgery import drop_blocks_
from tests.helpers import make_tiny_model, make_tiny_tokenizer

SEQ = 16


pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(samples: int = 16, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 320, (samples, seq), generator=torch.Generator().manual_seed(seed))  # [samples, seq]


def _dropped_pair(drop=(1,)):
    """A tiny llama teacher and a copy with ``drop`` removed, its layout recorded."""
    teacher = make_tiny_model("llama")
    student = copy.deepcopy(teacher)
    kept = drop_blocks_(student, list(drop))
    student.config.layercut_layout = [[k] for k in kept]
    return student, teacher


class MapAfterBlock(nn.Module):
    """A kept block followed by an affine map standing in for the removed block after it (test double)."""

    def __init__(self, block: nn.Module, hidden: int):
        super().__init__()
        self.block = block
        self.map = nn.Linear(hidden, hidden)
        with torch.no_grad():
            self.map.weight.copy_(torch.eye(hidden))
            self.map.bias.zero_()

    def forward(self, *args, **kwargs):
        out = self.block(*args, **kwargs)
        mapped = self.map(block_output(out))
        return (mapped, *out[1:]) if isinstance(out, tuple) else mapped


@pytest.fixture
def replaced_pair(monkeypatch):
    """Teacher + student whose block 1 is replaced by a map attached to block 0 (layout [[0, 1], [2], [3]])."""
    teacher = make_tiny_model("llama")
    student = copy.deepcopy(teacher)
    drop_blocks_(student, [1])
    student.model.layers[0] = MapAfterBlock(student.model.layers[0], 32)
    student.config.layercut_layout = [[0, 1], [2], [3]]
    monkeypatch.setattr(trainable_module, "replacement_modules", lambda model: [model.model.layers[0].map])
    return student, teacher


def _config(**kw) -> DistillConfig:
    # the layerwise objective: most tests here check the block-output machinery (the default is KL on the logits)
    base = dict(steps=4, lr=1e-3, batch_size=4, data={"seq_len": SEQ}, log_every=1, save_every=0, train="all",
                losses={"layerwise_mse": 1.0})
    base.update(kw)
    return DistillConfig(**base)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------------------------
# losses


def _random_inputs(seed=0, batch=2, seq=5, hidden=8, blocks=3, vocab=11):
    g = torch.Generator().manual_seed(seed)
    student = {i: torch.randn(batch, seq, hidden, generator=g) for i in range(blocks + 1)}
    teacher = {i: torch.randn(batch, seq, hidden, generator=g) for i in range(blocks + 3)}
    mask = torch.ones(batch, seq)
    mask[1, 3:] = 0
    logits = (torch.randn(batch, seq, vocab, generator=g), torch.randn(batch, seq, vocab, generator=g))
    return LossInputs(student, teacher, [1, 3, 5], mask, logits[0], logits[1])


def test_layerwise_mse_equals_direct_per_position_mse():
    inputs = _random_inputs()
    expected = 0.0
    for j, target in enumerate(inputs.targets):
        s, t = inputs.student_states[j + 1].double(), inputs.teacher_states[target].double()
        per_token = ((s - t) ** 2).mean(-1)  # [batch, seq]
        expected += float(per_token[inputs.mask.bool()].mean())
    assert float(layerwise_mse(inputs)) == pytest.approx(expected, rel=1e-5)


def test_layerwise_mse_is_zero_for_identical_states_and_ignores_masked_tokens():
    inputs = _random_inputs()
    teacher = {t: inputs.student_states[j + 1].clone() for j, t in enumerate(inputs.targets)}
    teacher[3][1, 3:] += 100.0  # only masked tokens differ
    inputs.teacher_states = teacher
    assert float(layerwise_mse(inputs)) == pytest.approx(0.0, abs=1e-10)


def test_teacher_student_kl_equals_direct_float64_sum_and_runs_in_float32():
    inputs = _random_inputs()
    p_t = torch.softmax(inputs.teacher_logits.double(), -1)
    p_s = torch.softmax(inputs.student_logits.double(), -1)
    per_token = (p_t * (p_t.log() - p_s.log())).sum(-1)  # [batch, seq]
    expected = float(per_token[inputs.mask.bool()].mean())
    assert float(teacher_student_kl(inputs)) == pytest.approx(expected, rel=1e-5)
    # bf16 logits go through a float32 log-softmax: the result is float32 and close to the float64 value
    inputs.student_logits, inputs.teacher_logits = inputs.student_logits.bfloat16(), inputs.teacher_logits.bfloat16()
    value = teacher_student_kl(inputs)
    assert value.dtype == torch.float32
    assert float(value) == pytest.approx(expected, rel=0.05)
    inputs.student_logits = inputs.teacher_logits
    assert float(teacher_student_kl(inputs)) == pytest.approx(0.0, abs=1e-6)


def test_consecutive_cosine_distance_equals_direct_token_loop():
    inputs = _random_inputs()
    states, mask = inputs.student_states, inputs.mask
    expected = 0.0
    for i in range(1, len(states)):
        values = []
        for b in range(mask.shape[0]):
            for s in range(mask.shape[1]):
                if mask[b, s]:
                    x, y = states[i][b, s].double(), states[i - 1][b, s].double()
                    values.append(1 - float(x @ y / (x.norm() * y.norm())))
        expected += sum(values) / len(values)
    assert float(consecutive_cosine_distance(inputs)) == pytest.approx(expected, rel=1e-5)
    # a state sequence that only rescales (same direction) costs nothing
    inputs.student_states = {i: states[0] * (i + 1) for i in range(4)}
    assert float(consecutive_cosine_distance(inputs)) == pytest.approx(0.0, abs=1e-6)


def test_total_loss_is_the_weighted_sum_and_registry_lists_names():
    inputs = _random_inputs()
    weights = {"layerwise_mse": 1.0, "teacher_student_kl": 0.5, "consecutive_cosine_distance": 0.1}
    total, terms = total_loss(inputs, weights)
    expected = sum(w * float(LOSSES[name](inputs)) for name, w in weights.items())
    assert float(total) == pytest.approx(expected, rel=1e-6)
    assert set(terms) == set(weights)
    with pytest.raises(LayercutError, match="layerwise_mse"):
        get_loss("mse")


def test_config_defaults_and_validation():
    config = DistillConfig(steps=50, data={"seq_len": 64})
    assert config.warmup == 5 and config.data.seq_len == 64 and config.tokens_per_step == 4 * 64
    assert config.loss_weights() == {"teacher_student_kl": 1.0}  # chosen on the selection split (config.py)
    # pretrained weights get a far smaller default step than fresh maps; an explicit lr always wins
    assert (config.lr, DistillConfig(train="lora").lr, DistillConfig(train="all").lr) == (3e-4, 3e-4, 2e-5)
    assert DistillConfig(train="all", lr=1e-3).lr == 1e-3
    for bad in (dict(train="everything"), dict(lr=-1.0), dict(steps=0), dict(warmup_steps=200, steps=100),
                dict(losses={"teacher_student_kl": 0.0}), dict(losses={"teacher_student_kl": float("nan")}),
                dict(losses={}), dict(losses={"mse": 1.0}), dict(batch_size=0)):
        with pytest.raises(LayercutError):
            DistillConfig(**bad)


def test_config_reads_numbers_written_as_text_and_refuses_the_rest():
    # YAML 1.1 reads lr: 3e-4 as the text "3e-4": it is the number it spells
    config = DistillConfig.from_dict({"lr": "3e-4", "steps": "20", "batch_size": 2.0, "data": {"samples": "16"}})
    assert (config.lr, config.steps, config.batch_size, config.data.samples) == (3e-4, 20, 2, 16)
    assert isinstance(config.steps, int) and isinstance(config.lr, float)
    for values, message in (({"lr": "fast"}, "distill: lr must be a number, got 'fast'"),
                            ({"steps": "ten"}, "distill: steps must be an integer, got 'ten'"),
                            ({"batch_size": 2.5}, "distill: batch_size must be an integer, got 2.5"),
                            ({"steps": True}, "distill: steps must be an integer, got True"),
                            ({"data": {"samples": "eight"}}, "data: samples must be an integer, got 'eight'")):
        with pytest.raises(LayercutError) as caught:
            DistillConfig.from_dict(values)
        assert str(caught.value) == message


@pytest.mark.parametrize("lr", [1e38, float("inf"), float("nan"), 2.0, 0.0])
def test_an_absurd_learning_rate_is_refused_before_training(lr):
    # 1e38 used to end in "value cannot be converted to type float without overflow" inside torch's Adam
    with pytest.raises(LayercutError, match=r"--lr must be a positive number at most 1 .*got"):
        DistillConfig(lr=lr)
    assert DistillConfig(lr=1.0).lr == 1.0


def test_batch_order_is_a_function_of_the_index_and_covers_each_epoch():
    order = BatchOrder(samples=10, batch_size=5, seed=3)
    first_epoch = torch.cat([order.rows(0), order.rows(1)])
    assert sorted(first_epoch.tolist()) == list(range(10))
    assert torch.equal(BatchOrder(10, 5, 3).rows(7), order.rows(7))  # no hidden state
    assert not torch.equal(BatchOrder(10, 5, 4).rows(0), order.rows(0))


# ---------------------------------------------------------------------------------------------------------------
# layout and compatibility


def test_layout_targets_and_resolution():
    assert layout_from_dropped(6, [2, 3]) == [[0], [1], [4], [5]]
    assert teacher_targets([[0], [1, 2, 3], [4]]) == [1, 4, 5]
    student, teacher = _dropped_pair([1])
    del student.config.layercut_layout
    assert resolve_layout(student, teacher, {"dropped": [1], "num_blocks_before": 4}) == [[0], [2], [3]]
    with pytest.raises(LayercutError, match="no layout"):
        resolve_layout(student, teacher)


def test_student_as_deep_as_the_teacher_without_layout_is_rejected():
    teacher = make_tiny_model("llama")
    with pytest.raises(LayercutError, match="not a pruned model"):
        resolve_layout(copy.deepcopy(teacher), teacher)


def test_mismatched_hidden_size_is_rejected():
    student, _ = _dropped_pair()
    teacher = make_tiny_model("llama", hidden_size=48)
    with pytest.raises(LayercutError, match="hidden size differs: student 32, teacher 48"):
        check_models(student, teacher)
    with pytest.raises(LayercutError, match="hidden size"):
        distill(student, teacher, None, _config(), token_ids=_ids())


def test_mismatched_tokenizers_are_rejected():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["completely different words: zebra quartz jukebox vex"] * 8, trainer)
    other = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")
    check_tokenizers(make_tiny_tokenizer(), make_tiny_tokenizer())
    with pytest.raises(LayercutError, match="tokenizers differ"):
        check_tokenizers(make_tiny_tokenizer(), other)


# ---------------------------------------------------------------------------------------------------------------
# training


def test_distillation_halves_the_layerwise_mse_of_a_dropped_block_student(tmp_path):
    student, teacher = _dropped_pair([1])
    ids = _ids(16)
    config = _config(steps=40, lr=3e-3, batch_size=8, warmup_steps=2, log_every=10)
    before = evaluate_losses(student, teacher, ids, config)["layerwise_mse"]
    teacher_params = _params(teacher)
    result = distill(student, teacher, None, config, out=tmp_path, token_ids=ids)
    after = evaluate_losses(student, teacher, ids, config)["layerwise_mse"]
    assert after < 0.5 * before
    assert result.steps == 40 and len(result.losses) == 40 and result.final_loss == result.losses[-1]
    assert result.steps_per_second > 0 and result.peak_memory_bytes > 10 * 2**20
    assert all(torch.equal(p, teacher_params[n]) for n, p in teacher.named_parameters())
    rows = [json.loads(line) for line in (tmp_path / LOG_FILE).read_text().splitlines()]
    assert [r["step"] for r in rows] == [10, 20, 30, 40]
    assert {"loss", "layerwise_mse", "lr", "seconds", "grad_norm"} <= set(rows[0])


def _changed(before: dict, model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}


def test_train_all_changes_blocks_and_norms_but_not_embeddings_or_teacher():
    student, teacher = _dropped_pair([1])
    s_before, t_before = _params(student), _params(teacher)
    distill(student, teacher, None, _config(steps=2), token_ids=_ids())
    changed = _changed(s_before, student)
    assert "model.embed_tokens.weight" not in changed and "lm_head.weight" not in changed
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.2.mlp.down_proj.weight"} <= changed
    assert not _changed(t_before, teacher)
    assert all(p.requires_grad for p in student.parameters())  # flags handed back as they were


def test_train_replacements_changes_only_the_replacement(replaced_pair):
    student, teacher = replaced_pair
    s_before, t_before = _params(student), _params(teacher)
    result = distill(student, teacher, None, _config(steps=3, train="replacements"), token_ids=_ids())
    assert _changed(s_before, student) == {"model.layers.0.map.weight", "model.layers.0.map.bias"}
    assert result.trainable_parameters == 32 * 32 + 32
    assert not _changed(t_before, teacher)


def test_train_replacements_without_replacements_is_an_error():
    student, teacher = _dropped_pair([1])
    with pytest.raises(LayercutError, match="no replacement modules"):
        distill(student, teacher, None, _config(train="replacements"), token_ids=_ids())


def test_train_lora_changes_block_linears_and_replacement_and_merges(replaced_pair):
    student, teacher = replaced_pair
    names_before = set(dict(student.named_parameters()))
    s_before, t_before = _params(student), _params(teacher)
    distill(student, teacher, None, _config(steps=3, train="lora", lr=1e-2), token_ids=_ids())
    assert set(dict(student.named_parameters())) == names_before  # adapters merged away
    changed = _changed(s_before, student)
    assert {"model.layers.0.map.weight", "model.layers.1.self_attn.q_proj.weight"} <= changed
    assert all(".layers." in n and not n.endswith("layernorm.weight") for n in changed)
    assert "model.embed_tokens.weight" not in changed
    assert not _changed(t_before, teacher)


def test_lora_targets_are_block_linears_without_the_replacements(replaced_pair):
    student, _ = replaced_pair
    names = lora_target_names(student, exclude=[student.model.layers[0].map])
    assert "model.layers.0.block.self_attn.q_proj" in names and "model.layers.2.mlp.down_proj" in names
    assert "model.layers.0.map" not in names and "lm_head" not in names
    assert len(names) == 3 * 7  # q, k, v, o, gate, up, down in each of 3 blocks


def test_lora_targets_by_name_keep_only_those_layers_and_refuse_a_name_no_block_has(replaced_pair):
    student, _ = replaced_pair
    names = lora_target_names(student, exclude=[student.model.layers[0].map], targets="q_proj,down_proj")
    assert len(names) == 3 * 2 and {name.rsplit(".", 1)[-1] for name in names} == {"q_proj", "down_proj"}
    with pytest.raises(LayercutError, match="no Linear layer named qproj; theirs are q_proj, k_proj"):
        lora_target_names(student, targets="q_proj,qproj")


def test_train_lora_on_named_targets_changes_only_those_weights(replaced_pair):
    student, _teacher = replaced_pair
    s_before = _params(student)
    distill(student, _teacher, None, _config(steps=3, train="lora", lr=1e-2, lora_targets="v_proj"), token_ids=_ids())
    changed = {name for name in _changed(s_before, student) if ".map." not in name}  # the replacement trains in full
    assert changed and all(name.endswith("v_proj.weight") for name in changed), changed


@pytest.mark.parametrize(("spec", "written"),
                         [("all-linear", "all-linear"), (" q_proj , v_proj,q_proj", "q_proj,v_proj"),
                          (["q_proj", "v_proj"], "q_proj,v_proj"), (["all-linear"], "all-linear")])
def test_lora_targets_are_written_one_way(spec, written):
    assert DistillConfig(lora_targets=spec).lora_targets == written


@pytest.mark.parametrize("spec", ["", "q_proj,,v_proj", "self_attn.q_proj", "q_proj,all-linear", [], ["q_proj", ""]])
def test_lora_targets_that_name_no_layer_are_one_line(spec):
    with pytest.raises(LayercutError, match="--lora-targets takes all-linear or a comma list"):
        DistillConfig(lora_targets=spec)


def test_lora_targets_enter_the_digest_only_when_not_the_default():
    assert "lora_targets" not in DistillConfig().legacy_dict()
    assert DistillConfig(lora_targets="q_proj").legacy_dict()["lora_targets"] == "q_proj"


def test_lora_merged_weights_give_the_same_logits_as_the_adapted_model():
    student, _ = _dropped_pair([1])
    peft_model = apply_lora(student, _config(train="lora", lora_r=4))
    with torch.no_grad():
        for name, param in student.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)  # B starts at zero: give the adapters something to merge
    ids = _ids(2)
    with torch.no_grad():
        adapted = student(input_ids=ids).logits
        with peft_model.disable_adapter():
            plain = student(input_ids=ids).logits
        merged_model = merge_lora(peft_model)
        merged = merged_model(input_ids=ids).logits
    assert merged_model is student
    assert not any("lora" in n for n, _ in student.named_parameters())
    assert (adapted - plain).abs().max() > 1e-2  # the adapters do change the logits
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)


def test_gradient_accumulation_matches_one_big_batch():
    runs = []
    for batch_size, accum in ((4, 1), (2, 2)):
        student, teacher = _dropped_pair([1])
        distill(student, teacher, None, _config(steps=3, batch_size=batch_size, grad_accum=accum), token_ids=_ids())
        runs.append(_params(student))
    for name in runs[0]:
        torch.testing.assert_close(runs[1][name], runs[0][name], rtol=1e-4, atol=1e-6)


def test_a_student_that_already_meets_every_layerwise_target_is_refused_and_kl_trains_it():
    student, teacher = _dropped_pair([3])  # the last block: every kept block is the teacher's own
    with pytest.raises(LayercutError, match="nothing to learn.*--kl-weight 1"):
        distill(student, teacher, None, _config(steps=2), token_ids=_ids())
    before = _params(student)
    result = distill(student, teacher, None, _config(steps=2, losses={"teacher_student_kl": 1.0}), token_ids=_ids())
    assert result.final_terms["teacher_student_kl"] > 0 and _changed(before, student)


def test_kl_and_cosine_terms_train_and_are_logged(tmp_path):
    student, teacher = _dropped_pair([1])
    config = _config(steps=2, losses={"layerwise_mse": 1.0, "teacher_student_kl": 1.0,
                                      "consecutive_cosine_distance": 0.1})
    result = distill(student, teacher, None, config, out=tmp_path, token_ids=_ids())
    assert set(result.final_terms) == {"layerwise_mse", "teacher_student_kl", "consecutive_cosine_distance"}
    assert result.final_terms["teacher_student_kl"] > 0
    row = json.loads((tmp_path / LOG_FILE).read_text().splitlines()[-1])
    assert row["teacher_student_kl"] == pytest.approx(result.final_terms["teacher_student_kl"])


# ---------------------------------------------------------------------------------------------------------------
# checkpoints, resume, failures


class _FailAfter:
    """Forward hook on a student block: after ``calls`` calls, return NaN (or raise, to simulate a crash)."""

    def __init__(self, calls: int, crash: bool):
        self.calls, self.crash, self.seen = calls, crash, 0

    def __call__(self, _module, _args, output):
        self.seen += 1
        if self.seen <= self.calls:
            return None
        if self.crash:
            raise KeyboardInterrupt("simulated crash")
        return (torch.full_like(output[0], math.nan), *output[1:]) if isinstance(output, tuple) else output * math.nan


@pytest.mark.parametrize("train", ["all", "lora"])
def test_resume_after_a_crash_gives_the_same_parameters_as_one_run(tmp_path, train):
    config = _config(steps=6, save_every=3, lr=3e-3, log_every=1, train=train)
    ids = _ids()
    reference, teacher = _dropped_pair([1])
    distill(reference, teacher, None, config, out=tmp_path / "straight", token_ids=ids)

    student, teacher = _dropped_pair([1])
    pristine = copy.deepcopy(student)
    student.model.layers[1].register_forward_hook(_FailAfter(calls=4, crash=True))  # crashes in step 5
    with pytest.raises(KeyboardInterrupt):
        distill(student, teacher, None, config, out=tmp_path / "crashed", token_ids=ids)
    assert [s for s, _ in list_checkpoints(tmp_path / "crashed")] == [3]

    result = distill(pristine, teacher, None, config, out=tmp_path / "crashed", token_ids=ids, resume=True)
    assert result.start_step == 3 and len(result.losses) == 3
    for name, param in reference.named_parameters():
        torch.testing.assert_close(dict(pristine.named_parameters())[name], param, rtol=0, atol=1e-7)
    steps = [json.loads(line)["step"] for line in (tmp_path / "crashed" / LOG_FILE).read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_checkpoint_holds_the_trained_tensors_and_buffers_not_a_tied_heads_second_name(tmp_path):
    student, teacher = _dropped_pair([1])
    student.register_buffer("running", torch.arange(3.0))  # a persistent buffer: kept
    student.lm_head.weight = student.model.embed_tokens.weight  # tied, as Gemma's and SmolLM2's are
    distill(student, teacher, None, _config(steps=2, save_every=2, train="lora"), out=tmp_path, token_ids=_ids())
    (_, path), = list_checkpoints(tmp_path)
    saved = load_checkpoint(path)["model"]
    assert "running" in saved and "lm_head.weight" not in saved and "model.embed_tokens.weight" not in saved
    assert saved and all("lora_" in name for name in saved if name != "running")


def test_nan_loss_stops_with_an_error_and_keeps_the_last_good_checkpoint(tmp_path):
    student, teacher = _dropped_pair([1])
    student.model.layers[1].register_forward_hook(_FailAfter(calls=2, crash=False))  # NaN from step 3 on
    with pytest.raises(LayercutError, match=r"loss became nan at step 3.*step-00000002\.pt \(step 2\).*--resume"):
        distill(student, teacher, None, _config(steps=5, save_every=2), out=tmp_path, token_ids=_ids())
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    student, teacher = _dropped_pair([1])
    with pytest.raises(LayercutError, match="no checkpoint found"):
        distill(student, teacher, None, _config(), out=tmp_path, resume=True, token_ids=_ids())
    with pytest.raises(LayercutError, match="no checkpoint found"):
        distill(student, teacher, None, _config(), resume=True, token_ids=_ids())


def test_a_checkpoint_is_tensors_and_json_read_with_weights_only(tmp_path):
    import random

    student, teacher = _dropped_pair([1])
    distill(student, teacher, None, _config(steps=2, save_every=2), out=tmp_path, token_ids=_ids())
    (_, path), = list_checkpoints(tmp_path)
    raw = torch.load(path, map_location="cpu", weights_only=True)  # no pickled object: no weights_only=False
    assert isinstance(raw["config_json"], str) and isinstance(raw["rng"]["python"], torch.Tensor)
    payload = load_checkpoint(path)
    assert payload["step"] == 2 and payload["config"]["config"]["steps"] == 2
    state = rng_state()
    drawn = (random.random(), torch.rand(3))
    set_rng_state(payload["rng"])
    set_rng_state(state)  # the tensor form restores the Python and torch generators exactly
    assert (random.random(), torch.rand(3).tolist()) == (drawn[0], drawn[1].tolist())


class _RunsCode:
    """Unpickled, it would run a shell command (a crafted file; no checkpoint layercut writes holds one)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_pickle_in_the_work_folder_is_refused_unread(tmp_path, how):
    import pickle

    marker = tmp_path / "code-ran"
    folder = tmp_path / "work" / "checkpoints"
    folder.mkdir(parents=True)
    payload = {"step": 2, "model": {}, "trained_names": [], "optimizer": _RunsCode(marker)}
    path = folder / "step-00000002.pt"
    if how == "pickle":
        path.write_bytes(pickle.dumps(payload))
    else:
        torch.save(payload, path)
    with pytest.raises(LayercutError, match="holds Python objects.*never unpickled.*--overwrite") as caught:
        load_checkpoint(path)
    assert "\n" not in str(caught.value) and not marker.exists()
    student, teacher = _dropped_pair([1])
    with pytest.raises(LayercutError, match="holds Python objects"):
        distill(student, teacher, None, _config(), out=tmp_path / "work", resume=True, token_ids=_ids())
    assert not marker.exists()


def test_a_damaged_checkpoint_is_one_line(tmp_path):
    path = tmp_path / "step-00000002.pt"
    path.write_bytes(b"PK\x03\x04 not a whole zip")
    with pytest.raises(LayercutError, match=r"step-00000002\.pt is damaged .*--overwrite"):
        load_checkpoint(path)
    torch.save({"step": 1}, path)
    with pytest.raises(LayercutError, match="not a training checkpoint of distill.run"):
        load_checkpoint(path)


# ---------------------------------------------------------------------------------------------------------------
# with prune.replace's real replacements


def _linear_pair(dropped=(1, 2)):
    from prune.replace import ReplaceConfig, replace_blocks_

    teacher = make_tiny_model("llama")
    student = copy.deepcopy(teacher)
    replace_blocks_(student, list(dropped), _ids(32), ReplaceConfig(method="linear", progress=False))
    return student, teacher


def test_real_linear_replacement_trains_only_its_map_and_lowers_the_loss():
    student, teacher = _linear_pair()
    assert resolve_layout(student, teacher) == [[0, 1, 2], [3]]
    ids = _ids(16, seed=1)
    config = _config(steps=30, lr=3e-3, train="replacements", batch_size=8)
    before = evaluate_losses(student, teacher, ids, config)["layerwise_mse"]
    s_before = _params(student)
    distill(student, teacher, None, config, token_ids=ids)
    assert evaluate_losses(student, teacher, ids, config)["layerwise_mse"] < before
    assert _changed(s_before, student) == {"model.layers.0.after.proj.weight", "model.layers.0.after.proj.bias"}


def test_lora_on_a_student_with_replacement_wrappers_merges_to_the_original_names():
    student, teacher = _linear_pair()
    names = set(dict(student.named_parameters()))
    s_before = _params(student)
    distill(student, teacher, None, _config(steps=2, train="lora", lr=1e-2), token_ids=_ids())
    assert set(dict(student.named_parameters())) == names
    changed = _changed(s_before, student)
    assert "model.layers.0.after.proj.weight" in changed and "model.layers.0.block.mlp.up_proj.weight" in changed


def test_the_loss_on_held_out_sequences_shows_what_training_sequences_hide(caplog):
    from prune.checkpoint.write import describe_generalisation

    student, teacher = _dropped_pair([1])
    ids, held = _ids(4, seed=1), _ids(4, seed=2)
    config = _config(steps=60, lr=3e-3, batch_size=4, warmup_steps=2, log_every=60)
    first = {name: evaluate_losses(student, teacher, rows, config)["layerwise_mse"]
             for name, rows in (("training", ids), ("held_out", held))}
    with caplog.at_level("WARNING", logger="distill.generalisation"):
        result = distill(student, teacher, None, config, token_ids=ids, heldout_ids=held)
    fit = result.generalisation
    assert fit["sequences"] == {"training": 4, "held_out": 4} and fit["reads"] == 60  # 60 steps of all 4
    assert "60 steps read each of the 4 distillation sequences 60 times" in caplog.text
    assert "give about 60 sequences" in caplog.text  # for 4 reads each
    for name in ("training", "held_out"):
        assert fit[name]["before"]["layerwise_mse"] == pytest.approx(first[name], rel=1e-5)
        assert fit[name]["before"]["loss"] == fit[name]["before"]["layerwise_mse"]  # weight 1, the only term
        final = evaluate_losses(student, teacher, ids if name == "training" else held, config)["layerwise_mse"]
        assert fit[name]["after"]["layerwise_mse"] == pytest.approx(final, rel=1e-5)
    seen, unseen = (fit[name]["after"]["loss"] / fit[name]["before"]["loss"] for name in ("training", "held_out"))
    assert seen < 0.5 and unseen > seen + 0.1  # four sequences memorised: the held-out loss falls far less
    assert describe_generalisation(fit) == (
        f"held-out loss {fit['held_out']['before']['loss']:.4g} -> {fit['held_out']['after']['loss']:.4g} "
        f"(training sequences {fit['training']['before']['loss']:.4g} -> {fit['training']['after']['loss']:.4g}; "
        "each read 60 times)")
    assert result.report(config)["generalisation"] == fit
    caplog.clear()
    with caplog.at_level("WARNING", logger="distill.generalisation"):
        assert distill(student, teacher, None, _config(steps=1), token_ids=ids).generalisation is None
    assert "distillation sequences" not in caplog.text  # one step reads each sequence at most once


def test_the_training_sequences_scored_are_ones_training_drew_as_many_of_each_source():
    from distill.generalisation import seen_rows

    student, teacher = _dropped_pair([1])
    ids, held = _ids(16, seed=1), _ids(4, seed=2)
    config = _config(steps=1, batch_size=4)
    drawn = ids[BatchOrder(16, 4, config.seed).rows(0)]  # the one batch one step draws
    expected = evaluate_losses(student, teacher, drawn, config)["layerwise_mse"]
    fit = distill(student, teacher, None, config, token_ids=ids, heldout_ids=held).generalisation
    assert fit["training"]["before"]["layerwise_mse"] == pytest.approx(expected, rel=1e-5)
    assert not torch.equal(drawn, ids[:4])  # so the first rows would give another figure
    # a mixture: the training sequences hold as many of each source as the held-out ones do
    order = BatchOrder(10, 2, 0)
    sources = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 1, 1])
    rows = seen_rows(order, [1, 2], sources, batches=6)
    assert sorted(sources[rows].tolist()) == [0, 1, 1]
    walked = [r for i in range(6) for r in order.rows(i).tolist()]
    assert rows[0].item() == next(r for r in walked if sources[r] == 0)  # the first of source 0 training drew
    assert len(seen_rows(order, [3], None, batches=1)) == 2  # one batch of 2 cannot give 3


def test_a_resumed_run_reports_from_its_first_measurement(tmp_path, caplog):
    student, teacher = _dropped_pair([1])
    ids, held = _ids(8, seed=1), _ids(4, seed=2)
    first = distill(student, teacher, None, _config(steps=4, save_every=2), out=tmp_path, token_ids=ids,
                    heldout_ids=held).generalisation
    with caplog.at_level("WARNING"):
        again = distill(student, teacher, None, _config(steps=6, save_every=2), out=tmp_path, resume=True,
                        token_ids=ids, heldout_ids=held).generalisation
    assert again["before_step"] == 0 and again["held_out"]["before"] == first["held_out"]["before"]
    assert again["held_out"]["after"] != first["held_out"]["after"]
    # the checkpoint's options are read back: only what changed is named
    assert "resuming with other options than the checkpoint's: steps" in caplog.text


def test_a_mixtures_strata_name_each_rows_source(tmp_path):
    from distill.generalisation import heldout_strata
    from prune.data.calibration import DataConfig, calibration_data

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(" ".join(str(i) for i in range(3000)))
    b.write_text(" ".join(f"x{i}" for i in range(3000)))  # only b holds the letter x
    tok = make_tiny_tokenizer()
    data = calibration_data(tok, DataConfig(data=f"{a}@0.75,{b}@0.25", samples=8, seq_len=SEQ, heldout_samples=4))
    rows, held = heldout_strata(data)
    assert rows.tolist() == [int("x" in tok.decode(r)) for r in data.token_ids] and sum(rows.tolist()) == 2
    assert held.tolist() == [int("x" in tok.decode(r)) for r in data.heldout_ids] == [0, 0, 0, 1]
    assert heldout_strata(calibration_data(tok, DataConfig(data=str(a), samples=4, seq_len=SEQ))) is None
