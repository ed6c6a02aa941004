"""Quantize a model's linear weights to FP8 (state dict or module), with a per-layer SQNR report.

- `quantize_state_dict(sd, ...)`: every 2-D floating `.weight` not matched by a keep pattern becomes a
  `QuantizedTensor`; everything else passes through unchanged.
- `quantize_module(module, ...)`: the same over `torch.nn.Linear` modules (ComfyUI's op classes are
  subclasses), returning the new weights by parameter name instead of changing the module, so a
  caller can apply them as patches (ComfyUI models are shared between graph nodes).

Keep patterns are shell-style globs (`fnmatch`) matched against the layer name (the key without
`.weight`). `DEFAULT_KEEP` keeps what is usually sensitive: embeddings and input projections (first
layers), final / output layers (last layers), norms and modulation heads of the output.
SQNR per layer: 20*log10(||w|| / ||w - dequant(q(w))||) in float64.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from .layouts import GRANULARITIES as LAYOUT_GRANULARITIES, Int8, layout_for, unfit_reason
from .tensor import QuantizedTensor

logger = logging.getLogger(__name__)

DEFAULT_KEEP: tuple[str, ...] = (
    "*embed*",  # token/position/patch/time embeddings and embedders (first layers)
    "*norm*",
    "*final_layer*",  # last layer of DiTs (SD3, Flux, ...)
    "*proj_out*",
    "*lm_head*",
    "*head",
    "*conv_in*",
    "*conv_out*",
    "*img_in*",
    "*txt_in*",
    "*time_in*",
    "*vector_in*",
    "*guidance_in*",
    "*patch_embedding*",
    "*text_projection*",
)

# mxfp8: 1 x 32 power-of-two scales (ComfyUI 0.29's form); nvfp4: 4-bit e2m1 (ComfyUI's NVFP4 form, 0.29+)
# ComfyUI 0.33's int8_tensorwise form: one scale per tensor, or per channel with its ConvRot rotation
# (regular Hadamard, 256 wide, where in_features allows it); these weights run the int8 path.
# No asym_w4a8_int8 output, 4- or 6-bit ("W6A8", comfy-kitchen 0.2.36+): ComfyUI 0.33.0 with the
# comfy-kitchen 0.2.31 it pins loads 6-bit rows but fails on their first use (kitchen 0.2.31 takes K
# as twice the row width and rejects the group scales), so such a file would not run there.
INT8_GRANULARITIES = ("int8 tensor", "int8 row convrot")
GRANULARITIES = tuple(LAYOUT_GRANULARITIES)  # the registry's names, in its order
FP8_NAMES = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2,
             "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}

ProgressFn = Callable[[int, int], None]


def fp8_dtype_from_name(name) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return FP8_NAMES[str(name)]
    except KeyError:
        raise ValueError(f"unknown fp8 dtype {name!r}; expected one of {sorted(FP8_NAMES)}") from None


def make_layout(granularity: str, block: tuple[int, int] = (128, 128), shape=None):
    """The layout for `granularity`; an NVFP4 layout holds its weight's `shape` (None gives None then: make
    one per weight)."""
    if granularity not in LAYOUT_GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; expected one of {GRANULARITIES}")
    return layout_for(granularity, block, shape)


# Bounds of keep patterns: fnmatch's translation of a glob into a regular expression takes time
# quadratic in its brackets (20,000 '[' took seconds), and layer names are a few dozen characters.
MAX_KEEP_PATTERNS = 256
MAX_KEEP_PATTERN_CHARS = 256


@dataclass(frozen=True)
class KeepPattern:
    """A keep glob and its regular expression, translated once (matching is then one regex match)."""

    glob: str
    regex: re.Pattern

    def matches(self, name: str) -> bool:
        return self.regex.match(name) is not None or self.regex.match(name + ".weight") is not None


def keep_patterns(keep: Iterable[str | KeepPattern], what: str = "keep patterns") -> tuple[KeepPattern, ...]:
    """The keep globs checked and translated once. ValueError naming `what` (the input they came from)
    when there are more than MAX_KEEP_PATTERNS or one is longer than MAX_KEEP_PATTERN_CHARS."""
    out = []
    for i, pat in enumerate(keep):
        if i >= MAX_KEEP_PATTERNS:
            raise ValueError(f"{what}: more than {MAX_KEEP_PATTERNS} patterns; use wildcards (*, ?) to cover many layers")
        if isinstance(pat, KeepPattern):
            out.append(pat)
            continue
        if not isinstance(pat, str):
            raise ValueError(f"{what}: pattern {i + 1} is a {type(pat).__name__}, not text")
        if len(pat) > MAX_KEEP_PATTERN_CHARS:
            raise ValueError(f"{what}: pattern {i + 1} ({pat[:32]!r}...) has {len(pat)} characters; a keep pattern may "
                             f"have at most {MAX_KEEP_PATTERN_CHARS} (layer names are far shorter)")
        out.append(KeepPattern(pat, re.compile(fnmatch.translate(pat))))
    return tuple(out)


def keep_reason(name: str, keep: Iterable[str | KeepPattern]) -> str | None:
    """The first keep pattern matching layer `name` (or `name`.weight); None when none does."""
    for pat in keep_patterns(keep):  # translated once where the caller passes keep_patterns(...)
        if pat.matches(name):
            return pat.glob
    return None


_SQNR_CHUNK = 1 << 20  # elements per float64 slice: the measurement never needs a float64 copy of a layer


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """20*log10(||ref|| / ||ref - approx||), accumulated in float64 over slices of 1M elements."""
    a = ref.detach().reshape(-1)
    b = approx.detach().reshape(-1)
    if a.numel() != b.numel():
        raise ValueError(f"sqnr_db: {a.numel()} reference values but {b.numel()} approximations")
    signal = 0.0
    noise = 0.0
    for start in range(0, a.numel(), _SQNR_CHUNK):
        x = a[start:start + _SQNR_CHUNK].double()
        d = b[start:start + _SQNR_CHUNK].double().sub_(x)
        signal += float(x.dot(x))
        noise += float(d.dot(d))
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise) if signal > 0 else -math.inf


@dataclass
class LayerQuality:
    name: str
    shape: tuple[int, ...]
    quantized: bool
    sqnr_db: float | None = None
    reason: str = ""  # why kept


@dataclass
class QuantizeReport:
    granularity: str
    fp8_dtype: str
    layers: list[LayerQuality] = field(default_factory=list)

    @property
    def quantized(self) -> list[LayerQuality]:
        return [l for l in self.layers if l.quantized]

    def summary(self) -> dict:
        q = [l.sqnr_db for l in self.quantized if l.sqnr_db is not None and math.isfinite(l.sqnr_db)]
        return {
            "granularity": self.granularity,
            "fp8_dtype": self.fp8_dtype,
            "layers_quantized": len(self.quantized),
            "layers_kept": len(self.layers) - len(self.quantized),
            "sqnr_db_min": round(min(q), 2) if q else None,
            "sqnr_db_mean": round(sum(q) / len(q), 2) if q else None,
        }

    def text(self) -> str:
        s = self.summary()
        lines = [
            f"FP8 {s['fp8_dtype']}, granularity {s['granularity']}: {s['layers_quantized']} layers quantized, "
            f"{s['layers_kept']} kept; SQNR min {s['sqnr_db_min']} dB, mean {s['sqnr_db_mean']} dB",
            f"{'layer':<60} {'shape':>14} {'SQNR dB':>9}",
        ]
        for l in self.layers:
            shape = "x".join(str(d) for d in l.shape)
            val = f"{l.sqnr_db:9.2f}" if l.quantized and l.sqnr_db is not None else f"kept ({l.reason})"
            lines.append(f"{l.name:<60} {shape:>14} {val:>9}")
        return "\n".join(lines)

    def worst_text(self, count: int = 5) -> str:
        """The `count` quantized layers with the lowest SQNR: what a node shows; the full per-layer
        table is `text()`."""
        lines = []
        ranked = sorted((l for l in self.quantized if l.sqnr_db is not None), key=lambda l: l.sqnr_db)
        if ranked:
            lines.append(f"worst {min(count, len(ranked))} of {len(ranked)}:")
            lines += [f"{l.sqnr_db:6.2f} dB  {l.name}" for l in ranked[:count]]
        if len(ranked) > count:
            lines.append(f"(all {len(self.layers)} layers: the report output)")
        return "\n".join(lines)


def fit_layout(layout, shape, fp8_dtype) -> tuple[object, torch.dtype]:
    """(layout, data dtype) for one weight of `shape`: int8 layouts store int8 and drop a rotation
    whose block does not divide in_features; AWQ stores its 4-bit codes in int8 bytes; FP8 layouts are
    returned as they are."""
    if layout.family == "awq":
        return layout, torch.int8
    if layout.family != "int8":
        return layout, fp8_dtype
    if layout.rotation and (len(shape) != 2 or shape[1] % layout.rotation):
        layout = Int8(layout.per_row)
    return layout, torch.int8


def data_dtype_name(layout, fp8_dtype) -> str:
    return "int8" if layout.family == "int8" else str(fp8_dtype).removeprefix("torch.")


def quantize_weight(w: torch.Tensor, layout, fp8_dtype, *, orig_dtype=None, stochastic_rounding=None, config=None):
    """One weight -> (QuantizedTensor, SQNR dB against the float64 original)."""
    layout, fp8_dtype = fit_layout(layout, tuple(w.shape), fp8_dtype)
    qt = QuantizedTensor.from_float(w, layout, fp8_dtype=fp8_dtype, stochastic_rounding=stochastic_rounding)
    if orig_dtype is not None and qt.orig_dtype != orig_dtype:
        qt = QuantizedTensor.from_parts(qt.qdata, qt.scale, qt.layout, orig_dtype=orig_dtype)
    if config is not None:
        qt = qt.with_config(config)
    return qt, sqnr_db(w, qt.dequantize(torch.float32))


def is_linear_weight(key: str, t) -> bool:
    return (key.endswith(".weight") and isinstance(t, torch.Tensor) and t.dim() == 2 and t.is_floating_point()
            and not isinstance(getattr(t, "qdata", None), torch.Tensor) and t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2))


def quantize_state_dict(sd: dict[str, torch.Tensor], *, granularity: str = "tensor", fp8_dtype="e4m3fn",
                        keep: Iterable[str] = DEFAULT_KEEP, block: tuple[int, int] = (128, 128),
                        stochastic_rounding: int | None = None, progress: ProgressFn | None = None,
                        config=None, release_source: bool = False) -> tuple[dict[str, torch.Tensor], QuantizeReport]:
    """Return a new state dict with FP8 QuantizedTensor linear weights, and the per-layer report.

    With `release_source`, every entry is removed from `sd` as soon as it has been handled, so a
    full-precision weight that nothing else holds is freed right after it is quantized (peak memory:
    the model plus one layer's temporaries, instead of the model plus all its FP8 copies).
    """
    fp8 = fp8_dtype_from_name(fp8_dtype)
    layout = make_layout(granularity, block)
    keep = keep_patterns(keep)
    report = QuantizeReport(granularity if granularity != "block" else f"block {block[0]}x{block[1]}",
                            _element_name(granularity, layout, fp8))
    out: dict[str, torch.Tensor] = {}
    keys = list(sd)
    for i, key in enumerate(keys):
        t = sd.pop(key) if release_source else sd[key]
        if is_linear_weight(key, t):
            name = key[: -len(".weight")]
            why = keep_reason(name, keep) or unfit_reason(granularity, t.shape)
            if why is None:
                qt, q = quantize_weight(t, layout or make_layout(granularity, block, t.shape), fp8, orig_dtype=t.dtype,
                                        stochastic_rounding=stochastic_rounding, config=config)
                out[key] = qt
                report.layers.append(LayerQuality(name, tuple(t.shape), True, q))
            else:
                out[key] = t
                report.layers.append(LayerQuality(name, tuple(t.shape), False, None, why))
        else:
            out[key] = t
        del t
        if progress is not None:
            progress(i + 1, len(keys))
    return out, report


def quantize_module(module: torch.nn.Module, *, granularity: str = "tensor", fp8_dtype="e4m3fn",
                    keep: Iterable[str] = DEFAULT_KEEP, block: tuple[int, int] = (128, 128),
                    stochastic_rounding: int | None = None, progress: ProgressFn | None = None,
                    config=None, prefix: str = "",
                    weight_of: Callable[[str, torch.nn.Module], object] | None = None,
                    ) -> tuple[dict[str, torch.Tensor], QuantizeReport]:
    """Quantize the weights of every `torch.nn.Linear` in `module` (the module is not changed).

    Returns ({"<prefix><module path>.weight": QuantizedTensor}, report). Keep patterns match the module
    path without `prefix`. `weight_of(module path, layer)` gives the weight to quantize when the one the
    layer holds right now may not be the model's own (a module shared by several patched copies of a
    model, as in ComfyUI); by default the layer's `weight`.
    """
    fp8 = fp8_dtype_from_name(fp8_dtype)
    layout = make_layout(granularity, block)
    keep = keep_patterns(keep)
    report = QuantizeReport(granularity if granularity != "block" else f"block {block[0]}x{block[1]}",
                            _element_name(granularity, layout, fp8))
    linears = [(n, m) for n, m in module.named_modules() if isinstance(m, torch.nn.Linear) or _looks_linear(m)]
    new: dict[str, torch.Tensor] = {}
    for i, (name, m) in enumerate(linears):
        w = weight_of(name, m) if weight_of is not None else getattr(m, "weight", None)
        if not isinstance(w, torch.Tensor) or not is_linear_weight(name + ".weight", w):
            continue
        why = keep_reason(name, keep) or unfit_reason(granularity, w.shape)
        if why is None:
            with torch.no_grad():
                qt, q = quantize_weight(w.detach(), layout or make_layout(granularity, block, w.shape), fp8,
                                        orig_dtype=w.dtype,
                                        stochastic_rounding=stochastic_rounding, config=config)
            new[prefix + name + ".weight"] = qt
            report.layers.append(LayerQuality(name, tuple(w.shape), True, q))
        else:
            report.layers.append(LayerQuality(name, tuple(w.shape), False, None, why))
        if progress is not None:
            progress(i + 1, len(linears))
    return new, report


def _element_name(granularity: str, layout, fp8: torch.dtype) -> str:
    if granularity == "awq w4a16":
        return "uint4"  # codes 0..15 with a scale and a zero point per 64 inputs
    return "e2m1" if granularity == "nvfp4" else data_dtype_name(layout, fp8)


def _looks_linear(m: torch.nn.Module) -> bool:
    # ComfyUI's mixed-precision Linear derives from Module, not nn.Linear.
    return type(m).__name__ == "Linear" and hasattr(m, "in_features") and hasattr(m, "out_features")


__all__ = ["DEFAULT_KEEP", "GRANULARITIES", "INT8_GRANULARITIES", "fit_layout", "LayerQuality", "QuantizeReport", "quantize_state_dict", "quantize_module",
           "quantize_weight", "sqnr_db", "keep_reason", "keep_patterns", "KeepPattern", "make_layout", "fp8_dtype_from_name", "is_linear_weight"]
