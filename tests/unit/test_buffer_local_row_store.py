"""LocalRowStore: the single-process RowStore (engram/store.py)."""

import pytest
import torch

from fp8_engram.engram import ue8m0
from fp8_engram.engram.store import LocalRowStore, RowStore
from helpers.numerics import sqnr

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_write_then_fetch_and_read_match_a_float64_reference(dtype):
    g = torch.Generator().manual_seed(0)
    rows, hidden = [50, 70], 256
    store = LocalRowStore(rows, hidden, dtype)
    assert isinstance(store, RowStore)
    ref = [torch.zeros(n, hidden, dtype=torch.float64) for n in rows]
    for layer, n in enumerate(rows):
        ids = torch.randperm(n, generator=g)[:30]
        vals = torch.randn(30, hidden, generator=g, dtype=torch.float64)
        store.write_rows(layer, ids, vals.float())
        ref[layer][ids] = vals
    indices = torch.randint(-5, 80, (2, 7, 3), generator=g, dtype=torch.int32)
    out = store.fetch_rows(indices)
    threshold = 40.0 if dtype == torch.bfloat16 else 25.0
    for layer, n in enumerate(rows):
        assert out[layer].dtype == torch.float32 and out[layer].shape == (7, 3, hidden)
        ids = indices[layer].reshape(-1).long()
        valid = (ids >= 0) & (ids < n)
        expect = torch.zeros(ids.numel(), hidden, dtype=torch.float64)
        expect[valid] = ref[layer][ids[valid]]
        got = out[layer].reshape(-1, hidden)
        assert torch.all(got[~valid] == 0)
        assert sqnr(expect[valid], got[valid]) > threshold
        assert torch.equal(store.read_rows(layer, ids[valid]), got[valid])


def test_fp8_write_requantizes_only_the_written_rows():
    store = LocalRowStore([8], 256, torch.float8_e4m3fn)
    store.write_rows(0, torch.tensor([1, 2]), torch.ones(2, 256))
    before = store.scales[0].clone(), store.tables[0].view(torch.uint8).clone()
    store.write_rows(0, torch.tensor([2]), torch.full((1, 256), 1000.0))
    assert torch.equal(store.scales[0][1], before[0][1]) and torch.equal(store.tables[0].view(torch.uint8)[1], before[1][1])
    assert not torch.equal(store.scales[0][2], before[0][2])
    q, sf = ue8m0.quantize_rows(torch.full((1, 256), 1000.0))
    assert torch.equal(store.scales[0][2:3], sf)


def test_repeated_row_ids_keep_the_last_value():
    store = LocalRowStore([4], 64, torch.bfloat16)
    store.write_rows(0, torch.tensor([1, 1, 1]), torch.stack([torch.full((64,), float(v)) for v in (1, 2, 3)]))
    assert torch.all(store.read_rows(0, torch.tensor([1])) == 3.0)


def test_bad_input_is_refused_with_clear_errors():
    store = LocalRowStore([4, 6], 64)
    with pytest.raises(IndexError, match=r"\[0, 6\)"):
        store.write_rows(1, torch.tensor([6]), torch.zeros(1, 64))
    with pytest.raises(ValueError, match="shape"):
        store.write_rows(0, torch.tensor([1]), torch.zeros(1, 63))
    with pytest.raises(IndexError, match="layer"):
        store.read_rows(2, torch.tensor([0]))
    with pytest.raises(ValueError, match="int32"):
        store.fetch_rows(torch.zeros(2, 1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="layers"):
        store.fetch_rows(torch.zeros(3, 1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="inf or NaN"):
        store.write_rows(0, torch.tensor([0]), torch.full((1, 64), float("inf")))
    with pytest.raises(ValueError, match="table_dtype"):
        LocalRowStore([4], 64, torch.float16)
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.read_rows(0, torch.tensor([0]))
