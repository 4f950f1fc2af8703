"""HeapTrim: the host heap's free pages go back to the system after a step, and nothing else changes."""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch

from rlhf_lit.callbacks.memory import HeapTrim, trim_heap

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None, reason="glibc only"
)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@glibc
def test_freed_heap_memory_leaves_the_resident_set_only_after_a_trim():
    trim_heap()
    before = _rss_mb()
    # 256 MiB in 64 KiB blocks: below glibc's mmap threshold, so they come from the heap and stay resident
    # when freed; one small block allocated last pins the top so free() alone cannot shrink the heap.
    blocks = [bytearray(64 * 1024) for _ in range(4096)]
    pin = bytearray(64 * 1024)
    assert _rss_mb() - before > 200
    del blocks
    gc.collect()
    held = _rss_mb()
    assert held - before > 200  # freed, but still resident
    assert trim_heap() is True
    assert _rss_mb() < held - 200  # the trim gave at least 200 of the 256 MiB back
    del pin


class _Module:
    def __init__(self, device: str) -> None:
        self.device = torch.device(device)


def test_the_callback_trims_every_n_batches_and_after_validation_on_a_cpu_only():
    cb = HeapTrim(every_n_steps=2)
    cpu = _Module("cpu")
    for batch_idx in range(5):  # batches 2 and 4
        cb.on_train_batch_end(None, cpu, None, None, batch_idx)
    assert cb.trims == 2
    cb.on_validation_end(None, cpu)
    assert cb.trims == 3
    cb.on_train_batch_end(None, _Module("meta"), None, None, 1)  # not the host's memory: nothing to trim
    assert cb.trims == 3


def test_every_n_steps_below_one_is_refused():
    with pytest.raises(ValueError, match="every_n_steps must be >= 1, got 0"):
        HeapTrim(every_n_steps=0)


@pytest.mark.parametrize("config", ["configs/dpo/smollm2_lora.yaml", "configs/ppo/smollm2_lora.yaml"])
def test_the_measured_smollm2_configs_trim_the_heap(config):
    """docs/scale.md measured these two with HeapTrim on; the configs must keep it."""
    import yaml

    from tests.tiny_runs import REPO_ROOT

    callbacks = yaml.safe_load((REPO_ROOT / config).read_text())["trainer"]["callbacks"]
    assert {"class_path": "rlhf_lit.callbacks.HeapTrim"} in callbacks
