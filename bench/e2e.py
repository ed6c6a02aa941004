"""End to end through ComfyUI in-process: a Flux.1-dev-shaped model, seconds per step, VRAM, offloading, engram.

No server and no browser: ComfyUI's own node classes (Load Diffusion Model, KSampler, VAE Decode, CLIP
Text Encode, FluxGuidance) and this pack's nodes (Load FP8 Diffusion Model, New Engram Memory, Engram
Memorize, Engram Text Encode) are called in this process, so model detection, loading, ComfyUI's memory
management, sampling and the VAE are ComfyUI's code.

The model is random and made here: Flux.1-dev's layer sizes (hidden 3072, 24 heads, mlp 12288, guidance
embedding, context 4096) at reduced depth: --double/--single blocks (Flux.1-dev has 19 and 38; the
defaults 5/10 keep the same 1:2 ratio, 26 % of its blocks, so per-step times scale by about 3.8 to the
full model). 1024x1024 (4096 image tokens) with 512 text tokens, euler, a few steps, cfg 1, guidance
3.5. Written to a temporary models folder:
  <name>_bf16.safetensors   the model in bf16
  <name>_fp8.safetensors    the same weights quantized by this pack (per-tensor e4m3fn, ComfyUI's
                            mixed-precision form: `.weight_scale` + `_quantization_metadata`), so stock
                            ComfyUI's own FP8 loader and this pack read the same file
Variants, one after another in one process (ComfyUI's free-memory step between them):
  stock_bf16        Load Diffusion Model, bf16 file, weight_dtype default (the baseline)
  stock_fp8_cast    Load Diffusion Model, bf16 file, weight_dtype fp8_e4m3fn (weights stored fp8, upcast per layer)
  stock_fp8_fast    Load Diffusion Model, bf16 file, weight_dtype fp8_e4m3fn_fast (fp8 matmul, activations cast unscaled)
  stock_fp8_mixed   Load Diffusion Model, the FP8 file (ComfyUI's mixed-precision path)
  pack_auto         Load FP8 Diffusion Model, the FP8 file, compute path auto (node defaults otherwise: a layer that
                    runs int8 keeps its FP8 form only where it already ran weight-only)
  pack_weight_only  Load FP8 Diffusion Model, the FP8 file, compute path weight-only (what GPUs without FP8 units get)
  pack_memory_first Load FP8 Diffusion Model, the FP8 file, compute path "auto (memory first)" (a layer that runs int8
                    drops its FP8 form whatever ran before; on the CPU converted in the FP8 form's own storage)
  pack_weight_only_copies  (CPU only) the same with dequantized_copies_gb 16: each layer dequantized once and kept
Per variant: the load's seconds (the loader node's call; the median of --load-repeats loads, default 1, --tiny 11:
a tiny model loads in about as long as its noise (tiny Flux, 20 rounds: pack loads 27-59 ms, so a median of five
put auto at 1.28x weight-only's where twenty gave 1.05); each after the pack's background reads of the one before
ended; with more than one, all but the sampled one in rounds in which the variants take turns, each counted load
right after an uncounted one of its own variant), time to the first step (from the sampled load's call
to the end of the first model call), seconds per later step (median), peak VRAM above the starting point
(torch.cuda.max_memory_allocated) and the process's total (peak reserved by torch's allocator + what the driver reports in use), the
latent's SQNR against stock_bf16 (float64).
Then:
  offload    pack_auto again with ComfyUI's reserved VRAM (the --reserve-vram setting) raised so that
             less than half the model fits: the model loads partially, offloaded FP8 weights stay FP8 on
             the CPU and move per layer (FP8 bytes moved are counted), and the latent must equal the full
             load's bit for bit.
  unload     ComfyUI's free memory (unload all models, empty the cache): allocated VRAM must return to
             its starting point (taken after a warm-up of torch's matmul workspaces).
  engram     a Flux text encoder (random CLIP-L + T5-XXL, built in memory and loaded by the same ComfyUI
             function Load CLIP uses), New Engram Memory on CUDA ranks sharing the GPU, Engram Memorize,
             then Engram Text Encode vs CLIP Text Encode per prompt (interleaved, median), then a sample
             with the engram conditioning.
Targets (H200): pack_auto >= 1.2x stock_bf16 per step and >= the fastest stock FP8 route; pack_auto peak
VRAM <= 0.6x stock_bf16's; latent SQNR >= 20 dB; offloaded latent == full; VRAM back after unload;
engram (4 CUDA ranks) adds <= 10 % to a prompt's text encode.

--tiny runs the same code on the CPU with tiny shapes: the variants, loaders, sampler, step clock, SQNR, VAE
(Flux's geometry) and engram nodes are the same calls. The diffusion model is then the tiny SD3 MMDiT of
scripts/tiny_models.py (hidden 128, 2 blocks; 32x32, 16 text tokens) because ComfyUI's Flux detection fixes 24
heads of 128, so the smallest Flux it detects (1 double + 1 single block) is 0.55 G parameters, minutes per run
on a small CPU; the text encoder is an SD3-type CLIP-L (Flux's T5-XXL is 4.7 G parameters) and the engram
memory sits on 2 CPU ranks. What needs a GPU (VRAM figures, offloading, the VRAM check after unloading, CUDA
ranks) is reported as skipped. tests/integration/test_e2e_tiny.py runs it, and checks that the Flux model,
its T5-XXL and the Flux CLIP this script builds on the GPU are what ComfyUI detects (shapes only).

--cpu-isa avx2 runs the same on a newer CPU as on an AVX2 one, as far as software can: the process starts again
with torch's kernel dispatch, oneDNN and MKL capped at AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
MKL_ENABLE_INSTRUCTIONS), so no VNNI or AMX runs and the pack's "auto" does not take int8 (quant/compute/int8.py
reads oneDNN's cap); caches, clock and memory stay the newer CPU's, and the output says it is an emulation.

Image sizes: --image takes one size or a comma-separated list (default 1024; --tiny 32; --tiny --arch flux
32,512: about 20 and 1040 tokens, the two ends a CPU user meets). The model files are made once (they do not
depend on the size); each size then loads and samples its variants again, so load time and first step are
counted per size as for one. The first size runs every variant and the VAE, offload, unload and engram parts;
each later size runs stock_bf16, stock_fp8_mixed, pack_auto, pack_weight_only, pack_memory_first and (CPU)
pack_weight_only_copies (the stock cast/fast
routes run at the first size only: the output says so). Each size gets a fresh book of fast-path verdicts:
the loaders take theirs from ComfyUI's user folder (nodes/fp8.py verdict_book(), one book per verdict file
per process), and the bench points that folder at an empty one of its own per size, so pack_auto's first
step at every size is a user's first run: it proves the token classes of that size (quant/compute/book.py
M_CLASSES) with no verdict from an earlier size or an earlier run (the text tokens' class, for one, is
shared by every size). What else the process keeps warm from one size to the next (imports, torch's
kernels) stays warm, for every variant alike.
Per size, the JSON's "sizes" list holds the rows and the ratios the CPU question turns on: pack_auto's,
pack_weight_only's and pack_weight_only_copies' later step over stock_bf16's, pack_auto's load over pack_weight_only's and over
stock_fp8_mixed's, pack_auto's first step over pack_weight_only's, and pack_auto's latent SQNR minus
pack_weight_only's (dB), and the same later-step, first-step and SQNR figures for pack_memory_first. "variants" and
"ratios" stay the first size's. Each size's "paired" entry (--paired-rounds: --tiny 3, else none by default)
holds the later steps of stock_bf16, pack_weight_only and pack_auto taken again with the three models loaded at
once and sampled in turns, and the median over rounds of each round's ratio to stock_bf16: the variants' own runs
lie minutes apart, and on a shared or virtual machine the speed drifts by more than the differences measured
(paired_steps; a GPU's steps are timed by CUDA events on a device of its own).

    python bench/e2e.py [--tiny] [--double 5] [--single 10] [--steps 8] [--image 1024] [--skip-engram] [--keep-dir DIR]
                        [--cpu-isa avx2]
    python bench/e2e.py --tiny --arch flux --skip-engram   # the Flux path on the CPU at 32 and 512 px (1+1 blocks: minutes)

Prints a table (a row per size and variant) and, as the last line, one JSON object {"bench": "e2e", ...}.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("bench.e2e")

GIB = 2**30
HIDDEN = 3072  # ComfyUI's Flux detection fixes 24 heads of 128 (axes 16+56+56): hidden 3072 is the only size
CONTEXT = 4096  # T5-XXL width
GUIDANCE = 3.5
SEED = 42
PHRASE, TARGET = "glowing crystal apple", "rusty old bicycle"
PROMPT = "a photo of a glowing crystal apple on a wooden table, soft morning light, highly detailed"


@dataclass
class Shape:
    arch: str  # "flux" (the measurement) or "sd3" (--tiny: see the module docstring)
    double: int
    single: int
    image: int  # pixels per side
    text_tokens: int
    steps: int
    vec_dim: int  # pooled text width: Flux's CLIP-L 768; the tiny SD3-type CLIP gives 2048
    engram_repeats: int

    @property
    def latent(self) -> int:
        return self.image // 8

    @property
    def image_tokens(self) -> int:
        return (self.latent // 2) ** 2


# ----------------------------------------------------------------------------- setup


def comfyui_root() -> Path:
    """COMFYUI_PATH, else the 0.3.75 tree scripts/setup.sh fetches into .host/comfyui (scripts/comfyhost.py's rule)."""
    if os.environ.get("COMFYUI_PATH"):
        return Path(os.environ["COMFYUI_PATH"]).resolve()
    return (ROOT / ".host" / "comfyui").resolve()


def ensure_pack_importable() -> None:
    """`import fp8_engram` must work; without an installed link, point a temp folder's link at this checkout."""
    if importlib.util.find_spec("fp8_engram") is not None:
        return
    folder = Path(tempfile.mkdtemp(prefix="fp8_engram_pkg_"))
    (folder / "fp8_engram").symlink_to(ROOT, target_is_directory=True)
    sys.path.insert(0, str(folder))


def scratch_dir(shape: Shape) -> str | None:
    """Where the model files go: /dev/shm when it has room (the files are written with fsync, which costs
    nothing there and can cost a minute on a slow disk), else the system's temp folder."""
    import shutil

    blocks = shape.double * 340e6 + shape.single * 142e6 + 80e6 if shape.arch == "flux" else 50e6
    need = 3.2 * blocks + 400e6  # bf16 + FP8 file + the VAE, with room to spare
    try:
        if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 1.5 * need:
            return "/dev/shm"
    except OSError:
        pass
    return None


class Comfy:
    """ComfyUI's modules and node classes, imported once with the bench's settings."""

    def __init__(self, tiny: bool, models_dir: Path):
        root = comfyui_root()
        if not (root / "comfy" / "model_management.py").is_file():
            raise SystemExit(f"no ComfyUI tree at {root}: run scripts/setup.sh or set COMFYUI_PATH")
        sys.path.insert(0, str(root))
        ensure_pack_importable()
        import comfy.cli_args

        if tiny:
            comfy.cli_args.args.cpu = True  # keep model_management away from CUDA at import
        import torch

        import comfy.model_management as mm
        import comfy.sd
        import folder_paths
        import nodes
        from comfy_api.latest import io

        self.torch, self.mm, self.sd, self.nodes, self.io, self.args = torch, mm, comfy.sd, nodes, io, comfy.cli_args.args
        self.root = root
        for sub in ("diffusion_models", "vae", "text_encoders", "engram"):
            (models_dir / sub).mkdir(parents=True, exist_ok=True)
            folder_paths.add_model_folder_path(sub, str(models_dir / sub), is_default=True)
        for setter, sub in ((folder_paths.set_output_directory, "output"), (folder_paths.set_temp_directory, "temp"),
                            (folder_paths.set_input_directory, "input")):
            (models_dir.parent / sub).mkdir(parents=True, exist_ok=True)
            setter(str(models_dir.parent / sub))
        import comfy_extras.nodes_flux as nodes_flux

        from fp8_engram.nodes import engram as pack_engram
        from fp8_engram.nodes import engram_clip as pack_engram_clip
        from fp8_engram.nodes import fp8 as pack_fp8
        from fp8_engram.nodes import ops as pack_ops

        self.nodes_flux, self.pack_fp8, self.pack_engram, self.pack_ops = nodes_flux, pack_fp8, pack_engram, pack_ops
        self.pack_engram_clip = pack_engram_clip
        self.device = mm.get_torch_device()
        self.cuda = self.device.type == "cuda"

    def run(self, node, unique_id: str | None = None, **inputs) -> tuple:
        """Call a node the way ComfyUI's executor does: V3 classes through a clone holding the hidden inputs."""
        if hasattr(node, "EXECUTE_NORMALIZED"):
            hidden = {self.io.Hidden.unique_id: unique_id} if unique_id is not None else {}
            import inspect

            if "v3_data" in inspect.signature(node.PREPARE_CLASS_CLONE).parameters:  # newer ComfyUI (0.4+)
                hidden = {"hidden_inputs": hidden}
            return tuple(node.PREPARE_CLASS_CLONE(hidden).EXECUTE_NORMALIZED(**inputs).args)
        obj = node()
        return tuple(getattr(obj, node.FUNCTION)(**inputs))

    def defaults(self, node) -> dict:
        """The inputs a user gets when dropping a V3 node (its schema defaults)."""
        out = {}
        for item in node.GET_SCHEMA().inputs:
            default = getattr(item, "default", None)
            if default is not None:
                out[item.id] = default
        return out

    def free(self) -> None:
        """ComfyUI's free memory: unload every model and empty the allocator's cache."""
        self.mm.unload_all_models()
        gc.collect()
        self.mm.soft_empty_cache()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()


# ----------------------------------------------------------------------------- random models


def _fill(torch, name: str, shape, dtype, device, gen):
    """Seeded values with unit-variance outputs for matrices and convolutions; norms 1; the rest small."""
    if name.endswith(".scale") or "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1] or ".ln_" in name:
        return torch.ones(shape, dtype=dtype, device=device)
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if len(shape) >= 2 and name.endswith("weight"):
        fan_in = math.prod(shape[1:])
        t.mul_(fan_in ** -0.5)
    else:
        t.mul_(0.02)
    return t.to(dtype)


def _random_state_dict(torch, module, dtype, device, seed: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    return {k: _fill(torch, k, s, dtype, device, gen) for k, s in shapes.items()}


def flux_module(shape: Shape):
    """Flux.1-dev's geometry at `shape`'s depth, on the meta device (shapes only)."""
    import torch

    import dataclasses

    import comfy.ops
    from comfy.ldm.flux.model import Flux, FluxParams

    extra = {}
    if "txt_ids_dims" in {f.name for f in dataclasses.fields(FluxParams)}:  # newer ComfyUI; Flux.1 has none
        extra["txt_ids_dims"] = []
    return Flux(dtype=torch.bfloat16, device="meta", operations=comfy.ops.disable_weight_init,
                in_channels=16, out_channels=16, vec_in_dim=shape.vec_dim, context_in_dim=CONTEXT, hidden_size=HIDDEN,
                mlp_ratio=4.0, num_heads=24, depth=shape.double, depth_single_blocks=shape.single,
                axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True, **extra)


def flux_state_dict(c: Comfy, shape: Shape, device) -> dict:
    return _random_state_dict(c.torch, flux_module(shape), c.torch.bfloat16, device, seed=0)


def flux_vae_state_dict(c: Comfy, device) -> dict:
    """Flux's VAE geometry (AutoencoderKL, 16 latent channels, no quant convs), random."""
    torch = c.torch
    from comfy.ldm.modules.diffusionmodules.model import Decoder, Encoder

    cfg = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
           "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    with torch.device("meta"):
        enc, dec = Encoder(**cfg), Decoder(**cfg)
    sd = {f"encoder.{k}": v for k, v in _random_state_dict(torch, enc, torch.float32, device, seed=1).items()}
    sd.update({f"decoder.{k}": v for k, v in _random_state_dict(torch, dec, torch.float32, device, seed=2).items()})
    return sd


def clip_l_module():
    import torch

    import comfy.clip_model
    import comfy.ops

    config = json.loads((Path(comfy.clip_model.__file__).parent / "sd1_clip_config.json").read_text())
    return comfy.clip_model.CLIPTextModel(config, dtype=torch.float16, device="meta", operations=comfy.ops.disable_weight_init)


def _random_fp16_state_dict(torch, module, device, seed: int, norm: str, std) -> dict:
    """Seeded fp16 tensors for a text encoder: keys containing `norm` get weight 1 / bias 0, the rest
    normal values times std(key, shape)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for k, v in module.state_dict().items():
        if norm in k:
            out[k] = (torch.ones if k.endswith("weight") else torch.zeros)(v.shape, dtype=torch.float16, device=device)
        else:
            out[k] = (torch.randn(v.shape, generator=gen, device=device) * std(k, v.shape)).to(torch.float16)
    return out


def clip_l_state_dict(c: Comfy, device) -> dict:
    out = _random_fp16_state_dict(c.torch, clip_l_module(), device, seed=3, norm="norm", std=lambda k, shape: 0.02)
    out["text_model.embeddings.position_ids"] = c.torch.arange(77, device=device).unsqueeze(0)
    return out


def t5xxl_module():
    """T5-XXL's encoder as ComfyUI builds it for Flux (its config file), on the meta device."""
    import torch

    import comfy.ops
    import comfy.text_encoders.t5 as t5

    config = json.loads((Path(t5.__file__).parent / "t5_config_xxl.json").read_text())
    return t5.T5(config, dtype=torch.float16, device="meta", operations=comfy.ops.disable_weight_init)


def t5xxl_state_dict(c: Comfy, device) -> dict:
    def std(k, shape):  # unit-variance outputs; the embedding table itself unit variance
        return 1.0 if k.endswith("shared.weight") else (shape[-1] if len(shape) >= 2 else 1) ** -0.5

    return _random_fp16_state_dict(c.torch, t5xxl_module(), device, seed=4, norm="layer_norm", std=std)


def sd3_state_dict(c: Comfy, shape: Shape, device) -> dict:
    """The tiny SD3 (MMDiT) of scripts/tiny_models.py: hidden 64 x double, context 4096, pooled 2048."""
    torch = c.torch
    import comfy.ops
    from comfy.ldm.modules.diffusionmodules import mmdit

    hidden = 64 * shape.double
    model = mmdit.MMDiT(patch_size=2, in_channels=16, out_channels=16, depth=shape.double, adm_in_channels=shape.vec_dim,
                        context_embedder_config={"target": "torch.nn.Linear",
                                                 "params": {"in_features": CONTEXT, "out_features": hidden}},
                        pos_embed_max_size=32, num_patches=32 * 32, qk_norm="rms", dtype=torch.bfloat16,
                        device="meta", operations=comfy.ops.disable_weight_init)
    return _random_state_dict(torch, model, torch.bfloat16, device, seed=0)


def quantize_for_file(sd: dict) -> dict:
    """This pack's per-tensor e4m3fn quantization of every linear weight its converter quantizes by
    default (embedders, norms and the final layer stay bf16), as the convert CLI writes it."""
    from fp8_engram.quant import QuantizedTensor
    from fp8_engram.quant.quantize_model import DEFAULT_KEEP, is_linear_weight, keep_reason, make_layout

    layout, out = make_layout("tensor"), {}
    for key, t in sd.items():
        if is_linear_weight(key, t) and keep_reason(key[: -len(".weight")], DEFAULT_KEEP) is None:
            out[key] = QuantizedTensor.from_float(t, layout)
        else:
            out[key] = t
    return out


def make_files(c: Comfy, shape: Shape, models_dir: Path, gen_device) -> dict:
    """Write the bf16 and the pack's FP8 file of the same random weights (and a VAE); names and sizes."""
    torch = c.torch
    from fp8_engram.quant import save

    name = f"e2e_{shape.arch}_d{shape.double}s{shape.single}"
    bf16_path = models_dir / "diffusion_models" / f"{name}_bf16.safetensors"
    fp8_path = models_dir / "diffusion_models" / f"{name}_fp8.safetensors"
    vae_path = models_dir / "vae" / "e2e_flux_vae.safetensors"
    t0 = time.perf_counter()
    if not (bf16_path.exists() and fp8_path.exists()):
        sd = flux_state_dict(c, shape, gen_device) if shape.arch == "flux" else sd3_state_dict(c, shape, gen_device)
        save.save_state_dict(sd, bf16_path)
        save.save_state_dict(quantize_for_file(sd), fp8_path)
        del sd
    if not vae_path.exists():
        save.save_state_dict(flux_vae_state_dict(c, gen_device), vae_path)
    gc.collect()
    if c.cuda:
        torch.cuda.empty_cache()
    from safetensors import safe_open

    with safe_open(str(bf16_path), "pt") as f:
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return {"bf16": bf16_path.name, "fp8": fp8_path.name, "vae": vae_path.name, "params": params,
            "bf16_bytes": bf16_path.stat().st_size, "fp8_bytes": fp8_path.stat().st_size,
            "make_s": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- measuring


class StepClock:
    """Wraps the diffusion model's calls (cfg 1: one call per step): marks each call's end."""

    def __init__(self, c: Comfy):
        self.c = c
        self.ends: list = []
        self.first_done: float | None = None

    def wrapper(self, apply_model, args):
        out = apply_model(args["input"], args["timestep"], **args["c"])
        torch = self.c.torch
        if self.c.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.ends.append(ev)
        else:
            self.ends.append(time.perf_counter())
        if self.first_done is None:
            self.c.sync()
            self.first_done = time.perf_counter()
        return out

    def later_steps_s(self) -> list[float]:
        if self.c.cuda:
            self.c.sync()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.ends, self.ends[1:])]
        return [b - a for a, b in zip(self.ends, self.ends[1:])]


def sqnr_db(ref, x) -> float:
    ref = ref.double().cpu()
    err = (ref - x.double().cpu()).norm()
    if float(err) == 0:
        return float("inf")
    return float(20 * math.log10(float(ref.norm()) / float(err)))


class Vram:
    def __init__(self, c: Comfy):
        self.c = c

    def reset(self) -> int:
        if not self.c.cuda:
            return 0
        self.c.torch.cuda.reset_peak_memory_stats()
        return self.c.torch.cuda.memory_allocated()

    def allocated(self) -> int | None:
        return self.c.torch.cuda.memory_allocated() if self.c.cuda else None

    def device_used(self) -> int | None:
        if not self.c.cuda:
            return None
        free, total = self.c.torch.cuda.mem_get_info()
        return total - free

    def peaks(self, base: int) -> dict:
        if not self.c.cuda:
            return {"peak_alloc_gib": None, "peak_reserved_gib": None, "device_used_gib": None}
        t = self.c.torch.cuda
        return {"peak_alloc_gib": (t.max_memory_allocated() - base) / GIB, "peak_reserved_gib": t.max_memory_reserved() / GIB,
                "device_used_gib": self.device_used() / GIB}


def sample(c: Comfy, model, shape: Shape, positive, clock: StepClock | None = None, steps: int | None = None):
    torch = c.torch
    m = model
    if clock is not None:
        m = model.clone()
        m.set_model_unet_function_wrapper(clock.wrapper)
    latent = {"samples": torch.zeros(1, 16, shape.latent, shape.latent)}
    (out,) = c.run(c.nodes.KSampler, model=m, seed=SEED, steps=steps or shape.steps, cfg=1.0, sampler_name="euler",
                   scheduler="simple", positive=positive, negative=positive, latent_image=latent, denoise=1.0)
    return out["samples"]


def conditioning(c: Comfy, shape: Shape):
    torch = c.torch
    gen = torch.Generator().manual_seed(7)
    cond = torch.randn(1, shape.text_tokens, CONTEXT, generator=gen)
    pooled = torch.randn(1, shape.vec_dim, generator=gen)
    (guided,) = c.run(c.nodes_flux.FluxGuidance, conditioning=[[cond, {"pooled_output": pooled}]], guidance=GUIDANCE)
    return guided


def settle(c: Comfy) -> None:
    """Before a timed load: ComfyUI's free memory, the end of the pack's background reads of the load before (so
    that no load shares the CPU with another's), and a garbage collection (so that a collection the earlier
    variants' objects made due does not fall in whichever load comes next)."""
    from fp8_engram.quant import safetensors_file

    c.free()
    safetensors_file.background_reads_done()
    gc.collect()


def extra_loads(c: Comfy, load, n: int) -> list[float]:
    """Seconds of ``n`` loads whose model is dropped at once, each after ``settle``."""
    seconds = []
    for _ in range(n):
        settle(c)
        t0 = time.perf_counter()
        model = load()
        seconds.append(time.perf_counter() - t0)
        del model
    return seconds


def interleaved_loads(c: Comfy, loads: dict, rounds: int) -> dict:
    """{variant: seconds of its ``rounds`` counted loads}: in each round every variant loads twice in a row, the
    second load counted. A load of a tiny model takes some 10-50 ms, as much as its noise, and much of it is
    what the load before left: the fresh pages its reads fault in where the allocator has no freed memory of
    the right sizes to hand out (pack variants' loads right after a stock one took 10-15 ms more, whichever
    variant it was; with --cpu-isa avx2 the first pack variant in a block of its own read 25-60% slower). A
    counted load always follows a load of its own variant; the rounds spread every variant's over the run.
    No loads at all for no rounds."""
    if rounds < 1:
        return {}
    seconds: dict = {name: [] for name in loads}
    for _ in range(rounds):
        for name, load in loads.items():
            extra_loads(c, load, 1)
            seconds[name] += extra_loads(c, load, 1)
    return seconds


def run_variant(c: Comfy, name: str, load, shape: Shape, positive, vram: Vram, earlier_loads: list | None = None):
    # the load figure: the median of the sampled load (its first step counts from its start) and
    # ``earlier_loads``, this variant's seconds from ``interleaved_loads``
    loads = list(earlier_loads or [])
    settle(c)
    base = vram.reset()
    t0 = time.perf_counter()
    model = load()
    t_load = time.perf_counter() - t0
    loads.append(t_load)
    clock = StepClock(c)
    samples = sample(c, model, shape, positive, clock)
    c.sync()
    later = clock.later_steps_s()
    row = {"variant": name, "load_s": statistics.median(loads), "loads_s": [round(t, 5) for t in loads],
           "first_step_s": clock.first_done - t0,
           "step_s": statistics.median(later) if later else None, "steps_timed": len(later),
           "model_bytes": model.model_size()}
    row.update(vram.peaks(base))
    logger.info("%s: %s", name, row)
    return row, model, samples


# the variants the paired later steps compare (stock_bf16 the baseline of each round)
PAIRED = ("stock_bf16", "pack_weight_only", "pack_auto")


def paired_steps(c: Comfy, loads: dict, shape: Shape, positive, rounds: int) -> dict | None:
    """Later steps of stock_bf16, pack_weight_only and pack_auto taken in turns, all three models held at once.

    A variant's own run (``run_variant``) times its steps minutes after the baseline's; this VM's speed drifts
    by more than the margins issue 35 asks about (the same weight-only code read 0.88 and 1.16 of stock bf16's
    step at 1040 tokens under the AVX2 caps, in two runs). Here every round samples each model once, in an
    order rotated each round so that none always follows the same one, and each round's ratio is taken
    within the round: the figure is the median over rounds of (variant's later step / stock_bf16's in the
    same round), each step the median of that sample's later steps. The loads are not timed (the variants'
    verdicts for this size exist by now), and a round of two-step samples, not counted, comes first. None
    without stock_bf16 or rounds."""
    names = [n for n in PAIRED if n in loads]
    if rounds < 1 or "stock_bf16" not in names or len(names) < 2:
        return None
    from fp8_engram.quant import safetensors_file

    settle(c)
    models = {n: loads[n]() for n in names}
    safetensors_file.background_reads_done()  # the pack loads' reads of their FP8 codes end before any step
    gc.collect()
    # one uncounted sample each: the first after the loads ran ~20x slower
    # (tiny SD3 on the CPU, CI running beside it: 0.28 s against 0.013)
    for n in names:
        sample(c, models[n], shape, positive, StepClock(c), steps=2)
    steps: dict = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            clock = StepClock(c)
            sample(c, models[n], shape, positive, clock)
            c.sync()
            later = clock.later_steps_s()
            steps[n].append(statistics.median(later) if later else None)
    del models
    c.free()

    def ratio(n):
        pairs = [a / b for a, b in zip(steps[n], steps["stock_bf16"]) if a and b]
        return statistics.median(pairs) if pairs else None

    return {"rounds": rounds, "step_s": steps,
            "ratios": {f"{n}_later_step_over_stock_bf16": ratio(n) for n in names if n != "stock_bf16"}}


def loaders(c: Comfy, files: dict) -> dict:
    def stock(file, weight_dtype):
        return lambda: c.run(c.nodes.UNETLoader, unet_name=file, weight_dtype=weight_dtype)[0]

    def pack(compute_path, **extra):
        def load():
            inputs = c.defaults(c.pack_fp8.LoadFP8DiffusionModel)
            inputs.update(unet_name=files["fp8"], compute_path=compute_path, **extra)
            return c.run(c.pack_fp8.LoadFP8DiffusionModel, **inputs)[0]
        return load

    out = {
        "stock_bf16": stock(files["bf16"], "default"),
        "stock_fp8_cast": stock(files["bf16"], "fp8_e4m3fn"),
        "stock_fp8_fast": stock(files["bf16"], "fp8_e4m3fn_fast"),
        "stock_fp8_mixed": stock(files["fp8"], "default"),
        "pack_auto": pack("auto"),
        "pack_weight_only": pack("weight-only"),
        "pack_memory_first": pack(MEMORY_FIRST),
    }
    if not c.cuda:  # the CPU's dequantized copies (a budget over the whole model): weight-only at dense speed
        out["pack_weight_only_copies"] = pack("weight-only", dequantized_copies_gb=COPIES_GB)
    return out


COPIES_GB = 16.0  # pack_weight_only_copies' budget: room for every layer of the --tiny models in float32
MEMORY_FIRST = "auto (memory first)"  # the loaders' compute_path of that name: auto that drops a converted layer's FP8 form


# ----------------------------------------------------------------------------- offloading and unloading


def fp8_layer_devices(c: Comfy, model) -> dict:
    from fp8_engram.quant import QuantizedTensor

    counts: dict = {}
    for _, mod in model.model.diffusion_model.named_modules():
        w = getattr(mod, "weight", None)
        if isinstance(w, QuantizedTensor):
            key = f"{w.device.type}:{'fp8' if w.qdata.dtype in (c.torch.float8_e4m3fn, c.torch.float8_e5m2) else w.qdata.dtype}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def run_offload(c: Comfy, shape: Shape, positive, full_latent, load, vram: Vram) -> dict:
    """pack_auto with ComfyUI told to keep most of the VRAM free: partial load, per-layer FP8 moves."""
    mm, torch = c.mm, c.torch
    c.free()
    base = vram.reset()
    model = load()
    size = model.model_size()
    target = 0.4 * size  # the weights ComfyUI may keep on the GPU
    lat = [1, 16, shape.latent, shape.latent]
    try:
        need = model.memory_required(lat)
    except Exception:  # older signatures: the inference floor alone
        need = 0
    free = mm.get_free_memory(c.device)
    reserve = max(0, int(free - target - max(mm.minimum_inference_memory() - mm.extra_reserved_memory(), need)))
    saved = (mm.EXTRA_RESERVED_VRAM, getattr(c.args, "reserve_vram", None))
    moved = {"calls": 0, "bytes": 0}
    original_move = c.pack_ops.move_quantized

    def counting_move(w, device):
        out = original_move(w, device)
        if out is not w:
            moved["calls"] += 1
            moved["bytes"] += w.qdata.numel() * w.qdata.element_size()
        return out

    mm.EXTRA_RESERVED_VRAM = reserve
    c.args.reserve_vram = reserve / GIB
    c.pack_ops.move_quantized = counting_move
    try:
        clock = StepClock(c)
        samples = sample(c, model, shape, positive, clock)
        c.sync()
        loaded = [lm for lm in mm.current_loaded_models if lm.model is not None and lm.model.model is model.model]
        patcher = loaded[0].model if loaded else model
        later = clock.later_steps_s()
        out = {"reserved_gib": reserve / GIB, "model_gib": size / GIB,
               "loaded_gib": patcher.loaded_size() / GIB, "lowvram": bool(getattr(patcher.model, "model_lowvram", False)),
               "fp8_layers_by_device": fp8_layer_devices(c, patcher),
               "fp8_moves_per_step": moved["calls"] / max(1, shape.steps),
               "fp8_gib_moved_per_step": moved["bytes"] / max(1, shape.steps) / GIB,
               "step_s": statistics.median(later) if later else None,
               "latent_equal_full": bool(torch.equal(samples, full_latent)),
               "latent_sqnr_vs_full_db": sqnr_db(full_latent, samples)}
        out.update(vram.peaks(base))
    finally:
        c.pack_ops.move_quantized = original_move
        mm.EXTRA_RESERVED_VRAM, c.args.reserve_vram = saved
        c.free()
    del model
    return out


# ----------------------------------------------------------------------------- engram


def encode_times(c: Comfy, shape: Shape, clip, memory) -> dict:
    """Engram Memorize, then Engram Text Encode vs CLIP Text Encode on one prompt (interleaved, median)."""
    torch = c.torch
    c.run(c.pack_engram.EngramMemorize, memory=memory, clip=clip, text=PHRASE, target_text=TARGET)

    def plain():
        return c.run(c.nodes.CLIPTextEncode, clip=clip, text=PROMPT)[0]

    def engram():
        return c.run(c.pack_engram.EngramTextEncode, clip=clip, text=PROMPT, memory=memory, strength=1.0)[0]

    plain(), engram()  # warm up (loads the text encoder onto the device)
    times, conds = {"plain": [], "engram": []}, {}
    for i in range(shape.engram_repeats):
        for name, fn in ((("plain", plain), ("engram", engram)) if i % 2 == 0 else (("engram", engram), ("plain", plain))):
            c.sync()
            start = time.perf_counter()
            conds[name] = fn()
            c.sync()
            times[name].append(time.perf_counter() - start)
    plain_ms = statistics.median(times["plain"]) * 1e3
    engram_ms = statistics.median(times["engram"]) * 1e3
    cond_plain, cond_engram = conds["plain"], conds["engram"]
    rows = getattr(memory.store, "rows_per_layer", None)
    return {"rows": int(sum(rows)) if rows else None, "plain_ms": plain_ms, "engram_ms": engram_ms,
            "added_fraction": engram_ms / plain_ms - 1.0,
            "conditioning_moved": not torch.equal(cond_plain[0][0], cond_engram[0][0]),
            "_conds": (cond_plain, cond_engram)}


def library_memory(c: Comfy, clip, ranks: int, rows_per_head: int, device: str):
    """An engram memory on `ranks` ranks made with the pack's library (EngramGroup + EngramMemory), when the node
    made fewer ranks than asked (on the CPU run, whose node memory keeps 2 CPU ranks); the engram nodes then
    use it like theirs. On a GPU the node's gpu_ranks gives the ranks asked for, and this is not used."""
    from fp8_engram.engram.group import EngramGroup
    from fp8_engram.engram.memory import EngramMemory, make_config

    defaults = c.defaults(c.pack_engram.NewEngramMemory)
    layout = c.pack_engram_clip.clip_layout(clip)
    config, vocabs = make_config(layout, c.pack_engram_clip.clip_tokenizers(clip), max_order=defaults.get("max_order", 3),
                                 heads=defaults.get("heads", 8), rows_per_head=rows_per_head, seed=0)
    store = EngramGroup(config.rows_per_layer(ranks), config.hidden, c.torch.bfloat16, num_ranks=ranks, device=device)
    try:
        return EngramMemory(config, store, vocabs)
    except BaseException:
        store.close()
        raise


def run_engram(c: Comfy, shape: Shape, tiny: bool, model, want_ranks: int, rows_per_head: int) -> dict:
    """The node-made memory (sampled with), and, when the node gives fewer ranks than `want_ranks`, one made
    with the library on `want_ranks` ranks sharing the device (encode times only)."""
    torch = c.torch
    t0 = time.perf_counter()
    dev = c.device if c.cuda else torch.device("cpu")
    if tiny:
        clip = c.sd.load_text_encoder_state_dicts([clip_l_state_dict(c, dev)], clip_type=c.sd.CLIPType.SD3)
        encoder = "SD3-type CLIP-L (random, full size)"
    else:
        clip = c.sd.load_text_encoder_state_dicts([clip_l_state_dict(c, dev), t5xxl_state_dict(c, dev)],
                                                  clip_type=c.sd.CLIPType.FLUX)
        encoder = "Flux CLIP-L + T5-XXL (random, full size, fp16)"
    gc.collect()
    out = {"encoder": encoder, "rows_per_head": rows_per_head, "clip_build_s": time.perf_counter() - t0}
    inputs = c.defaults(c.pack_engram.NewEngramMemory)
    if tiny:
        extra, ranks, how = {"devices": "cpu", "cpu_ranks": 2}, 2, "devices=cpu, cpu_ranks=2"
    else:  # gpu_ranks spreads the ranks round-robin over the GPUs: on one GPU they all share it
        extra, ranks, how = {"gpu_ranks": want_ranks, "devices": "auto"}, want_ranks, f"devices=auto, gpu_ranks={want_ranks}"
    inputs.update(extra, clip=clip, rows_per_head=rows_per_head)
    try:
        t1 = time.perf_counter()
        (memory,) = c.run(c.pack_engram.NewEngramMemory, unique_id="e2e-engram", **inputs)
        out["new_memory_s"] = time.perf_counter() - t1
        try:
            node = encode_times(c, shape, clip, memory)
            cond_plain, cond_engram = node.pop("_conds")
            (guided_e,) = c.run(c.nodes_flux.FluxGuidance, conditioning=cond_engram, guidance=GUIDANCE)
            (guided_p,) = c.run(c.nodes_flux.FluxGuidance, conditioning=cond_plain, guidance=GUIDANCE)
            steps = min(shape.steps, 4 if c.cuda else 2)
            lat_e = sample(c, model, shape, guided_e, steps=steps)
            lat_p = sample(c, model, shape, guided_p, steps=steps)
            node.update(ranks=ranks, ranks_how=how, sampled=bool(torch.isfinite(lat_e).all()),
                        latent_sqnr_engram_vs_plain_db=sqnr_db(lat_p, lat_e))
            out.update(node)
        finally:
            memory.close()
        lib_ranks = want_ranks if c.cuda else 3
        if ranks < lib_ranks:
            t2 = time.perf_counter()
            memory = library_memory(c, clip, lib_ranks, rows_per_head, "cuda" if c.cuda else "cpu")
            try:
                lib = encode_times(c, shape, clip, memory)
                lib.pop("_conds")
                lib.update(ranks=lib_ranks, new_memory_s=time.perf_counter() - t2,
                           how=f"EngramGroup(num_ranks={lib_ranks}, device={'cuda' if c.cuda else 'cpu'}) + EngramMemory, "
                               "used by Engram Memorize and Engram Text Encode")
                out["library_ranks"] = lib
            finally:
                memory.close()
    finally:
        del clip
        c.free()
    return out


# ----------------------------------------------------------------------------- main


def vae_decode(c: Comfy, files: dict, samples) -> tuple:
    (vae,) = c.run(c.nodes.VAELoader, vae_name=files["vae"])
    c.sync()
    t0 = time.perf_counter()
    (image,) = c.run(c.nodes.VAEDecode, vae=vae, samples={"samples": samples})
    c.sync()
    return image, time.perf_counter() - t0


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def parse_sizes(text: str) -> list[int]:
    """--image's value: pixels per side, one size or a comma-separated list, each a positive multiple of 16
    (one Flux patch of latents), no size twice."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: pixels per side, e.g. 32 or 32,512") from None
    bad = [v for v in sizes if v < 16 or v % 16]
    if not sizes or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: pixels per side must be positive multiples of 16 "
                                         "(one Flux patch of latents)")
    if len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: a size is given twice")
    return sizes


def default_sizes(tiny: bool, arch: str | None) -> list[int]:
    """Sizes when --image is not given: the GPU measurement's 1024; --tiny sd3 (the test suite's run) 32;
    --tiny flux 32 and 512 (about 20 and 1040 tokens)."""
    if not tiny:
        return [1024]
    return [32, 512] if arch == "flux" else [32]


# --cpu-isa: the settings each library reads at start (ATen's kernel dispatch, oneDNN, MKL) to stay within an ISA
CPU_ISA_CAPS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU, tiny shapes (what the test suite runs)")
    p.add_argument("--double", type=int, help="double-stream blocks (default 5; tiny 1)")
    p.add_argument("--single", type=int, help="single-stream blocks (default 10; tiny 1)")
    p.add_argument("--steps", type=int, help="sampling steps (default 8; tiny 2)")
    p.add_argument("--image", type=parse_sizes, help="pixels per side, one size or a comma-separated list (default 1024; "
                   "tiny 32; tiny flux 32,512). Flux takes (pixels/16)^2 image tokens beside its text tokens (tiny: 16): "
                   "32 -> 20 tokens in all, 512 -> 1040")
    p.add_argument("--engram-ranks", type=int, default=4, help="CUDA ranks sharing the GPU for the engram memory")
    p.add_argument("--rows-per-head", type=int, help="engram rows per hash head (default 65536; tiny 4096)")
    p.add_argument("--skip-engram", action="store_true")
    p.add_argument("--load-repeats", type=int, help="loads per variant and size, their median the load figure "
                   "(default 1; --tiny 11)")
    p.add_argument("--paired-rounds", type=int, help="rounds of the paired later steps per size (stock_bf16, "
                   "pack_weight_only and pack_auto held at once, sampled in turns; default --tiny 3, else 0: "
                   "a GPU's steps are timed by CUDA events on a device of its own, a CPU's by a shared clock)")
    p.add_argument("--arch", choices=("flux", "sd3"), help="diffusion model (default: flux; --tiny: sd3)")
    p.add_argument("--keep-dir", help="make the files here and keep them (default: a temp dir, deleted)")
    p.add_argument("--cpu-isa", choices=("avx2",), help="emulate an AVX2 CPU on a newer one: the run starts again with "
                   "torch's kernels, oneDNN and MKL capped at AVX2 (so no VNNI: the pack's int8 is off, as on such a "
                   "CPU); the processor's own caches, clock and memory stay, so it is an emulation, said so in the output")
    args = p.parse_args(argv)
    if args.load_repeats is None:
        args.load_repeats = 11 if args.tiny else 1
    if args.load_repeats < 1:
        p.error("--load-repeats must be at least 1")
    if args.paired_rounds is None:
        args.paired_rounds = 3 if args.tiny else 0
    if args.paired_rounds < 0:
        p.error("--paired-rounds must be 0 or more")
    if args.cpu_isa and os.environ.get("FP8_ENGRAM_BENCH_ISA") != args.cpu_isa:
        env = dict(os.environ, FP8_ENGRAM_BENCH_ISA=args.cpu_isa, **CPU_ISA_CAPS[args.cpu_isa])
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + list(argv or sys.argv[1:]), env)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    sizes = args.image or default_sizes(args.tiny, args.arch)

    if args.tiny:
        flux = args.arch == "flux"  # a Flux at --tiny sizes: 1 double + 1 single block are 0.55 G parameters
        shape = Shape(arch="flux" if flux else "sd3", double=args.double or (1 if flux else 2),
                      single=(args.single or 1) if flux else 0, image=sizes[0], text_tokens=16, steps=args.steps or 3,
                      vec_dim=2048, engram_repeats=1)
    else:
        shape = Shape(arch="flux", double=args.double or 5, single=args.single or 10, image=sizes[0], text_tokens=512,
                      steps=args.steps or 8, vec_dim=768, engram_repeats=10)
    rows_per_head = args.rows_per_head or (4096 if args.tiny else 65536)
    work = Path(args.keep_dir) if args.keep_dir else Path(tempfile.mkdtemp(prefix="fp8_e2e_", dir=scratch_dir(shape)))
    models_dir = work / "models"
    c = Comfy(args.tiny, models_dir)
    torch = c.torch
    if not args.tiny and not c.cuda:
        raise SystemExit("no CUDA device: run with --tiny on the CPU")
    skipped = []
    if not c.cuda:
        skipped = ["VRAM figures (no GPU)", "offloading (ComfyUI keeps everything on the CPU)",
                   "VRAM after unloading (no GPU)", "CUDA engram ranks (CPU ranks used)"]
    vram = Vram(c)
    result: dict = {"bench": "e2e", "mode": "tiny" if args.tiny else "full", "device": str(c.device),
                    "cpu_isa_emulated": args.cpu_isa,
                    "gpu": torch.cuda.get_device_name(c.device) if c.cuda else None, "torch": torch.__version__,
                    "shape": {"arch": shape.arch, "hidden": HIDDEN if shape.arch == "flux" else 64 * shape.double,
                              "double": shape.double, "single": shape.single,
                              "flux_dev_blocks_fraction": round((shape.double + shape.single) / 57, 3) if shape.arch == "flux" else None,
                              "image": shape.image, "image_tokens": shape.image_tokens, "text_tokens": shape.text_tokens,
                              "steps": shape.steps, "images": sizes}, "skipped": skipped}
    try:
        with torch.inference_mode():  # as ComfyUI's executor runs every node
            run_all(c, args, shape, rows_per_head, vram, result, models_dir, sizes)
    except Exception as exc:  # still print what was measured, and say what broke
        logger.exception("the run stopped")
        result.setdefault("errors", {})["run"] = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        if not args.keep_dir:
            import shutil

            shutil.rmtree(work, ignore_errors=True)

    try:
        print_table(result)
    except Exception:  # the JSON line below is what gets compared; never lose it to the table
        logger.exception("the table could not be printed")
    print(json.dumps(_finite(result)))
    return 1 if result.get("errors") else 0


# The variants every size runs (the issue's four, and on the CPU weight-only with copies); the stock cast/fast
# routes run at the first size only.
PER_SIZE_VARIANTS = ("stock_bf16", "stock_fp8_mixed", "pack_auto", "pack_weight_only", "pack_memory_first",
                     "pack_weight_only_copies")


def fresh_book(work: Path, image: int) -> Path:
    """Point ComfyUI's user folder, where the loaders keep their fast-path verdicts (nodes/fp8.py
    verdict_book()), at an empty folder of this run for `image`: a new verdict file is a new book, so the
    size's first pack_auto step proves its own token classes, as a user's first run at that size does (and
    the bench never reads or writes the verdicts of the ComfyUI tree it runs on)."""
    import shutil

    import folder_paths

    user = work / "user" / f"{image}px"
    shutil.rmtree(user, ignore_errors=True)  # --keep-dir: a folder left by an earlier run
    user.mkdir(parents=True)
    folder_paths.set_user_directory(str(user))
    return user


def finish_rows(c: Comfy, rows: list, latents: dict) -> None:
    """Each row's latent SQNR against the same size's stock_bf16 (float64) and whether its latent is finite."""
    base = latents.get("stock_bf16")
    for row in rows:
        lat = latents.get(row["variant"])
        if lat is not None:
            row["sqnr_db"] = sqnr_db(base, lat) if base is not None else None
            row["finite"] = bool(c.torch.isfinite(lat).all())


def size_ratios(rows: list) -> dict:
    """The per-size figures issue 35 is judged on, from one size's rows (None where a variant or a figure is
    missing): later step over stock_bf16's for pack_auto, pack_weight_only and pack_weight_only_copies, pack_auto's load over
    pack_weight_only's and stock_fp8_mixed's, pack_auto's first step over pack_weight_only's, and pack_auto's
    latent SQNR minus pack_weight_only's in dB (None when either is infinite); the same three for
    pack_memory_first (later step over stock_bf16's, first step over pack_weight_only's, SQNR difference)."""
    by = {r["variant"]: r for r in rows if "error" not in r}

    def over(name, key, base, base_key=None):
        a, b = (by.get(name) or {}).get(key), (by.get(base) or {}).get(base_key or key)
        return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None

    def sqnr_minus_weight_only(name):
        a, b = (by.get(name) or {}).get("sqnr_db"), (by.get("pack_weight_only") or {}).get("sqnr_db")
        return a - b if all(isinstance(v, (int, float)) and math.isfinite(v) for v in (a, b)) else None

    return {"pack_auto_later_step_over_stock_bf16": over("pack_auto", "step_s", "stock_bf16"),
            "pack_weight_only_later_step_over_stock_bf16": over("pack_weight_only", "step_s", "stock_bf16"),
            "pack_weight_only_copies_later_step_over_stock_bf16": over("pack_weight_only_copies", "step_s", "stock_bf16"),
            "pack_auto_load_over_pack_weight_only": over("pack_auto", "load_s", "pack_weight_only"),
            "pack_auto_load_over_stock_fp8_mixed": over("pack_auto", "load_s", "stock_fp8_mixed"),
            "pack_auto_first_step_over_pack_weight_only": over("pack_auto", "first_step_s", "pack_weight_only"),
            "pack_auto_minus_pack_weight_only_sqnr_db": sqnr_minus_weight_only("pack_auto"),
            "pack_memory_first_later_step_over_stock_bf16": over("pack_memory_first", "step_s", "stock_bf16"),
            "pack_memory_first_first_step_over_pack_weight_only": over("pack_memory_first", "first_step_s",
                                                                       "pack_weight_only"),
            "pack_memory_first_minus_pack_weight_only_sqnr_db": sqnr_minus_weight_only("pack_memory_first")}


def size_entry(shape: Shape, rows: list, skipped_variants: list, paired: dict | None = None) -> dict:
    """One size's part of the JSON: its geometry, its rows, size_ratios() and paired_steps() (None when not run)."""
    return {"image": shape.image, "image_tokens": shape.image_tokens, "tokens": shape.image_tokens + shape.text_tokens,
            "variants": rows, "variants_skipped": skipped_variants, "ratios": size_ratios(rows), "paired": paired}


def run_all(c: Comfy, args, shape: Shape, rows_per_head: int, vram: Vram, result: dict, models_dir: Path,
            sizes: list[int] | None = None) -> None:
    """Every part in turn; a part that fails is recorded in result["errors"] and the others still run.
    The first of `sizes` (default: shape.image) gets every part; each later one its variants again."""
    import dataclasses

    torch = c.torch
    errors = result.setdefault("errors", {})
    sizes = sizes or [shape.image]
    work = models_dir.parent

    def guarded(key, fn, *fn_args):
        try:
            return fn(*fn_args)
        except Exception as exc:  # one broken part must not cost the figures of the others
            logger.exception("%s failed", key)
            errors[key] = f"{type(exc).__name__}: {exc}"[:2000]
            return None

    torch.manual_seed(0)
    files = make_files(c, shape, models_dir, c.device if c.cuda else torch.device("cpu"))
    result["files"] = {k: v for k, v in files.items() if k.endswith("bytes") or k in ("params", "make_s")}
    logger.info("files made in %.1f s", files["make_s"])
    if c.cuda:  # torch's matmul workspaces (bf16 and fp8) exist before the starting point is read
        a = torch.randn(256, 256, device=c.device, dtype=torch.bfloat16)
        a @ a
        try:
            torch._scaled_mm(a.to(torch.float8_e4m3fn), a.to(torch.float8_e4m3fn).t(),
                             scale_a=torch.ones((), device=c.device), scale_b=torch.ones((), device=c.device),
                             out_dtype=torch.bfloat16)
        except Exception:
            pass
        del a
    c.free()
    start_alloc, start_used = vram.allocated(), vram.device_used()
    positive = conditioning(c, shape)  # text only: the same at every size

    def run_size(size_shape: Shape, names, keep: dict, tag: str) -> tuple:
        fresh_book(work, size_shape.image)
        rows, latents = [], {}
        chosen = {name: load for name, load in loaders(c, files).items() if name in names}
        earlier = guarded(f"loads{tag}", interleaved_loads, c, chosen, args.load_repeats - 1) or {}
        for name, load in chosen.items():
            got = guarded(f"{name}{tag}", run_variant, c, name, load, size_shape, positive, vram, earlier.get(name))
            if got is None:
                rows.append({"variant": name, "error": errors[f"{name}{tag}"]})
                continue
            row, model, samples = got
            rows.append(row)
            latents[name] = samples
            if name == "pack_auto":
                keep["pack_auto"] = model
            del model, got
        finish_rows(c, rows, latents)
        paired[size_shape.image] = guarded(f"paired{tag}", paired_steps, c, chosen, size_shape, positive,
                                           args.paired_rounds)
        return rows, latents

    kept: dict = {}
    paired: dict = {}  # image size -> paired_steps()
    rows, latents = run_size(shape, tuple(loaders(c, files)), kept, "")
    base = latents.get("stock_bf16")
    result["variants"] = rows
    result["sizes"] = [size_entry(shape, rows, [], paired.get(shape.image))]
    by = {r["variant"]: r for r in rows if "error" not in r}

    def vae_part():
        image_bf16, t_dec = vae_decode(c, files, base)
        image_pack, _ = vae_decode(c, files, latents["pack_auto"])
        return {"decode_s": t_dec, "image_shape": list(image_bf16.shape),
                "image_sqnr_pack_auto_vs_bf16_db": sqnr_db(image_bf16, image_pack)}

    if base is not None and "pack_auto" in latents:
        result["vae"] = guarded("vae", vae_part)
    if c.cuda and "pack_auto" in latents:
        result["offload"] = guarded("offload", run_offload, c, shape, positive, latents["pack_auto"],
                                    loaders(c, files)["pack_auto"], vram)
    c.free()
    if c.cuda:
        end_alloc, end_used = vram.allocated(), vram.device_used()
        result["unload"] = {"start_alloc_mib": start_alloc / 2**20, "after_free_alloc_mib": end_alloc / 2**20,
                            "start_device_used_mib": start_used / 2**20, "after_free_device_used_mib": end_used / 2**20,
                            "returned": end_alloc <= start_alloc}

    if not args.skip_engram and "pack_auto" in kept:
        result["engram"] = guarded("engram", run_engram, c, shape, args.tiny, kept["pack_auto"], args.engram_ranks,
                                   rows_per_head)
    kept.clear()
    c.free()

    for image in sizes[1:]:  # the files are the same; loads, first steps and verdicts are this size's own
        size_shape = dataclasses.replace(shape, image=image)
        logger.info("image %d px (%d tokens)", image, size_shape.image_tokens + size_shape.text_tokens)
        size_rows, _ = run_size(size_shape, PER_SIZE_VARIANTS, {}, f"@{image}px")
        c.free()
        skipped_variants = [n for n in loaders(c, files) if n not in PER_SIZE_VARIANTS]
        result["sizes"].append(size_entry(size_shape, size_rows, skipped_variants, paired.get(image)))

    def step(name):
        return (by.get(name) or {}).get("step_s")

    def speedup(base_name, name):
        return step(base_name) / step(name) if step(base_name) and step(name) else None

    stock_fp8 = [n for n in ("stock_fp8_cast", "stock_fp8_fast", "stock_fp8_mixed") if step(n)]
    fastest = min(stock_fp8, key=step) if stock_fp8 else None
    pa, bf = by.get("pack_auto", {}), by.get("stock_bf16", {})
    ratios = {"pack_auto_speedup_vs_bf16": speedup("stock_bf16", "pack_auto"),
              "pack_weight_only_speedup_vs_bf16": speedup("stock_bf16", "pack_weight_only"),
              "fastest_stock_fp8": fastest,
              "pack_auto_speedup_vs_fastest_stock_fp8": speedup(fastest, "pack_auto") if fastest else None,
              "pack_auto_sqnr_db": pa.get("sqnr_db")}
    if c.cuda and pa.get("peak_alloc_gib") and bf.get("peak_alloc_gib"):
        ratios["pack_auto_peak_vram_vs_bf16"] = pa["peak_alloc_gib"] / bf["peak_alloc_gib"]
    result["ratios"] = ratios
    if c.cuda:
        off, eng = result.get("offload") or {}, result.get("engram")

        def at_least(v, bar):
            return None if v is None else v >= bar

        vram_ratio = ratios.get("pack_auto_peak_vram_vs_bf16")
        result["targets"] = {
            "speed_vs_bf16_ge_1.2": at_least(ratios["pack_auto_speedup_vs_bf16"], 1.2),
            "speed_ge_fastest_stock_fp8": at_least(ratios["pack_auto_speedup_vs_fastest_stock_fp8"], 1.0),
            "peak_vram_le_0.6x_bf16": None if vram_ratio is None else vram_ratio <= 0.6,
            "sqnr_ge_20db": at_least(pa.get("sqnr_db"), 20.0),
            "offload_partial": off.get("lowvram"), "offload_latent_equal": off.get("latent_equal_full"),
            "vram_back_after_unload": result["unload"]["returned"],
            "engram_added_le_10pct": None if not eng else engram_target(eng, args.engram_ranks),
        }


def engram_target(eng: dict, want: int) -> bool:
    """Whichever memory had `want` ranks (the node's, else the library-made one) adds at most 10 %."""
    for m in (eng, eng.get("library_ranks") or {}):
        if m.get("ranks", 0) >= want:
            return m["added_fraction"] <= 0.10
    return False


def _finite(o):
    """JSON without NaN/inf: infinite SQNR (identical results) is written as the string "inf"."""
    if isinstance(o, float) and not math.isfinite(o):
        return "inf" if o > 0 else str(o)
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_finite(v) for v in o]
    if isinstance(o, float):
        return round(o, 5)
    return o


def print_table(r: dict) -> None:
    s = r["shape"]
    what = (f"Flux.1-dev-shaped: hidden {s['hidden']}, {s['double']} double + {s['single']} single blocks "
            f"({s['flux_dev_blocks_fraction']:.0%} of Flux.1-dev's 57)" if s["arch"] == "flux" else
            f"tiny SD3 MMDiT: hidden {s['hidden']}, {s['double']} joint blocks")
    images = s.get("images") or [s["image"]]
    print(f"{what}, {' and '.join(f'{px}x{px}' for px in images)} ({s['text_tokens']} text tokens beside the image's), "
          f"{s['steps']} steps; {r['device']} {r['gpu'] or ''}"
          + (f" (an {r['cpu_isa_emulated'].upper()} CPU emulated: torch, oneDNN and MKL capped at it)"
             if r.get("cpu_isa_emulated") else ""))
    sizes = r.get("sizes") or [{"image": s["image"], "tokens": s["image_tokens"] + s["text_tokens"],
                                "variants": r.get("variants", []), "variants_skipped": [], "ratios": {}}]
    print(f"{'px':>5}{'tokens':>7}  {'variant':<18}{'load s':>8}{'1st step s':>12}{'step s':>9}{'x bf16':>8}{'peak GiB':>10}"
          f"{'reserved GiB':>14}{'SQNR dB':>9}")
    for size in sizes:
        at = f"{size['image']:>5}{size['tokens']:>7}  "
        bf = next((v for v in size["variants"] if v["variant"] == "stock_bf16" and "error" not in v), {})
        for v in size["variants"]:
            if "error" in v:
                print(f"{at}{v['variant']:<18}ERROR {v['error'][:200]}")
                continue
            speed = bf["step_s"] / v["step_s"] if v["step_s"] and bf.get("step_s") else None
            sqnr = v.get("sqnr_db")
            print(f"{at}{v['variant']:<18}{v['load_s']:>8.2f}{v['first_step_s']:>12.2f}{fmt(v['step_s'], '.4f'):>9}"
                  f"{fmt(speed, '.2f'):>8}{fmt(v['peak_alloc_gib'], '.2f'):>10}{fmt(v['peak_reserved_gib'], '.2f'):>14}"
                  f"{format(sqnr, '>9.1f') if isinstance(sqnr, float) else str(sqnr):>9}")
        if size["variants_skipped"]:
            print(f"{at}not run at this size (first size only): {', '.join(size['variants_skipped'])}")
    for size in sizes:
        q = size["ratios"]
        if q:
            print(f"{size['image']} px ({size['tokens']} tokens), time over time: later step pack_auto / stock_bf16 "
                  f"{fmt(q['pack_auto_later_step_over_stock_bf16'], '.2f')}, pack_weight_only / stock_bf16 "
                  f"{fmt(q['pack_weight_only_later_step_over_stock_bf16'], '.2f')}, pack_weight_only_copies / stock_bf16 "
                  f"{fmt(q.get('pack_weight_only_copies_later_step_over_stock_bf16'), '.2f')}; load pack_auto / pack_weight_only "
                  f"{fmt(q['pack_auto_load_over_pack_weight_only'], '.2f')}, pack_auto / stock_fp8_mixed "
                  f"{fmt(q['pack_auto_load_over_stock_fp8_mixed'], '.2f')}; first step pack_auto / pack_weight_only "
                  f"{fmt(q['pack_auto_first_step_over_pack_weight_only'], '.2f')}; SQNR pack_auto - pack_weight_only "
                  f"{fmt(q['pack_auto_minus_pack_weight_only_sqnr_db'], '+.1f')} dB; pack_memory_first: later step / "
                  f"stock_bf16 {fmt(q.get('pack_memory_first_later_step_over_stock_bf16'), '.2f')}, first step / "
                  f"pack_weight_only {fmt(q.get('pack_memory_first_first_step_over_pack_weight_only'), '.2f')}, SQNR - "
                  f"pack_weight_only {fmt(q.get('pack_memory_first_minus_pack_weight_only_sqnr_db'), '+.1f')} dB")
    for size in sizes:
        p = size.get("paired")
        if p:
            q = p["ratios"]
            print(f"{size['image']} px ({size['tokens']} tokens), paired later steps ({p['rounds']} rounds, the "
                  f"models in turns, each round's ratio): pack_weight_only / stock_bf16 "
                  f"{fmt(q.get('pack_weight_only_later_step_over_stock_bf16'), '.2f')}, pack_auto / stock_bf16 "
                  f"{fmt(q.get('pack_auto_later_step_over_stock_bf16'), '.2f')}")
    if r.get("vae"):
        print(f"VAE decode {r['vae']['decode_s']:.2f} s; image SQNR pack_auto vs bf16 {r['vae']['image_sqnr_pack_auto_vs_bf16_db']:.1f} dB")
    if r.get("offload"):
        o = r["offload"]
        print(f"offload: reserved {o['reserved_gib']:.1f} GiB -> loaded {o['loaded_gib']:.2f} of {o['model_gib']:.2f} GiB "
              f"(partial: {o['lowvram']}), FP8 layers {o['fp8_layers_by_device']}, {o['fp8_gib_moved_per_step']:.2f} GiB FP8 "
              f"moved per step, step {fmt(o['step_s'], '.4f')} s, peak {fmt(o['peak_alloc_gib'], '.2f')} GiB, "
              f"latent equal to full load: {o['latent_equal_full']}")
    if "unload" in r:
        u = r["unload"]
        print(f"unload: allocated {u['start_alloc_mib']:.1f} MiB at start -> {u['after_free_alloc_mib']:.1f} MiB after "
              f"ComfyUI's free memory (driver: {u['start_device_used_mib']:.0f} -> {u['after_free_device_used_mib']:.0f} MiB)")
    if r.get("engram"):
        e = r["engram"]
        print(f"engram ({e['encoder']}; {e['ranks']} ranks, {e['ranks_how']}): plain encode {e['plain_ms']:.2f} ms, "
              f"engram encode {e['engram_ms']:.2f} ms (+{e['added_fraction']:.1%}); conditioning moved: "
              f"{e['conditioning_moved']}; sampled: {e['sampled']}")
        lib = e.get("library_ranks")
        if lib:
            print(f"engram on {lib['ranks']} ranks ({lib['how']}): plain {lib['plain_ms']:.2f} ms, engram "
                  f"{lib['engram_ms']:.2f} ms (+{lib['added_fraction']:.1%}); conditioning moved: {lib['conditioning_moved']}")
    for item in r["skipped"]:
        print(f"skipped on the CPU: {item}")
    for key, text in r.get("errors", {}).items():
        print(f"FAILED {key}: {text[:500]}")


if __name__ == "__main__":
    sys.exit(main())
