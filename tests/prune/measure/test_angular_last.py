"""``angular-last``: Gromov et al.'s angular distance at each sequence's last token, against plain hidden states."""

import math

import pytest
import torch

from prune.measure.moments import StateMoments, stream_moments
from prune.measure.scores import get_score
from prune.model.adapters import get_blocks
from prune.pipeline.recipes import METHODS_DIR, read_recipe
from prune.selection.strategies import SelectionInput, select_blocks
from tests.helpers import make_tiny_model

BLOCKS = 4


def tokens(samples=10, seq=20, seed=0):
    return torch.randint(3, 320, (samples, seq), generator=torch.Generator().manual_seed(seed))


def last_token_states(model, ids) -> list[torch.Tensor]:
    """Residual states 0..L at the last position [samples, d]: HF's hidden states, and the last block's output
    from a hook (HF's last entry is after the final norm)."""
    out = {}
    hook = get_blocks(model)[1][-1].register_forward_hook(lambda _m, _a, o: out.__setitem__("last", o))
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    hook.remove()
    last = out["last"][0] if isinstance(out["last"], tuple) else out["last"]
    return [h[:, -1].double() for h in (*hidden[:BLOCKS], last)]


def reference(states: list[torch.Tensor], i: int, j: int) -> float:
    """mean over sequences of arccos(cos(h_i, h_j)) / pi at the last token, in float64."""
    cos = torch.nn.functional.cosine_similarity(states[i], states[j], dim=-1).clamp(-1, 1)
    return float((torch.arccos(cos) / math.pi).mean())


def test_angular_last_matches_hidden_states_for_every_pair_and_picks_their_span(one_thread):
    model, ids = make_tiny_model("llama"), tokens()
    states = last_token_states(model, ids)
    # batches of 3 over 10 sequences: the last batch is short, and every pair is streamed for spans
    moments = stream_moments(model, ids, cosine_pairs="all", batch_size=3, progress=False)
    score = get_score("angular-last")
    assert moments.sequences == ids.shape[0] and not score.higher_is_removable
    for i in range(BLOCKS):
        for j in range(i + 1, BLOCKS + 1):
            assert score.span(moments, i, j) == pytest.approx(reference(states, i, j), abs=1e-6), (i, j)
    # it is not the token-averaged ``angular``
    assert abs(score.compute(moments, 1) - get_score("angular").compute(moments, 1)) > 1e-4
    values = [score.compute(moments, b) for b in range(BLOCKS)]
    for count in (1, 2, 3):
        chosen = select_blocks("span", SelectionInput(score, moments, values, count, []))
        distances = [reference(states, s, s + count) for s in range(BLOCKS - count + 1)]
        start = distances.index(min(distances))
        assert chosen == list(range(start, start + count)), (count, distances)


def test_last_token_is_the_last_counted_one_under_a_mask():
    states = [torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])  # a full row, a padded one, an empty one
    moments = StateMoments(2, [], cosine_pairs="adjacent")
    moments.begin_batch(mask)
    for index, state in enumerate(states):
        moments.observe(index, state)
    rows = [torch.stack([s[0, 4], s[1, 2]]).double() for s in states]  # [2, d]: the empty row does not count
    cos = torch.nn.functional.cosine_similarity(rows[0], rows[1], dim=-1)
    assert moments.sequences == 2
    assert moments.last_token_angular_distance(0, 1) == pytest.approx(float((torch.arccos(cos) / math.pi).mean()),
                                                                      abs=1e-6)


def test_gromov_recipe_uses_the_papers_last_token_distance():
    recipe = read_recipe(METHODS_DIR / "gromov.yaml")
    assert recipe["score"] == "angular-last" and recipe["select"] == "span" and recipe["protect"] == "none"
