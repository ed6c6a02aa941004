"""engram/placement.py: the store a memory gets says where it lives and why (an explicit Placement)."""

from __future__ import annotations

import pytest
import torch

from fp8_engram.engram.host_tier import HostRowStore
from fp8_engram.engram.placement import Placement, make_store, placement_text, resolve_tier
from fp8_engram.engram.store import LocalRowStore

pytestmark = pytest.mark.unit

ROWS = lambda ranks: [-(-n // ranks) * ranks for n in (300, 120)]  # noqa: E731 - as MemoryConfig pads them


def test_one_cpu_rank_is_a_local_store_placed_on_the_device_tier():
    store = make_store(ROWS, 64, torch.bfloat16, "cpu", 1)
    try:
        assert isinstance(store, LocalRowStore)
        assert store.placement == Placement("device", "CPU", 1, "asked for")
        assert placement_text(store).startswith("placement: device (")
    finally:
        store.close()


def test_the_host_tier_is_placed_with_the_reason_it_was_chosen():
    store = make_store(ROWS, 64, torch.bfloat16, "cpu", 1, placement="host", reason="auto: too big")
    try:
        assert isinstance(store, HostRowStore)
        assert store.placement.tier == "host" and store.placement.reason == "auto: too big"
        assert store.placement.fell_back_from is None
        assert "instead of" not in placement_text(store)
    finally:
        store.close()


def test_a_store_made_directly_has_no_placement():
    store = LocalRowStore([16], 8)
    assert store.placement is None
    store.close()


def test_auto_takes_the_device_while_the_tables_fit_in_half_its_free_memory():
    size = sum(ROWS(1)) * 64 * 2
    asked = []

    def free(n):
        return lambda: asked.append(n) or n

    assert resolve_tier("auto", ROWS(1), 64, torch.bfloat16, free(2 * size))[0] == "device"
    tier, why = resolve_tier("auto", ROWS(1), 64, torch.bfloat16, free(2 * size - 1))
    assert tier == "host" and why.startswith("auto:") and "do not fit" in why
    assert resolve_tier("auto", ROWS(1), 64, torch.bfloat16, lambda: None)[0] == "device"
    assert resolve_tier("host", ROWS(1), 64, torch.bfloat16, free(0)) == ("host", "asked for")
    assert asked == [2 * size, 2 * size - 1], "the free memory is asked for only when the choice is auto"
    with pytest.raises(ValueError, match="placement must be one of"):
        resolve_tier("gpu", ROWS(1), 64, torch.bfloat16, free(0))
