"""The engram errors that cross floors, at the bottom so that raising one imports nothing above it
(the modules that own them re-export them: `table_file.TableFileError`, `group.EngramWorkerError`)."""

from __future__ import annotations


class TableFileError(ValueError):
    """A table file that cannot be read or does not match what was expected (names the file and key)."""


class TableFileWriteError(OSError):
    """Writing a table file failed (disk full, I/O error). The message names the file and says that
    nothing was left under its name; `errno` is the operating system's error number."""


class EngramWorkerError(RuntimeError):
    """A worker process of an EngramGroup died, failed to start, or failed a command.

    The message names the rank (and `rank` holds it) whenever one rank is to blame. `state` says what
    became of the worker: "died" (it ended; `exitcode` holds how), "stopped" (it is frozen: SIGSTOP or a
    debugger), "unresponsive" (it runs but did not answer in time) or None (a command failed).
    """

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None, state: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.state = state if state is not None else ("died" if exitcode is not None else None)


class EngramMemoryError(ValueError):
    """A memory used with input it was not built for (another tokenizer, width, or conditioning)."""
