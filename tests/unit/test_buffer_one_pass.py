"""LocalEngramBuffer.gather_layers: every layer's rows in one pass (what EngramGroup.fetch_rows, the
product's lookup, uses) equals the per-layer gather of the same ids bit for bit, invalid ids giving zero
rows and zero scales, in every gather mode a CPU can run (one select over the unified view, the
per-peer selects, and the Triton kernel in its interpreter where Triton is installed)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fp8_engram.engram import ue8m0
from fp8_engram.engram.buffer import LocalEngramBuffer
from fp8_engram.engram.worker import gloo_group

pytestmark = pytest.mark.unit

ROWS = [40, 24, 9]
HIDDEN = 256


def _triton_interpretable() -> bool:
    try:
        from fp8_engram.engram import gather_triton  # noqa: F401
    except ImportError:
        return False
    return True


MODES = ["unified", "grouped"] + (["triton"] if _triton_interpretable() else [])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_one_pass_equals_the_per_layer_gather(mode, fp8):
    group = gloo_group(dist.HashStore(), 0, 1, timedelta(seconds=30))
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    packs = ue8m0.num_sf_packs(HIDDEN) if fp8 else 0
    buffer = LocalEngramBuffer(group, ROWS, HIDDEN, 16, 4, dtype, packs, device="cpu", gather=mode)
    try:
        assert buffer.gather_mode == mode
        g = torch.Generator().manual_seed(7)
        full = [torch.randn(n, HIDDEN, generator=g) for n in ROWS]
        if fp8:
            pairs = [ue8m0.quantize_rows(t) for t in full]
            buffer.write([q for q, _ in pairs], [s for _, s in pairs])
        else:
            buffer.write([t.bfloat16() for t in full])
        for n in (0, 1, 13):
            ids = torch.randint(-3, 45, (len(ROWS), n), generator=g, dtype=torch.int32)
            data, sf = buffer.gather_layers(ids)
            assert data.shape == (len(ROWS), n, HIDDEN) and (sf is None) == (not fp8)
            for layer, count in enumerate(ROWS):
                valid = (ids[layer] >= 0) & (ids[layer] < count)
                want, want_sf = buffer.read_global_rows(layer, torch.where(valid, ids[layer], 0).long())
                want = want.view(torch.uint8).clone()
                want[~valid] = 0
                assert torch.equal(data[layer].view(torch.uint8), want), (layer, n)
                if fp8:
                    want_sf = want_sf.clone()
                    want_sf[~valid] = 0
                    assert torch.equal(sf[layer], want_sf), (layer, n)
        with pytest.raises(ValueError, match="cover 2 layers"):
            buffer.gather_layers(torch.zeros(2, 1, dtype=torch.int32))
    finally:
        buffer.destroy()
