"""A tiny gpt-oss text encoder (ComfyUI 0.33's Lens encoder, comfy/text_encoders/gpt_oss.py) whose MoE expert
banks are FP8 with one scale per expert, or NVFP4, read by the pack's loader (``formats.load_file``) and built with the
pack's operations (``make_fp8_ops``, whose ``MoEExperts`` keeps each bank quantized), in process with the 0.33
tree: built directly and through ``comfy.sd.load_text_encoder_state_dicts`` (the Load FP8 Text Encoder path, with
a word-level tokenizer and the tiny size passed in model_options). It encodes bit for bit like the stock encoder
with the dequantized banks, and close to the float original. Tests that need gpt-oss skip on 0.3.75."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from helpers.host import comfy_in_process
from helpers.numerics import sqnr

pytestmark = pytest.mark.integration

CFG = dict(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2, sliding_window=4)
E, H, I = CFG["num_local_experts"], CFG["hidden_size"], CFG["intermediate_size"]
LAYERS = (0, 2)
BANKS = ("gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def gpt_oss():
    comfy_in_process()
    try:
        import comfy.text_encoders.gpt_oss as gpt_oss
    except ImportError:
        pytest.skip("this ComfyUI has no gpt-oss text encoder (it came with ComfyUI 0.33)")
    return gpt_oss


def float_sd(seed: int = 0, cfg: dict = CFG) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, std=0.05):
        return torch.randn(shape, generator=g) * std

    E, H, I = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    sd = {"embed_tokens.weight": r(cfg["vocab_size"], H, std=1.0), "norm.weight": 1 + r(H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        for name, n_out, n_in in (("q_proj", heads * hd, H), ("k_proj", kv * hd, H), ("v_proj", kv * hd, H),
                                  ("o_proj", H, heads * hd)):
            sd[p + f"self_attn.{name}.weight"] = r(n_out, n_in, std=n_in ** -0.5)
            sd[p + f"self_attn.{name}.bias"] = r(n_out)
        sd[p + "self_attn.sinks"] = r(heads)
        sd[p + "input_layernorm.weight"] = 1 + r(H)
        sd[p + "post_attention_layernorm.weight"] = 1 + r(H)
        sd[p + "mlp.router.weight"] = r(E, H, std=H ** -0.5)
        sd[p + "mlp.router.bias"] = r(E)
        # experts of different magnitudes, so the per-expert scales matter; [E, out, in] as 0.33 stores them
        mags = torch.logspace(-1, 0.5, E).reshape(E, 1, 1)
        sd[p + "mlp.experts.gate_up_proj.weight"] = r(E, 2 * I, H, std=H ** -0.5) * mags
        sd[p + "mlp.experts.gate_up_proj.bias"] = r(E, 2 * I)
        sd[p + "mlp.experts.down_proj.weight"] = r(E, H, I, std=I ** -0.5) * mags
        sd[p + "mlp.experts.down_proj.bias"] = r(E, H)
    return sd


def write_quantized_file(path, sd: dict, fmt: str) -> dict[str, torch.Tensor]:
    """The file: every expert bank in ComfyUI 0.33's MoEExperts form with its comfy_quant, the rest float32.
    "fp8": e4m3fn with weight_scale [E]; "nvfp4": each expert's 2-D NVFP4 tensors stacked (weight_scale_2 [E]).
    Tensors of other names (a ``tokenizer_json``) are written as they are. Returns the banks as the file's numbers
    dequantize."""
    from safetensors.torch import save_file

    from fp8_engram.quant import NVFP4, PerExpert, QuantizedTensor
    from fp8_engram.quant.layouts.nvfp4 import file_tensors

    out, dequantized = {}, {}
    for k, v in sd.items():
        if not any(f"experts.{b}.weight" in k for b in BANKS):
            out[k] = v.contiguous()
            continue
        name, E = k[: -len(".weight")], v.shape[0]
        if fmt == "fp8":
            q = QuantizedTensor.from_float(v, PerExpert())
            out[k], out[name + ".weight_scale"] = q.qdata, q.scale.reshape(E)
            dequantized[k] = q.qdata.to(torch.float32) * q.scale
        else:
            mats = [QuantizedTensor.from_float(v[e], NVFP4(*v.shape[1:])) for e in range(E)]
            parts = [file_tensors(m) for m in mats]
            for suffix in ("weight", "weight_scale", "weight_scale_2"):
                out[f"{name}.{suffix}"] = torch.stack([p[suffix] for p in parts])
            dequantized[k] = torch.stack([m.dequantize(torch.float32) for m in mats])
        cq = json.dumps({"format": "float8_e4m3fn" if fmt == "fp8" else "nvfp4", "num_experts": E}).encode()
        out[name + ".comfy_quant"] = torch.tensor(list(cq), dtype=torch.uint8)
    save_file(out, str(path))
    return dequantized


def encoder(gpt_oss, sd: dict, operations=None):
    options = {"gpt_oss_config": CFG, "selected_layers": LAYERS, "txt_offset": 0}
    if operations is not None:
        options["custom_operations"] = operations
    model = gpt_oss.LensGptOssClipModel(device="cpu", dtype=torch.float32, model_options=options)
    missing, unexpected = model.load_sd(dict(sd))
    assert not unexpected, unexpected
    assert not [k for k in missing if "rope" not in k], missing
    return model


def encode(model, ids):
    with torch.inference_mode():
        flat, _, extra = model.encode_token_weights([[(t, 1.0) for t in row] for row in ids])
    return flat.float()


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_tiny_gpt_oss_with_quantized_expert_banks_encodes_like_its_float_version(gpt_oss, tmp_path, monkeypatch, fmt):
    from fp8_engram.nodes.ops import make_fp8_ops
    from fp8_engram.quant import NVFP4, NVFP4Bank, PerExpert, QuantizedTensor, formats

    ref_sd = float_sd()
    path = tmp_path / f"tiny_gpt_oss_{fmt}_experts.safetensors"
    banks = write_quantized_file(path, ref_sd, fmt)
    sd, report = formats.load_file(path, orig_dtype=torch.float32)
    assert report.granularities.get("expert" if fmt == "fp8" else "nvfp4") == 2 * CFG["num_hidden_layers"]

    fp8_model = encoder(gpt_oss, sd, make_fp8_ops(source=path.name))
    bank = fp8_model.transformer.layers[0].mlp.experts.gate_up_proj.weight
    assert isinstance(bank, QuantizedTensor) and tuple(bank.shape) == (E, 2 * I, H)
    assert bank.layout == (PerExpert() if fmt == "fp8" else NVFP4Bank(2 * I, H))

    # never more than one expert's matrix dequantized at a time, and never a whole bank: every FP8 weight of
    # this model is a bank, so every dequantization the layouts do is counted
    from fp8_engram.quant import PerTensor

    sizes = []

    def tracked(cls):
        original = cls.dequantize

        def dequantize(self, q, *args, **kwargs):
            sizes.append(q.numel())
            return original(self, q, *args, **kwargs)
        return dequantize

    ids = [[int(t) for t in torch.randint(0, CFG["vocab_size"], (12,), generator=torch.Generator().manual_seed(1))],
           [int(t) for t in torch.randint(0, CFG["vocab_size"], (12,), generator=torch.Generator().manual_seed(2))]]
    for cls in (PerTensor, PerExpert, NVFP4, NVFP4Bank):
        monkeypatch.setattr(cls, "dequantize", tracked(cls))
    y_fp8 = encode(fp8_model, ids)
    monkeypatch.undo()
    assert sizes and max(sizes) <= 2 * I * H

    y_deq = encode(encoder(gpt_oss, {**ref_sd, **banks}), ids)       # stock ops, banks as the file dequantizes
    y_float = encode(encoder(gpt_oss, ref_sd), ids)                  # stock ops, the float original
    assert y_fp8.shape == y_float.shape == (2, 12, len(LAYERS) * H)
    db_same_math, db_float = sqnr(y_deq, y_fp8), sqnr(y_float, y_fp8)
    logging.getLogger(__name__).info("SQNR vs dequantized-float encoder %.1f dB, vs float original %.1f dB; "
                                     "largest dequantization %d elements", db_same_math, db_float, max(sizes))
    assert torch.equal(y_fp8, y_deq), db_same_math  # the same math: each expert dequantized, then F.linear
    assert db_float > (20 if fmt == "fp8" else 10), db_float  # NVFP4: about 12 dB after 3 layers


@pytest.fixture(scope="module")
def any_tree():
    comfy_in_process()


def test_the_packs_moe_experts_runs_expert_by_expert_on_any_tree(any_tree):
    """``make_fp8_ops().MoEExperts`` alone (ComfyUI 0.3.75 has no gpt-oss, but the class is the same)."""
    from fp8_engram.nodes.ops import make_fp8_ops
    from fp8_engram.quant import PerExpert, QuantizedTensor

    w = torch.randn(E, 2 * I, H, generator=torch.Generator().manual_seed(3)) * 0.1
    bias = torch.randn(E, 2 * I, generator=torch.Generator().manual_seed(4))
    bank = QuantizedTensor.from_float(w, PerExpert())
    layer = make_fp8_ops().MoEExperts(E, H, 2 * I, bias=True, dtype=torch.float32)
    layer.load_state_dict({"weight": bank, "bias": bias})
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(5))
    ref = bank.dequantize(torch.float32)
    with torch.inference_mode(), layer.bank_resident(x) as b:
        for e in range(E):
            assert torch.equal(b.expert_linear(x, e), torch.nn.functional.linear(x, ref[e], bias[e]))
    assert isinstance(layer.expert_weight(2), QuantizedTensor) and layer.expert_weight(2).shape == (2 * I, H)


def test_the_packs_moe_experts_refuses_a_bank_of_another_shape_naming_the_file(any_tree):
    from fp8_engram.nodes.ops import make_fp8_ops
    from fp8_engram.quant import PerExpert, QuantizedTensor

    bank = QuantizedTensor.from_float(torch.randn(E, H, I), PerExpert())  # [E, in, out]: the other form
    layer = make_fp8_ops(source="text_encoders/tiny.safetensors").MoEExperts(E, H, I, dtype=torch.float32)
    with pytest.raises(RuntimeError, match=rf"tiny\.safetensors: size mismatch for weight: file has "
                                           rf"\[{E}, {H}, {I}\].*\[{E}, {I}, {H}\]"):
        layer.load_state_dict({"weight": bank, "bias": torch.zeros(E, I)})


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_comfyui_033_reads_the_same_bank_files_to_the_same_bits(gpt_oss, fmt):
    """The file form the pack reads is ComfyUI 0.33's own: its MoEExperts loads the same tensors and
    dequantizes every expert to the pack's bits."""
    import comfy.ops

    from fp8_engram.quant import NVFP4, PerExpert, QuantizedTensor
    from fp8_engram.quant.layouts.nvfp4 import file_tensors

    out, inp = 64, 32
    w = torch.randn(E, out, inp, generator=torch.Generator().manual_seed(14)) * torch.logspace(-2, 0, E).reshape(E, 1, 1)
    if fmt == "fp8":
        q = QuantizedTensor.from_float(w, PerExpert())
        sd = {"weight": q.qdata, "weight_scale": q.scale.reshape(E)}
        ours = list(q.dequantize(torch.float32))
    else:
        mats = [QuantizedTensor.from_float(w[e], NVFP4(out, inp)) for e in range(E)]
        parts = [file_tensors(m) for m in mats]
        sd = {k: torch.stack([p[k] for p in parts]) for k in ("weight", "weight_scale", "weight_scale_2")}
        ours = [m.dequantize(torch.float32) for m in mats]
    cq = {"format": "float8_e4m3fn" if fmt == "fp8" else "nvfp4", "num_experts": E}
    sd["comfy_quant"] = torch.tensor(list(json.dumps(cq).encode()), dtype=torch.uint8)
    sd["bias"] = torch.zeros(E, out)
    stock = comfy.ops.mixed_precision_ops({}, torch.float32).MoEExperts(E, inp, out, bias=True, dtype=torch.float32)
    stock.load_state_dict(sd)
    for e in range(E):
        assert torch.equal(stock.expert_weight(e).dequantize().float(), ours[e])


def _tiny_tokenizer_json() -> torch.Tensor:
    """A word-level tokenizer over "w0".."w94" (unknown words -> 0), as the uint8 JSON tensor Lens encoders carry."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(CFG["vocab_size"] - 1)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return torch.tensor(list(tok.to_str().encode()), dtype=torch.uint8)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_text_encoder_loader_path_encodes_a_prompt_like_the_float_encoder(gpt_oss, tmp_path, fmt):
    """What Load FP8 Text Encoder does (formats.load_file, then comfy.sd.load_text_encoder_state_dicts with the
    pack's operations), with the tiny size given through model_options, then a prompt through the Lens template:
    equal to the stock encoder with the dequantized banks, in the dtype ComfyUI picks for the encoder."""
    import comfy.sd

    from fp8_engram.nodes.ops import make_fp8_ops
    from fp8_engram.quant import QuantizedTensor, formats

    tj = _tiny_tokenizer_json()
    ref_sd = float_sd()
    path = tmp_path / f"tiny_lens_{fmt}.safetensors"
    banks = write_quantized_file(path, ref_sd, fmt)
    sd, _ = formats.load_file(path, orig_dtype=torch.float32)

    def encode_prompt(state_dict, operations=None):
        options = {"gpt_oss_config": CFG, "selected_layers": LAYERS, "txt_offset": 0}
        if operations is not None:
            options["custom_operations"] = operations
        clip = comfy.sd.load_text_encoder_state_dicts([{**state_dict, "tokenizer_json": tj}], model_options=options)
        with torch.inference_mode():
            cond = clip.encode_from_tokens(clip.tokenize("w1 w5 w9 w33 w2 w70"), return_dict=True)["cond"]
        return clip, cond.detach().float()

    clip, y_q = encode_prompt(sd, make_fp8_ops(source=path.name))
    encoder_dtype = clip.cond_stage_model.gpt_oss.dtype
    assert isinstance(clip.cond_stage_model.gpt_oss.transformer.layers[1].mlp.experts.down_proj.weight,
                      QuantizedTensor)
    # the banks dequantized straight into the encoder's dtype, as the expert loop does (NVFP4's rule rounds in
    # the output dtype, so float32 values cast to float16 would be other numbers)
    _, y_deq = encode_prompt({**ref_sd, **{k: sd[k].dequantize(encoder_dtype) for k in banks}})
    _, y_float = encode_prompt(ref_sd)
    assert y_q.shape == y_float.shape and y_q.shape[-1] == len(LAYERS) * H
    assert torch.equal(y_q, y_deq)
    db = sqnr(y_float, y_q)
    logging.getLogger(__name__).info("%s banks, prompt through comfy.sd: %.1f dB against the float encoder", fmt, db)
    assert db > (15 if fmt == "fp8" else 8), db


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_a_patched_bank_is_requantized_into_its_layout(any_tree, fmt):
    """ComfyUI's weight patching (LoRA) goes through convert_weight / set_weight: the bank stays a bank of its layout."""
    from fp8_engram.nodes.ops import make_fp8_ops
    from fp8_engram.quant import NVFP4Bank, PerExpert, QuantizedTensor

    layout = PerExpert() if fmt == "fp8" else NVFP4Bank(2 * I, H)
    w = torch.randn(E, 2 * I, H, generator=torch.Generator().manual_seed(15)) * 0.1
    layer = make_fp8_ops().MoEExperts(E, H, 2 * I, bias=False, dtype=torch.float32)
    layer.load_state_dict({"weight": QuantizedTensor.from_float(w, layout)})
    base = layer.convert_weight(layer.weight)
    assert base.dtype == torch.float32 and tuple(base.shape) == (E, 2 * I, H)
    delta = torch.randn(E, 2 * I, H, generator=torch.Generator().manual_seed(16)) * 0.01
    layer.set_weight(base + delta)
    new = layer.weight
    assert isinstance(new, QuantizedTensor) and new.layout == layout and tuple(new.shape) == (E, 2 * I, H)
    assert sqnr(base + delta, new.dequantize(torch.float32)) > (28 if fmt == "fp8" else 17)
