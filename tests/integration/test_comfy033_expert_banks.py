"""A tiny gpt-oss text encoder (ComfyUI 0.33's Lens encoder, comfy/text_encoders/gpt_oss.py) whose MoE expert
banks are FP8 with one scale per expert, or NVFP4, read by the pack's loader (``formats.load_file``) and built with the
pack's operations (``make_fp8_ops``, whose ``MoEExperts`` keeps each bank quantized), in process with the 0.33
tree: built directly and through ``comfy.sd.load_text_encoder_state_dicts`` (the Load FP8 Text Encoder path, with
a word-level tokenizer and the tiny size passed in model_options). It encodes bit for bit like the stock encoder
with the dequantized banks, and close to the float original.

Load FP8 Text Encoder itself (its execute in process, and a graph on the real server) loads a tiny gpt-oss file
that says its size only through its tensors, with a character tokenizer inside: the node reads the size
(nodes/gpt_oss.py), selects 4 of its 6 layers, and encodes equal to the stock encoder at that size with the banks
dequantized. The size reader refuses a file whose shapes disagree and overrides nothing for gpt-oss-20b's shapes.
Tests that need gpt-oss skip on 0.3.75 and 0.29."""

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


# -- Load FP8 Text Encoder itself: a gpt-oss file of its own size, read from its tensors (nodes/gpt_oss.py) --

# Every size differs from gpt-oss-20b's; router top-k (4) and sliding window (128) stay at the defaults, which the
# tensors do not say. vocab 128 holds the character tokenizer below.
LENS_CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=6)
LENS_LAYERS = (0, 2, 3, 5)  # the 4 layers the loader selects from 6: evenly spaced, ending at the last
PROMPT = "a red apple on a wooden table"


def _char_tokenizer_json() -> torch.Tensor:
    """A character-level tokenizer (BPE without merges) over printable ASCII, unknown characters -> 0, as the uint8
    JSON tensor Lens encoders carry. Harmony's template around a prompt is 627 characters, so rows remain past
    LENS_TXT_OFFSET (97); the encoder keeps the first 512 tokens (LENS_MAX_TOKENS), which hold the user message
    (from character 464) for a prompt this short."""
    import string

    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(string.printable)}}
    assert len(vocab) <= LENS_CFG["vocab_size"]
    tok = Tokenizer(models.BPE(vocab, merges=[], unk_token="<unk>"))
    return torch.tensor(list(tok.to_str().encode()), dtype=torch.uint8)


def _meta_sd(cfg: dict) -> dict[str, torch.Tensor]:
    """The weights of a gpt-oss encoder at `cfg`'s sizes on the meta device (shapes only, no memory)."""
    V, H, I, E = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    shapes = {"embed_tokens.weight": (V, H), "norm.weight": (H,)}
    for i in range(cfg["num_hidden_layers"]):
        shapes |= {f"layers.{i}.{k}": v for k, v in {
            "self_attn.q_proj.weight": (heads * hd, H), "self_attn.k_proj.weight": (kv * hd, H),
            "self_attn.v_proj.weight": (kv * hd, H), "self_attn.o_proj.weight": (H, heads * hd),
            "self_attn.sinks": (heads,), "mlp.router.weight": (E, H), "mlp.experts.gate_up_proj.weight": (E, 2 * I, H),
            "mlp.experts.down_proj.weight": (E, H, I), "input_layernorm.weight": (H,),
            "post_attention_layernorm.weight": (H,)}.items()}
    return {k: torch.empty(v, device="meta") for k, v in shapes.items()}


@pytest.fixture(scope="module")
def text_encoders_dir(gpt_oss, tmp_path_factory):
    """A folder ComfyUI lists under text_encoders, and a user folder of the test's own (the loader keeps its
    fast-path verdicts there, never in the ComfyUI tree)."""
    import folder_paths

    folder = tmp_path_factory.mktemp("lens_text_encoders")
    folder_paths.add_model_folder_path("text_encoders", str(folder))
    user = folder_paths.get_user_directory()
    folder_paths.set_user_directory(str(tmp_path_factory.mktemp("lens_user")))
    yield folder
    folder_paths.set_user_directory(user)


def _encode_prompt(clip, prompt: str = PROMPT) -> torch.Tensor:
    with torch.inference_mode():
        return clip.encode_from_tokens(clip.tokenize(prompt), return_dict=True)["cond"].detach().float()


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_load_fp8_text_encoder_loads_a_tiny_gpt_oss_and_encodes_like_its_float_version(text_encoders_dir, fmt,
                                                                                        caplog):
    """The node's own execute on a file with no size but its tensors' (and its tokenizer inside): the encoder is
    built at the file's size with 4 of its 6 layers selected, encodes equal to stock ComfyUI's encoder (stock ops)
    at that size with the banks dequantized, and close to the float original: its first selected layer as close
    as the 3-layer encoder above (> 20 dB FP8, > 10 dB NVFP4; measured 26.4 / 15.4 dB), all four layers
    > 15 / 6 dB (measured 16.7 / 7.4 dB: each further layer adds its banks' error, as these random experts'
    outputs dominate the residual stream; float16 against float32 is not it, > 43 dB on every layer)."""
    import comfy.sd

    from fp8_engram.nodes.fp8 import LoadFP8TextEncoder
    from fp8_engram.quant import QuantizedTensor, formats

    tj = _char_tokenizer_json()
    ref_sd = float_sd(cfg=LENS_CFG)
    name = f"tiny_lens_{fmt}.safetensors"
    write_quantized_file(text_encoders_dir / name, {**ref_sd, "tokenizer_json": tj}, fmt)

    with caplog.at_level(logging.INFO, logger="fp8_engram.nodes.gpt_oss"):
        out = LoadFP8TextEncoder.execute(name, "lens", "weight-only", "auto", "auto")
    clip, summary = out.result[0], out.ui["fp8_summary"][0]
    assert "taking layers (0, 2, 3, 5)" in caplog.text
    banks = 2 * LENS_CFG["num_hidden_layers"]
    assert summary["file"] == name and summary["layers_quantized"] == banks
    assert summary["granularity"] == {"expert" if fmt == "fp8" else "nvfp4": banks}
    encoder = clip.cond_stage_model.gpt_oss
    assert encoder.selected_layers == LENS_LAYERS
    assert {k: getattr(encoder.config, k) for k in LENS_CFG} == LENS_CFG
    assert isinstance(encoder.transformer.layers[5].mlp.experts.gate_up_proj.weight, QuantizedTensor)
    y_node = _encode_prompt(clip)

    def stock(sd: dict) -> torch.Tensor:  # stock ComfyUI: its own ops, the size and layers given by hand
        options = {"gpt_oss_config": LENS_CFG, "selected_layers": LENS_LAYERS}
        return _encode_prompt(comfy.sd.load_text_encoder_state_dicts(
            [{**sd, "tokenizer_json": tj}], clip_type=comfy.sd.CLIPType.LENS, model_options=options))

    # the file's banks dequantized straight into the encoder's dtype, as the expert loop does
    file_sd, _ = formats.load_file(text_encoders_dir / name, orig_dtype=torch.float32)
    dequantized = {k: v.dequantize(encoder.dtype) for k, v in file_sd.items() if isinstance(v, QuantizedTensor)}
    assert len(dequantized) == banks
    y_deq, y_float = stock({**ref_sd, **dequantized}), stock(ref_sd)
    # rows 97 to 511 of the rendered template, 4 layers of 64 side by side; the prompt is among them
    assert y_node.shape == y_float.shape and y_node.shape[1] > 0 and y_node.shape[2] == len(LENS_LAYERS) * 64
    assert torch.equal(y_node, y_deq)  # the same math: each expert dequantized, then its linear
    assert not torch.equal(_encode_prompt(clip, PROMPT.replace("table", "chair")), y_node)
    # per selected layer (layer 0 has one layer of bank error), and all four together
    width = LENS_CFG["hidden_size"]
    per_layer = [sqnr(y_float[..., j * width:(j + 1) * width], y_node[..., j * width:(j + 1) * width])
                 for j in range(len(LENS_LAYERS))]
    db = sqnr(y_float, y_node)
    logging.getLogger(__name__).info("Load FP8 Text Encoder, tiny gpt-oss with %s banks, %d rows: %.1f dB against the "
                                     "float encoder (layers %s: %s dB)", fmt, y_node.shape[1], db, LENS_LAYERS,
                                     ", ".join(f"{d:.1f}" for d in per_layer))
    assert per_layer[0] > (20 if fmt == "fp8" else 10), per_layer
    assert db > (15 if fmt == "fp8" else 6), db


def test_the_gpt_oss_size_reader_gives_no_override_for_gpt_oss_20b(gpt_oss):
    """A gpt-oss-20b file's shapes (on the meta device) change nothing: the loader then calls ComfyUI as stock
    does. A tiny one gets its sizes and the selected layers; a file of another family gets nothing."""
    from fp8_engram.nodes.gpt_oss import lens_options, read_config

    big = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
               num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32)
    assert read_config(_meta_sd(big), "text_encoders/gpt_oss_20b.safetensors") == {}
    assert lens_options(_meta_sd(big), "text_encoders/gpt_oss_20b.safetensors") == {}
    assert read_config(_meta_sd(LENS_CFG), "tiny") == LENS_CFG
    assert lens_options(_meta_sd(LENS_CFG), "tiny") == {"gpt_oss_config": LENS_CFG, "selected_layers": LENS_LAYERS}
    assert read_config(_meta_sd({**LENS_CFG, "num_local_experts": 3}), "tiny")["num_experts_per_tok"] == 3
    assert lens_options({"text_model.encoder.layers.0.mlp.fc1.weight": torch.empty(8, 4, device="meta")}, "clip") == {}


def test_the_gpt_oss_size_reader_refuses_an_inconsistent_file_naming_it_and_the_tensor(gpt_oss):
    from fp8_engram.nodes.gpt_oss import read_config

    where = "text_encoders/tiny_lens_bad.safetensors"
    sd = _meta_sd(LENS_CFG)
    sd["layers.0.self_attn.k_proj.weight"] = torch.empty(40, 64, device="meta")  # 40 rows: not k heads of 16
    with pytest.raises(ValueError, match=r"^text_encoders/tiny_lens_bad\.safetensors: layers\.0\.self_attn\.k_proj"
                                         r"\.weight \[40, 64\] .*head_dim 16"):
        read_config(sd, where)
    sd = _meta_sd(LENS_CFG)
    sd["layers.4.mlp.experts.down_proj.weight"] = torch.empty(6, 64, 48, device="meta")  # another intermediate size
    with pytest.raises(ValueError, match=r"^text_encoders/tiny_lens_bad\.safetensors: layers\.4\.mlp\.experts\."
                                         r"down_proj\.weight \[6, 64, 48\] is not \[6, 64, 32\]"):
        read_config(sd, where)
    del sd["layers.4.mlp.experts.down_proj.weight"]
    with pytest.raises(ValueError, match=r"tiny_lens_bad\.safetensors: .*no tensor layers\.4\.mlp\.experts\.down_proj"):
        read_config(sd, where)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_a_tiny_gpt_oss_encodes_through_the_server(gpt_oss, comfy, models_dir, fmt):
    """The real server: Load FP8 Text Encoder (type lens) -> CLIPTextEncode -> Preview as Text."""
    name = f"tiny_lens_server_{fmt}.safetensors"
    (models_dir / "text_encoders").mkdir(exist_ok=True)
    write_quantized_file(models_dir / "text_encoders" / name,
                         {**float_sd(cfg=LENS_CFG), "tokenizer_json": _char_tokenizer_json()}, fmt)
    hist = comfy.run({
        "1": {"class_type": "FP8Engram.LoadFP8TextEncoder",
              "inputs": {"clip_name": name, "type": "lens", "compute_path": "auto", "activation_scaling": "auto",
                         "compute_dtype": "auto"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": PROMPT}},
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}},
    })
    summary = hist["outputs"]["1"]["fp8_summary"][0]
    assert summary["file"] == name and summary["layers_quantized"] == 2 * LENS_CFG["num_hidden_layers"]
    text = hist["outputs"]["3"]["text"][0]
    assert "tensor(" in text and "'num_layers_stacked': 4" in text, text[-400:]
