"""Process checks the tests share."""

from __future__ import annotations


def process_ended(pid: int) -> bool:
    """True once process `pid` has exited: gone from /proc, or a zombie nobody has reaped yet."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return True
