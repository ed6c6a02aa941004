"""The errors of the quantization library: bad input to it, and files it cannot read.

Floor 1 (imports nothing from the pack), so that every module above can raise them without depending
on the layouts or on file reading.
"""

from __future__ import annotations

__all__ = ["QuantizationError", "FormatError"]


class QuantizationError(ValueError):
    """Bad input to the quantization library (wrong dtype, bad scale, shape mismatch, ...)."""


class FormatError(ValueError):
    """A file this pack cannot read as it claims to be; the message names file, key and expectation."""
