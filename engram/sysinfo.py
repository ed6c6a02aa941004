"""What the machine and this process have, read from /proc, and byte counts in words for messages."""

from __future__ import annotations


def kib_fields(path: str = "/proc/meminfo") -> dict[str, int] | None:
    """The `Name: <n> kB` fields of a /proc file (/proc/meminfo, /proc/self/status) in bytes; None where
    it cannot be read."""
    try:
        with open(path) as f:
            return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[-1:] == ["kB"]}
    except (OSError, ValueError, IndexError):
        return None


def gib_text(n: float) -> str:
    """`n` bytes as "1.25 GiB", or "12 MiB" under a GiB."""
    return f"{n / (1 << 30):.2f} GiB" if abs(n) >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"
