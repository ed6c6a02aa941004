"""Nodes that work on any model, quantized or not."""

from __future__ import annotations

from comfy_api.latest import io

from ..quant.summary import summarize_module
from . import CATEGORY, NODE_ID_PREFIX


class WeightReport(io.ComfyNode):
    """Shows what a loaded model's weights are stored as: tensors, elements and MiB per dtype."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID_PREFIX + "WeightReport",
            display_name="Model Weight Report",
            category=CATEGORY,
            description="Counts a model's weights by the dtype they are stored in (FP8 weights with "
            "their scales), and compares the total with the same model stored as bf16.",
            inputs=[io.Model.Input("model", tooltip="Any diffusion model (MODEL output of a loader).")],
            outputs=[io.String.Output(display_name="report", tooltip="The table as text.")],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, model) -> io.NodeOutput:
        summary = summarize_module(model.model)
        text = summary.as_text()
        return io.NodeOutput(text, ui={"text": [text]})


NODES = [WeightReport]
