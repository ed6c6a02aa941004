"""Which path a kind of product takes on this device: proven by value, chosen by measurement, remembered.

The first time a kind of product (path kind, layout, shape class, dtypes; ``key_for``) is about to run,
``decide`` runs each candidate path that could take it on a seeded activation of its shape class and
the layer's own weight, proves each against a reference of its math (``proof.py``), times those that
pass against each other and against the plain path (dequantize then matmul: what stock ComfyUI runs),
and keeps the fastest. A fast path wins only when it takes at most ``WIN`` of the fastest slower-or-
plain candidate's time, so noise never makes the pack slower than the plain path. Verdicts are kept
per device stack (``stack``: the device's name and capability, driver, torch, Triton and the pack's
kernel sources) in memory and, once ``configure(cache_path)`` names a file, in that JSON file: a second
process on the same stack proves nothing again, a changed stack proves again.

Cost, by construction: per shape class, one run of each candidate for the proof (the warm-up too),
then up to ``ROUNDS`` timed rounds (fewer once ``BUDGET_S`` of timed calls is spent, or once one
candidate took ``DECISIVE`` times another's time), plus the
reference and the twin on at most ``ROWS`` x ``COLS`` outputs. Shape classes are coarse: tokens in
four classes (timed at ``M_CLASSES``' representative counts), features rounded up to powers of two.
A product too small to pay for that (``too_small``: under ``SMALL_MACS`` multiply-adds at its class's
token count, e.g. every layer of a 128-wide model at 128 tokens) is not proven: under "auto" it takes the
plain path, which any fast path could beat by microseconds a call only (``settle`` files that verdict,
in memory: a rule, not a measurement).
Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..kernels._triton import HAS_TRITON
from ..runtime import log_once
from . import proof
from .failures import device_key, first_line, is_oom

logger = logging.getLogger("fp8_engram.quant.compute.linear")

__all__ = ["Candidate", "Verdict", "WIN", "ROUNDS", "BUDGET_S", "M_CLASSES", "ROWS", "COLS", "configure",
           "cache_path", "forget", "reset", "describe", "key_for", "known", "decide", "stack", "verdicts", "summary_lines",
           "shape_class", "SMALL_MACS", "too_small", "settle", "every_size", "TIME_ROWS", "SMALL_ROWS",
           "extrapolate"]

WIN = 0.97
ROUNDS = 3
BUDGET_S = 0.5
DECISIVE = 2.0  # timing stops after a round in which one candidate took this many times another's time
# On the CPU, a weight of more than twice TIME_ROWS output rows is timed on its first SMALL_ROWS and
# its first TIME_ROWS rows, and each candidate's time for the whole weight is the line through the two
# (a part per call, as int8's activation quantizer, plus a part per row): a 12288-row layer is timed at
# about a tenth of its cost, and a per-call part does not weigh more than it does on the whole layer.
TIME_ROWS = 1024
SMALL_ROWS = 128  # a multiple of every block height the layouts cut at (128 x 128 blocks)
# (tokens up to, tokens timed at): the last class holds everything above 1024 tokens
M_CLASSES = ((16, 16), (128, 128), (1024, 1024), (math.inf, 4096))
ROWS, COLS = 64, 256
SMALL_MACS = 1 << 24  # multiply-adds of a call at its class's token count below which nothing is proven
FORMAT = 1

_lock = threading.RLock()
_verdicts: dict = {}  # (stack id, key) -> Verdict
_stacks: dict = {}  # device key -> (stack id, stack dict)
_settings = {"path": None}


@dataclass
class Candidate:
    """One way to compute a kind of product, ready to prove: ``run()`` gives the full ``[M, N]`` output on
    the proof's activation; ``twin()`` the eager twin's output and ``reference()`` the reference's, both on
    the sampled rows and columns (``None`` for a path that is the reference math itself: the plain path,
    which is judged by its SQNR only and always passes)."""

    run: Callable[[], torch.Tensor]
    twin: Callable[[], torch.Tensor] | None = None
    reference: Callable[[], torch.Tensor] | None = None
    # what the timing calls instead of run, for a large weight of ``rows`` output rows: {row count: the
    # same product on the weight's first that many rows}, at SMALL_ROWS and TIME_ROWS (every candidate
    # of a key on the same slices); the time of the whole is extrapolated from the two (``extrapolate``),
    # and the plain path is then not run for its proof
    timed: dict | None = None
    rows: int = 0
    # a further check of the sampled output once it passed against its twin: the reason it fails, or None
    # (a library's kernel whose twin is the library's own eager code must also compute the pack's product)
    agrees: Callable[[torch.Tensor], str | None] | None = None


@dataclass
class Verdict:
    """What ``decide`` found for one key: the path chosen, why, and each candidate's figures."""

    key: str
    kind: str
    chosen: str
    why: str
    proofs: dict = field(default_factory=dict)  # name -> Proof.as_dict()
    seconds: dict = field(default_factory=dict)  # name -> median seconds per call
    cost_s: float = 0.0  # time the proof and the timing took
    source: str = "measured"  # "measured" in this process, or "cache"

    def as_dict(self) -> dict:
        return {"kind": self.kind, "chosen": self.chosen, "why": self.why, "proofs": self.proofs,
                "seconds": self.seconds, "cost_s": round(self.cost_s, 4)}


# ---------------------------------------------------------------------------------------------
# the device stack
# ---------------------------------------------------------------------------------------------


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sources_digest() -> str:
    """A digest of the compute and kernel sources: a changed kernel is a changed stack."""
    here = Path(__file__).resolve().parent
    h = hashlib.sha1()
    for folder in (here, here.parent / "kernels"):
        for p in sorted(folder.glob("*.py")):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:12]


def _pack_version() -> str:
    try:
        for line in (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text().splitlines():
            if line.startswith("version"):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return "unknown"


def stack(device) -> dict:
    """The facts a verdict holds for: the device, its driver, torch, Triton and the pack."""
    return _stack_entry(device)[1]


def _stack_entry(device):
    dkey = device_key(device)
    hit = _stacks.get(dkey)
    if hit is not None:
        return hit
    d = torch.device(dkey[0], dkey[1]) if dkey[1] is not None else torch.device(dkey[0])
    facts = {"device_type": d.type, "torch": torch.__version__, "pack": _pack_version(),
             "kernels": _sources_digest(), "triton": None}
    if HAS_TRITON:
        import triton

        facts["triton"] = triton.__version__
    if d.type == "cuda":
        props = torch.cuda.get_device_properties(d)
        facts.update(device=props.name, capability=list(torch.cuda.get_device_capability(d)),
                     driver=_cuda_driver(), runtime=torch.version.hip or torch.version.cuda)
    else:
        cpu = getattr(torch, "cpu", None)
        flags = [n for n in ("_is_avx512_supported", "_is_vnni_supported", "_is_amx_tile_supported")
                 if bool(getattr(cpu, n, lambda: False)())]
        facts.update(device=_cpu_name(), capability=flags, threads=torch.get_num_threads(), driver=None)
    sid = hashlib.sha1(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    _stacks[dkey] = (sid, facts)
    return _stacks[dkey]


def _cuda_driver():
    try:
        return int(torch._C._cuda_getDriverVersion())
    except Exception:  # noqa: BLE001 - an older torch without it: the runtime version stands in
        return None


# ---------------------------------------------------------------------------------------------
# keys
# ---------------------------------------------------------------------------------------------


def _pow2(v: int) -> int:
    return 1 << max(0, int(v) - 1).bit_length()


def shape_class(m: int, n: int, k: int) -> tuple:
    """(token class index, tokens timed at, features class, reduction class) of an ``[m, k] x [k, n]`` product."""
    for i, (bound, rep) in enumerate(M_CLASSES):
        if m <= bound:
            return i, rep, _pow2(n), _pow2(k)
    raise AssertionError("unreachable")


def too_small(m: int, n: int, k: int, plain_extra_macs: int = 0) -> bool:
    """Whether an ``[m, k] x [k, n]`` product is too small to be worth proving (see the module docstring):
    its multiply-adds at its class's token count, plus ``plain_extra_macs`` that the plain path spends
    beyond them (rotating an int8 weight back), under SMALL_MACS; never inside ``every_size()``."""
    return not _settings.get("every_size") and shape_class(m, n, k)[1] * n * k + plain_extra_macs < SMALL_MACS


@contextlib.contextmanager
def every_size():
    """Prove products of every size in this block (``selftest``: the table covers every shape asked)."""
    before = _settings.get("every_size", False)
    _settings["every_size"] = True
    try:
        yield
    finally:
        _settings["every_size"] = before


def _m_label(i: int) -> str:
    bound = M_CLASSES[i][0]
    return f"m>{M_CLASSES[i - 1][0]}" if math.isinf(bound) else f"m<={bound}"


def key_for(kind: str, mode: str, layout_key, m: int, n: int, k: int, x_dtype, w_dtype, out_dtype,
            has_bias: bool) -> str:
    """The key one verdict is filed under."""
    i, _, nc, kc = shape_class(m, n, k)
    name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
    return (f"{kind}|{mode}|{layout_key}|{_m_label(i)}|n<={nc}|k<={kc}|{name(x_dtype)}>{name(out_dtype)}|"
            f"{name(w_dtype)}|{'bias' if has_bias else 'nobias'}")


# ---------------------------------------------------------------------------------------------
# the cache file
# ---------------------------------------------------------------------------------------------


def configure(path: str | os.PathLike | None) -> None:
    """Keep verdicts in the JSON file ``path`` (ComfyUI's nodes pass one in ComfyUI's user directory), or
    in memory only (None). Verdicts the file holds for a device stack are read when that stack first asks."""
    with _lock:
        _settings["path"] = None if path is None else Path(path)
        _settings["loaded"] = set()


def cache_path() -> Path | None:
    return _settings["path"]


def _read_file() -> dict:
    path = _settings["path"]
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("stacks"), dict):
            raise ValueError("not a verdict file of this format")
        return data
    except (OSError, ValueError) as exc:
        log_once(logger, ("verdict_file", str(path)), logging.WARNING, "fast-path verdicts in %s could not be "
                 "read (%s); they are proven again and the file rewritten", path, first_line(exc))
        return {}


def _load_stack(sid: str) -> None:
    loaded = _settings.setdefault("loaded", set())
    if _settings["path"] is None or sid in loaded:
        return
    loaded.add(sid)
    entry = _read_file().get("stacks", {}).get(sid)
    if not isinstance(entry, dict):
        return
    for key, v in (entry.get("verdicts") or {}).items():
        try:
            _verdicts.setdefault((sid, key), Verdict(key=key, kind=v["kind"], chosen=v["chosen"], why=v["why"],
                                                     proofs=dict(v.get("proofs", {})),
                                                     seconds=dict(v.get("seconds", {})),
                                                     cost_s=float(v.get("cost_s", 0.0)), source="cache"))
        except (KeyError, TypeError, ValueError):
            continue  # a damaged entry is proven again


def _write_stack(sid: str, facts: dict) -> None:
    path = _settings["path"]
    if path is None:
        return
    data = _read_file() or {"format": FORMAT, "stacks": {}}
    mine = {key: v.as_dict() for (s, key), v in _verdicts.items() if s == sid}
    data["stacks"][sid] = {"stack": facts, "updated": time.time(), "verdicts": mine}
    # a file read by people too: keep the newest few stacks
    newest = sorted(data["stacks"].items(), key=lambda kv: -float(kv[1].get("updated", 0)))[:8]
    data["stacks"] = dict(newest)
    _write_file(data)


def _write_file(data: dict) -> None:
    """Write ``data`` to the cache file through a temporary file renamed into place."""
    path = _settings["path"]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        log_once(logger, ("verdict_write", str(path)), logging.WARNING, "fast-path verdicts could not be written "
                 "to %s (%s); they hold for this process only", path, first_line(exc))


def forget(device=None) -> None:
    """Drop the verdicts of ``device``'s stack (every stack when None), here and in the cache file, so that
    each kind of product is proven again at its next use."""
    with _lock:
        data = _read_file()
        sids = {_stack_entry(device)[0]} if device is not None else (
            {s for s, _ in _verdicts} | set(data.get("stacks", {})))
        for k in [k for k in _verdicts if k[0] in sids]:
            del _verdicts[k]
        _settings.setdefault("loaded", set()).update(sids)  # nothing of the old file is read back
        if data and any(sid in data["stacks"] for sid in sids):
            for sid in sids:
                data["stacks"].pop(sid, None)
            _write_file(data)


def reset() -> None:
    """Forget everything this process knows (verdicts, device stacks) without touching the file; tests
    and benches use it to measure a first use."""
    with _lock:
        _verdicts.clear()
        _stacks.clear()
        _settings["loaded"] = set()


# ---------------------------------------------------------------------------------------------
# deciding
# ---------------------------------------------------------------------------------------------


def known(device, key: str) -> Verdict | None:
    """The verdict already found for ``key`` on ``device``'s stack, or None."""
    sid = _stack_entry(device)[0]
    hit = _verdicts.get((sid, key))
    if hit is None and _settings["path"] is not None and sid not in _settings.get("loaded", ()):
        with _lock:
            _load_stack(sid)
        hit = _verdicts.get((sid, key))
    return hit


def _prove_one(cand: Candidate, sample) -> tuple:
    out = cand.run()
    got = sample(out)
    if cand.twin is None:
        ref = cand.reference() if cand.reference is not None else None
        db = proof.sqnr_db(got, ref) if ref is not None else math.inf
        return proof.Proof(True, db, db, "the plain path"), out
    p = proof.judge(got, cand.twin(), cand.reference())
    if p.ok and cand.agrees is not None:
        why = cand.agrees(got)
        if why is not None:
            p = proof.Proof(False, p.sqnr_db, p.twin_db, why)
    return p, out


def decide(device, key: str, kind: str, candidates: dict, sample: Callable, *, forced: str | None = None,
           fallback: str = "weight-only", setup_s: float = 0.0) -> Verdict:
    """Prove ``candidates`` (name -> Candidate; the plain one, if any, named "plain" or ``fallback``), time
    those that pass, and file the verdict under ``key``. ``sample(out)`` picks the proof's rows and columns
    of a full output. With ``forced``, only that candidate is proven (no timing): it is chosen if it passes,
    else ``fallback``. Raises nothing but out of memory: a candidate that raises fails its proof.
    ``setup_s``: what making the candidates took (counted in the verdict's cost)."""
    sid, facts = _stack_entry(device)
    started = time.perf_counter()
    proofs: dict = {}
    passed: dict = {}
    names = [forced] if forced is not None else list(candidates)
    for name in names:
        cand = candidates[name]
        if cand.twin is None and cand.timed and forced is None:
            # the plain path is the reference math itself and always passes: timed on the slice only
            proofs[name] = proof.Proof(True, math.nan, math.nan, "the plain path")
            passed[name] = cand
            continue
        try:
            with torch.no_grad():
                p, _ = _prove_one(cand, sample)
        except Exception as exc:  # noqa: BLE001 - a path that cannot run here is an answer
            if is_oom(exc):
                raise
            p = proof.Proof(False, -math.inf, math.nan, f"raised {type(exc).__name__}: {first_line(exc)}")
        proofs[name] = p
        if p.ok:
            passed[name] = cand
    seconds: dict = {}
    if forced is not None:
        chosen = forced if proofs[forced].ok else fallback
        why = "forced" if proofs[forced].ok else f"forced, refused: {proofs[forced].why}"
    else:
        if len(passed) > 1:
            fns: dict = {}
            for n, c in passed.items():
                for r, fn in (c.timed or {0: c.run}).items():
                    fns[(n, r)] = fn
            with torch.no_grad():  # no warm-up call of the slices: a slow first call never decides (proof.py)
                combine = lambda raw: _whole_times(passed, raw)  # noqa: E731
                seconds = combine(proof.time_interleaved(fns, device, ROUNDS, BUDGET_S, DECISIVE, combine))
        chosen, why = _fastest(passed, seconds, fallback)
    v = Verdict(key=key, kind=kind, chosen=chosen, why=why, proofs={n: p.as_dict() for n, p in proofs.items()},
                seconds={n: round(s, 7) for n, s in seconds.items()}, cost_s=setup_s + time.perf_counter() - started)
    with _lock:
        _verdicts[(sid, key)] = v
        _write_stack(sid, facts)
    _log(device, v, proofs)
    return v


def extrapolate(t_small: float, t_slice: float, small: int, slice_rows: int, rows: int) -> float:
    """Seconds for ``rows`` rows on the line through (small, t_small) and (slice_rows, t_slice); where noise
    made the small slice the slower, in proportion to the rows from the larger slice."""
    if t_slice <= t_small:
        return t_slice * rows / slice_rows
    return t_small + (t_slice - t_small) * (rows - small) / (slice_rows - small)


def _whole_times(passed: dict, raw: dict) -> dict:
    """Each candidate's seconds for the whole product from ``raw`` ((name, rows) -> seconds; rows 0: the
    whole product itself)."""
    out = {}
    for n, c in passed.items():
        if not c.timed:
            out[n] = raw[(n, 0)]
            continue
        small, big = sorted(c.timed)
        out[n] = extrapolate(raw[(n, small)], raw[(n, big)], small, big, c.rows)
    return out


def settle(device, key: str, kind: str, chosen: str, why: str) -> Verdict:
    """File a verdict found by a rule, not measured (``too_small``): kept in memory, not in the cache file."""
    sid, _ = _stack_entry(device)
    v = Verdict(key=key, kind=kind, chosen=chosen, why=why, source="rule")
    with _lock:
        _verdicts[(sid, key)] = v
    return v


def _fastest(passed: dict, seconds: dict, fallback: str) -> tuple:
    if not passed:
        return fallback, "no candidate passed its proof"
    if len(passed) == 1:
        only = next(iter(passed))
        return only, "the only candidate that passed"
    plain = "plain" if "plain" in seconds else fallback if fallback in seconds else None
    order = sorted(seconds, key=seconds.get)
    best = order[0]
    if plain is not None and best != plain and not seconds[best] <= WIN * seconds[plain]:
        best = plain  # within noise of the plain path: the plain path
    base = plain if plain is not None and plain != best else order[1]
    return best, f"{seconds[base] / seconds[best]:.2f}x {base}"


def _log(device, v: Verdict, proofs: dict) -> None:
    for name, p in proofs.items():
        if not p.ok:
            what = "failed" if p.why.startswith("raised ") else "gives wrong numbers, refused,"
            log_once(logger, ("refused", v.key, name), logging.WARNING,
                     "%s %s on %s for %s (%s); %s runs these from now on (logged once)", name, what,
                     torch.device(device), v.key, p.why, v.chosen)
    log_once(logger, ("chosen", v.key), logging.INFO, "fast path for %s on %s: %s (%s; proving took %.0f ms)",
             v.key, torch.device(device), v.chosen, v.why, v.cost_s * 1e3)


def verdicts(device=None) -> list:
    """The verdicts known for ``device``'s stack (every stack when None), oldest first."""
    if device is None:
        return list(_verdicts.values())
    sid = _stack_entry(device)[0]
    return [v for (s, _), v in _verdicts.items() if s == sid]


def _db(p: dict, name: str) -> str:
    v = p.get(name)
    return f"{v:.0f} dB" if isinstance(v, (int, float)) and math.isfinite(v) else f"{v} dB"


def describe(v: Verdict) -> str:
    """One verdict as a line: what was chosen and why, with the figures of its proof."""
    p = v.proofs.get(v.chosen, {})
    figures = f", {_db(p, 'sqnr_db')}, twin {_db(p, 'twin_db')}" if p and p.get("why") != "the plain path" else ""
    refused = [f"{n}: wrong on this device ({q.get('why')}): off" for n, q in v.proofs.items() if not q.get("ok")]
    return "; ".join([f"{v.chosen}: {v.why}{figures}"] + refused)


def summary_lines(device=None, kinds=None) -> list:
    """Per path kind, what was chosen over how many shape classes, and why (the loaders' summaries)."""
    groups: dict = {}
    for v in verdicts(device):
        if kinds is None or v.kind in kinds:
            groups.setdefault(v.kind, []).append(v)
    lines = []
    for kind, vs in groups.items():
        counts: dict = {}
        for v in vs:
            counts[v.chosen] = counts.get(v.chosen, 0) + 1
        told = ", ".join(f"{name} on {c} of {len(vs)} shape classes" for name, c in counts.items())
        cost = sum(v.cost_s for v in vs if v.source == "measured")
        lines.append(f"{kind}: {told} (e.g. {describe(vs[0])}; proving took {cost * 1e3:.0f} ms)")
    return lines
