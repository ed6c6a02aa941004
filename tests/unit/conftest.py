"""Unit-test fixtures: every test starts without fast-path verdicts, so a kernel a test replaces is proven
anew and no verdict of one test decides another's path."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _fresh_fast_path_verdicts():
    from fp8_engram.quant.compute import choice

    saved = choice.cache_path()
    choice.configure(None)
    choice.reset()
    yield
    choice.reset()
    choice.configure(saved)
