"""``prune.memory``: the peak-RSS reading every memory figure uses."""

import psutil
import torch

from prune.memory import peak_rss_bytes

SLACK = 4 * 2**20  # the kernel syncs its RSS counters lazily: readings can differ by a few pages


def test_peak_rss_is_a_high_water_mark():
    block = torch.ones(32 * 2**20)  # 128 MiB, touched
    with_block = psutil.Process().memory_info().rss
    assert peak_rss_bytes() >= with_block - SLACK
    del block  # returned to the system: no longer resident, but the peak remembers it
    peak, now = peak_rss_bytes(), psutil.Process().memory_info().rss
    assert peak >= with_block - SLACK
    assert peak - now > 100 * 2**20
