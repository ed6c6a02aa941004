"""How the pack's long loops (reads, quantization, saves) report to ComfyUI: its own ProgressBar, whose updates a
server sends to the page that queued the prompt, and its interrupt check."""

from __future__ import annotations

import comfy.model_management
import comfy.utils

# At most this many progress updates per read, quantization or save (and always the last one): each update is two
# websocket messages from the server to the page that queued the prompt, one of them the whole progress state of the
# prompt; one update per tensor was two messages for each of a file's hundreds or thousands of tensors.
PROGRESS_UPDATES = 100


def progress_fn():
    """``progress(done, total)`` for the pack's readers and writers: checks for an interrupt at every tensor and moves
    the node's bar by at most ``PROGRESS_UPDATES`` steps."""
    state = {"bar": None, "shown": -1}

    def progress(done, total):
        comfy.model_management.throw_exception_if_processing_interrupted()
        step = done * PROGRESS_UPDATES // max(total, 1)
        if step == state["shown"] and done < total:
            return
        state["shown"] = step
        if state["bar"] is None:
            state["bar"] = comfy.utils.ProgressBar(total)
        state["bar"].update_absolute(done, total)

    return progress
