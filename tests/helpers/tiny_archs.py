"""Tiny seeded diffusion models of the architectures people load FP8 files of, built by ComfyUI itself.

Each `Arch` names one of ComfyUI's supported model classes (`comfy.supported_models.<config_class>`) and
a small `unet_config` for it (widths of 64-256, one or two blocks, 0.4-7 million parameters; Hunyuan-DiT
42 million, most of it its fixed 2048-wide T5 input MLP and pooler);
`build_state_dict` asks that class for its model (`get_model`, the model ComfyUI builds for a file),
fills every parameter from a fixed seed and returns the bf16 state dict, with the key names and
shapes a released file of that family has.

Loading such a file goes through ComfyUI's detection (`comfy.model_detection`), which reads most sizes
from the tensor shapes but fixes some to the released models' values (Qwen-Image's 24 heads, Chroma's
5120-wide guidance approximator, AuraFlow's 3072 width, Lumina's heads...). While `detection_for(arch)`
is active, ComfyUI's detection runs unchanged on the file; the sizes it fixed are then set back to the
tiny ones (`amended()`, found by comparing its result with the tiny config) and ComfyUI's class match
runs on that. Where the match itself needs a released size (SD1.5 and SDXL: 320 model channels, SDXL's
transformer depths; Z-Image: width 3840) it is made with `Arch.match_as` in place of the tiny values,
and the matched class builds the tiny model. The test checks the class. Stock ComfyUI and the pack go
through the same detection, so the comparison of the two loaders is not affected by it.

`inputs(arch)` gives one forward's arguments for `BaseModel.apply_model`: latents of the family's
shape (5-D for the video models), the family's text width, pooled / guidance vectors where the
model takes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Arch:
    name: str
    config_class: str  # in comfy.supported_models
    unet_config: dict
    latent: tuple  # per-sample latent shape (C, H, W) or (C, T, H, W)
    text: tuple  # (tokens, width) of the text conditioning
    extra: dict = dataclasses.field(default_factory=dict)  # name -> shape (float), ("int", shape, _) or an int
    match_as: dict = dataclasses.field(default_factory=dict)  # released sizes the class match requires
    seed: int = 0


ARCHS: tuple[Arch, ...] = (
    Arch("wan2.1", "WAN21_T2V",
         {"image_model": "wan2.1", "model_type": "t2v", "dim": 128, "ffn_dim": 256, "num_heads": 1, "num_layers": 2,
          "in_dim": 16, "out_dim": 16, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1),
          "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6},
         latent=(16, 2, 8, 8), text=(8, 4096), seed=1),
    Arch("wan2.2-5b", "WAN22_T2V",
         {"image_model": "wan2.1", "model_type": "t2v", "dim": 128, "ffn_dim": 256, "num_heads": 1, "num_layers": 2,
          "in_dim": 48, "out_dim": 48, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1),
          "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6},
         latent=(48, 2, 8, 8), text=(8, 4096), seed=2),
    Arch("hunyuan-video", "HunyuanVideo",
         {"image_model": "hunyuan_video", "in_channels": 16, "out_channels": 16, "patch_size": [1, 2, 2],
          "vec_in_dim": 768, "axes_dim": [16, 56, 56], "meanflow": False, "context_in_dim": 4096, "hidden_size": 128,
          "mlp_ratio": 4.0, "num_heads": 1, "depth": 1, "depth_single_blocks": 1, "theta": 256, "qkv_bias": True,
          "byt5": False, "guidance_embed": True, "use_cond_type_embedding": False, "vision_in_dim": None,
          "meanflow_sum": False},
         latent=(16, 2, 8, 8), text=(8, 4096), extra={"y": (768,), "guidance": ()}, seed=3),
    Arch("ltx-video", "LTXV",
         {"image_model": "ltxv", "num_layers": 2, "attention_head_dim": 8, "num_attention_heads": 32,
          "cross_attention_dim": 256, "in_channels": 128, "caption_channels": 4096},
         latent=(128, 2, 4, 4), text=(8, 4096), extra={"attention_mask": ("int", (8,), 2)}, seed=4),
    Arch("qwen-image", "QwenImage",
         {"image_model": "qwen_image", "in_channels": 64, "num_layers": 1, "attention_head_dim": 32,
          "num_attention_heads": 2, "axes_dims_rope": (8, 12, 12), "joint_attention_dim": 3584},
         latent=(16, 1, 8, 8), text=(8, 3584), seed=5),
    Arch("chroma", "Chroma",
         {"image_model": "chroma", "in_channels": 64, "out_channels": 64, "in_dim": 64, "out_dim": 64,
          "hidden_dim": 128, "n_layers": 1, "axes_dim": [8, 12, 12], "num_heads": 2, "mlp_ratio": 4.0, "theta": 10000,
          "qkv_bias": True, "context_in_dim": 4096, "hidden_size": 64, "patch_size": 2, "depth": 1,
          "depth_single_blocks": 1, "txt_ids_dims": [], "vec_in_dim": None},
         latent=(16, 8, 8), text=(8, 4096), extra={"guidance": ()}, seed=6),
    Arch("lumina2", "Lumina2",
         {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 64, "cap_feat_dim": 2304, "n_layers": 1,
          "qk_norm": True, "n_heads": 2, "n_kv_heads": 1, "axes_dims": [8, 12, 12], "axes_lens": [300, 512, 512],
          "rope_theta": 10000.0, "ffn_dim_multiplier": 4.0},
         latent=(16, 8, 8), text=(8, 2304), extra={"num_tokens": 8}, seed=7),
    Arch("z-image", "ZImage",
         {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 256, "cap_feat_dim": 2560, "n_layers": 2,
          "qk_norm": True, "n_heads": 8, "n_kv_heads": 8, "axes_dims": [8, 12, 12], "axes_lens": [1536, 512, 512],
          "rope_theta": 256.0, "ffn_dim_multiplier": 8.0 / 3.0, "z_image_modulation": True, "time_scale": 1000.0},
         latent=(16, 8, 8), text=(8, 2560), extra={"num_tokens": 8}, match_as={"dim": 3840}, seed=8),
    Arch("sd1.5", "SD15",
         {"model_channels": 64, "in_channels": 4, "out_channels": 4, "num_res_blocks": [1], "channel_mult": [1],
          "transformer_depth": [1], "transformer_depth_output": [1, 1], "transformer_depth_middle": 1,
          "context_dim": 768, "use_linear_in_transformer": False, "adm_in_channels": None,
          "use_temporal_attention": False, "use_spatial_transformer": True, "legacy": False, "image_size": 32,
          "use_checkpoint": False, "num_heads": 8, "num_head_channels": -1, "use_temporal_resblock": False},
         latent=(4, 8, 8), text=(8, 768), match_as={"model_channels": 320}, seed=9),
    Arch("sdxl", "SDXL",
         {"model_channels": 64, "in_channels": 4, "out_channels": 4, "num_res_blocks": [1], "channel_mult": [1],
          "transformer_depth": [1], "transformer_depth_output": [1, 1], "transformer_depth_middle": 1,
          "context_dim": 2048, "use_linear_in_transformer": True, "adm_in_channels": 2816, "num_classes": "sequential",
          "use_temporal_attention": False, "use_spatial_transformer": True, "legacy": False, "image_size": 32,
          "use_checkpoint": False, "num_head_channels": 64, "use_temporal_resblock": False},
         latent=(4, 8, 8), text=(8, 2048), extra={"y": (2816,)},
         match_as={"model_channels": 320, "transformer_depth": [0, 0, 2, 2, 10, 10]},
         seed=10),
    Arch("cosmos-predict2", "CosmosT2IPredict2",
         {"image_model": "cosmos_predict2", "max_img_h": 240, "max_img_w": 240, "max_frames": 128, "in_channels": 16,
          "out_channels": 16, "patch_spatial": 2, "patch_temporal": 1, "model_channels": 128, "num_heads": 2,
          "concat_padding_mask": True, "crossattn_emb_channels": 1024, "pos_emb_cls": "rope3d",
          "pos_emb_learnable": True, "pos_emb_interpolation": "crop", "min_fps": 1, "max_fps": 30,
          "use_adaln_lora": True, "adaln_lora_dim": 256, "num_blocks": 1, "extra_per_block_abs_pos_emb": False,
          "rope_h_extrapolation_ratio": 4.0, "rope_w_extrapolation_ratio": 4.0, "rope_t_extrapolation_ratio": 1.0,
          "extra_h_extrapolation_ratio": 1.0, "extra_w_extrapolation_ratio": 1.0, "extra_t_extrapolation_ratio": 1.0,
          "rope_enable_fps_modulation": False},
         latent=(16, 1, 8, 8), text=(8, 1024), seed=11),
    Arch("hunyuan-dit", "HunyuanDiT",
         {"image_model": "hydit", "depth": 2, "hidden_size": 128, "num_heads": 2},
         latent=(4, 8, 8), text=(77, 1024),  # HunyuanDiT pads to its fixed 77 CLIP and 256 T5 tokens
         extra={"text_embedding_mask": ("int", (77,), 2), "encoder_hidden_states_t5": (256, 2048),
                "text_embedding_mask_t5": ("int", (256,), 2)}, seed=12),
    Arch("auraflow", "AuraFlow",
         {"max_seq": 256, "cond_seq_dim": 2048, "n_double_layers": 1, "n_layers": 2, "dim": 128, "n_heads": 2,
          "global_conddim": 128},
         latent=(4, 8, 8), text=(8, 2048), seed=13),
)

# Qwen-Image as nunchaku's int4 bundles of it are laid out, tiny: its attention and MLP linears are the
# SVDQuant W4A4 ones, whose output count is a multiple of 128 and input count of 64, so the width is 128
# (2 heads of 64; the rotary axes sum to 64) where the ARCHS entry is 64 wide. Not in ARCHS (the FP8 cases
# there need none of this); tests/integration/test_qwen_image_int4_bundle_server.py uses it.
QWEN_IMAGE_INT4 = Arch("qwen-image-int4", "QwenImage",
                       {"image_model": "qwen_image", "in_channels": 64, "num_layers": 2, "attention_head_dim": 64,
                        "num_attention_heads": 2, "axes_dims_rope": (8, 28, 28), "joint_attention_dim": 3584},
                       latent=(16, 1, 8, 8), text=(8, 3584), seed=14)

BY_NAME = {a.name: a for a in ARCHS + (QWEN_IMAGE_INT4,)}


def missing_from(arch: Arch, comfy) -> str | None:
    """Why this ComfyUI tree cannot hold `arch` (None when it can)."""
    cls = getattr(comfy.supported_models, arch.config_class, None)
    if cls is None:
        return f"this ComfyUI has no comfy.supported_models.{arch.config_class} ({arch.name})"
    return None


def _init_random(model: torch.nn.Module, seed: int) -> None:
    """Defined, seeded values everywhere (ComfyUI's layers skip initialization): matrices and
    convolutions std 1/sqrt(fan_in), norms 1, the rest small."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and name.endswith("weight"):
                p.copy_(torch.randn(p.shape, generator=g) * p[0].numel() ** -0.5)
            elif "norm" in name or name.endswith(("scale", ".gamma")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
        for _, b in model.named_buffers():
            if b.is_floating_point():
                b.copy_(0.02 * torch.randn(b.shape, generator=g))


_EFFECTIVE: dict[tuple[str, str], dict] = {}


def tiny_config(arch: Arch, comfy) -> dict:
    """`arch.unet_config` less the keys this tree's model class does not take (older trees lack some,
    e.g. HunyuanVideo's `meanflow_sum`, Chroma's `txt_ids_dims`)."""
    key = (arch.name, comfy.__file__)
    if key not in _EFFECTIVE:
        cls = getattr(comfy.supported_models, arch.config_class)
        config = dict(arch.unet_config)
        while True:
            try:
                mc = cls(dict(config))
                mc.set_inference_dtype(torch.float32, None)
                with torch.device("meta"):
                    mc.get_model({}, "")
                break
            except TypeError as exc:
                bad = [k for k in config if f"'{k}'" in str(exc) and "unexpected keyword" in str(exc)]
                if not bad:
                    raise
                del config[bad[0]]
        _EFFECTIVE[key] = config
    return _EFFECTIVE[key]


def build_state_dict(arch: Arch, comfy) -> dict[str, torch.Tensor]:
    """The bf16 state dict of the tiny model, as ComfyUI's own class for the family builds it."""
    cls = getattr(comfy.supported_models, arch.config_class)
    config = cls(dict(tiny_config(arch, comfy)))
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({}, "")
    _init_random(model.diffusion_model, arch.seed)
    return {k: v.detach().to(torch.bfloat16).contiguous() if v.is_floating_point() else v.detach().clone()
            for k, v in model.diffusion_model.state_dict().items()}


def _norm(v):
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    return v


def amended(arch: Arch, detected: dict, comfy) -> dict:
    """The tiny config's values that ComfyUI's detection set otherwise (fixed to the released sizes)."""
    extra = getattr(getattr(comfy.supported_models, arch.config_class), "unet_extra_config", {})  # the class adds these
    return {k: v for k, v in tiny_config(arch, comfy).items()
            if (k not in detected or _norm(detected[k]) != _norm(v))
            and not (k in extra and _norm(extra[k]) == _norm(v))}


@contextlib.contextmanager
def detection_for(arch: Arch, comfy, record: dict | None = None):
    """ComfyUI's detection, with the sizes it fixes set back to `arch`'s (see the module docstring).
    `record` gets "detected" (ComfyUI's own config), "amended" and "class"."""
    md = comfy.model_detection
    original = md.model_config_from_unet_config

    def patched(unet_config, state_dict=None, *args, **kwargs):
        fix = amended(arch, unet_config, comfy)
        tiny = {**unet_config, **fix}
        if arch.match_as:  # the class match itself needs released sizes: match with them, build the tiny one
            probe = original({**tiny, **arch.match_as}, state_dict, *args, **kwargs)
            found = type(probe)(tiny) if probe is not None else None
        else:
            found = original(tiny, state_dict, *args, **kwargs)
        if record is not None:
            record.update(detected=dict(unet_config), amended=fix, cls=type(found).__name__ if found else None)
        return found

    md.model_config_from_unet_config = patched
    try:
        yield
    finally:
        md.model_config_from_unet_config = original


def inputs(arch: Arch, batch: int = 1, seed: int = 100) -> dict[str, Any]:
    """One forward's arguments for `BaseModel.apply_model(x, t, **rest)` (float32)."""
    g = torch.Generator().manual_seed(seed + arch.seed)
    out: dict[str, Any] = {
        "x": torch.randn((batch,) + arch.latent, generator=g),
        "t": torch.full((batch,), 0.6),
        "c_crossattn": torch.randn((batch,) + arch.text, generator=g),
    }
    for name, spec in arch.extra.items():
        if isinstance(spec, int):
            out[name] = spec
        elif isinstance(spec, tuple) and spec and spec[0] == "int":
            out[name] = torch.ones((batch,) + spec[1], dtype=torch.int64)
        elif name == "guidance":
            out[name] = torch.full((batch,), 3.5)
        else:
            out[name] = torch.randn((batch,) + spec, generator=g)
    return out
