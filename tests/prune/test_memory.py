"""``prune.memory``: the peak-RSS reading every memory figure uses."""

import mmap

import psutil
import pytest

from prune.memory import peak_rss_bytes, return_freed_memory

SLACK = 4 * 2**20  # the kernel syncs its RSS counters lazily: readings can differ by a few pages
SIZE = 128 * 2**20
PAGE = mmap.PAGESIZE


def test_peak_rss_is_a_high_water_mark():
    # An anonymous mapping, not a tensor: malloc may carve a tensor out of heap an earlier test freed and keep it
    # resident after it is freed, so "no longer resident" would depend on which tests ran before
    block = mmap.mmap(-1, SIZE)
    for offset in range(0, SIZE, PAGE):  # touched: resident
        block[offset] = 1
    with_block = psutil.Process().memory_info().rss
    assert peak_rss_bytes() >= with_block - SLACK
    block.close()  # unmapped: no longer resident, but the peak remembers it
    peak, now = peak_rss_bytes(), psutil.Process().memory_info().rss
    assert peak >= with_block - SLACK
    assert peak - now > 100 * 2**20


def test_freed_heap_memory_goes_back_to_the_system():
    from prune.memory import _libc

    if getattr(_libc(), "malloc_trim", None) is None:
        pytest.skip("no glibc malloc_trim here (macOS, musl): return_freed_memory does nothing")
    # blocks below glibc's mmap threshold come from its heap; one allocated after them pins the heap's top, so
    # freeing them leaves them resident until the heap is trimmed
    chunks = [b"x" * 100_000 for _ in range(1000)]
    pin = b"y" * 100_000
    del chunks
    before = psutil.Process().memory_info().rss
    return_freed_memory()
    after = psutil.Process().memory_info().rss
    assert before - after > 50 * 2**20
    assert pin
