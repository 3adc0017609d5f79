"""Generation fidelity: the slim model's greedy text, judged by the original."""

import copy

import pytest
import torch

from eval.quality.fidelity import (
    FidelityOptions,
    Reference,
    continuation_nll,
    greedy_continuations,
    kept_prefix,
    prompts_from_streams,
)
from prune.errors import LayercutError
from tests.helpers import make_tiny_model


def test_kept_prefix_counts_tokens_before_the_first_difference():
    reference = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    candidate = torch.tensor([[1, 2, 9, 4], [1, 2, 3, 4], [7, 2, 3, 4]])  # a later agreement does not count
    assert kept_prefix(reference, candidate).tolist() == [0.5, 1.0, 0.0]


def test_prompts_are_shared_over_the_texts_and_spread_through_each():
    first, second = torch.arange(100), torch.arange(1000, 1050)
    prompts = prompts_from_streams([first, second], FidelityOptions(prompts=5, prompt_tokens=10))
    assert prompts.shape == (5, 10)
    assert prompts[:, 0].tolist() == [0, 45, 90, 1000, 1040]  # 3 from the first text, 2 from the second, ends included
    assert torch.equal(prompts[1], torch.arange(45, 55))
    with pytest.raises(LayercutError, match="fewer than the fidelity prompts' 64"):
        prompts_from_streams([torch.arange(20)], FidelityOptions())
    with pytest.raises(LayercutError, match="prompt_tokens must be at least 1"):
        FidelityOptions(prompt_tokens=0)


@pytest.fixture
def models(one_thread):
    torch.manual_seed(0)
    original = make_tiny_model("llama").eval()
    slim = copy.deepcopy(original)
    del slim.model.layers[1]  # a block removed, as a pruned model
    slim.config.num_hidden_layers -= 1
    for index, layer in enumerate(slim.model.layers):
        layer.self_attn.layer_idx = index
    prompts = torch.randint(0, original.config.vocab_size, (5, 12), generator=torch.Generator().manual_seed(1))
    return original, slim, prompts


def test_greedy_continuations_are_what_transformers_generate_writes(models):
    original, _, prompts = models
    options = FidelityOptions(new_tokens=6, batch_size=2)
    ours = greedy_continuations(original, prompts, options)
    theirs = original.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=6,
                               min_new_tokens=6, pad_token_id=0, suppress_tokens=None)[:, prompts.shape[1]:]
    eos = original.generation_config.eos_token_id
    # generate stops a row's text at end-of-text; up to there the two loops agree token for token
    assert eos is None or not (ours == eos).any()
    assert torch.equal(ours, theirs)


def test_the_nll_is_the_original_s_loss_on_the_written_tokens_row_by_row(models):
    original, slim, prompts = models
    options = FidelityOptions(new_tokens=5, batch_size=3)
    written = greedy_continuations(slim, prompts, options)
    nll = continuation_nll(original, prompts, written, options)
    for row in range(len(prompts)):
        ids = torch.cat([prompts[row], written[row]]).unsqueeze(0)
        labels = ids.clone()
        labels[:, :prompts.shape[1]] = -100  # only the written tokens are scored
        expected = original(input_ids=ids, labels=labels).loss
        assert nll[row].item() == pytest.approx(expected.item(), rel=1e-5)


def test_the_original_is_faithful_to_itself_and_a_pruned_copy_is_not(models):
    original, slim, prompts = models
    reference = Reference(original, prompts, FidelityOptions(new_tokens=8, batch_size=2))
    itself = reference.measure(original)
    assert itself["kept"] == 1.0 and itself["nll"] == itself["own_nll"]
    twin = reference.measure(copy.deepcopy(original))  # the same weights decoded again: the same text, the same NLL
    assert twin["kept"] == 1.0 and twin["nll"] == pytest.approx(itself["own_nll"], rel=1e-5)
    pruned = reference.measure(slim)
    assert pruned["kept"] < 1.0
    assert pruned["own_nll"] == itself["own_nll"]
    # the original's own greedy tokens are its most likely at every step: another model's are less likely to it
    assert pruned["nll"] > itself["own_nll"]
    assert {"prompts": 32, "prompt_tokens": 64, "new_tokens": 8}.items() <= pruned.items()
    assert len(pruned["nll_rows"]) == len(pruned["kept_rows"]) == len(prompts)
    assert sum(pruned["nll_rows"]) / len(prompts) == pytest.approx(pruned["nll"], rel=1e-5)
    rows = torch.tensor(pruned["nll_rows"], dtype=torch.float64)
    assert pruned["nll_stderr"] == pytest.approx(float(rows.std() / len(prompts) ** 0.5), rel=1e-4)
    assert itself["kept_stderr"] == 0.0  # every prompt kept whole


def test_the_nll_reads_only_the_continuation_s_logits_and_the_same_without_logits_to_keep(models):
    original, slim, prompts = models
    options = FidelityOptions(new_tokens=5, batch_size=3)
    written = greedy_continuations(slim, prompts, options)
    widths = []
    hook = original.lm_head.register_forward_hook(lambda module, args, out: widths.append(out.shape[1]))
    try:
        nll = continuation_nll(original, prompts, written, options)
    finally:
        hook.remove()
    assert widths == [5, 5]  # two batches, each scored on its 5 written positions, not the prompt's 12 + 4

    class Plain(torch.nn.Module):  # a model whose forward has no logits_to_keep: every position's logits
        def __init__(self, model):
            super().__init__()
            self.model = model

        def get_input_embeddings(self):
            return self.model.get_input_embeddings()

        def forward(self, input_ids, use_cache=False):
            return self.model(input_ids=input_ids, use_cache=use_cache)

    assert torch.allclose(continuation_nll(Plain(original), prompts, written, options), nll, rtol=1e-5, atol=1e-6)
