"""Injection into CONDITIONING: exact bits where the memory holds nothing, c + strength*gate*v elsewhere."""

import math

import pytest
import torch

from fp8_engram.engram.inject import combine, context_gate, inject, inject_block
from fp8_engram.engram.streams import Stream, StreamTokens
from helpers.numerics import sqnr

pytestmark = pytest.mark.unit


def test_zero_values_keep_exact_bits_including_negative_zero():
    block = torch.randn(2, 5, 8)
    block[0, 0, 0] = -0.0
    block[1, 2, 3] = -0.0
    v = torch.zeros(5, 8)
    v[1, 2] = 0.5  # only one element holds a value
    out = inject_block(block, v, strength=1.0)
    same = torch.ones_like(block, dtype=torch.bool)
    same[:, 1, 2] = False
    assert torch.equal(out.view(torch.int32)[same], block.view(torch.int32)[same])  # bit-level
    assert torch.signbit(out[0, 0, 0]) and torch.signbit(out[1, 2, 3])
    assert torch.allclose(out[:, 1, 2], block[:, 1, 2] + 0.5)


def test_update_matches_float64_reference_with_gate():
    torch.manual_seed(0)
    block = torch.randn(1, 6, 32, dtype=torch.float16)
    v = torch.randn(6, 32)
    got = inject_block(block, v, strength=0.7, gate=True)
    c = block.double()[0]
    rc = c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)
    rk = v.double() / torch.sqrt(v.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    s = (rc * rk).sum(-1, keepdim=True) / math.sqrt(32)
    a = torch.sigmoid(torch.sign(s) * torch.sqrt(s.abs()))
    ref = c + 0.7 * a * v.double()
    assert got.dtype == torch.float16
    assert sqnr(ref, got[0]) > 55  # fp16 output rounding only
    gate = context_gate(block[0], v)
    assert gate.shape == (6, 1) and bool(((gate > 0) & (gate < 1)).all())


def test_inject_places_each_stream_and_leaves_input_alone():
    cond = torch.randn(1, 10, 12)
    before = cond.clone()
    s_l = StreamTokens(Stream("clip_l", "l", 0, 4), torch.tensor([-1, 5, 6, -1]), 0)
    s_g = StreamTokens(Stream("clip_g", "g", 4, 8), torch.tensor([-1, 5, 6, -1]), 0)
    s_t = StreamTokens(Stream("t5xxl", "t5xxl", 0, 12), torch.tensor([7, 8, -1]), 4)
    v_l = torch.zeros(4, 4); v_l[1] = 1.0
    v_g = torch.zeros(4, 8)
    v_t = torch.zeros(3, 12); v_t[0] = 2.0
    out = inject(cond, [s_l, s_g, s_t], [v_l, v_g, v_t], strength=0.5)
    assert torch.equal(cond, before)
    expected = cond.clone()
    expected[0, 1, 0:4] += 0.5
    expected[0, 4, :] += 1.0
    assert torch.equal(out, expected)
    assert torch.equal(inject(cond, [s_l], [v_l], strength=0.0), cond)
    with pytest.raises(ValueError, match="covers rows"):
        inject(torch.randn(1, 3, 12), [s_t], [v_t])


def test_combine_sums_entries_truncates_or_projects():
    fetched = torch.randn(3, 4, 16)
    assert torch.allclose(combine(fetched, 8), fetched.sum(1)[:, :8])
    proj = torch.randn(16, 32)
    assert torch.allclose(combine(fetched, 32, proj), fetched.sum(1) @ proj, atol=1e-5)
    with pytest.raises(ValueError, match="without a projection"):
        combine(fetched, 32)
