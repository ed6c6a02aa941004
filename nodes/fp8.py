"""FP8 nodes: load every published FP8 format, quantize in memory, save in the forms stock ComfyUI reads.

Nodes (ids "FP8Engram.<Name>", category "fp8-engram/fp8"):
- Load FP8 Diffusion Model (diffusion_models) -> MODEL
- Load FP8 Checkpoint (checkpoints) -> MODEL, CLIP, VAE
- Load FP8 Text Encoder (text_encoders, with stock CLIPLoader's type choice) -> CLIP
- Quantize Model to FP8 (MODEL -> MODEL in memory, per-layer SQNR as text and IMAGE)
- Save FP8 Model (MODEL -> a safetensors file in the output folder)

What the frontend gets: every node returns `ui` data in the executed message, read by
web/fp8_engram.js:
- loaders:  ui.fp8_summary = [{file, format, layers_quantized, layers_total, bytes_on_disk, bytes_bf16,
            compute_path, fp8_dtypes, granularity, stock_comfyui_reads_scales, notes,
            int8 (when the int8 path converted weights: layers, mean/min SQNR, worst layer), int8_sqnr_db}]
- quantize: ui.fp8_quality = [{granularity, dtype, layers, kept, mean_sqnr_db, min_sqnr_db, worst_layer}]
            and ui.text = [the per-layer table]
- save:     ui.fp8_summary (of the written file) and ui.text = [a sentence saying where it went and
            whether stock ComfyUI can read it]
Loading goes through ComfyUI's own model construction with a fresh FP8 operations class per load
(nodes/ops.py), so no full-precision copy of the model is made. Long loops report progress
(comfy.utils.ProgressBar, at most 100 updates: nodes/progress.py) and stop when the user cancels.
"""

from __future__ import annotations

import dataclasses
import errno
import io as _pyio
import logging
import math
import os

import comfy.model_management
import comfy.sd
import folder_paths
import torch
from comfy_api.latest import io

from ..quant import ComputeConfig, QuantizedTensor, formats, save
from ..quant.safetensors_file import background_reads_held
from ..quant.compute import Book, book_for_file, default_book
from ..quant.compute.int8 import is_int8
from ..quant.compute.paths.int8 import dropped_fp8_form, in_fp8_form
from ..quant.quantize_model import DEFAULT_KEEP, GRANULARITIES, MAX_KEEP_PATTERN_CHARS, MAX_KEEP_PATTERNS, quantize_module
from ..quant.quantize_model import keep_patterns as compile_keep_patterns
from . import CATEGORY, NODE_ID_PREFIX
from .gpt_oss import lens_options
from .ops import count_widened_size, make_fp8_ops, release_workspace_on_unload
from .progress import progress_fn

logger = logging.getLogger(__name__)

FP8_CATEGORY = f"{CATEGORY}/fp8"

# the compute_path choices that are "auto" with another ComputeConfig.fp8_form (added last: saved workflows name
# their choice, and the default stays "auto", whose fp8_form is "serving")
MEMORY_FIRST = "auto (memory first)"
BOTH_FORMS = "auto (keep both forms)"
FP8_FORM_OF = {MEMORY_FIRST: "drop", BOTH_FORMS: "keep"}
COMPUTE_PATHS = {"auto": "auto", "fp8 matmul": "fp8", "weight-only": "weight_only", "int8": "int8",
                 "int8 without rotation": "int8", MEMORY_FIRST: "auto", BOTH_FORMS: "auto"}
ACT_SCALING = {"auto": "auto", "static": "static", "dynamic per tensor": "dynamic_tensor", "dynamic per row": "dynamic_row"}
COMPUTE_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ROUNDING = ("nearest", "stochastic")
FAST_PATHS = ("proven on this device", "prove again", "trust without proving")
# On a loaded model (comfy BaseModel): {key: dtype} of the file it came from, so Save FP8 Model can
# write the weights that are not FP8 in their original dtype (ComfyUI computes in float32 on the CPU).
SOURCE_DTYPES_ATTR = "fp8_engram_source_dtypes"


def _verdict_file() -> str | None:
    """Where the fast-path verdicts of this ComfyUI live: its user folder (None: in memory only)."""
    user = getattr(folder_paths, "get_user_directory", None)
    return os.path.join(user(), "fp8_engram", "fast_paths.json") if user is not None else None


def verdict_book() -> Book:
    """The book of fast-path verdicts the loaders hand their weights: the one of ComfyUI's user folder
    (made at the first load, not at import), in memory where the folder is unknown."""
    path = _verdict_file()
    return book_for_file(path) if path is not None else default_book()


def _options():
    return [
        io.Combo.Input("compute_path", options=list(COMPUTE_PATHS), default="auto",
                       tooltip="auto: fp8 x fp8 matmul on GPUs with FP8 units (CUDA 8.9+); int8 on GPUs with INT8 but "
                       "no FP8 units (CUDA 8.0-8.6: RTX 30, A100, A10) and CPUs with VNNI/AMX; weight-only elsewhere. "
                       "fp8 matmul: always try it (falls back if it fails). weight-only: dequantize and multiply. "
                       "int8: weights converted to int8 per channel at load (rotated by a 128-wide Hadamard "
                       "transform, which tames activation outliers, unless 'without rotation'), activations per token; "
                       "auto converts a layer only at its first call that runs int8, and keeps the file's form "
                       "beside it only while that form serves: a layer that already ran weight-only keeps both "
                       "(about one more byte per parameter), one whose calls all ran int8 becomes int8 in place. "
                       "auto (keep both forms): every converted layer keeps the file's form, so later weight-only "
                       "calls and Save FP8 Model use its exact values. auto (memory first): a layer whose call ran "
                       "int8 keeps only the int8 form, whatever ran before. A layer without the file's form "
                       "multiplies its int8 values in weight-only calls too (about 40 dB SQNR against the file's), "
                       "and Save FP8 Model re-quantizes it to its FP8 form. Only devices where auto runs int8 "
                       "(INT8 without FP8 units) are affected."),
        io.Combo.Input("activation_scaling", options=list(ACT_SCALING), default="auto",
                       tooltip="How activations are scaled for fp8 x fp8. auto: one dynamic scale per row (token), "
                       "quantized in one fused pass; the most accurate and, on FP8 GPUs, the fastest. static: the "
                       "file's input scale (dynamic per tensor when it has none; never a scale of 1). Or one dynamic "
                       "scale per tensor, or per row."),
        io.Combo.Input("compute_dtype", options=list(COMPUTE_DTYPES), default="auto",
                       tooltip="Dtype of the matmul and its output; auto follows the activations."),
        io.Combo.Input("patch_rounding", options=list(ROUNDING), default="nearest", optional=True,
                       tooltip="How weights are requantized after a LoRA or other weight patch: round to nearest, "
                       "or stochastic rounding (seeded per weight)."),
        io.Combo.Input("fast_paths", options=list(FAST_PATHS), default=FAST_PATHS[0], optional=True,
                       tooltip="proven on this device: each fast path (fp8 x fp8, int8, the fused GEMMs) is checked "
                       "against its plain twin and timed against dequantize + matmul the first time it meets a kind "
                       "of layer; the verdicts are kept in ComfyUI's user folder (fp8_engram/fast_paths.json) until "
                       "the GPU, driver, torch or pack changes. prove again: forget them and prove anew. trust "
                       "without proving: take fast paths by the device's capability alone."),
        io.Float.Input("dequantized_copies_gb", default=0.0, min=0.0, max=1024.0, step=0.5, optional=True,
                       tooltip="On the CPU: keep the layers that run weight-only dequantized, up to this many GB "
                       "for all models together (first layers called first kept), so steps of few tokens run "
                       "at full-precision speed instead of dequantizing every layer at every call. Costs the "
                       "compute dtype's size per parameter: ComfyUI computes in float32 on the CPU, 4 bytes per "
                       "parameter (the copies of a tiny SD3 load here were float32); 2 with compute_dtype "
                       "bfloat16. Same results; freed when ComfyUI unloads the model. 0 = off."),
    ]


def _config(compute_path, activation_scaling, compute_dtype, fast_paths=FAST_PATHS[0],
            dequantized_copies_gb=0.0) -> ComputeConfig:
    if fast_paths not in FAST_PATHS:
        raise ValueError(f"fast_paths must be one of {list(FAST_PATHS)}, got {fast_paths!r}")
    gb = float(dequantized_copies_gb)
    if not math.isfinite(gb) or not 0 <= gb <= 1024:
        raise ValueError(f"dequantized_copies_gb must be between 0 and 1024, got {dequantized_copies_gb!r}")
    if fast_paths == "prove again":
        verdict_book().forget(comfy.model_management.get_torch_device())
    return ComputeConfig(path=COMPUTE_PATHS[compute_path], activation_scaling=ACT_SCALING[activation_scaling],
                         compute_dtype=COMPUTE_DTYPES[compute_dtype],
                         int8_rotation=compute_path != "int8 without rotation",
                         fp8_form=FP8_FORM_OF.get(compute_path, "serving"),
                         trust_fast_paths=fast_paths == "trust without proving", dequant_cache_bytes=int(gb * 2**30),
                         book=verdict_book())


def _path_label(cfg: ComputeConfig, ops=None) -> str:
    label = _compute_label(cfg, ops)
    if cfg.dequant_cache_bytes:
        label += (f"; weight-only layers on the CPU kept dequantized up to {cfg.dequant_cache_bytes / 2**30:g} GB "
                  "(all models together)")
    return label


def _compute_label(cfg: ComputeConfig, ops=None) -> str:
    if cfg.path == "weight_only":
        return "weight-only"
    if cfg.path == "fp8":
        return f"fp8 matmul ({cfg.activation_scaling})"
    int8_label = "int8 (rotated 128)" if cfg.int8_rotation else "int8 (no rotation)"
    if cfg.path == "int8":
        return int8_label
    device = comfy.model_management.get_torch_device()
    from ..quant import fp8_supported

    how = "by capability" if cfg.trust_fast_paths else "where proven and measured faster"
    choice = {"drop": " (memory first)", "keep": " (keep both forms)"}.get(cfg.fp8_form, "")
    unused = f"; {choice.strip(' ()')} changes nothing here (no layer is converted to int8)" if choice else ""
    if fp8_supported(device):
        return f"auto: fp8 matmul ({cfg.activation_scaling}) {how}, else weight-only{unused}"
    from ..quant.compute.int8 import int8_supported

    if int8_supported(device):  # per token class int8 or weight-only, as measured; converted at first use
        forms = {"drop": "drop their FP8 form", "keep": "keep their FP8 form beside"}.get(
            cfg.fp8_form, "keep their FP8 form only where it already ran weight-only")
        return f"auto{choice}: {int8_label} on {device} {how} (layers converted at first use {forms}), else weight-only"
    return f"auto: weight-only on {device}{unused}"


def _read(folder: str, name: str, cfg: ComputeConfig):
    path = folder_paths.get_full_path_or_raise(folder, name)
    try:
        # the FP8 codes are read in the background while ComfyUI builds the model (a small file's once it has: the
        # loaders hold them) and the prompt is encoded; each weight waits for its own at its first use, reading it
        # itself where the thread has not (a read that failed is raised there, naming the file)
        sd, report = formats.load_file(path, config=cfg, progress=progress_fn(), defer=True)
    except formats.FormatError as exc:
        raise ValueError(f"{folder}/{name}: {exc}") from exc
    # Layers the file marks "full precision matmul" run weight-only unless the user forces fp8.
    if cfg.path == "auto":
        wo = dataclasses.replace(cfg, path="weight_only")
        for info in report.layers:
            if info.full_precision_mm and isinstance(sd.get(info.weight_key), QuantizedTensor):
                sd[info.weight_key] = sd[info.weight_key].with_config(wo)
    header = report.header if report.header is not None else formats.read_header(path)
    metadata = {k: v for k, v in header.metadata.items() if k not in ("_quantization_metadata", "quantization_config")}
    return header, sd, report, metadata or None


def _check_compute_range(patcher, sd: dict, report: formats.FormatReport, cfg: ComputeConfig, where: str) -> None:
    """The loader checked every scale against float32's range (or the chosen compute dtype); ComfyUI
    may pick float16 for the model (GPUs without bfloat16), whose range is far smaller: check again."""
    if patcher is None or cfg.compute_dtype is not None:
        return
    model = patcher.model
    dtype = getattr(model, "manual_cast_dtype", None) or model.get_dtype()
    if dtype != torch.float16:
        return
    for info in report.layers:
        qt = sd.get(info.weight_key)
        if isinstance(qt, QuantizedTensor) and info.scale_key is not None:
            try:
                formats.check_scale_range(report.path, info.scale_key, qt.scale, info.fp8_dtype, dtype)
            except formats.FormatError as exc:
                raise ValueError(f"{where}: {exc} (ComfyUI computes this model in float16; pick compute_dtype "
                                 "bfloat16 or float32)") from exc


def _adopt(patcher, header: formats.SafetensorsHeader) -> None:
    """What every model this pack loads carries: its file's dtypes, and the workspace release on unload."""
    if patcher is None:
        return
    setattr(patcher.model, SOURCE_DTYPES_ATTR, {k: e.dtype for k, e in header.tensors.items()})
    _adopt_patcher(patcher)


def _adopt_patcher(patcher) -> None:
    """Every ModelPatcher a loader returns (diffusion model, text encoders): the workspace release on unload, and
    its size counted with its kept layers as they will be after their first call."""
    release_workspace_on_unload(patcher)
    count_widened_size(patcher)


def _summary(report: formats.FormatReport, cfg: ComputeConfig, ops=None) -> dict:
    s = report.summary()
    s["layers_total"] = report.linear_weights
    s["compute_path"] = _path_label(cfg, ops)
    # what the fast-path proofs chose on this device so far (the load's own int8 measurement included;
    # products first run by the sampler are proven then, logged, and listed by the next load)
    s["fast_paths"] = (cfg.book or verdict_book()).summary_lines(comfy.model_management.get_torch_device())
    layers = getattr(ops, "int8_layers", None)
    if layers:
        # per-layer SQNR of the int8 conversion against the file's weights
        s["int8_sqnr_db"] = {name: round(db, 2) for name, db in layers}
        worst = min(layers, key=lambda item: item[1])
        mean = sum(db for _, db in layers) / len(layers)
        s["int8"] = {"layers": len(layers), "mean_sqnr_db": round(mean, 2), "min_sqnr_db": round(worst[1], 2),
                     "worst_layer": worst[0]}
    if "nvfp4" in report.granularities and "weight-only" not in s["compute_path"]:
        s["compute_path"] += "; nvfp4 layers weight-only"  # the fp4 x fp4 matmul is not used
    for fmt in ("awq_w4a16", "svdquant_w4a4"):  # dequantized (SVDQuant: its effective weight), then multiplied
        if fmt in report.granularities and s["compute_path"] != "weight-only" \
                and not s["compute_path"].startswith("auto: weight-only"):
            s["compute_path"] += f"; {fmt} layers weight-only"  # on every path, no int8 conversion either
    return s


def _ops(cfg, patch_rounding, source: str | None = None):
    return make_fp8_ops(cfg, stochastic_rounding=(patch_rounding == "stochastic"), source=source)


class LoadFP8DiffusionModel(io.ComfyNode):
    """Loads a diffusion model in any FP8 format (or full precision) with FP8 weights kept FP8."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID_PREFIX + "LoadFP8DiffusionModel",
            display_name="Load FP8 Diffusion Model",
            category=FP8_CATEGORY,
            description="Loads a diffusion model from models/diffusion_models in any published FP8 format "
            "(plain casts, ComfyUI scaled fp8 and mixed precision, per-layer comfy_quant, musubi fp8_scaled, "
            "modelopt / compressed-tensors, DeepSeek block-wise), detected automatically. Weights stay FP8 in "
            "memory; shows format, layers quantized, size on disk vs bf16 and the compute path.",
            inputs=[io.Combo.Input("unet_name", options=folder_paths.get_filename_list("diffusion_models"),
                                   tooltip="File in models/diffusion_models.")] + _options(),
            outputs=[io.Model.Output(display_name="MODEL", tooltip="The diffusion model with FP8 weights.")],
        )

    @classmethod
    def execute(cls, unet_name, compute_path, activation_scaling, compute_dtype, patch_rounding="nearest",
                fast_paths=FAST_PATHS[0], dequantized_copies_gb=0.0) -> io.NodeOutput:
        cfg = _config(compute_path, activation_scaling, compute_dtype, fast_paths, dequantized_copies_gb)
        with background_reads_held():  # a small file's FP8 codes are read once the model is built, not beside it
            header, sd, report, metadata = _read("diffusion_models", unet_name, cfg)
            ops = _ops(cfg, patch_rounding, f"diffusion_models/{unet_name}")
            options = {"custom_operations": ops}
            if cfg.compute_dtype is not None:
                options["dtype"] = cfg.compute_dtype
            model = comfy.sd.load_diffusion_model_state_dict(sd, model_options=options, metadata=metadata)
        if model is None:
            raise ValueError(f"diffusion_models/{unet_name}: ComfyUI could not detect the model type of this file")
        _check_compute_range(model, sd, report, cfg, f"diffusion_models/{unet_name}")
        _adopt(model, header)
        return io.NodeOutput(model, ui={"fp8_summary": [_summary(report, cfg, ops)]})


VAE_PREFIXES = ("first_stage_model.", "vae.")


class LoadFP8Checkpoint(io.ComfyNode):
    """Loads a checkpoint (MODEL, CLIP, VAE) whose FP8 weights stay FP8."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID_PREFIX + "LoadFP8Checkpoint",
            display_name="Load FP8 Checkpoint",
            category=FP8_CATEGORY,
            description="Loads a full checkpoint from models/checkpoints in any FP8 format this pack reads; "
            "the diffusion model and text encoders keep their FP8 weights, the VAE loads in full precision.",
            inputs=[io.Combo.Input("ckpt_name", options=folder_paths.get_filename_list("checkpoints"),
                                   tooltip="File in models/checkpoints.")] + _options(),
            outputs=[io.Model.Output(display_name="MODEL", tooltip="The diffusion model with FP8 weights."),
                     io.Clip.Output(display_name="CLIP", tooltip="The text encoder(s), FP8 where the file is."),
                     io.Vae.Output(display_name="VAE", tooltip="The VAE (full precision).")],
        )

    @classmethod
    def execute(cls, ckpt_name, compute_path, activation_scaling, compute_dtype, patch_rounding="nearest",
                fast_paths=FAST_PATHS[0], dequantized_copies_gb=0.0) -> io.NodeOutput:
        cfg = _config(compute_path, activation_scaling, compute_dtype, fast_paths, dequantized_copies_gb)
        with background_reads_held():
            header, sd, report, metadata = _read("checkpoints", ckpt_name, cfg)
            for k in list(sd):
                if k.startswith(VAE_PREFIXES) and isinstance(sd[k], QuantizedTensor):
                    sd[k] = sd[k].dequantize()
            ops = _ops(cfg, patch_rounding, f"checkpoints/{ckpt_name}")
            out = comfy.sd.load_state_dict_guess_config(
                sd, output_vae=True, output_clip=True, embedding_directory=folder_paths.get_folder_paths("embeddings"),
                model_options={"custom_operations": ops}, te_model_options={"custom_operations": ops},
                metadata=metadata)
        if out is None:
            raise ValueError(f"checkpoints/{ckpt_name}: ComfyUI could not detect the model type of this file")
        _check_compute_range(out[0], sd, report, cfg, f"checkpoints/{ckpt_name}")
        _adopt(out[0], header)
        if out[1] is not None:
            _adopt_patcher(out[1].patcher)
        return io.NodeOutput(out[0], out[1], out[2], ui={"fp8_summary": [_summary(report, cfg, ops)]})


def _clip_types() -> list[str]:
    return [t.name.lower() for t in comfy.sd.CLIPType]


class LoadFP8TextEncoder(io.ComfyNode):
    """Loads a text encoder whose FP8 weights stay FP8."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID_PREFIX + "LoadFP8TextEncoder",
            display_name="Load FP8 Text Encoder",
            category=FP8_CATEGORY,
            description="Loads a text encoder from models/text_encoders in any FP8 format this pack reads "
            "(including prefixed scaled_fp8 markers), with the same encoder types as the stock CLIP loader.",
            inputs=[io.Combo.Input("clip_name", options=folder_paths.get_filename_list("text_encoders"),
                                   tooltip="File in models/text_encoders."),
                    io.Combo.Input("type", options=_clip_types(), default="stable_diffusion",
                                   tooltip="Which model family the encoder is for (as in the stock Load CLIP node).")]
            + _options(),
            outputs=[io.Clip.Output(display_name="CLIP", tooltip="The text encoder with FP8 weights.")],
        )

    @classmethod
    def execute(cls, clip_name, type, compute_path, activation_scaling, compute_dtype, patch_rounding="nearest",
                fast_paths=FAST_PATHS[0], dequantized_copies_gb=0.0) -> io.NodeOutput:
        cfg = _config(compute_path, activation_scaling, compute_dtype, fast_paths, dequantized_copies_gb)
        with background_reads_held():
            header, sd, report, metadata = _read("text_encoders", clip_name, cfg)
            clip_type = getattr(comfy.sd.CLIPType, type.upper(), comfy.sd.CLIPType.STABLE_DIFFUSION)
            ops = _ops(cfg, patch_rounding, f"text_encoders/{clip_name}")
            # ComfyUI 0.33 builds a gpt-oss (Lens) encoder at gpt-oss-20b's size whatever the file holds
            options = {"custom_operations": ops, **lens_options(sd, f"text_encoders/{clip_name}")}
            clip = comfy.sd.load_text_encoder_state_dicts(
                [sd], embedding_directory=folder_paths.get_folder_paths("embeddings"), clip_type=clip_type,
                model_options=options)
        _adopt_patcher(clip.patcher)
        return io.NodeOutput(clip, ui={"fp8_summary": [_summary(report, cfg, ops)]})


def _sqnr_plot(report) -> torch.Tensor:
    """IMAGE [1, H, W, 3] float in [0, 1]: one bar per quantized layer (SQNR dB), drawn with PIL."""
    from PIL import Image, ImageDraw

    layers = report.quantized
    w, h, pad = max(320, 8 * len(layers) + 80), 240, 40
    img = Image.new("RGB", (w, h), (24, 24, 24))
    d = ImageDraw.Draw(img)
    vals = [l.sqnr_db if l.sqnr_db is not None and math.isfinite(l.sqnr_db) else 60.0 for l in layers]
    top = max([40.0] + vals)
    d.line([(pad, h - pad), (w - 10, h - pad)], fill=(180, 180, 180))
    d.line([(pad, 10), (pad, h - pad)], fill=(180, 180, 180))
    for db in range(0, int(top) + 1, 10):
        y = h - pad - (h - pad - 10) * db / top
        d.line([(pad - 4, y), (pad, y)], fill=(180, 180, 180))
        d.text((4, y - 6), f"{db}", fill=(200, 200, 200))
    bw = max(2, (w - pad - 20) // max(1, len(layers)) - 2)
    for i, v in enumerate(vals):
        x0 = pad + 4 + i * (bw + 2)
        y = h - pad - (h - pad - 10) * v / top
        color = (80, 200, 120) if v >= 30 else (230, 180, 60) if v >= 20 else (230, 80, 80)
        d.rectangle([x0, y, x0 + bw, h - pad], fill=color)
    d.text((pad + 4, h - pad + 8), f"SQNR (dB) per quantized layer, {report.granularity} {report.fp8_dtype}",
           fill=(220, 220, 220))
    arr = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).reshape(h, w, 3)
    return (arr.float() / 255.0).unsqueeze(0)


def _own_weights(model):
    """The weights `model` itself computes with, before weight patches, whatever is loaded right now.

    The clones of one ComfyUI model share its torch module: while another clone is loaded its object
    patches (e.g. the FP8 weights of an earlier Quantize Model) or its in-place weight patches (a LoRA)
    sit in that module, with the originals kept in the backups every clone shares. They stay there after
    that clone is dropped from the cache: ComfyUI then hands its loaded slot to the parent model without
    unpatching. Reading the module as it is would quantize someone else's weights, or find them FP8
    already and quantize nothing."""
    backup = getattr(model, "backup", {})

    def weight_of(name: str, layer: torch.nn.Module):
        key = f"diffusion_model.{name}.weight"
        w = model.get_model_object(key)  # this clone's object patch, else the original of a patched one
        if key not in model.object_patches and key in backup and w is getattr(layer, "weight", None):
            w = backup[key].weight  # a clone's weight patches are applied in place: the original
        return w

    return weight_of


class QuantizeModelToFP8(io.ComfyNode):
    """Quantizes a MODEL's linear weights to FP8 in memory and reports SQNR per layer."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID_PREFIX + "QuantizeModelToFP8",
            display_name="Quantize Model to FP8",
            category=FP8_CATEGORY,
            description="Quantizes the linear layers of a diffusion model to FP8 in memory (the input model is "
            "left unchanged; the output carries the FP8 weights as patches). Layers matching the keep patterns "
            "stay in full precision. Reports the quality of every layer as SQNR (dB), as text and as a plot.",
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model to quantize."),
                io.Combo.Input("granularity", options=list(GRANULARITIES), default="tensor",
                               tooltip="One scale per tensor (stock ComfyUI can read it when saved), per row "
                               "(output channel), per 128x128 block; mxfp8: e4m3fn (only) with a power-of-two scale per "
                               "32 inputs (ComfyUI 0.29's form); nvfp4: 4-bit e2m1 values with an e4m3 scale per "
                               "16 inputs (ComfyUI's NVFP4 form, about half of FP8's size; fp8_dtype is ignored). "
                               "'int8 tensor' / 'int8 row convrot': int8 "
                               "weights (fp8_dtype is ignored) in ComfyUI 0.33's int8_tensorwise form, one scale per "
                               "tensor, or per channel with its 256-wide ConvRot rotation (better quality); they run "
                               "the int8 path where it is fast (or when the loader forces it). 'awq w4a16': 4-bit "
                               "codes with a bf16 scale and zero point per 64 inputs (comfy-kitchen's AWQ W4A16 form, "
                               "about a quarter of bf16's size), rounded to nearest; runs weight-only; layers whose "
                               "inputs are not a multiple of 64 stay in full precision; fp8_dtype is ignored."),
                io.Combo.Input("fp8_dtype", options=["e4m3fn", "e5m2"], default="e4m3fn",
                               tooltip="e4m3fn: more precision (the usual choice); e5m2: more range."),
                io.String.Input("keep_patterns", default=", ".join(DEFAULT_KEEP), multiline=True,
                                tooltip="Comma or newline separated globs of layer names to keep in full precision "
                                "(defaults: embeddings, norms, first and last layers)."),
            ],
            outputs=[io.Model.Output(display_name="MODEL", tooltip="The model with FP8 linear weights."),
                     io.String.Output(display_name="report", tooltip="Per-layer SQNR table as text."),
                     io.Image.Output(display_name="plot", tooltip="Per-layer SQNR as a bar chart.")],
        )

    @classmethod
    def execute(cls, model, granularity, fp8_dtype, keep_patterns) -> io.NodeOutput:
        what = "Quantize Model to FP8: input 'keep_patterns'"
        if len(keep_patterns) > MAX_KEEP_PATTERNS * (MAX_KEEP_PATTERN_CHARS + 2):
            raise ValueError(f"{what} has {len(keep_patterns)} characters; give at most {MAX_KEEP_PATTERNS} patterns of "
                             f"at most {MAX_KEEP_PATTERN_CHARS} characters each")
        keep = compile_keep_patterns([p.strip() for p in keep_patterns.replace("\n", ",").split(",") if p.strip()], what)
        diffusion = model.get_model_object("diffusion_model")
        new, report = quantize_module(diffusion, granularity=granularity, fp8_dtype=fp8_dtype, keep=keep,
                                      progress=progress_fn(), weight_of=_own_weights(model))
        out = model.clone()
        release_workspace_on_unload(out)
        for key, qt in new.items():
            out.add_object_patch("diffusion_model." + key, torch.nn.Parameter(qt, requires_grad=False))
        s = report.summary()
        worst = min(report.quantized, key=lambda l: l.sqnr_db, default=None)
        quality = {"granularity": s["granularity"], "dtype": s["fp8_dtype"], "layers": s["layers_quantized"],
                   "kept": s["layers_kept"], "mean_sqnr_db": s["sqnr_db_mean"], "min_sqnr_db": s["sqnr_db_min"],
                   "worst_layer": worst.name if worst else None}
        # The node shows the worst layers only; the full table is the report output.
        return io.NodeOutput(out, report.text(), _sqnr_plot(report), ui={"fp8_quality": [quality],
                                                                       "text": [report.worst_text()]})


def _back_to_fp8(sd: dict) -> int:
    """Weights of ``sd`` that "auto" made int8 in place (``ComputeConfig.fp8_form``) go back to the FP8 form
    they were loaded in, each re-quantized from its int8 values when the writer reaches it (one layer's copy at
    a time): the file is what the user loaded, in the form the loaded file had (per-tensor e4m3fn stays readable
    by stock ComfyUI), whichever layers happened to run int8. Returns how many were re-quantized."""
    count = 0
    for key, w in list(sd.items()):
        form = dropped_fp8_form(w) if is_int8(w) else None
        if form is None:
            continue
        sd[key] = save.PendingQuantized(tuple(w.shape), form.dtype, form.layout, form.input_scale is not None,
                                        (lambda w=w: in_fp8_form(w)))
        count += 1
    return count


SAVE_DTYPES = {"as loaded": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class SaveFP8Model(io.ComfyNode):
    """Writes a MODEL with FP8 weights to a safetensors file in the output folder."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID_PREFIX + "SaveFP8Model",
            display_name="Save FP8 Model",
            category=FP8_CATEGORY,
            description="Saves the diffusion model's weights (FP8 where they are FP8) as a .safetensors file in "
            "the output folder, atomically; an existing file is never replaced (a counter is added). Per-tensor "
            "FP8 files load unchanged in stock ComfyUI's Load Diffusion Model; row- and block-wise files need "
            "this pack's loader, and the node says so. Weights that are not FP8 keep the dtype of the file they "
            "were loaded from, or the one picked here. Layers that a loader's 'auto' made int8 in place (their calls ran "
            "int8 on a CPU or GPU with INT8 and no FP8 units) are written re-quantized into the FP8 form they were "
            "loaded in; load with 'auto (keep both forms)' or 'weight-only' to save the file's bytes exactly.",
            inputs=[io.Model.Input("model", tooltip="The model to save (e.g. from Quantize Model to FP8)."),
                    io.String.Input("filename_prefix", default="fp8/model",
                                    tooltip="Name (and subfolder) inside the output folder; a counter is appended. "
                                    "Absolute paths and '..' are refused."),
                    io.Combo.Input("weight_dtype", options=list(SAVE_DTYPES), default="as loaded", optional=True,
                                   tooltip="Dtype of the weights that are not FP8 (biases, norms, kept layers): as in "
                                   "the file the model was loaded from (ComfyUI computes in float32 on the CPU, which "
                                   "would double them), or bfloat16 / float16 / float32.")],
            outputs=[io.String.Output(display_name="path", tooltip="Where the file was written.")],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, model, filename_prefix, weight_dtype="as loaded") -> io.NodeOutput:
        out_dir = folder_paths.get_output_directory()
        try:
            prefix, _ = save.check_output_prefix(filename_prefix, out_dir)
        except ValueError as exc:
            raise ValueError(f"Save FP8 Model: {exc}") from None
        full_folder, filename, counter, subfolder, _ = folder_paths.get_save_image_path(prefix, out_dir)
        path = save.unique_path(os.path.join(full_folder, f"{filename}_{counter:05}_.safetensors"))
        # The weights as they are used, patches applied (object patches included), FP8 kept.
        comfy.model_management.load_models_gpu([model], force_full_load=True)
        sd = model.model.diffusion_model.state_dict()
        sd = {k: (v.detach() if not isinstance(v, QuantizedTensor) else v) for k, v in sd.items()}
        refp8 = _back_to_fp8(sd)
        source = getattr(model.model, SOURCE_DTYPES_ATTR, None)
        # ComfyUI holds every model in float32 on the CPU whatever its file held; bfloat16 is what models
        # are published in, so it stands in for a source dtype this pack never saw.
        unknown = torch.bfloat16 if comfy.model_management.get_torch_device().type == "cpu" else None
        dtypes, dtype_note = save.plain_dtypes(sd, SAVE_DTYPES[weight_dtype], source, unknown)
        try:
            result = save.save_state_dict(sd, path, progress=progress_fn(), dtypes=dtypes)
        except OSError as exc:  # say which node failed (SaveError names the file and what was kept)
            detail = exc.strerror if isinstance(exc, save.SaveError) and exc.strerror else f"{path}: {exc}"
            raise save.SaveError(exc.errno or errno.EIO, f"Save FP8 Model: {detail}") from exc
        report = formats.inspect_file(result.path)
        where = os.path.relpath(result.path, out_dir)
        msg = (f"saved output/{where}\n{result.bytes_written / 2**20:.2f} MiB, {result.layers_quantized} FP8 layers; "
               f"{dtype_note}.\n"
               + (f"{refp8} layer(s) had run int8 under compute_path auto and kept no FP8 data: "
                  "written re-quantized from their int8 values into the FP8 form they were loaded in (near the "
                  "loaded values, not their bytes; load with compute_path 'auto (keep both forms)' to save those "
                  "exactly).\n"
                  if refp8 else "")
               + ("Stock ComfyUI's Load Diffusion Model reads it unchanged." if result.stock_comfy_readable else
                  "Its MXFP8 layers are in ComfyUI 0.29's own form: stock ComfyUI 0.29 and newer read them; "
                  "ComfyUI 0.3.75 cannot (for it, quantize per tensor)." if "mxfp8" in result.granularities else
                  "Its int8 layers are in ComfyUI 0.33's int8_tensorwise form: stock ComfyUI 0.33 and newer read "
                  "them; older versions need this pack's loader." if "int8" in result.granularities else
                  "Its int4 layers are in comfy-kitchen 0.2.40's form, which ComfyUI 0.33 and older cannot read: load "
                  "it with Load FP8 Diffusion Model." if {"awq_w4a16", "svdquant_w4a4"} & set(result.granularities) else
                  "Stock ComfyUI cannot read its row/block-wise scales: load it with Load FP8 Diffusion Model."))
        summary = report.summary()
        summary["layers_total"] = report.linear_weights
        summary["compute_path"] = "-"
        return io.NodeOutput(result.path, ui={"fp8_summary": [summary], "text": [msg]})


NODES = [LoadFP8DiffusionModel, LoadFP8Checkpoint, LoadFP8TextEncoder, QuantizeModelToFP8, SaveFP8Model]
