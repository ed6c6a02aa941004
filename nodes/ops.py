"""ComfyUI operations class for FP8 weights: one fresh class per load, carrying that load's options.

`make_fp8_ops(config, ...)` returns a subclass of `comfy.ops.manual_cast` whose `Linear`:
- never allocates a full-precision weight: `__init__` creates only the bias, and
  `_load_from_state_dict` takes the `QuantizedTensor` from the state dict as it is (FP8 bytes,
  memory-mapped from the file until touched); plain weights (layers kept in high precision) load as
  in stock ComfyUI;
- keeps a convolution's weight FP8 when the file holds it FP8 (cast per call, exactly, as stock's manual
  cast does);
- runs forward through `fp8_engram.quant.compute.linear` with the weight's ComputeConfig (weight-only on the
  CPU by default); a weight on another device moves as FP8 (that is what offloading moves);
- supports ComfyUI weight patches (LoRA ...) through the `convert_weight` / `set_weight` hooks that
  `comfy.model_patcher` looks up: dequantize -> patch -> requantize into the same layout and FP8
  dtype with a fresh scale (round to nearest, or stochastic with ComfyUI's per-key seed). The
  patcher keeps the original QuantizedTensor as its backup, so unpatching restores the exact bytes. Under
  "auto" where int8 runs (``ComputeConfig.fp8_form``) a weight may have become int8 in place before or while
  it is patched: it is patched in its int8 layout, and unpatching gives back the original weight in the
  form it has now (its int8 one once a call of it ran int8).
Options live on the fresh class only (never on a shared class), so two loads never leak into each other.
"""

from __future__ import annotations

import contextlib
import logging

import comfy.model_management
import comfy.ops
import torch

from ..quant import ComputeConfig, QuantizedTensor
from ..quant import linear as quant_linear
from ..quant.compute import int8 as quant_int8
from ..quant.compute.paths.int8 import carry_fp8_form, sampled_conversion_sqnr_db
from ..quant.errors import QuantizationError
from ..quant.layouts import mxfp8, nvfp4
from ..quant.layouts.expert import bank_at_shape
from ..quant.compute.paths.plain import drop_kept_copies
from ..quant.runtime import release_workspace

logger = logging.getLogger(__name__)

_run_every_op = getattr(comfy.ops, "run_every_op", None)


def _same_device(device, current: torch.device) -> bool:
    if device is None:
        return True
    device = torch.device(device)
    return device.type == current.type and (device.index is None or device.index == current.index)


def move_quantized(w: QuantizedTensor, device) -> QuantizedTensor:
    """The same FP8 weight on `device` (bytes and scales move; nothing is dequantized)."""
    if _same_device(device, w.device):
        return w
    return QuantizedTensor.from_parts(
        w.qdata.to(device), w.scale.to(device), w.layout, orig_dtype=w.orig_dtype,
        input_scale=None if w.input_scale is None else w.input_scale.to(device), config=w.config)


def _patch_source(weight):
    """What ComfyUI's weight patches (LoRA ...) add to: a quantized weight (or bank) dequantized in float32."""
    return weight.dequantize(torch.float32) if isinstance(weight, QuantizedTensor) else weight


def make_fp8_ops(config: ComputeConfig | None = None, *, stochastic_rounding: bool = False,
                 base=comfy.ops.manual_cast, source: str | None = None):
    """A new operations class (subclass of `base`) for one load. `config` is attached to quantized
    weights that come without one; `stochastic_rounding` applies to requantization after patches;
    `source` names the file being loaded in errors."""
    cfg = config or ComputeConfig()
    sr = bool(stochastic_rounding)
    # "int8" converts FP8 weights once, here. "auto" keeps the file's weights: where the device has fast INT8
    # and no FP8 units, a layer is converted the first time a token class of its calls proves int8 right and
    # faster (compute/paths/int8.py), on the device it runs on, and a model that never runs int8 converts
    # nothing (converting every layer at load took minutes per billion parameters on a CPU, and held both
    # forms of the whole model at once).
    to_int8 = cfg.path == "int8"

    class FP8Ops(base):
        fp8_config = cfg
        fp8_stochastic_rounding = sr
        int8_convert = to_int8
        int8_layers: list = []  # (layer, conversion SQNR dB) of this load, for the load report
        fp8_source = source

        class Linear(base.Linear):
            fp8_widen_to = None  # the dtype a kept 16-bit weight is widened to at its first call (CPU)

            def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
                torch.nn.Module.__init__(self)
                self.in_features = in_features
                self.out_features = out_features
                self.factory_dtype = dtype
                self.factory_device = device
                # No weight storage yet: the state dict brings it (FP8, or full precision for kept layers).
                self.register_parameter("weight", None)
                if bias:
                    self.bias = torch.nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False)
                else:
                    self.register_parameter("bias", None)

            def reset_parameters(self):
                return None

            def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs):
                key = prefix + "weight"
                w = state_dict.pop(key, None)
                if w is not None:
                    if isinstance(w, QuantizedTensor):
                        # 0.29 stores MXFP8 layers padded to multiples of 32; the model's size is the true one
                        w = mxfp8.at_shape(w, (self.out_features, self.in_features))
                        w = nvfp4.at_shape(w, (self.out_features, self.in_features))  # NVFP4 files pad to 16
                        if w.config is None:
                            w = w.with_config(FP8Ops.fp8_config)
                        if (FP8Ops.int8_convert and w.config.path != "weight_only" and w.qdata.dim() == 2
                                and not quant_int8.is_int8(w)):
                            # the block of the device it will compute on (a GPU model's weights load on the CPU)
                            compute_device = comfy.model_management.get_torch_device()
                            rot = (quant_int8.default_rotation(w.qdata.shape[1], compute_device)
                                   if w.config.int8_rotation else 0)
                            try:
                                w8 = quant_int8.to_int8(w, rot)
                            except QuantizationError as exc:
                                # e.g. scales so near float32's range that the rotated weight overflows
                                where = f"{FP8Ops.fp8_source}: " if FP8Ops.fp8_source else ""
                                raise QuantizationError(
                                    f"{where}layer {prefix.rstrip('.')!r} ({w.layout!r}): its weight cannot be converted "
                                    f"to int8 for the int8 compute path ({exc}); load the file with compute_path "
                                    "weight-only") from exc
                            FP8Ops.int8_layers.append((prefix.rstrip("."), sampled_conversion_sqnr_db(w, w8)))
                            w = w8
                        if self.factory_device is not None:
                            w = move_quantized(w, self.factory_device)
                    else:
                        dtype = self.factory_dtype if self.factory_dtype is not None else w.dtype
                        device = self.factory_device or w.device
                        if _widens_later(w, dtype, device):
                            # a layer the file keeps in 16 bits, for a CPU model computing in float32: held as the
                            # file has it and widened at its first call (widening every kept layer here was most
                            # of a load's time, fresh pages for twice the bytes, before anything ran)
                            w = w.to(device=device)
                            self.fp8_widen_to = dtype
                        else:
                            w = w.to(device=device, dtype=dtype)
                    if tuple(w.shape) != (self.out_features, self.in_features):
                        error_msgs.append(f"size mismatch for {key}: file has {list(w.shape)}, "
                                          f"the model expects {[self.out_features, self.in_features]}")
                    else:
                        self.weight = torch.nn.Parameter(w, requires_grad=False)
                super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                              unexpected_keys, error_msgs)
                if w is None and key not in missing_keys:
                    missing_keys.append(key)
                elif w is not None and key in missing_keys:
                    missing_keys.remove(key)


            def forward(self, input, *args, **kwargs):
                if _run_every_op is not None:
                    _run_every_op()
                w = self.weight
                if w is None:
                    raise RuntimeError("FP8 Linear has no weight: the state dict did not contain it")
                if not isinstance(w, QuantizedTensor):
                    if self.fp8_widen_to is not None and w.dtype != self.fp8_widen_to:
                        _widen_at_first_call(self, w, input)
                    return super().forward(input, *args, **kwargs)
                if len(self.weight_function) > 0 or len(self.bias_function) > 0:
                    # lowvram patches: ComfyUI casts, dequantizes through convert_weight and patches per call
                    weight, bias, offload_stream = comfy.ops.cast_bias_weight(self, input, offloadable=True)
                    out = torch.nn.functional.linear(input, weight, bias)
                    comfy.ops.uncast_bias_weight(self, weight, bias, offload_stream)
                    return out
                device = input.device
                w = move_quantized(w, device)  # FP8 bytes and scales move, nothing else
                bias = self.bias
                if bias is not None:
                    out_dtype = (w.config.compute_dtype if w.config is not None else None) or input.dtype
                    bias = comfy.model_management.cast_to(bias, out_dtype, device)
                return quant_linear(input, w, bias)

            # -- weight patches (comfy.model_patcher.get_key_weight looks these up) -----------------
            def convert_weight(self, weight, inplace=False, **kwargs):
                return _patch_source(weight)

            def set_weight(self, weight, inplace_update=False, seed=None, return_weight=False, **kwargs):
                cur = self.weight
                if not isinstance(cur, QuantizedTensor):
                    new = weight.to(dtype=cur.dtype, device=cur.device)
                    if return_weight:
                        return new
                    if inplace_update:
                        cur.data.copy_(new)
                    else:
                        self.weight = torch.nn.Parameter(new, requires_grad=False)
                    return None
                rounding = seed if (FP8Ops.fp8_stochastic_rounding and seed is not None) else None
                fresh = QuantizedTensor.from_float(weight.to(device=cur.qdata.device, dtype=torch.float32),
                                                   cur.layout, fp8_dtype=cur.fp8_dtype, stochastic_rounding=rounding)
                new = QuantizedTensor.from_parts(fresh.qdata, fresh.scale, cur.layout, orig_dtype=cur.orig_dtype,
                                                 input_scale=cur.input_scale, config=cur.config)
                if return_weight:
                    return new.dequantize(weight.dtype if weight.dtype.is_floating_point and weight.dtype.itemsize >= 2
                                          else cur.orig_dtype)
                if inplace_update:
                    with torch.no_grad():
                        cur.qdata.copy_(new.qdata)
                        cur.scale.copy_(new.scale)
                        cur.scales_written()
                else:
                    # a weight made int8 in place is patched in its int8 layout (one rounding, no FP8
                    # data to come back to); the patched one still knows the FP8 form to be saved in
                    param = torch.nn.Parameter(new, requires_grad=False)
                    carry_fp8_form(cur, param)
                    self.weight = param
                return None

        class MoEExperts(torch.nn.Module, comfy.ops.CastWeightBiasOp):
            """A mixture-of-experts bank with ComfyUI 0.33's interface (``expert_weight``, ``bank_resident``,
            ``expert_linear``; gpt-oss uses it). The weight ``[E, out, in]`` is kept as the file holds it: a
            bank (``QuantizedTensor``: FP8 per-tensor or per-expert scale, or NVFP4) is never cast as a whole; each
            expert's linear takes that expert's FP8 view (moved to the input's device as FP8) through the
            pack's linear, so at most one expert is dequantized at a time. Plain weights load as in stock."""

            def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = True,
                         device=None, dtype=None):
                torch.nn.Module.__init__(self)
                self.num_experts = num_experts
                self.in_features = in_features
                self.out_features = out_features
                self.factory_dtype = dtype
                self.factory_device = device
                self.register_parameter("weight", None)
                if bias:
                    self.bias = torch.nn.Parameter(torch.empty(num_experts, out_features, device=device, dtype=dtype),
                                                   requires_grad=False)
                else:
                    self.register_parameter("bias", None)

            def reset_parameters(self):
                return None

            def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs):
                key = prefix + "weight"
                w = state_dict.pop(key, None)
                want = (self.num_experts, self.out_features, self.in_features)
                if w is not None:
                    if isinstance(w, QuantizedTensor):
                        w = bank_at_shape(w, want)  # NVFP4 banks are stored padded to multiples of 16
                        if w.config is None:
                            w = w.with_config(FP8Ops.fp8_config)
                        if self.factory_device is not None:
                            w = move_quantized(w, self.factory_device)
                    else:
                        dtype = self.factory_dtype if self.factory_dtype is not None else w.dtype
                        w = w.to(device=self.factory_device or w.device, dtype=dtype)
                    if tuple(w.shape) != want:
                        where = f"{FP8Ops.fp8_source}: " if FP8Ops.fp8_source else ""
                        error_msgs.append(f"{where}size mismatch for {key}: file has {list(w.shape)}, the model "
                                          f"expects an expert bank {list(want)} [experts, out, in]")
                    else:
                        self.weight = torch.nn.Parameter(w, requires_grad=False)
                super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                              unexpected_keys, error_msgs)
                if w is None and key not in missing_keys:
                    missing_keys.append(key)
                elif w is not None and key in missing_keys:
                    missing_keys.remove(key)

            # -- weight patches (LoRA ...): the whole bank dequantized for the patch, requantized into its layout
            def convert_weight(self, weight, inplace=False, **kwargs):
                return _patch_source(weight)

            def set_weight(self, weight, inplace_update=False, seed=None, return_weight=False, **kwargs):
                cur = self.weight
                if not isinstance(cur, QuantizedTensor):
                    new = weight.to(dtype=cur.dtype, device=cur.device)
                    if return_weight:
                        return new
                    self.weight = torch.nn.Parameter(new, requires_grad=False)
                    return None
                rounding = seed if (FP8Ops.fp8_stochastic_rounding and seed is not None) else None
                fp8 = torch.float8_e4m3fn if cur.layout.packed else cur.fp8_dtype
                new = QuantizedTensor.from_float(weight.to(device=cur.qdata.device, dtype=torch.float32), cur.layout,
                                                 fp8_dtype=fp8, stochastic_rounding=rounding)
                new = new._replace(orig_dtype=cur.orig_dtype, config=cur.config)
                if return_weight:
                    return new.dequantize(weight.dtype if weight.dtype.is_floating_point and weight.dtype.itemsize >= 2
                                          else cur.orig_dtype)
                self.weight = torch.nn.Parameter(new, requires_grad=False)
                return None

            def expert_weight(self, i: int):
                """Expert i's weight: a 2-D QuantizedTensor view of the bank's FP8 bytes, or a plain slice."""
                if self.weight is None:
                    raise RuntimeError("FP8 MoEExperts has no weight: the state dict did not contain it")
                return self.weight[i]

            @contextlib.contextmanager
            def bank_resident(self, input):
                # stock casts the whole bank here; an FP8 bank stays as it is, each expert moves on use
                yield self

            def expert_linear(self, input: torch.Tensor, i: int) -> torch.Tensor:
                if _run_every_op is not None:
                    _run_every_op()
                w = self.expert_weight(i)
                bias = None if self.bias is None else self.bias[i]
                if isinstance(w, QuantizedTensor):
                    w = move_quantized(w, input.device)
                    if bias is not None:
                        out_dtype = (w.config.compute_dtype if w.config is not None else None) or input.dtype
                        bias = comfy.model_management.cast_to(bias, out_dtype, input.device)
                    return quant_linear(input, w, bias)
                w = comfy.model_management.cast_to(w, input.dtype, input.device)
                if bias is not None:
                    bias = comfy.model_management.cast_to(bias, input.dtype, input.device)
                return torch.nn.functional.linear(input, w, bias)

    for conv in ("Conv1d", "Conv2d", "Conv3d"):
        if hasattr(base, conv):
            setattr(FP8Ops, conv, _fp8_keeping_conv(getattr(base, conv)))
    FP8Ops.__name__ = FP8Ops.__qualname__ = "FP8EngramOps"
    return FP8Ops


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _widens_later(w: torch.Tensor, dtype: torch.dtype, device) -> bool:
    """Whether a kept (not quantized) weight loading into a model of `dtype` on `device` is held in its file's
    narrower float dtype until its first call: on the CPU only (ComfyUI sizes a GPU's memory by the loaded
    weights, so there it is widened at load as before)."""
    return (w.dtype in (torch.bfloat16, torch.float16) and dtype == torch.float32
            and torch.device(device).type == "cpu")


def _widen_at_first_call(layer, w: torch.Tensor, input: torch.Tensor) -> None:
    """Widen `layer`'s kept weight (not yet in its model's dtype: the caller checks) once, at its first call on
    the CPU, so later calls pay no cast. The weight stays as it is (cast per call by ComfyUI's manual cast, as
    stock casts a kept layer) under torch.compile (no module state changes in a graph), with weight patches
    applied per call (lowvram), or while it is on another device. A weight ComfyUI's patcher patched keeps its patched
    values: the widened copy is made from the weight the layer holds now, and unpatching puts back the
    patcher's own backup, which is widened again at its next call."""
    if torch.compiler.is_compiling() or w.device.type != "cpu" or input.device.type != "cpu":
        return  # (a weight ComfyUI offloads to the CPU for a GPU's call is cast per call there, as stock does)
    if len(layer.weight_function) > 0 or len(layer.bias_function) > 0:
        return
    layer.weight = torch.nn.Parameter(w.to(layer.fp8_widen_to), requires_grad=False)


def _fp8_keeping_conv(conv_cls):
    """`conv_cls` whose weight stays FP8 when the file holds it FP8 (plain casts of UNets and patch
    embeddings), as stock ComfyUI keeps it when it keeps a file's FP8 weights; the cast to the input's
    dtype per call (the base class's manual cast) is exact. Other weights load as in the base class."""

    class FP8KeepingConv(conv_cls):
        def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                                  unexpected_keys, error_msgs):
            w = state_dict.get(prefix + "weight")
            cur = self.weight
            if (isinstance(w, torch.Tensor) and not isinstance(w, QuantizedTensor) and w.dtype in _FP8_DTYPES
                    and cur is not None and cur.dtype != w.dtype and tuple(cur.shape) == tuple(w.shape)):
                self.weight = torch.nn.Parameter(torch.empty(cur.shape, dtype=w.dtype, device=cur.device),
                                                 requires_grad=False)
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)

    FP8KeepingConv.__name__ = FP8KeepingConv.__qualname__ = conv_cls.__name__
    return FP8KeepingConv


_WORKSPACE_CALLBACK_KEY = "fp8_engram.release_workspace"


def _model_weights(patcher):
    """The weights of `patcher`'s model: its modules' parameters, and the originals its weight patches
    set aside (ComfyUI's backups, which unpatching puts back)."""
    model = getattr(patcher, "model", None)
    if isinstance(model, torch.nn.Module):
        yield from model.parameters()
    for saved in getattr(patcher, "backup", {}).values():
        yield getattr(saved, "weight", None)


def _release_workspace_on_detach(patcher, unpatch_all=True) -> None:
    # ComfyUI unloads models on the thread that runs prompts, the thread whose buffers the weight-only
    # path filled: free them with the model instead of keeping the largest layer's size mapped; and the
    # dequantized copies its weights keep (ComputeConfig.dequant_cache_bytes), whose bytes go back to the
    # process's account (the clones sharing these modules make theirs again at their next calls)
    release_workspace()
    dropped = drop_kept_copies(_model_weights(patcher))
    logger.debug("released the FP8 dequantization workspace and %d dequantized copies (model unloaded)", dropped)


def release_workspace_on_unload(patcher) -> None:
    """Make ComfyUI's unloading of `patcher` (its ModelPatcher: free memory, a model switch) also free
    the pack's per-thread dequantization buffers and the dequantized copies its weights keep. Clones inherit
    the callback; adding it twice is a no-op."""
    callbacks = getattr(patcher, "callbacks", None)
    if callbacks is None or not hasattr(patcher, "add_callback_with_key"):
        return  # a ComfyUI without model patcher callbacks
    from comfy.patcher_extension import CallbacksMP

    if _WORKSPACE_CALLBACK_KEY in callbacks.get(CallbacksMP.ON_DETACH, {}):
        return
    patcher.add_callback_with_key(CallbacksMP.ON_DETACH, _WORKSPACE_CALLBACK_KEY, _release_workspace_on_detach)


def count_widened_size(patcher) -> int:
    """Tell ComfyUI's memory planning the size `patcher`'s model will have once its kept 16-bit layers are widened
    at their first call (``_widen_at_first_call``): the bytes they will add are counted in now (ComfyUI caches a
    model's size when it is first asked). Returns those bytes."""
    model = getattr(patcher, "model", None)
    if not isinstance(model, torch.nn.Module) or not hasattr(patcher, "size"):
        return 0
    extra = 0
    for m in model.modules():
        # set on the instance by the load (an nn.Module's missing attribute costs a raised AttributeError each)
        target = m.__dict__.get("fp8_widen_to")
        if target is None:
            continue
        w = m._parameters.get("weight")
        if isinstance(w, torch.Tensor) and w.dtype != target:
            extra += w.numel() * (target.itemsize - w.element_size())
    if extra:
        patcher.size = comfy.model_management.module_size(_AsItIs(model)) + extra
    return extra


class _AsItIs:
    """A module as ``comfy.model_management.module_size`` sees it, whose state dict holds its tensors as they are:
    the same sizes by ComfyUI's own count (element sizes in 0.3.75, ``nbytes`` later) without a detached copy of
    each (0.14 ms against 0.37 for hunyuan-dit's tiny model: each FP8 weight's detach is a subclass dispatch)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def state_dict(self):
        return self.module.state_dict(keep_vars=True)


__all__ = ["make_fp8_ops", "move_quantized", "release_workspace_on_unload", "count_widened_size"]
