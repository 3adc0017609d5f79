"""Statistics of some calibration rows kept apart in the pass that takes every row's (``held_rows``)."""

from __future__ import annotations

import pytest
import torch

from prune.measure.moments import StateMoments, stream_moments
from tests.helpers import make_tiny_model, make_tiny_tokenizer

IDS = torch.randint(3, 320, (12, 24), generator=torch.Generator().manual_seed(1))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_the_whole_pass_minus_the_held_rows_is_a_pass_over_the_other_rows(one_thread):
    model = make_tiny_model("llama", seed=2)
    held_rows = [0, 5, 11]  # the first batch's first row too: the held rows take the whole pass's shift
    whole = stream_moments(model, IDS, batch_size=4, progress=False, held_rows=held_rows)
    others = [row for row in range(IDS.shape[0]) if row not in held_rows]
    held = stream_moments(model, IDS[held_rows], batch_size=4, progress=False, cosine_pairs="none")
    rest = stream_moments(model, IDS[others], batch_size=4, progress=False, cosine_pairs="none")
    for found, alone in ((whole.held.moments, held), (whole.minus(whole.held.moments), rest)):
        assert found.n == alone.n
        for block in range(whole.num_states - 1):
            mine, theirs = found.pair(block, block + 1), alone.pair(block, block + 1)
            # other shifts and other float32 batch products: the same sums to float32's rounding
            for name in ("mean_x", "mean_y", "cxx", "cxy", "cyy", "cxu"):
                assert _relative(getattr(mine, name), getattr(theirs, name)) < 2e-6, (block, name)
            assert mine.tuu == pytest.approx(theirs.tuu, rel=2e-6)
    assert whole.held.rows == (0, 5, 11) and whole.held.token_ids is IDS


def test_minus_refuses_statistics_shifted_otherwise(one_thread):
    model = make_tiny_model("llama", seed=2)
    whole = stream_moments(model, IDS, batch_size=4, progress=False)
    alone = stream_moments(model, IDS[4:8], batch_size=4, progress=False)  # shifted by its own first batch
    with pytest.raises(ValueError, match="shifted alike"):
        whole.minus(alone)
    with pytest.raises(ValueError, match="shifted alike"):
        whole.minus(StateMoments(whole.num_states - 1, [], "none"))


def test_a_skeleton_takes_the_map_errors_of_the_held_rows_block_by_block_as_memory_does(tmp_path, one_thread):
    """Block by block each state's statistics are freed once its scores are taken; the map errors that repaired-fast
    reads are taken in the same pass, before the freeing, and equal the in-memory pass's (float32 rounding)."""
    from prune.loading.offload import load_offloaded
    from prune.measure.blockwise import stream_moments_blockwise
    from prune.measure.scores import SCORES
    from prune.selection.map_errors import held_map_errors, map_errors_of_shares
    from prune.selection.repaired import measuring_rows

    model = make_tiny_model("llama", seed=2)
    model.save_pretrained(tmp_path)
    make_tiny_tokenizer().save_pretrained(tmp_path)
    ids = torch.randint(3, 320, (16, 24), generator=torch.Generator().manual_seed(3))
    rows, shares = measuring_rows(ids), [0.7, 1.0]  # rows 7 and 15, as repaired-fast reads them
    whole = stream_moments(model, ids, batch_size=4, progress=False, held_rows=rows)
    expected = map_errors_of_shares(model, ids, shares, moments=whole)
    skeleton = load_offloaded(str(tmp_path), dtype="float32").model
    found, after_block = held_map_errors(shares)
    streamed = stream_moments_blockwise(skeleton, ids, batch_size=4, progress=False, scores=list(SCORES),
                                        held_rows=rows, after_block=after_block)
    assert streamed.held.rows == tuple(rows) and all(g is None for g in streamed.grams[:-1])  # freed as it went
    for share in shares:
        assert found[share] == pytest.approx(expected[share], rel=1e-4)
    assert expected[0.7] != pytest.approx(expected[1.0], rel=1e-3)  # two shares, two sets of errors
