"""3-D FP8 expert banks (MoE layers): per-tensor and per-expert scales, indexing an expert without
dequantizing the bank, and the products MoE code applies (bmm, matmul, einsum) one expert at a time,
against the plain rule ``round(float32(q) * scale_e)`` and a float64 reference of the float weights."""

import logging

import pytest
import torch
import torch.nn.functional as F

from fp8_engram.quant import PerExpert, PerTensor, QuantizationError, QuantizedTensor
from fp8_engram.quant.expert_bank import expert, is_bank
from helpers.numerics import sqnr

pytestmark = pytest.mark.unit

E, OUT, IN = 5, 48, 40
FALLBACK = "no quantized kernel"


def _float_bank(seed=0, shape=(E, OUT, IN)):
    g = torch.Generator().manual_seed(seed)
    # experts of different magnitudes, so one scale per expert matters
    mags = torch.logspace(-5, 0, shape[0], dtype=torch.float64).reshape(-1, 1, 1)
    return torch.randn(shape, generator=g, dtype=torch.float64) * mags


def _bank(layout, dtype=torch.bfloat16, seed=0, shape=(E, OUT, IN)):
    w = _float_bank(seed, shape)
    return w, QuantizedTensor.from_float(w.to(dtype), layout)


def _plain_rule(bank: QuantizedTensor, dtype) -> torch.Tensor:
    """The reference dequantization, written out: float32(q) * that expert's float32 scale, rounded once."""
    s = bank.scale.reshape(-1, 1, 1) if bank.scale.dim() else bank.scale.reshape(1, 1, 1)
    return (bank.qdata.to(torch.float32) * s).to(dtype)


def _track_dequantize(monkeypatch):
    sizes = []
    original = QuantizedTensor.dequantize

    def tracked(self, dtype=None):
        sizes.append(self.numel())
        return original(self, dtype)

    monkeypatch.setattr(QuantizedTensor, "dequantize", tracked)
    return sizes


LAYOUTS = [PerTensor(), PerExpert()]


# -- storage ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_shape", [(E,), (E, 1, 1)])
def test_per_expert_scale_from_a_file_shape_builds_a_bank(scale_shape):
    q = (torch.randn(E, OUT, IN) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(scale_shape) + 0.01
    bank = QuantizedTensor.from_parts(q, scale, PerExpert(), orig_dtype=torch.bfloat16)
    assert tuple(bank.shape) == (E, OUT, IN) and bank.dtype == torch.bfloat16
    assert tuple(bank.scale.shape) == (E, 1, 1)
    assert is_bank(bank)


@pytest.mark.parametrize("bad", [(E + 1,), (E, OUT, 1), (1, E)])
def test_per_expert_scale_of_wrong_shape_is_refused_with_the_shapes(bad):
    q = torch.zeros(E, OUT, IN).to(torch.float8_e4m3fn)
    with pytest.raises(QuantizationError, match=rf"per-expert scale .*\[{E}, {OUT}, {IN}\].*{list(bad)}"):
        QuantizedTensor.from_parts(q, torch.ones(bad), PerExpert())


def test_per_expert_layout_refuses_a_2d_weight():
    with pytest.raises(QuantizationError, match="3-D expert bank"):
        QuantizedTensor.from_float(torch.randn(OUT, IN), PerExpert())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_bank_dequantizes_by_the_plain_rule_bit_for_bit(layout, dtype):
    w, bank = _bank(layout)
    got = bank.dequantize(dtype)
    assert torch.equal(got, _plain_rule(bank, dtype))
    for e in range(E):
        assert torch.equal(bank[e].dequantize(dtype), got[e])


def test_per_expert_scales_beat_one_scale_on_experts_of_different_sizes():
    w, per_tensor = _bank(PerTensor(), torch.float32)
    _, per_expert = _bank(PerExpert(), torch.float32)
    quiet = 0  # the smallest expert: a shared scale leaves it near FP8's subnormals
    db_tensor = sqnr(w[quiet], per_tensor.dequantize(torch.float64)[quiet])
    db_expert = sqnr(w[quiet], per_expert.dequantize(torch.float64)[quiet])
    assert db_expert > 28 and db_expert > db_tensor + 10, (db_expert, db_tensor)


# -- indexing: views of the same bytes, nothing dequantized ----------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_indexing_an_expert_shares_the_bytes_and_dequantizes_nothing(layout, monkeypatch, caplog):
    _, bank = _bank(layout)
    ref = _plain_rule(bank, torch.bfloat16)
    sizes = _track_dequantize(monkeypatch)
    with caplog.at_level(logging.WARNING):
        one = bank[3]
        last = bank[-1]
        some = bank[1:4]
        picked = bank[torch.tensor([4, 0])]
        every = list(bank)
    assert sizes == []
    assert not [r for r in caplog.records if FALLBACK in r.getMessage()]
    assert isinstance(one, QuantizedTensor) and tuple(one.shape) == (OUT, IN) and one.layout == PerTensor()
    assert one.qdata.data_ptr() == bank.qdata[3].data_ptr()
    monkeypatch.undo()
    assert torch.equal(one.dequantize(), ref[3]) and torch.equal(last.dequantize(), ref[-1])
    assert is_bank(some) and torch.equal(some.dequantize(), ref[1:4])
    assert is_bank(picked) and torch.equal(picked.dequantize(), ref[[4, 0]])
    assert len(every) == E and all(torch.equal(x.dequantize(), ref[e]) for e, x in enumerate(every))


def test_expert_index_out_of_range_is_an_index_error():
    _, bank = _bank(PerExpert())
    with pytest.raises(IndexError, match=f"out of range for a bank of {E} experts"):
        expert(bank, E)


# -- products, one expert at a time ------------------------------------------------------------------


def _stacked(fn, n=E):
    return torch.stack([fn(e) for e in range(n)])


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_bmm_bank_out_in_form_matches_plain_rule_and_float_reference(layout, monkeypatch):
    w, bank = _bank(layout, torch.float32)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(E, IN, 7, generator=g)  # [E, in, n]: bank [E, out, in] on the left
    ref = _plain_rule(bank, torch.float32)
    sizes = _track_dequantize(monkeypatch)
    y = torch.bmm(bank, x)
    assert max(sizes) <= OUT * IN and len(sizes) == E  # one expert's matrix at a time
    assert torch.equal(y, _stacked(lambda e: ref[e] @ x[e]))
    db = sqnr(torch.bmm(w, x.double()), y)
    assert db > 28, db


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_bmm_bank_in_out_form_as_hugging_face_gpt_oss(layout, monkeypatch):
    # HF gpt-oss: gate_up_proj [E, hidden, 2*inter], torch.bmm(hidden_states [E, tokens, hidden], gate_up_proj)
    w, bank = _bank(layout, torch.bfloat16, shape=(E, IN, OUT))
    x = torch.randn(E, 6, IN, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    ref = _plain_rule(bank, torch.bfloat16)
    sizes = _track_dequantize(monkeypatch)
    y = x.bmm(bank)
    assert max(sizes) <= OUT * IN
    assert y.dtype == torch.bfloat16 and torch.equal(y, _stacked(lambda e: x[e] @ ref[e]))
    assert sqnr(torch.bmm(x.double(), w), y) > 25


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_matmul_with_shared_and_batched_inputs(layout, monkeypatch):
    w, bank = _bank(layout, torch.float32)
    ref = _plain_rule(bank, torch.float32)
    shared = torch.randn(9, OUT, generator=torch.Generator().manual_seed(3))
    batched = torch.randn(E, IN, 4, generator=torch.Generator().manual_seed(4))
    sizes = _track_dequantize(monkeypatch)
    y1 = torch.matmul(shared, bank)      # [9, out] @ [E, out, in] -> [E, 9, in]
    y2 = bank @ batched                  # [E, out, in] @ [E, in, 4] -> [E, out, 4]
    assert max(sizes) <= OUT * IN
    assert torch.equal(y1, _stacked(lambda e: shared @ ref[e]))
    assert torch.equal(y2, _stacked(lambda e: ref[e] @ batched[e]))
    assert sqnr(torch.matmul(shared.double(), w), y1) > 28


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("equation,other_shape", [
    ("eoi,eni->eno", (E, 6, IN)),   # per-expert tokens against [E, out, in]
    ("eni,eoi->neo", (E, 6, IN)),   # bank second, expert axis moved in the output
    ("ni,eoi->eno", (6, IN)),       # shared tokens
    ("eni,eoi->no", (E, 6, IN)),    # summed over experts
])
def test_einsum_runs_expert_by_expert(layout, equation, other_shape, monkeypatch):
    w, bank = _bank(layout, torch.float32)
    ref = _plain_rule(bank, torch.float32)
    x = torch.randn(other_shape, generator=torch.Generator().manual_seed(5))
    bank_first = equation.index("o") < equation.index(",")
    operands = (bank, x) if bank_first else (x, bank)
    sizes = _track_dequantize(monkeypatch)
    y = torch.einsum(equation, *operands)
    assert max(sizes) <= OUT * IN
    monkeypatch.undo()
    want = torch.einsum(equation, *((ref, x) if bank_first else (x, ref)))
    assert y.shape == want.shape
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)  # einsum may contract in another order
    exact = torch.einsum(equation, *((w, x.double()) if bank_first else (x.double(), w)))
    assert sqnr(exact, y) > 28


def test_bmm_batch_mismatch_names_both_shapes():
    _, bank = _bank(PerExpert(), torch.float32)
    with pytest.raises(QuantizationError, match=rf"\[{E}, {OUT}, {IN}\].*\[{E - 1}, {IN}, 3\]"):
        torch.bmm(bank, torch.randn(E - 1, IN, 3))


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_comfy_033_expert_loop_indexes_then_linears(layout):
    """ComfyUI 0.33's MoEExperts.expert_linear on a weight that is not its own QuantizedTensor:
    ``weight[i]`` then ``F.linear(input, weight[i], bias[i])``."""
    w, bank = _bank(layout, torch.bfloat16)
    ref = _plain_rule(bank, torch.bfloat16)
    bias = torch.randn(E, OUT, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    x = torch.randn(11, IN, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    for i in (0, 2, E - 1):
        y = F.linear(x, bank[i], bias[i])
        torch.testing.assert_close(y, F.linear(x, ref[i], bias[i]), rtol=1e-2, atol=1e-2 * float(w[i].abs().max()))
        assert sqnr(F.linear(x.double(), w[i], bias[i].double()), y) > 25


def test_bank_survives_torch_save_with_weights_only():
    import io

    _, bank = _bank(PerExpert())
    buf = io.BytesIO()
    torch.save({"w": bank}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)["w"]
    assert isinstance(back, QuantizedTensor) and back.layout == PerExpert()
    assert torch.equal(back.qdata.view(torch.uint8), bank.qdata.view(torch.uint8))
    assert torch.equal(back.scale, bank.scale)


# -- files: a bank with its scale loads as a QuantizedTensor ------------------------------------------


def _bank_file(tmp_path, scale, *, comfy_quant=None, name="model.layers.0.mlp.experts.gate_up_proj"):
    import json

    from safetensors.torch import save_file

    _, bank = _bank(PerExpert(), torch.bfloat16)
    sd = {name + ".weight": bank.qdata, name + ".weight_scale": scale,
          name + ".bias": torch.zeros(E, OUT, dtype=torch.bfloat16),
          "model.embed_tokens.weight": torch.zeros(8, IN, dtype=torch.bfloat16)}
    if comfy_quant is not None:
        sd[name + ".comfy_quant"] = torch.tensor(list(json.dumps(comfy_quant).encode()), dtype=torch.uint8)
    path = tmp_path / "bank.safetensors"
    save_file(sd, str(path))
    return path, name, bank


@pytest.mark.parametrize("form", ["[E]", "[E,1,1]", "comfy_quant [E]", "per tensor []"])
def test_bank_in_a_file_loads_as_a_quantized_bank(tmp_path, form):
    from fp8_engram.quant import formats

    scale = torch.rand(E, generator=torch.Generator().manual_seed(8)) * 0.01 + 1e-3
    if form == "[E,1,1]":
        scale = scale.reshape(E, 1, 1)
    if form == "per tensor []":
        scale = scale[0].reshape(())
    cq = {"format": "float8_e4m3fn", "num_experts": E} if form.startswith("comfy_quant") else None
    path, name, bank = _bank_file(tmp_path, scale, comfy_quant=cq)
    sd, report = formats.load_file(path, orig_dtype=torch.bfloat16)
    w = sd[name + ".weight"]
    assert is_bank(w) and tuple(w.shape) == (E, OUT, IN)
    assert w.layout == (PerTensor() if form == "per tensor []" else PerExpert())
    assert torch.equal(w.qdata.view(torch.uint8), bank.qdata.view(torch.uint8))
    want = (bank.qdata.to(torch.float32) * scale.reshape(-1, 1, 1)).to(torch.bfloat16)
    assert torch.equal(w.dequantize(), want)
    assert name + ".comfy_quant" not in sd and name + ".weight_scale" not in sd
    assert report.granularities.get("tensor" if form == "per tensor []" else "expert") == 1


def test_bank_scale_of_wrong_shape_names_the_file_and_key(tmp_path):
    from fp8_engram.quant import formats
    from fp8_engram.quant.errors import FormatError

    path, name, _ = _bank_file(tmp_path, torch.ones(E + 2))
    with pytest.raises(FormatError, match=rf"bank\.safetensors.*{name}\.weight_scale.*\[{E + 2}\].*expert bank"):
        formats.load_file(path)


# -- NVFP4 banks: each expert is a 2-D NVFP4 weight as it is ---------------------------------------------

NR, NC = 40, 72  # not multiples of 16: every expert carries NVFP4's padding


def _nvfp4_bank(dtype=torch.float32):
    from fp8_engram.quant import NVFP4Bank

    w = _float_bank(9, (E, NR, NC))
    return w, QuantizedTensor.from_float(w.to(dtype), NVFP4Bank(NR, NC))


def test_nvfp4_bank_experts_are_the_2d_nvfp4_weights_byte_for_byte():
    from fp8_engram.quant import NVFP4

    w, bank = _nvfp4_bank()
    assert tuple(bank.shape) == (E, NR, NC) and is_bank(bank)
    full = bank.dequantize(torch.float32)
    for e in range(E):
        alone = QuantizedTensor.from_float(w[e].float(), NVFP4(NR, NC))
        one = bank[e]
        assert one.layout == NVFP4(NR, NC) and one.qdata.data_ptr() == bank.qdata[e].data_ptr()
        assert torch.equal(one.qdata, alone.qdata) and torch.equal(one.scale, alone.scale)
        assert torch.equal(full[e], alone.dequantize(torch.float32))
    db = min(sqnr(w[e], full[e].double()) for e in range(E))
    assert db > 17, db  # e2m1 with e4m3 group scales: about 20 dB on Gaussian weights


def test_nvfp4_bank_products_go_expert_by_expert(monkeypatch):
    w, bank = _nvfp4_bank(torch.bfloat16)
    ref = bank.dequantize(torch.bfloat16)
    x = torch.randn(E, 5, NR, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    sizes = _track_dequantize(monkeypatch)
    y = torch.bmm(x, bank)               # [E, 5, rows] @ [E, rows, cols]
    assert max(sizes) <= NR * NC and len(sizes) == E
    monkeypatch.undo()
    assert torch.equal(y, _stacked(lambda e: x[e] @ ref[e]))
    assert sqnr(torch.bmm(x.double(), w), y) > 15
    sub = bank[torch.tensor([3, 1])]
    assert is_bank(sub) and torch.equal(sub.dequantize(torch.bfloat16), ref[[3, 1]])
    t = torch.randn(4, NC, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    lin = F.linear(t, bank[2])         # ComfyUI 0.33's expert loop: an expert's NVFP4 weight in a linear
    torch.testing.assert_close(lin, F.linear(t, ref[2]), rtol=2e-2, atol=2e-2 * float(ref[2].abs().max()))


def test_nvfp4_bank_scales_of_wrong_shape_are_refused():
    from fp8_engram.quant import NVFP4Bank

    _, bank = _nvfp4_bank()
    with pytest.raises(QuantizationError, match=rf"NVFP4 bank scales for {E} experts .*\[{E}, {bank.scale.shape[1] - 1}\]"):
        QuantizedTensor.from_parts(bank.qdata, bank.scale[:, 1:], NVFP4Bank(NR, NC), orig_dtype=torch.float32)


def test_bmm_on_a_bank_passes_gradients_to_the_activations():
    _, bank = _bank(PerExpert(), torch.float32)
    ref = _plain_rule(bank, torch.float32)
    x = torch.randn(E, IN, 3, generator=torch.Generator().manual_seed(12), requires_grad=True)
    torch.bmm(bank, x).sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    torch.bmm(ref, x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert bank.grad is None


@pytest.mark.parametrize("shared_tensor_scale", [False, True])
def test_nvfp4_bank_in_comfy_033_file_form_loads_as_an_nvfp4_bank(tmp_path, shared_tensor_scale):
    import json

    from safetensors.torch import save_file

    from fp8_engram.quant import NVFP4, NVFP4Bank, formats
    from fp8_engram.quant.layouts.expert import bank_at_shape
    from fp8_engram.quant.layouts.nvfp4 import file_tensors

    w = _float_bank(13, (E, NR, NC))
    mats = [QuantizedTensor.from_float(w[e].float(), NVFP4(NR, NC)) for e in range(E)]
    if shared_tensor_scale:  # one tensor scale for every expert: requantize each with the bank's
        from fp8_engram.quant.layouts.nvfp4 import join_scales, split_scales
        ts = max(float(split_scales(m.scale, m.layout)[1]) for m in mats)
        mats = [m._replace(scale=join_scales(split_scales(m.scale, m.layout)[0], torch.tensor(ts))) for m in mats]
    parts = [file_tensors(m) for m in mats]
    name = "model.layers.0.mlp.experts.down_proj"
    sd = {name + ".weight": torch.stack([p["weight"] for p in parts]),
          name + ".weight_scale": torch.stack([p["weight_scale"] for p in parts]),
          name + ".weight_scale_2": (parts[0]["weight_scale_2"].reshape(()) if shared_tensor_scale
                                     else torch.stack([p["weight_scale_2"].reshape(()) for p in parts])),
          name + ".comfy_quant": torch.tensor(list(json.dumps({"format": "nvfp4", "num_experts": E}).encode()),
                                              dtype=torch.uint8)}
    path = tmp_path / "nvfp4_bank.safetensors"
    save_file(sd, str(path))
    loaded, report = formats.load_file(path, orig_dtype=torch.float32)
    bank = bank_at_shape(loaded[name + ".weight"], (E, NR, NC))  # the file holds the padded size
    assert is_bank(bank) and bank.layout == NVFP4Bank(NR, NC) and tuple(bank.shape) == (E, NR, NC)
    assert report.granularities.get("nvfp4") == 1
    for e in range(E):
        assert torch.equal(bank[e].dequantize(torch.float32), mats[e].dequantize(torch.float32))


def test_nvfp4_bank_file_with_wrong_tensor_scales_names_the_key(tmp_path):
    import json

    from safetensors.torch import save_file

    from fp8_engram.quant import NVFP4, formats
    from fp8_engram.quant.errors import FormatError
    from fp8_engram.quant.layouts.nvfp4 import file_tensors

    parts = [file_tensors(QuantizedTensor.from_float(torch.randn(32, 32), NVFP4(32, 32))) for _ in range(3)]
    name = "experts.gate_up_proj"
    sd = {name + ".weight": torch.stack([p["weight"] for p in parts]),
          name + ".weight_scale": torch.stack([p["weight_scale"] for p in parts]),
          name + ".weight_scale_2": torch.ones(2),
          name + ".comfy_quant": torch.tensor(list(json.dumps({"format": "nvfp4"}).encode()), dtype=torch.uint8)}
    save_file(sd, str(tmp_path / "bad.safetensors"))
    with pytest.raises(FormatError, match=rf"bad\.safetensors.*{name}\.weight_scale.*tensor scales must be \[3\]"):
        formats.load_file(tmp_path / "bad.safetensors")
