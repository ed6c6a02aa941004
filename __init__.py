"""fp8-engram: FP8 models and a multi-GPU engram memory for ComfyUI.

ComfyUI imports this file when the pack sits in `custom_nodes/`. Importing it is cheap and has no side
effects: the node classes (the only code that touches `comfy`) load when ComfyUI calls
`comfy_entrypoint`, and `quant/` and `engram/` stay usable as plain libraries without ComfyUI.
"""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    """Entry point of ComfyUI's V3 node API: returns the extension that lists this pack's nodes."""
    from .nodes import FP8EngramExtension

    return FP8EngramExtension()


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
