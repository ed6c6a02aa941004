"""Non-finite numbers given where a number means a strength or a step size are refused by the library.

ComfyUI's FLOAT validation compares with min and max, and every comparison with NaN is false, so a raw
JSON `NaN` reaches the nodes; the nodes refuse it by input name (tests/integration/test_engram_float_inputs.py),
and the library refuses it too, for scripts that call it directly."""

import math

import pytest
import torch

from fp8_engram.engram.fit import fit
from fp8_engram.engram.inject import inject
from fp8_engram.engram.store import LocalRowStore
from fp8_engram.engram.streams import Stream, StreamTokens

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("strength", [math.nan, math.inf, -math.inf])
def test_inject_refuses_a_non_finite_strength(strength):
    cond = torch.randn(1, 4, 8)
    placed = [StreamTokens(Stream("clip_l", "l", 0, 8), torch.tensor([-1, 5, 6, -1]), 0)]
    values = [torch.ones(4, 8)]
    with pytest.raises(ValueError, match="strength must be a finite number"):
        inject(cond, placed, values, strength)
    # a finite strength is still applied, and zero rows keep their bits
    out = inject(cond, placed, values, 0.5)
    assert torch.allclose(out, cond + 0.5)


@pytest.mark.parametrize("lr", [math.nan, math.inf, 0.0, -0.1])
def test_fit_refuses_a_learning_rate_that_is_not_a_positive_finite_number(lr):
    store = LocalRowStore([16], 4, torch.bfloat16)
    with pytest.raises(ValueError, match="lr > 0"):
        fit(store, [], steps=1, lr=lr)
