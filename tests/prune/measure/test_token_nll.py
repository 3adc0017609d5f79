"""The vocabulary-wide sums taken a row's chunk of positions at a time give those of whole-batch ones."""

import torch

from prune.measure.perplexity import LOGPROB_POSITIONS, row_chunks, token_nll


def test_row_chunks_cover_every_position_of_every_row_once_a_row_at_a_time():
    pieces = list(row_chunks(3, 2 * LOGPROB_POSITIONS + 5))
    assert len(pieces) == 3 * 3
    seen = torch.zeros(3, 2 * LOGPROB_POSITIONS + 5, dtype=torch.long)
    for row, span in pieces:
        assert span.stop - span.start <= LOGPROB_POSITIONS
        seen[row, span] += 1
    assert torch.equal(seen, torch.ones_like(seen))
    assert list(row_chunks(2, 3, 2)) == [(0, slice(0, 2)), (0, slice(2, 3)), (1, slice(0, 2)), (1, slice(2, 3))]


def test_token_nll_by_rows_chunks_is_the_whole_batch_log_softmax_per_row():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 2 * LOGPROB_POSITIONS + 9, 40, generator=generator) * 3
    targets = torch.randint(0, 40, logits.shape[:2], generator=generator)
    picked = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    expected = -picked.double().sum(1)
    # a slice across rows, as the held-out perplexity passes it (its rows not contiguous)
    assert torch.allclose(token_nll(logits[:, 1:], targets[:, 1:]), expected - (-picked[:, 0].double()),
                          rtol=0, atol=1e-9)
    assert torch.allclose(token_nll(logits, targets), expected, rtol=0, atol=1e-9)
    # 16-bit logits are turned into float32 first
    half = logits.bfloat16()
    assert torch.allclose(token_nll(half, targets), -torch.log_softmax(half.float(), -1).gather(
        -1, targets[..., None]).squeeze(-1).double().sum(1), rtol=0, atol=1e-9)
