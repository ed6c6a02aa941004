"""One prompt's websocket messages on a real ComfyUI server, each with the time it arrived here.

`PromptWatch(comfy)` opens the websocket before the prompt is queued, keeps every message of that
prompt (`.messages`, each a `Message` with `at` = time.monotonic() on arrival), and runs actions when
a message meets a trigger (`.on(trigger, action)`). An action runs on a thread of its own, so the
reader keeps stamping messages while it runs (a kill that waits for the process to end does not
delay the stamps of what the server sent meanwhile). Timings taken from these stamps measure the
event itself (a node's own run, the steps a training made after a kill), not a whole prompt.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Callable

TERMINAL = ("execution_success", "execution_error", "execution_interrupted")


@dataclass(frozen=True)
class Message:
    at: float  # time.monotonic() when it arrived here
    kind: str
    data: dict


@dataclass
class Fired:
    """What became of one `.on()` action: whether and when it ran, and what it raised."""

    trigger_message: Message | None = None
    started: float | None = None
    finished: float | None = None
    error: BaseException | None = None

    @property
    def ran(self) -> bool:
        return self.started is not None


# ----- triggers: Message -> bool -----

def executing(node: str) -> Callable[[Message], bool]:
    return lambda m: m.kind == "executing" and m.data.get("node") == node


def progress_of(node: str, at_least: int = 1) -> Callable[[Message], bool]:
    return lambda m: m.kind == "progress" and m.data.get("node") == node and m.data.get("value", 0) >= at_least


def execution_start(m: Message) -> bool:
    return m.kind == "execution_start"


class PromptWatch:
    def __init__(self, comfy, timeout: float = 600.0) -> None:
        self.comfy = comfy
        self.timeout = timeout
        self.messages: list[Message] = []
        self.prompt_id: str | None = None
        self._actions: list[tuple[Callable[[Message], bool], Callable[[Message], None], Fired]] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ended = threading.Event()  # a terminal message of the prompt arrived

    def on(self, trigger: Callable[[Message], bool], action: Callable[[Message], None]) -> Fired:
        """Run `action(message)` once, on its own thread, for the first message that meets `trigger`."""
        fired = Fired()
        self._actions.append((trigger, action, fired))
        return fired

    def run(self, graph: dict) -> tuple[dict | None, Exception | None]:
        """Queue `graph`, wait for it; (history, None) or (None, the WorkflowError). Actions are waited for
        (and an error one raised is raised here) before this returns."""
        import websocket
        from comfyhost import WorkflowError

        ws = websocket.create_connection(f"{self.comfy.url.replace('http', 'ws', 1)}/ws?clientId={self.comfy.client_id}", timeout=1.0)
        reader = threading.Thread(target=self._read, args=(ws,), daemon=True)
        try:
            self.prompt_id = self.comfy.queue(graph)
            reader.start()
            try:
                history, exc = self.comfy.wait(self.prompt_id, self.timeout), None
            except WorkflowError as error:
                history, exc = None, error
            self._ended.wait(10.0)  # the server sent the last message before it wrote the history
        finally:
            self._stop.set()
            ws.close()
        if reader.is_alive():
            reader.join(5.0)
        for thread in list(self._threads):
            thread.join(self.timeout)
        for _, _, fired in self._actions:
            if fired.error is not None:
                raise fired.error
        return history, exc

    # ----- reading -----

    def _read(self, ws) -> None:
        import websocket

        deadline = time.monotonic() + self.timeout
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                raw = ws.recv()
            except websocket.WebSocketTimeoutException:
                continue
            except Exception:  # closed by run()
                return
            at = time.monotonic()
            if not isinstance(raw, str) or not raw:
                continue  # previews (binary), or the empty frame of a closing socket
            try:
                message = json.loads(raw)
            except ValueError:
                continue
            data = message.get("data") or {}
            if data.get("prompt_id") != self.prompt_id:
                continue
            m = Message(at, message.get("type"), data)
            with self._lock:
                self.messages.append(m)
            for trigger, action, fired in self._actions:
                if fired.trigger_message is None and trigger(m):
                    fired.trigger_message = m
                    thread = threading.Thread(target=self._act, args=(action, fired, m), daemon=True)
                    self._threads.append(thread)
                    thread.start()
            if m.kind in TERMINAL:
                self._ended.set()

    @staticmethod
    def _act(action, fired: Fired, m: Message) -> None:
        fired.started = time.monotonic()
        try:
            action(m)
        except BaseException as exc:  # noqa: BLE001 - raised again by run()
            fired.error = exc
        finally:
            fired.finished = time.monotonic()

    # ----- what arrived -----

    def snapshot(self) -> list[Message]:
        with self._lock:
            return list(self.messages)

    def first(self, predicate: Callable[[Message], bool]) -> Message | None:
        return next((m for m in self.snapshot() if predicate(m)), None)

    def progress(self, node: str) -> list[Message]:
        return [m for m in self.snapshot() if m.kind == "progress" and m.data.get("node") == node]

    def span(self, node: str) -> tuple[float, float] | None:
        """(arrival of the node's "executing", arrival of the first message that says it ended: its
        "executed", the next node's "executing" (or a cached node's "executed"), or the prompt's end), or
        None when it did not run. ComfyUI runs one node at a time, so what comes next marks the end."""
        messages = self.snapshot()
        for i, m in enumerate(messages):
            if m.kind == "executing" and m.data.get("node") == node:
                for later in messages[i + 1:]:
                    if later.kind in TERMINAL or later.kind == "executed" or (later.kind == "executing" and later.data.get("node") != node):
                        return m.at, later.at
                return None
        return None

    def took(self, node: str) -> float:
        """Seconds between the node's start and its end as the messages tell (see span)."""
        span = self.span(node)
        assert span is not None, f"node {node} did not run (or its end never arrived): {[(m.kind, m.data.get('node')) for m in self.snapshot()]}"
        return span[1] - span[0]

    def until_end_of(self, node: str) -> float:
        """Seconds from the prompt's "execution_start" (before ComfyUI looks at each node's fingerprint)
        to the node's end as the messages tell (see span)."""
        start = self.first(execution_start)
        span = self.span(node)
        assert start is not None and span is not None, f"node {node} did not run: {[(m.kind, m.data.get('node')) for m in self.snapshot()]}"
        return span[1] - start.at
