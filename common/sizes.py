"""Byte counts in words, for messages."""

from __future__ import annotations


def size_text(n: float, mib_digits: int = 0) -> str:
    """`n` bytes as "1.25 GiB", or "12 MiB" under a GiB (`mib_digits` decimals there)."""
    return f"{n / (1 << 30):.2f} GiB" if abs(n) >= 1 << 30 else f"{n / (1 << 20):.{mib_digits}f} MiB"
