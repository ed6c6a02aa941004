"""``y = x @ W.T + b`` for a QuantizedTensor W: the registered paths that take W, the book's pick, the run.

Per call, in steady state: the route cached on the weight for this token class, device, dtypes and config
(the paths that take it and the verdict's pick), a look that the call's shape was proven, then the run.
The first call of a kind of product builds that route: the paths of ``paths.PATHS`` that take the weight
(``Path.operand``), the book's verdict for them (``book.py``), proven and timed now if there is none
(``prove.decide``), or the plain path by rule for a product too small to be worth it. The first call at
each new shape is checked by value (``prove.check_call``). One fallback rule: a fast path that raises is
remembered as failed for its kind of product (out of memory: for that call only), and the call runs the
plain path, as does every call of a path refused on record.
A weight whose call runs int8 becomes its int8 form in place where ``ComputeConfig.fp8_form`` says so (by default:
no call has run weight-only on its FP8 form yet; ``paths.int8.drop_fp8_form``); on the CPU, once its kind of call is
proven, it is converted in its own storage (``paths.int8.convert_in_place``). Its int8 kinds of call take the
verdicts and proven shapes of the FP8 kinds that ran int8 (the same int8 operand and kernel were proven there).

Autograd: only paths that declare a backward (fp8; the plain path) take calls that record, under the same
verdicts. torch.compile: while tracing nothing is proven or timed; a fast path is traced (through its custom
ops, the callables its proof ran) only where a verdict chose it and the traced shape was proven, else the
plain path is. Where the config trusts fast paths, the first path that takes the weight and trusts itself
at that token count runs, unproven. Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ..config import DEFAULT_CONFIG, ComputeConfig
from ..errors import QuantizationError
from ..runtime import first_line, is_oom, log_once, tracing
from ..tensor import QuantizedTensor
from . import prove
from .book import M_CLASSES, Key, Verdict, default_book, shape_class
from .paths import PATHS, REGISTRY, WEIGHT_ONLY
from .paths.int8 import INT8, convert_in_place, drop_fp8_form, drops_fp8_form, has_conversion, served_plain
from .paths.plain import rotation_macs
from .int8 import is_int8
from .scaled_mm import fp8_supported

logger = logging.getLogger(__name__)
_CPU = torch.device("cpu")

__all__ = ["linear", "fp8_supported", "route_of"]


def _compute_dtype(x: torch.Tensor, cfg: ComputeConfig) -> torch.dtype:
    if cfg.compute_dtype is not None:
        return cfg.compute_dtype
    if x.dtype.is_floating_point and x.dtype.itemsize >= 2:
        return x.dtype
    raise QuantizationError(f"linear: the input must be a float tensor, got {x.dtype}")


class _Route:
    """What a kind of call runs: ``path`` (registered), the verdict's ``key`` (None where no proof applies:
    only the plain path takes the weight, or fast paths are trusted), and the shapes proven for it."""

    __slots__ = ("cfg", "generation", "path", "key", "covered")

    def __init__(self, cfg, generation, path, key=None, covered=None):
        self.cfg, self.generation, self.path, self.key, self.covered = cfg, generation, path, key, covered


_M_BOUNDS = tuple(bound for bound, _ in M_CLASSES)


def _m_class(m: int) -> int:
    """The token class of ``m`` (``book.M_CLASSES``), per call: a few comparisons."""
    for i, bound in enumerate(_M_BOUNDS):
        if m <= bound:
            return i
    return len(_M_BOUNDS) - 1


def _key(w, cfg, names: tuple, forced: str, m: int, n: int, k: int, x_dtype, cdt, has_bias: bool, device) -> Key:
    lead = REGISTRY[next(p for p in names if not REGISTRY[p].plain)]
    _, _, nc, kc = shape_class(m, n, k)  # (its token class is _m_class's: the same bounds)
    name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
    mode = lead.mode(w, cfg) + ("" if cfg.int8_rotation or lead.name != "int8" else "/unrotated")
    return Key(kind=lead.kind(w, cfg), paths=names, forced=forced, mode=mode, layout=repr(w.layout),
               m_class=_m_class(m), n_class=nc, k_class=kc, x_dtype=name(x_dtype), w_dtype=name(w.qdata.dtype),
               out_dtype=name(cdt), bias=has_bias)


def _names(w, cfg, device, cdt, grad: bool) -> tuple:
    """The registered paths that take ``w`` for a call on ``device`` (those that record autograd under ``grad``)."""
    return tuple(p.name for p in PATHS if (not grad or p.grad_ok) and p.takes(w, cfg, device, cdt))


def _build(x2d, w, bias, cfg: ComputeConfig, cdt, grad: bool, book):
    """The route of this call's kind (see the module docstring), or None while tracing without a verdict."""
    device = x2d.device
    generation = book.generation
    m, k = x2d.shape
    n = w.matrix_shape[0]
    names = _names(w, cfg, device, cdt, grad)
    fast = [p for p in names if not REGISTRY[p].plain]
    if not fast or m == 0:
        return _Route(cfg, generation, WEIGHT_ONLY)
    if cfg.trust_fast_paths:
        for name in fast:
            path = REGISTRY[name]
            # while tracing, past a path that takes the weight but cannot be traced (its operand: None there)
            if path.trusted(m, device) and not (tracing() and path.operand(w, cfg, device, cdt) is None):
                return _Route(cfg, generation, path)
        return _Route(cfg, generation, WEIGHT_ONLY)
    forced = fast[0] if cfg.path in ("fp8", "int8") else ""
    if forced:
        names = (forced, WEIGHT_ONLY.name)
    key = _key(w, cfg, names, forced, m, n, k, x2d.dtype, cdt, bias is not None, device)
    v = book.verdict(device, key)
    if v is None:
        if tracing():
            return None  # nothing is proven while tracing: this trace takes the plain path
        if not forced and prove.too_small(book, m, n, k, rotation_macs(w, m)):
            v = prove.settle(book, device, key, WEIGHT_ONLY.name, f"too small to prove ({prove.SMALL_MACS >> 20} M "
                             "multiply-adds a call at most): the plain path")
        else:
            operands, first_rows = {}, set()
            on_rows = not forced and prove.timed_on_rows(device, w)
            for name in names:
                # a path may prove itself on an operand of the weight's first rows, those the proof times
                part = REGISTRY[name].rows_operand(w, cfg, device, cdt, prove.TIME_ROWS) if on_rows else None
                if part is not None:
                    first_rows.add(name)
                operands[name] = part if part is not None else REGISTRY[name].operand(w, cfg, device, cdt)
            b = None if bias is None else bias.detach().to(cdt)
            try:
                v = prove.decide(book, device, key, operands, b, cdt, cfg, x2d.dtype, n, k, frozenset(first_rows))
            except Exception as exc:  # out of memory while proving (all else is a verdict): this call plain
                if not is_oom(exc):
                    raise
                log_once(logger, ("proof_oom", key), logging.WARNING, "proving %s ran out of memory on %s; this call "
                         "runs weight-only, the next proves again (logged once)", key.text(), device)
                return None
            generation = book.generation
    path = REGISTRY.get(v.chosen, WEIGHT_ONLY)
    if path.name not in names:
        path = WEIGHT_ONLY
    return _Route(cfg, generation, path, key, None if path.plain else book.shapes(device, key, path.name))


def _route(x2d, w, bias, cfg, cdt, grad: bool, book) -> _Route | None:
    cache = w.__dict__.get("_routes")
    if cache is None:
        cache = w.__dict__["_routes"] = {}
    # is_cpu first: reading x2d.device builds a torch.device object (~0.5 us a call)
    rk = (_CPU if x2d.is_cpu else x2d.device, x2d.dtype, cdt, bias is not None, id(cfg), grad, _m_class(x2d.shape[0]))
    hit = cache.get(rk)
    if hit is not None and hit.cfg is cfg and hit.generation == book.generation:
        return hit
    route = _build(x2d, w, bias, cfg, cdt, grad, book)
    if route is not None and not tracing():
        cache[rk] = route
    return route


def _file_int8_kinds(w, routes, cfg, book) -> None:
    """``w`` has just become its int8 form (``drop_fp8_form``): for each kind of call its FP8 form was routed int8
    on (``routes``: the weight's route cache before the drop), file the same verdict under the int8 form's key,
    with the shapes it was checked at, so those calls are not proven again. The proofs behind them multiplied
    this int8 operand with this kernel, checked against its twin and against the FP8 weight; the verdict is
    filed for this process only (``source="derived"``), where the next load derives it again."""
    n, k = w.matrix_shape
    for (device, x_dtype, cdt, has_bias, _, grad, mc), route in list((routes or {}).items()):
        if route.path is not INT8 or route.key is None or route.cfg is not cfg:
            continue
        v = book.verdict(device, route.key)
        proof = None if v is None else v.proofs.get(INT8.name)
        if v is None or v.chosen != INT8.name or not (proof or {}).get("ok"):
            continue
        names = _names(w, cfg, device, cdt, grad)
        if INT8.name not in names:
            continue
        key = _key(w, cfg, names, route.key.forced, M_CLASSES[mc][1], n, k, x_dtype, cdt, has_bias, device)
        if book.verdict(device, key) is None:
            book.file(device, Verdict(key=key, chosen=INT8.name, why=f"as its FP8 form's: {v.why}",
                                      proofs={INT8.name: proof},
                                      seconds={p: t for p, t in v.seconds.items() if p == INT8.name},
                                      source="derived"), persist=False)
        for shape in list(book.shapes(device, route.key, INT8.name)):
            book.cover(device, key, INT8.name, shape)


def _dropped(w, w8, routes, cfg, book) -> None:
    """Book-keeping of a weight that became its int8 form ``w8``: the memory freed, its int8 kinds' verdicts."""
    book.dropped_fp8(w8.qdata.device, w8.qdata.numel())
    _file_int8_kinds(w, routes, cfg, book)


def route_of(x: torch.Tensor, w: QuantizedTensor, bias=None, config: ComputeConfig | None = None) -> str:
    """The registered name of the path ``linear(x, w, bias, config)`` takes now (proving first if needed)."""
    cfg = config or w.config or DEFAULT_CONFIG
    x2d = x.reshape(-1, x.shape[-1])
    grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    route = _route(x2d, w, bias, cfg, _compute_dtype(x, cfg), grad, cfg.book or default_book())
    return WEIGHT_ONLY.name if route is None else route.path.name


def _plain(x2d, w, bias, cdt, cfg=None):
    return WEIGHT_ONLY.run(x2d, w, bias, cdt, cfg)


def _call_shape(x2d, w) -> tuple:
    """What a route's covered shapes hold for a call: (tokens, out, in, activation contiguous)."""
    return x2d.shape[0], w.matrix_shape[0], x2d.shape[1], x2d.is_contiguous()


def _fast(route: _Route, x2d, w, bias, cfg, cdt, book):
    """The route's fast path on this call, or None where the call takes the plain path (see the docstring)."""
    if route.path is INT8 and not is_int8(w) and drops_fp8_form(w, cfg) and not has_conversion(w, cfg):
        # its kind of call runs int8: on the CPU converted in its own storage, no second copy. A new shape is
        # checked first (``_fast_call``; where the check fails, the weight runs its int8 form weight-only); the
        # int8 form's kinds then take the verdicts and the shapes checked, this call's included
        routes = w.__dict__.get("_routes")
        if convert_in_place(w, cfg, x2d.device):
            try:
                return _fast_call(route, x2d, w, bias, cfg, cdt, book)
            finally:
                _dropped(w, w, routes, cfg, book)
    return _fast_call(route, x2d, w, bias, cfg, cdt, book)


def _fast_call(route: _Route, x2d, w, bias, cfg, cdt, book):
    path, device = route.path, x2d.device
    wop = path.operand(w, cfg, device, cdt)
    if wop is None or not path.accepts(x2d, wop):
        return None
    fkey = path.failure_key(wop, cfg, x2d.dtype, cdt)
    if book.failed(device, path.name, fkey):
        return None
    if route.key is None:  # trusted: no proof, no check
        return _guarded(path, x2d, wop, bias, cdt, cfg, book, fkey, op=tracing())
    if _call_shape(x2d, w) in route.covered:
        return _guarded(path, x2d, wop, bias, cdt, cfg, book, fkey, op=tracing())
    if tracing():
        return None  # a shape never checked is not compiled in: the plain path is
    out = _guarded(path, x2d, wop, bias, cdt, cfg, book, fkey, op=True)
    if out is None or not prove.check_call(book, device, route.key, path, x2d, wop, bias, cdt, cfg, out):
        return None
    return out


def _guarded(path, x2d, wop, bias, cdt, cfg, book, fkey, op: bool):
    try:
        return path.run(x2d, wop, bias, cdt, cfg, op=op)
    except Exception as exc:  # a kernel that cannot run here must not break the model
        if tracing():
            raise
        if is_oom(exc):
            log_once(logger, (path.name, "oom", fkey), logging.WARNING, "%s ran out of memory on %s; this call runs "
                     "weight-only (later calls try it again; logged once)", path.name, x2d.device)
            return None
        book.fail(x2d.device, path.name, fkey)
        log_once(logger, (path.name, "failed", fkey), logging.WARNING, "%s failed on %s for %s (%s: %s); these run "
                 "weight-only from now on (logged once)", path.name, x2d.device, fkey, type(exc).__name__,
                 first_line(exc))
        return None


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None,
           config: ComputeConfig | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a QuantizedTensor (or plain) weight; x of any rank >= 1.

    ``config`` overrides ``weight.config`` for this call. The output has the compute dtype
    (``config.compute_dtype``, else x's dtype).
    """
    if torch.compiler.is_dynamo_compiling():
        # Dynamo cannot follow this Python (a layout is an object it does not model). It gets the
        # whole op instead, which comes back here through QuantizedTensor's F.linear handler while
        # the compiler traces it with fake tensors, so the compiled graph holds the same math.
        if config is not None and isinstance(weight, QuantizedTensor):
            weight = weight.with_config(config)
        return F.linear(x, weight, bias)
    if isinstance(bias, QuantizedTensor):
        bias = bias.dequantize()
    if isinstance(x, QuantizedTensor):
        x = x.dequantize()
    if not isinstance(weight, QuantizedTensor):
        return F.linear(x, weight, bias)
    cfg = config or weight.config or DEFAULT_CONFIG
    cdt = _compute_dtype(x, cfg)
    shape = weight.matrix_shape
    if weight.transposed or len(shape) != 2:
        # not an [out, in] weight: plain math on the dequantized tensor
        return F.linear(x.to(cdt), weight.dequantize(cdt), None if bias is None else bias.to(cdt))
    out_f, in_f = shape
    if x.dim() == 0 or x.shape[-1] != in_f:
        raise QuantizationError(
            f"linear: input of shape {list(x.shape)} does not fit a weight of shape "
            f"[{out_f}, {in_f}] (last input dim must be {in_f})"
        )
    x2d = x if x.dim() == 2 else x.reshape(-1, in_f)
    grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    book = cfg.book or default_book()
    route = _route(x2d, weight, bias, cfg, cdt, grad, book)
    out = None
    if route is not None and not route.path.plain:
        out = _fast(route, x2d, weight, bias, cfg, cdt, book)
        if out is not None and route.path is INT8 and not tracing() and not is_int8(weight) \
                and drops_fp8_form(weight, cfg):
            routes = weight.__dict__.get("_routes")
            w8 = route.path.operand(weight, cfg, x2d.device, cdt)
            if drop_fp8_form(weight, w8):  # its FP8 form serves no call: the int8 form only
                _dropped(weight, w8, routes, cfg, book)
    traced = route.path if out is not None else WEIGHT_ONLY
    if out is None:
        out = _plain(x2d, weight, bias, cdt, cfg)
        if not tracing():
            served_plain(weight)  # its FP8 form (or its int8 one) serves a kind of call now
    if tracing():
        log_once(logger, ("traced", traced.name, x2d.device.type), logging.INFO,
                 "torch.compile is tracing FP8 linears (%s path on %s) into its graph", traced.name, x2d.device.type)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out_f)
