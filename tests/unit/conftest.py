"""Unit-test fixtures: every test starts with an empty default verdict book, so a kernel a test replaces is
proven anew and no verdict of one test decides another's path (nor silences its log line)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _fresh_fast_path_verdicts():
    from fp8_engram.quant.compute import default_book
    from fp8_engram.quant.runtime import reset_log_once

    default_book().reset()
    reset_log_once()  # a verdict's "logged once" line belongs to the test that made it
    yield
    default_book().reset()
