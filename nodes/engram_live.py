"""How long the engram memories the nodes make live: reuse, parking, release, and what a dead worker means.

One live memory per New/Load node, reused while its settings stay the same. The registry holds
memories WEAKLY: ComfyUI's output cache owns them. When the cache lets go of a memory (its node was
deleted, or its node runs again and ComfyUI drops the old output first), the memory's tables are
parked: a run of the same node with the same settings during that prompt takes them back (no new
worker processes); otherwise they are closed, with their worker processes, once that prompt is done.
A node run with other settings closes its previous memory at once; ComfyUI's "free model memory"
(POST /free, which calls comfy.model_management.unload_all_models) closes every memory. A memory that
was closed or lost a worker makes its node report "changed" (fingerprint_inputs), so the next prompt
builds it again instead of being served the dead one from the cache.

`LIVE` (a `LiveMemories`) is the registry; the node classes (nodes/engram.py) use it through its
methods and import nothing else of this module's state. What the nodes know about a memory beyond the
library's own fields (the CLIP it was last used with, the version it was clean at, Load's settings) is
its `MemoryNotes`, kept beside the memory (weakly), never attached to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
import weakref
from typing import Any

import comfy.model_management

from ..engram.group import EngramWorkerError, stop_idle_template
from ..engram.memory import EngramMemory, EngramMemoryError

logger = logging.getLogger(__name__)

_PARK_FALLBACK_S = 30.0  # when ComfyUI's prompt queue cannot be read: how long parked tables wait
_REAP_PERIOD_S = 0.5


class _Live:
    __slots__ = ("key", "ref")

    def __init__(self, key: tuple, memory: EngramMemory) -> None:
        self.key = key
        self.ref = weakref.ref(memory)


class _Parked:
    __slots__ = ("key", "store", "state", "name", "prompt_id", "since")

    def __init__(self, key, store, state, name, prompt_id) -> None:
        self.key, self.store, self.state, self.name, self.prompt_id = key, store, state, name, prompt_id
        self.since = time.monotonic()


@dataclasses.dataclass
class MemoryNotes:
    """What the nodes know of a memory beyond the library's fields. `clip`: the last CLIP it was used with
    in this session (for nodes given none: Engram Apply). `clean_version`: the version its node made or
    loaded it at (written since when its version moved on). `load_settings`: Load's (path, mtime, devices,
    ranks, placement), None for a memory New made."""

    clip: Any = None
    clean_version: int | None = None
    load_settings: tuple | None = None


def _close_store_quietly(store, name: str) -> None:
    try:
        store.close()
    except Exception:  # may run from a finalizer or the reaper: log, never raise
        logger.warning("engram: closing the tables of %s failed", name, exc_info=True)


def _running_prompt_ids() -> set | None:
    """Ids of the prompts ComfyUI is running now; None when its queue cannot be read."""
    try:
        from server import PromptServer

        queue = PromptServer.instance.prompt_queue
        with queue.mutex:
            return {item[1] for item in queue.currently_running.values()}
    except Exception:
        return None


def _current_prompt_id() -> str | None:
    try:
        from server import PromptServer

        return getattr(PromptServer.instance, "last_prompt_id", None)
    except Exception:
        return None


def _how_it_died(code: int | None) -> str:
    """" (killed by signal N)" / " (exit code N)" for a worker's exit code, "" when unknown."""
    return "" if code is None else (f" (killed by signal {-code})" if code < 0 else f" (exit code {code})")


def _what_became(exc: BaseException) -> str:
    """"died (killed by signal 9)", "was frozen (stopped)", "stopped answering" for a worker error."""
    state = getattr(exc, "state", None)
    if state == "stopped":
        return "was frozen (stopped by SIGSTOP or a debugger)"
    if state == "unresponsive":
        return "stopped answering"
    return f"died{_how_it_died(getattr(exc, 'exitcode', None))}"


def _lost_reason(exc: BaseException) -> str:
    rank = getattr(exc, "rank", None)
    who = f"engram worker rank {rank}" if rank is not None else "an engram worker"
    return f"lost: {who} {_what_became(exc)}"


def current_node_id() -> str | None:
    """The id of the node ComfyUI is running a method of (fingerprint_inputs gets no hidden inputs)."""
    try:
        from comfy_execution.utils import get_executing_context
    except ImportError:
        return None
    context = get_executing_context()
    return None if context is None else str(context.node_id)


SAVE_ADVICE = ("To keep what a memory has learned across such failures, save it with Save Engram Memory and "
               "use it through Load Engram Memory, which rebuilds it from the file.")


def _recovery(memory: EngramMemory) -> str:
    """What happens when the prompt is queued again, for a memory that lost a worker."""
    if memory.source:
        name = os.path.basename(memory.source)
        return f"Queue the prompt again: Load Engram Memory rebuilds it from {name}."
    kept = f" (its last save, {os.path.basename(memory.saved_to)}, is intact)" if memory.saved_to else ""
    return (f"What was written into it since it was made is lost{kept}. Queue the prompt again: New Engram Memory "
            f"makes a new empty memory and the nodes after it write it again. {SAVE_ADVICE}")


def problem(memory: EngramMemory) -> str | None:
    """None when the memory can serve; else why not, as a phrase ("closed ...", "lost ...")."""
    if memory.closed:
        return memory.closed_reason
    try:
        memory.check()
    except EngramWorkerError as exc:
        return _lost_reason(exc)
    except Exception as exc:  # a store that cannot tell: treat as unusable
        return f"lost: {exc}"
    return None


@contextlib.contextmanager
def serving(node: str, memory: EngramMemory):
    """Run a node's use of `memory`; a dead worker or a closed memory becomes an error that names the
    memory, the rank and what to do (and the failed memory is closed, freeing its other workers)."""
    try:
        if memory.closed:
            raise EngramMemoryError(f"{memory.name} was {memory.closed_reason}; queue the prompt again to make it again")
        yield
    except EngramWorkerError as exc:
        reason = _lost_reason(exc)
        logger.warning("engram: %s: %s was %s (%s)", node, memory.name, reason, exc)
        memory.close(reason)
        rank = getattr(exc, "rank", None)
        code = getattr(exc, "exitcode", None)
        worker = f"its engram worker rank {rank}" if rank is not None else "one of its engram workers"
        raise EngramWorkerError(f"{node}: {memory.name} lost {worker}, which {_what_became(exc)}. {_recovery(memory)}",
                                rank, code, getattr(exc, "state", None)) from exc
    except EngramMemoryError as exc:
        raise EngramMemoryError(f"{node}: {exc}") from exc


class LiveMemories:
    """The memories the nodes made: one live memory per New/Load node (held weakly, by node id), tables
    parked while their memory's output is gone during a prompt, every memory made (for release_all), the
    memory New made per (node id, settings), and each memory's `MemoryNotes`."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._live: dict[str, _Live] = {}
        self._parked: dict[str, _Parked] = {}
        self._made: weakref.WeakSet[EngramMemory] = weakref.WeakSet()  # every memory the nodes made, until collected
        self._by_settings: weakref.WeakValueDictionary[tuple, EngramMemory] = weakref.WeakValueDictionary()
        self._notes: weakref.WeakKeyDictionary[EngramMemory, MemoryNotes] = weakref.WeakKeyDictionary()
        self._reaper: threading.Thread | None = None

    # ----- per memory -----

    def notes(self, memory: EngramMemory) -> MemoryNotes:
        """The nodes' notes of `memory` (empty ones for a memory they have not met)."""
        with self._lock:
            notes = self._notes.get(memory)
            if notes is None:
                notes = self._notes[memory] = MemoryNotes()
            return notes

    def written_since_made(self, memory: EngramMemory) -> bool:
        """Whether `memory` was written (Memorize, Train) since its node made or loaded it."""
        clean = self.notes(memory).clean_version
        return clean is not None and memory.version != clean

    def adopt(self, memory: EngramMemory, node_id: str | None, key: tuple) -> EngramMemory:
        """Register a memory made by a node: parked or closed when it is collected, closed by release_all()."""
        weakref.finalize(memory, self._on_collected, node_id, key, memory.store, memory.state, memory.name)
        self._made.add(memory)
        return memory

    # ----- per node -----

    def memory_of(self, node_id: str | None, key: tuple | None = None) -> EngramMemory | None:
        """The live memory of node `node_id` (with `key`: only when it was made with that key)."""
        with self._lock:
            entry = self._live.get(node_id) if node_id is not None else None
            if entry is None or (key is not None and entry.key != key):
                return None
            return entry.ref()

    def made_with(self, node_id: str | None, settings: tuple) -> EngramMemory | None:
        """The memory New Engram Memory (node `node_id`) made with `settings`, while it lives."""
        return self._by_settings.get((node_id, settings))

    def remember_settings(self, node_id: str, settings: tuple, memory: EngramMemory) -> None:
        self._by_settings[(str(node_id), settings)] = memory

    def replace(self, node_id: str | None, key: tuple, make, reuse, rewrap) -> tuple[EngramMemory, str | None]:
        """(the node's memory, why its previous memory had to be replaced or None).

        Reuses the node's previous memory (or its parked tables, through `rewrap(store, state)`) when
        the key is the same and it still serves; otherwise closes it and makes a new one. A reuse that
        fails (a worker died, an interrupt, a bad file) closes the previous memory: nothing half-rewritten
        is kept. An interrupt or a file error propagates."""
        with self._lock:
            entry = self._live.pop(node_id, None) if node_id is not None else None
            old = entry.ref() if entry is not None else None
            parked = self._parked.pop(node_id, None) if node_id is not None and old is None else None
            if parked is not None:
                if parked.key == key and parked.state.closed_reason is None:
                    old = rewrap(parked.store, parked.state)
                    entry = _Live(key, old)
                else:
                    parked.state.closed_reason = parked.state.closed_reason or "closed: its node now has other settings"
                    _close_store_quietly(parked.store, parked.name)
            note = None
            if old is not None:
                note = problem(old)
                if note is None and entry.key == key:
                    try:
                        reuse(old)
                    except EngramWorkerError as exc:
                        note = _lost_reason(exc)
                        old.close(note)
                    except BaseException:
                        old.close("closed: its rebuild failed or was cancelled")
                        raise
                    else:
                        self._live[node_id] = entry
                        return old, None
                if not old.closed:
                    old.close("closed: its node now has other settings" if note is None else note)
            memory = make()
            if node_id is not None:
                self._live[node_id] = _Live(key, memory)
            return memory, note

    # ----- release -----

    def release_all(self, reason: str) -> int:
        """Close every memory the nodes made (their tables, GPU memory and worker processes), all at once
        (each close waits for its workers to stop). Returns how many were closed."""
        with self._lock:
            memories = [m for m in list(self._made) if not m.closed]
            parked = list(self._parked.values())
            self._live.clear()
            self._parked.clear()

        def close_memory(memory: EngramMemory) -> None:
            try:
                memory.close(reason)
            except Exception:
                logger.warning("engram: closing %s failed", memory.name, exc_info=True)

        def close_parked(p: _Parked) -> None:
            p.state.closed_reason = p.state.closed_reason or reason
            _close_store_quietly(p.store, p.name)

        closers = [threading.Thread(target=close_memory, args=(m,), daemon=True) for m in memories]
        closers += [threading.Thread(target=close_parked, args=(p,), daemon=True) for p in parked]
        for thread in closers:
            thread.start()
        for thread in closers:
            thread.join()
        if closers:
            logger.info("engram: %s: released %d memory(ies)", reason, len(closers))
        return len(closers)

    def _on_collected(self, node_id: str | None, key: tuple, store, state, name: str) -> None:
        """Finalizer of a node's memory: park its tables for the prompt now running, or close them."""
        if node_id is None or state.closed_reason is not None:
            _close_store_quietly(store, name)
            return
        with self._lock:
            entry = self._live.get(node_id)
            if entry is not None and entry.ref() is None:
                self._live.pop(node_id, None)
            previous = self._parked.pop(node_id, None)
            self._parked[node_id] = _Parked(key, store, state, name, _current_prompt_id())
        if previous is not None and previous.store is not store:
            previous.state.closed_reason = previous.state.closed_reason or "closed: replaced"
            _close_store_quietly(previous.store, previous.name)
        self._start_reaper()

    def _start_reaper(self) -> None:
        with self._lock:
            if self._reaper is not None and self._reaper.is_alive():
                return
            self._reaper = threading.Thread(target=self._reap_loop, name="engram-release", daemon=True)
            self._reaper.start()

    def _reap_loop(self) -> None:
        """Close parked tables nobody took back: once the prompt that parked them is done."""
        while True:
            time.sleep(_REAP_PERIOD_S)
            running = _running_prompt_ids()
            now = time.monotonic()
            with self._lock:
                done = [node_id for node_id, p in self._parked.items()
                        if (running is None and now - p.since > _PARK_FALLBACK_S)
                        or (running is not None and p.prompt_id not in running)]
                expired = [self._parked.pop(node_id) for node_id in done]
                if not self._parked and not expired:
                    self._reaper = None
                    return
            for parked in expired:
                logger.info("engram: released the tables of %s (its node's output is gone)", parked.name)
                parked.state.closed_reason = parked.state.closed_reason or "released: its node's output is gone"
                _close_store_quietly(parked.store, parked.name)


LIVE = LiveMemories()


def _install_release_hook() -> None:
    """Close every engram memory when ComfyUI unloads all models ("free model memory": POST /free with
    unload_models or free_memory; also its out-of-memory recovery). Both ComfyUI 0.3.75 and 0.29 call
    comfy.model_management.unload_all_models() through the module there; it has no hook list."""
    mm = comfy.model_management
    original = mm.unload_all_models
    if getattr(original, "_fp8_engram_releases", False):
        return

    @functools.wraps(original)
    def unload_all_models(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            LIVE.release_all("released when ComfyUI freed model memory")
            stop_idle_template()  # the worker template would otherwise linger a minute for a rebuild

    unload_all_models._fp8_engram_releases = True
    mm.unload_all_models = unload_all_models


_install_release_hook()
