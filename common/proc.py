"""What the machine and its processes have, read from /proc (Linux); every reader gives None where
/proc cannot tell."""

from __future__ import annotations


def kib_fields(path: str = "/proc/meminfo") -> dict[str, int] | None:
    """The `Name: <n> kB` fields of a /proc file (/proc/meminfo, /proc/self/status) in bytes; None where
    it cannot be read."""
    try:
        with open(path) as f:
            return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[-1:] == ["kB"]}
    except (OSError, ValueError, IndexError):
        return None


def process_state(pid: int) -> str | None:
    """The state letter of process `pid` (R, S, D, T, t, Z, X, ...); None when it is gone or unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # the state is the field after the parenthesized command name (which may hold spaces and ")")
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def overcommit_mode() -> int | None:
    """/proc/sys/vm/overcommit_memory: 0 heuristic, 1 always, 2 strict; None where it cannot be read."""
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def cpu_model() -> str | None:
    """The processor's model name from /proc/cpuinfo; None where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
