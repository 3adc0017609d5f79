"""The LM head left to the caller: the final norm's output kept, the logits made a row's chunk at a time."""

import pytest
import torch

from prune.measure.perplexity import log_prob_chunks
from prune.model.adapters import lm_head
from prune.model.head import HeadOutputs, head_apart, kept_hidden, normed_output
from tests.helpers import make_tiny_model

IDS = torch.randint(3, 320, (3, 20), generator=torch.Generator().manual_seed(0))

pytestmark = pytest.mark.usefixtures("one_thread")


def _both(model):
    """The model's whole logits, and its outputs with the head left apart."""
    apart = head_apart(model)
    assert apart == {"logits_to_keep": 1}
    with torch.no_grad():
        whole = model(input_ids=IDS, use_cache=False).logits
        with normed_output(model) as kept:
            last = model(input_ids=IDS, use_cache=False, **apart).logits
    assert last.shape[1] == 1  # the model's head ran on the last position alone
    return whole, HeadOutputs(kept_hidden(kept, model), lm_head(model))


def test_the_heads_outputs_are_the_models_logits_whole_and_a_chunk_at_a_time():
    whole, outputs = _both(make_tiny_model("llama", seed=2))
    assert outputs.shape == whole.shape
    assert torch.allclose(outputs.logits(), whole, atol=1e-5)
    assert torch.allclose(outputs.logits(1), whole[:1], atol=1e-5)
    out = torch.empty(7, whole.shape[-1])
    assert torch.allclose(outputs.chunk(2, slice(5, 12), out), whole[2, 5:12], atol=1e-5)
    assert torch.allclose(outputs.positions(slice(None, -1)).logits(), whole[:, :-1], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_probabilities_of_the_heads_outputs_are_those_of_the_whole_logits(dtype):
    whole, outputs = _both(make_tiny_model("llama", seed=2).to(dtype))
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2  # a 16-bit product over other shapes rounds otherwise
    pieces = list(zip(log_prob_chunks(whole, size=6), log_prob_chunks(outputs, size=6), strict=True))
    assert len(pieces) == 3 * 4  # every row's 20 positions in chunks of 6
    for (row, span, want), (row_, span_, got) in pieces:
        assert (row, span) == (row_, span_) and got.dtype == torch.float32
        assert torch.allclose(got, want, atol=tolerance), float((got - want).abs().max())


def test_logits_changed_after_the_head_are_not_left_apart():
    model = make_tiny_model("llama", seed=2)
    model.config.final_logit_softcapping = 30.0  # Gemma 2's: small logits are hardly capped, the field decides
    assert head_apart(model) is None
    model.config.final_logit_softcapping = None
    lm_head(model).register_forward_hook(lambda _module, _args, out: out * 2)  # unnamed: the short forward tells
    assert head_apart(model) is None


def test_masked_logits_never_agree_and_the_answer_is_kept_while_the_head_and_its_hooks_stay():
    from prune.model.head import head_agrees

    model = make_tiny_model("llama", seed=2)
    head = lm_head(model)
    hidden = torch.randn(1, 1, head.weight.shape[1])
    logits = head(hidden).detach()
    assert head_agrees(hidden, head, logits)
    logits[..., 0] = float("-inf")  # an infinite scale would let any difference pass
    assert not head_agrees(hidden, head, logits)
    calls = []
    model.get_input_embeddings().register_forward_hook(lambda *_: calls.append(1))
    assert head_apart(model) == head_apart(model) == {"logits_to_keep": 1} and len(calls) == 1  # one short forward
    head.register_forward_hook(lambda _module, _args, out: out * 2)  # a new hook: asked again, and refused
    assert head_apart(model) is None and len(calls) == 2
