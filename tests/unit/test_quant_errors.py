"""Bad input to the quantization library raises QuantizationError (a ValueError) saying what was
wrong and what was expected."""

import pytest
import torch
import torch.nn.functional as F

from fp8_engram.quant import Block, ComputeConfig, PerRow, PerTensor, QuantizationError, QuantizedTensor

pytestmark = pytest.mark.unit

Q = torch.zeros(8, 16).to(torch.float8_e4m3fn)


def test_is_a_value_error():
    assert issubclass(QuantizationError, ValueError)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.uint8])
def test_qdata_must_be_fp8(dtype):
    with pytest.raises(QuantizationError, match="float8_e4m3fn or torch.float8_e5m2"):
        QuantizedTensor.from_parts(torch.zeros(8, 16, dtype=dtype), torch.tensor(1.0), PerTensor())


@pytest.mark.parametrize("bad, msg", [
    (torch.tensor(0.0), "zero or negative"),
    (torch.tensor(-1.0), "zero or negative"),
    (torch.tensor(float("nan")), "inf or nan"),
    (torch.tensor(float("inf")), "inf or nan"),
    (torch.tensor(1, dtype=torch.int32), "must be float32"),
    (torch.tensor(1.0).to(torch.float8_e4m3fn), "must be float32"),
    (torch.tensor([]), "empty"),
    ("1.0", "must be a float tensor"),
])
def test_bad_scales(bad, msg):
    with pytest.raises(QuantizationError, match=msg):
        QuantizedTensor.from_parts(Q, bad, PerTensor())


def test_one_bad_value_in_a_per_row_scale_is_caught():
    scale = torch.ones(8, 1)
    scale[5] = 0.0
    with pytest.raises(QuantizationError, match=r"zero or negative values \(min 0, first at index \[5, 0\]\)"):
        QuantizedTensor.from_parts(Q, scale, PerRow())


@pytest.mark.parametrize("layout, scale, msg", [
    (PerTensor(), torch.ones(2), "exactly one value"),
    (PerRow(), torch.ones(16, 1), r"must have shape \[8, 1\], got \[16, 1\]"),
    (PerRow(), torch.ones(1, 8), r"must have shape \[8, 1\]"),
    (Block(4, 8), torch.ones(2, 3), r"must have shape \[2, 2\], got \[2, 3\]"),
    (Block(1, 64), torch.ones(8, 2), r"must have shape \[8, 1\]"),
])
def test_scale_shape_mismatch(layout, scale, msg):
    with pytest.raises(QuantizationError, match=msg):
        QuantizedTensor.from_parts(Q, scale, layout)


def test_musubi_block_scale_shape_is_accepted():
    qt = QuantizedTensor.from_parts(Q, torch.ones(8, 1, 1, dtype=torch.bfloat16), Block(1, 16))
    assert qt.scale.shape == (8, 1) and qt.scale.dtype == torch.float32


def test_a_module_parameter_as_scale_is_held_as_a_plain_tensor():
    """ComfyUI's scaled layers keep their scale as an nn.Parameter: the weight holds a plain tensor of it (same
    storage), not the Parameter itself, as for any other scale."""
    p = torch.nn.Parameter(torch.tensor(0.5), requires_grad=False)
    qt = QuantizedTensor.from_parts(Q, p, PerTensor())
    assert type(qt.scale) is torch.Tensor and qt.scale.data_ptr() == p.data_ptr()


def test_input_scale_is_checked():
    with pytest.raises(QuantizationError, match="input_scale holds zero"):
        QuantizedTensor.from_parts(Q, torch.tensor(1.0), PerTensor(), input_scale=torch.tensor(0.0))
    with pytest.raises(QuantizationError, match="input_scale must hold one value"):
        QuantizedTensor.from_parts(Q, torch.tensor(1.0), PerTensor(), input_scale=torch.ones(3))


def test_bad_layouts_and_dtypes():
    with pytest.raises(QuantizationError, match="layout must be PerTensor"):
        QuantizedTensor.from_parts(Q, torch.tensor(1.0), "per_tensor")
    for rows, cols in ((0, 64), (1.5, 64), (True, 4)):
        with pytest.raises(QuantizationError, match="positive int"):
            Block(rows, cols)
    with pytest.raises(QuantizationError, match="orig_dtype"):
        QuantizedTensor.from_parts(Q, torch.tensor(1.0), PerTensor(), orig_dtype=torch.float8_e4m3fn)
    with pytest.raises(QuantizationError, match="2-D weight"):
        QuantizedTensor.from_parts(torch.zeros(8).to(torch.float8_e4m3fn), torch.ones(8, 1), PerRow())
    with pytest.raises(QuantizationError, match="fp8_dtype"):
        QuantizedTensor.from_float(torch.ones(4, 4), PerTensor(), fp8_dtype=torch.int8)


def test_from_float_rejects_bad_tensors():
    with pytest.raises(QuantizationError, match="float32/float16/bfloat16"):
        QuantizedTensor.from_float(torch.ones(4, 4, dtype=torch.int32), PerTensor())
    w = torch.ones(4, 4)
    w[1, 2] = float("nan")
    with pytest.raises(QuantizationError, match="inf or nan"):
        QuantizedTensor.from_float(w, PerRow())
    with pytest.raises(QuantizationError, match="int seed"):
        QuantizedTensor.from_float(torch.ones(4, 4), PerTensor(), stochastic_rounding="yes")


def test_all_zero_weights_get_valid_scales():
    qt = QuantizedTensor.from_float(torch.zeros(8, 16), Block(4, 8))
    assert bool((qt.scale > 0).all()) and torch.equal(qt.dequantize(), torch.zeros(8, 16))


def test_compute_config_checks():
    with pytest.raises(QuantizationError, match="path must be one of"):
        ComputeConfig(path="fast")
    with pytest.raises(QuantizationError, match="activation_scaling must be one of"):
        ComputeConfig(activation_scaling="per_token")
    with pytest.raises(QuantizationError, match="compute_dtype"):
        ComputeConfig(compute_dtype=torch.int8)
    with pytest.raises(QuantizationError, match="config must be a ComputeConfig"):
        QuantizedTensor.from_parts(Q, torch.tensor(1.0), PerTensor(), config={"path": "fp8"})


def test_linear_input_shape_mismatch():
    qt = QuantizedTensor.from_parts(Q, torch.tensor(1.0), PerTensor())
    with pytest.raises(QuantizationError, match=r"input of shape \[3, 15\] does not fit a weight of shape \[8, 16\]"):
        F.linear(torch.ones(3, 15), qt)


def test_copy_shape_mismatch():
    qt = QuantizedTensor.from_parts(Q, torch.tensor(1.0), PerTensor())
    with pytest.raises(QuantizationError, match="shapes differ"):
        qt.copy_(torch.ones(8, 15))
