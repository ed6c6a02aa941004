"""The book of fast-path verdicts: what each kind of product runs on a device, why, and what it was proven on.

A ``Book`` is an object, made by whoever loads models (ComfyUI's nodes make one for the verdict file in
ComfyUI's user folder) and handed down on the weights' ``ComputeConfig``; tests make their own. It holds:

- verdicts, per device stack and ``Key`` (the candidate paths, the layout, the shape class, the dtypes):
  which registered path runs that kind of product, with each candidate's proof and timing;
- the shapes each chosen fast path was proven on (``covered``): a verdict serves a call only at a shape its
  path was checked on, by value, on that device (``prove.check_call`` adds the call's own shape);
- failures: kernels that raised on a device, per path and kind of product, so they are not retried.

The verdict file is read once per stack, validated entry by entry (types, ``chosen`` among the key's
registered paths, its proof passed), and bounded: a file that is not a regular file, or is larger than
``MAX_FILE_BYTES``, is not read. Writes take a lock beside the file, read what another process wrote
since, merge, prune (``MAX_STACKS`` stacks, ``MAX_VERDICTS`` verdicts a stack, newest kept) and rename
a temporary file into place; they happen only when a verdict was added or changed.

A stack is the device (name, capability, driver), torch, Triton, comfy-kitchen where it imports, the
pack's version and a digest of every source file of quant/ (a changed kernel, layout or rule is a
changed stack). Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import platform
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from ..kernels._triton import HAS_TRITON
from ..runtime import device_key, first_line, log_once
from .verdict_file import FORMAT, MAX_FILE_BYTES, locked as _locked, parse as _parse, read_bounded as _read_bounded
from .verdict_file import write_atomic as _write_atomic

logger = logging.getLogger("fp8_engram.quant.compute.linear")

__all__ = ["Key", "Verdict", "Book", "default_book", "book_for_file", "describe", "stack_facts", "M_CLASSES", "shape_class", "FORMAT",
           "MAX_FILE_BYTES", "MAX_STACKS", "MAX_VERDICTS", "MAX_SHAPES"]

MAX_STACKS = 8  # stacks kept in the file, the most recently updated first
MAX_VERDICTS = 1024  # verdicts kept per stack, the most recently updated first
MAX_SHAPES = 256  # exact shapes remembered as proven per verdict and path (more are checked each time)
# (tokens up to, tokens a class is timed at): the last class holds everything above 1024 tokens
M_CLASSES = ((16, 16), (128, 128), (1024, 1024), (math.inf, 4096))


def _pow2(v: int) -> int:
    return 1 << max(0, int(v) - 1).bit_length()


def shape_class(m: int, n: int, k: int) -> tuple:
    """(token class index, tokens it is timed at, features class, reduction class) of an ``[m, k] x [k, n]``
    product: tokens in the four ``M_CLASSES``, features rounded up to powers of two."""
    for i, (bound, rep) in enumerate(M_CLASSES):
        if m <= bound:
            return i, rep, _pow2(n), _pow2(k)
    raise AssertionError("unreachable")


def _m_label(i: int) -> str:
    bound = M_CLASSES[i][0]
    return f"m>{M_CLASSES[i - 1][0]}" if math.isinf(bound) else f"m<={bound}"


@dataclass(frozen=True)
class Key:
    """The kind of product one verdict is filed under. ``paths``: the registered paths that were
    candidates, in registry order; ``kind``: its label in summaries; ``forced``: the one path the config
    forces, or ""."""

    kind: str
    paths: tuple
    forced: str
    mode: str
    layout: str
    m_class: int
    n_class: int
    k_class: int
    x_dtype: str
    w_dtype: str
    out_dtype: str
    bias: bool

    @property
    def rep_m(self) -> int:
        return M_CLASSES[self.m_class][1]

    def text(self) -> str:
        """One line for logs and reports (never parsed back: the file keeps the fields)."""
        return (f"{self.kind}|{self.mode}|{self.layout}|{_m_label(self.m_class)}|n<={self.n_class}|k<={self.k_class}|"
                f"{self.x_dtype}>{self.out_dtype}|{self.w_dtype}|{'bias' if self.bias else 'nobias'}")

    def as_json(self) -> dict:
        d = asdict(self)
        d["paths"] = list(self.paths)
        return d

    @classmethod
    def from_json(cls, d) -> "Key":
        """The key of a file entry; ValueError for anything that is not one."""
        if not isinstance(d, dict) or set(d) != {f.name for f in fields(cls)}:
            raise ValueError("not a key")
        types = {"m_class": int, "n_class": int, "k_class": int, "bias": bool}
        for name, value in d.items():
            want = types.get(name, list if name == "paths" else str)
            if type(value) is not want:  # noqa: E721 - bool is not an int here, nor an int a bool
                raise ValueError(f"key field {name} is {type(value).__name__}")
        if not all(isinstance(p, str) for p in d["paths"]) or not 0 <= d["m_class"] < len(M_CLASSES):
            raise ValueError("key paths or class out of range")
        return cls(**{**d, "paths": tuple(d["paths"])})


@dataclass
class Verdict:
    """What the proof found for one key: the path chosen, why, and each candidate's figures."""

    key: Key
    chosen: str
    why: str
    proofs: dict = field(default_factory=dict)  # name -> {"ok", "sqnr_db", "twin_db", "why"}
    seconds: dict = field(default_factory=dict)  # name -> seconds per call
    cost_s: float = 0.0  # time the proof and the timing took
    source: str = "measured"  # "measured" in this process, "cache" (the file), "rule" (too small to prove)
    updated: float = 0.0

    @property
    def kind(self) -> str:
        return self.key.kind

    def as_dict(self) -> dict:
        return {"kind": self.kind, "chosen": self.chosen, "why": self.why, "proofs": self.proofs,
                "seconds": self.seconds, "cost_s": round(self.cost_s, 4)}

    def as_json(self) -> dict:
        return {"key": self.key.as_json(), "chosen": self.chosen, "why": self.why, "proofs": self.proofs,
                "seconds": self.seconds, "cost_s": round(self.cost_s, 4), "updated": self.updated}


def _number_or_text(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) or v in ("inf", "-inf", "not measured")


def verdict_from_json(entry, registered) -> Verdict:
    """A verdict of the file; ValueError for an entry that is damaged, names a path that is not registered
    (or not one of its key's candidates), or chose a path whose proof did not pass."""
    if not isinstance(entry, dict):
        raise ValueError("not an object")
    key = Key.from_json(entry.get("key"))
    chosen, why, proofs, seconds = entry.get("chosen"), entry.get("why"), entry.get("proofs"), entry.get("seconds", {})
    if not isinstance(chosen, str) or not isinstance(why, str) or not isinstance(proofs, dict) \
            or not isinstance(seconds, dict):
        raise ValueError("chosen, why, proofs or seconds of the wrong type")
    if any(p not in registered for p in key.paths) or chosen not in key.paths:
        raise ValueError(f"names a path that is not registered here ({chosen!r} among {list(key.paths)})")
    for name, p in proofs.items():
        if name not in key.paths or not isinstance(p, dict) or type(p.get("ok")) is not bool \
                or not isinstance(p.get("why", ""), str) or not all(_number_or_text(p.get(f)) for f in ("sqnr_db", "twin_db")):
            raise ValueError(f"a damaged proof of {name!r}")
    if not registered[chosen].plain and not (chosen in proofs and proofs[chosen]["ok"] is True):
        raise ValueError(f"chose {chosen!r} without a passed proof")
    if not all(n in key.paths and _number_or_text(s) and not isinstance(s, str) for n, s in seconds.items()):
        raise ValueError("damaged timings")
    cost, updated = entry.get("cost_s", 0.0), entry.get("updated", 0.0)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (cost, updated)):
        raise ValueError("damaged cost or time")
    return Verdict(key=key, chosen=chosen, why=why, proofs=proofs, seconds=seconds, cost_s=float(cost),
                   source="cache", updated=float(updated))


# ---------------------------------------------------------------------------------------------
# the device stack
# ---------------------------------------------------------------------------------------------


def _cpu_name() -> str:
    from ...common.proc import cpu_model

    return cpu_model() or platform.processor() or platform.machine()


_QUANT = Path(__file__).resolve().parents[1]
_digest: dict = {}


def _sources_digest() -> str:
    """A digest of every source file of quant/ (layouts, kernels, compute, the rules below them)."""
    if "quant" not in _digest:
        from ...common.fingerprint import source_digest

        _digest["quant"] = source_digest(_QUANT, "sha1", 12)
    return _digest["quant"]


def _pack_version() -> str:
    try:
        for line in (_QUANT.parent / "pyproject.toml").read_text().splitlines():
            if line.startswith("version"):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return "unknown"


def _kitchen_version() -> str | None:
    if importlib.util.find_spec("comfy_kitchen") is None:
        return None
    try:
        return importlib.metadata.version("comfy-kitchen")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _cuda_driver():
    try:
        return int(torch._C._cuda_getDriverVersion())
    except Exception:  # noqa: BLE001 - an older torch without it: the runtime version stands in
        return None


_stacks: dict = {}  # device key -> (stack id, facts); facts of one process do not change


def stack_facts(device) -> tuple:
    """(stack id, facts) of ``device``: the facts a verdict holds for."""
    dkey = device_key(device)
    hit = _stacks.get(dkey)
    if hit is not None:
        return hit
    d = torch.device(dkey[0], dkey[1]) if dkey[1] is not None else torch.device(dkey[0])
    facts = {"device_type": d.type, "torch": torch.__version__, "pack": _pack_version(), "sources": _sources_digest(),
             "triton": None, "comfy_kitchen": _kitchen_version()}
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


# ---------------------------------------------------------------------------------------------
# the book
# ---------------------------------------------------------------------------------------------


class Book:
    """Verdicts, proven shapes and failures of fast paths, in memory and (with ``path``) in a JSON file.

    Thread-safe. ``generation`` grows whenever a verdict is dropped or changed, so that routes cached on
    weights know to look again."""

    def __init__(self, path: str | os.PathLike | None = None, *, every_size: bool = False):
        self.path = None if path is None else Path(path)
        self.every_size = every_size  # prove products of every size (the selftest), none "too small"
        self._lock = threading.RLock()
        self._verdicts: dict = {}  # (stack id, Key) -> Verdict
        self._covered: dict = {}  # (stack id, Key, path name) -> set of shapes
        self._failed: set = set()  # (device key, path name, failure key)
        self._loaded: set = set()  # stack ids read from the file
        self._dirty: set = set()  # (stack id, Key) written in this process since the last write
        self._forgotten: set = set()  # stack ids to drop from the file at the next write
        # stack id -> [layers, parameters, seconds, [sampled SQNR dB], layers and parameters whose FP8 form went]
        self._conversions: dict = {}
        self.checks = [0, 0.0]  # calls checked at a new shape (prove.check_call) in this process, and their seconds
        self.generation = 0

    def __repr__(self) -> str:
        return f"Book({str(self.path) if self.path else 'in memory'!r})"

    # a config carrying a book may be pickled or copied with its model: a copy shares the book; a pickle comes
    # back with the unpickling process's in-memory book (a file must never name where a book would write)
    def __reduce__(self):
        return (default_book, ())

    def __deepcopy__(self, memo):
        return self

    # -- reading -------------------------------------------------------------------------------

    def _registered(self) -> dict:
        return REGISTERED  # the paths registry fills it when it is imported (it imports this module)

    def _read_file(self) -> dict:
        """The file's document, validated at the top level; {} when there is none or it cannot be read."""
        if self.path is None:
            return {}
        try:
            data = _read_bounded(self.path)
            return {} if data is None else _parse(data)
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            log_once(logger, ("verdict_file", str(self.path)), logging.WARNING,
                     "fast-path verdicts in %s are not read (%s); they are proven again and the file rewritten",
                     self.path, first_line(exc))
            return {}

    def _valid_entries(self, doc: dict, sid: str) -> dict:
        """{Key: Verdict} of the file's entries for stack ``sid`` that pass validation (one warning for the rest)."""
        entry = doc.get("stacks", {}).get(sid)
        if not isinstance(entry, dict):
            return {}
        found, dropped, reasons = {}, 0, []
        items = entry.get("verdicts")
        registered = self._registered()
        for item in items if isinstance(items, list) else ([] if items is None else [items]):
            try:
                v = verdict_from_json(item, registered)
                found[v.key] = v
            except (ValueError, TypeError, KeyError) as exc:
                dropped += 1
                reasons.append(first_line(exc))
        if dropped or (items is not None and not isinstance(items, list)):
            log_once(logger, ("verdicts_dropped", str(self.path), sid), logging.WARNING,
                     "%d fast-path verdict(s) in %s were damaged or name no registered path, and are dropped "
                     "(proven again when needed): %s", max(dropped, 1), self.path, "; ".join(reasons[:3]) or "not a list")
        return found

    def _load(self, sid: str) -> None:
        if self.path is None or sid in self._loaded:
            return
        self._loaded.add(sid)
        for key, v in self._valid_entries(self._read_file(), sid).items():
            self._verdicts.setdefault((sid, key), v)

    def verdict(self, device, key: Key) -> Verdict | None:
        """The verdict filed for ``key`` on ``device``'s stack, or None."""
        sid = stack_facts(device)[0]
        hit = self._verdicts.get((sid, key))
        if hit is None and self.path is not None and sid not in self._loaded:
            with self._lock:
                self._load(sid)
                hit = self._verdicts.get((sid, key))
        return hit

    def verdicts(self, device=None) -> list:
        """The verdicts known for ``device``'s stack (every stack when None), oldest first."""
        with self._lock:
            if device is None:
                return list(self._verdicts.values())
            sid = stack_facts(device)[0]
            self._load(sid)
            return [v for (s, _), v in self._verdicts.items() if s == sid]

    # -- filing --------------------------------------------------------------------------------

    def file(self, device, v: Verdict, *, persist: bool = True) -> Verdict:
        """File ``v`` for its key on ``device``'s stack (and in the file unless ``persist`` is False)."""
        sid, facts = stack_facts(device)
        v.updated = time.time()
        with self._lock:
            self._load(sid)
            old = self._verdicts.get((sid, v.key))
            self._verdicts[(sid, v.key)] = v
            if old is not None:
                self.generation += 1
                for p in v.key.paths:
                    self._covered.pop((sid, v.key, p), None)
            if persist:
                self._dirty.add((sid, v.key))
                self._write(sid, facts)
        return v

    def shapes(self, device, key: Key, path: str) -> set:
        """The shapes ``path`` was checked right at for ``key`` on ``device`` (a live set: routes cached on
        weights read it; ``cover`` adds to it)."""
        with self._lock:
            return self._covered.setdefault((stack_facts(device)[0], key, path), set())

    def covered(self, device, key: Key, path: str, shape) -> bool:
        return shape in self._covered.get((stack_facts(device)[0], key, path), ())

    def cover(self, device, key: Key, path: str, shape) -> None:
        """Remember that ``path`` was checked right at ``shape`` for ``key`` on ``device``."""
        with self._lock:
            shapes = self._covered.setdefault((stack_facts(device)[0], key, path), set())
            if len(shapes) < MAX_SHAPES:
                shapes.add(shape)

    def failed(self, device, path: str, fkey) -> bool:
        return bool(self._failed) and (device_key(device), path, fkey) in self._failed

    def converted(self, device, seconds: float, sqnr_db: float, params: int) -> None:
        """Count one weight converted at first use (for the int8 path) on ``device``: what it cost and its
        sampled SQNR against the weight it was made from."""
        with self._lock:
            c = self._tally(device)
            c[0] += 1
            c[1] += params
            c[2] += seconds
            c[3].append(sqnr_db)

    def _tally(self, device) -> list:
        """``device``'s conversion counts (``_conversions``), made empty at first (called with the lock held)."""
        return self._conversions.setdefault(stack_facts(device)[0], [0, 0, 0.0, [], 0, 0])

    def dropped_fp8(self, device, params: int) -> None:
        """Count one converted weight on ``device`` that became its int8 form, its FP8 form (``params`` codes of
        one byte) freed (``ComputeConfig.fp8_form``)."""
        with self._lock:
            c = self._tally(device)
            c[4] += 1
            c[5] += params

    def conversions(self, device) -> dict | None:
        """{layers, parameters, seconds, mean_sqnr_db, min_sqnr_db, dropped_layers, dropped_parameters} of the
        conversions on ``device`` so far (dropped: the weights that kept only their int8 form)."""
        c = self._conversions.get(stack_facts(device)[0])
        if not c or not c[0]:
            return None
        finite = [d for d in c[3] if math.isfinite(d)] or [math.inf]
        return {"layers": c[0], "parameters": c[1], "seconds": round(c[2], 3),
                "mean_sqnr_db": round(sum(finite) / len(finite), 2), "min_sqnr_db": round(min(c[3]), 2),
                "dropped_layers": c[4], "dropped_parameters": c[5]}

    def failures(self, device=None) -> list:
        """(path, failure key) of each kind of product whose path raised on ``device`` (every device: None)."""
        dk = None if device is None else device_key(device)
        return [(p, f) for d, p, f in self._failed if dk is None or d == dk]

    def fail(self, device, path: str, fkey) -> None:
        with self._lock:
            self._failed.add((device_key(device), path, fkey))
            self.generation += 1

    def forget(self, device=None) -> None:
        """Drop the verdicts, proven shapes and failures of ``device``'s stack (every stack when None), here
        and in the file, so that each kind of product is proven again at its next use."""
        with self._lock:
            if device is None:
                sids = {s for s, _ in self._verdicts} | set(self._read_file().get("stacks", {}))
                self._failed.clear()
            else:
                sids = {stack_facts(device)[0]}
                dk = device_key(device)
                self._failed = {f for f in self._failed if f[0] != dk}
            self._verdicts = {k: v for k, v in self._verdicts.items() if k[0] not in sids}
            self._covered = {k: v for k, v in self._covered.items() if k[0] not in sids}
            self._dirty = {k for k in self._dirty if k[0] not in sids}
            self._loaded |= sids  # nothing of the old file is read back
            self._forgotten |= sids
            self.generation += 1
            if self.path is not None and self.path.exists():
                self._write(None, None)

    def reset(self) -> None:
        """Forget everything this process knows without touching the file (tests and benches measure a
        first use with it)."""
        with self._lock:
            self._verdicts.clear()
            self._covered.clear()
            self._failed.clear()
            self._loaded.clear()
            self._dirty.clear()
            self._forgotten.clear()
            self._conversions.clear()
            self.checks = [0, 0.0]
            self.generation += 1

    def _write(self, sid, facts) -> None:
        """Merge this process's new verdicts into the file under its lock (called with self._lock held)."""
        if self.path is None or (not self._dirty and not self._forgotten):
            return
        try:
            if self.path.exists() and not self.path.is_file():  # never renamed over a device or a FIFO
                raise OSError(f"{self.path} is not a regular file")
            with _locked(self.path):
                doc = self._read_file() or {"format": FORMAT, "stacks": {}}
                stacks = doc["stacks"]
                for gone in self._forgotten:
                    stacks.pop(gone, None)
                mine: dict = {}
                for s, key in self._dirty:
                    mine.setdefault(s, []).append(self._verdicts[(s, key)])
                for s, new in mine.items():
                    kept = self._valid_entries(doc, s)  # what this and other processes wrote before
                    kept.update({v.key: v for v in new})
                    newest = sorted(kept.values(), key=lambda v: -v.updated)[:MAX_VERDICTS]
                    stacks[s] = {"stack": stack_facts_by_id(s) or (facts if s == sid else {}),
                                 "updated": time.time(), "verdicts": [v.as_json() for v in newest]}
                valid = {s: e for s, e in stacks.items() if isinstance(e, dict)}
                order = sorted(valid, key=lambda s: -_updated(valid[s]))[:MAX_STACKS]
                doc = {"format": FORMAT, "stacks": {s: valid[s] for s in order}}
                _write_atomic(self.path, json.dumps(doc, indent=1, sort_keys=True))
                self._dirty.clear()
                self._forgotten.clear()
        except (OSError, TimeoutError) as exc:
            log_once(logger, ("verdict_write", str(self.path)), logging.WARNING, "fast-path verdicts could not be "
                     "written to %s (%s); they hold for this process (written with the next verdict)", self.path,
                     first_line(exc))

    def fingerprint(self) -> str:
        """A digest of every verdict, proven shape and failure this book holds: what a compiled graph's
        routing depends on (``QuantizedTensor``'s compile-cache key holds it, so a graph traced under other
        verdicts is never reused from torch.compile's caches)."""
        with self._lock:
            parts = sorted((s, k.text(), v.chosen) for (s, k), v in self._verdicts.items())
            parts += sorted((s, k.text(), p, tuple(sorted(shapes))) for (s, k, p), shapes in self._covered.items())
            parts += sorted(map(repr, self._failed))
        return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]

    # -- reports -------------------------------------------------------------------------------

    def summary_lines(self, device=None, kinds=None) -> list:
        """Per kind, what was chosen over how many shape classes, and why (the loaders' summaries)."""
        groups: dict = {}
        for v in self.verdicts(device):
            if v.source != "derived" and (kinds is None or v.kind in kinds):  # (derived: a converted weight's
                # kinds, filed as its FP8 kinds were: not classes of their own)
                groups.setdefault(v.kind, []).append(v)
        lines = []
        for kind, vs in groups.items():
            counts: dict = {}
            for v in vs:
                counts[v.chosen] = counts.get(v.chosen, 0) + 1
            told = ", ".join(f"{name} on {c} of {len(vs)} shape classes" for name, c in counts.items())
            cost = sum(v.cost_s for v in vs if v.source == "measured")
            lines.append(f"{kind}: {told} (e.g. {describe(vs[0])}; proving took {cost * 1e3:.0f} ms)")
        c = self.conversions(device) if device is not None and (kinds is None or "int8" in kinds) else None
        if c:
            kept_layers, kept = c["layers"] - c["dropped_layers"], c["parameters"] - c["dropped_parameters"]
            forms = [f"{c['dropped_layers']} hold only the int8 form ({c['dropped_parameters'] / 2**20:.0f} MiB of "
                     "FP8 codes freed)"] if c["dropped_layers"] else []
            if kept_layers > 0:
                forms.append(f"{kept_layers} keep the file's form beside it (+{max(kept, 0) / 2**20:.0f} MiB)")
            lines.append(f"int8 conversions at first use: {c['layers']} layer(s), {c['parameters'] / 1e6:.1f} M "
                         f"parameters in {c['seconds']:.2f} s ({'; '.join(forms)}), sampled SQNR mean "
                         f"{c['mean_sqnr_db']:.1f} dB, min {c['min_sqnr_db']:.1f} dB")
        return lines


def _updated(entry: dict) -> float:
    u = entry.get("updated", 0.0)
    return float(u) if isinstance(u, (int, float)) and not isinstance(u, bool) and math.isfinite(u) else 0.0


def stack_facts_by_id(sid: str) -> dict | None:
    for s, facts in _stacks.values():
        if s == sid:
            return facts
    return None


def _db(p: dict, name: str) -> str:
    v = p.get(name)
    return f"{v:.0f} dB" if isinstance(v, (int, float)) and math.isfinite(v) else f"{v} dB"


def describe(v: Verdict) -> str:
    """One verdict as a line: what was chosen and why, with the figures of its proof."""
    p = v.proofs.get(v.chosen, {})
    figures = f", {_db(p, 'sqnr_db')}, twin {_db(p, 'twin_db')}" if p and p.get("why") != "the plain path" else ""
    refused = [f"{n}: wrong on this device ({q.get('why')}): off" for n, q in v.proofs.items() if not q.get("ok")]
    return "; ".join([f"{v.chosen}: {v.why}{figures}"] + refused)


# name -> path of the registry (compute/paths/__init__.py fills it at import: the paths module imports this one)
REGISTERED: dict = {}
_books: dict = {}
_books_lock = threading.Lock()


def _book_for(path: str | None) -> Book:
    """The process's one book for ``path`` (None: the in-memory default)."""
    with _books_lock:
        hit = _books.get(path)
        if hit is None:
            hit = _books[path] = Book(path)
        return hit


def default_book() -> Book:
    """The book of weights whose config names none: in memory only, for this process."""
    hit = _books.get(None)  # read without the lock: every linear call of such a weight asks
    return hit if hit is not None else _book_for(None)


def book_for_file(path: str | os.PathLike) -> Book:
    """The process's book for the verdict file ``path`` (one per file, so two loads share their proofs)."""
    return _book_for(str(Path(path)))
