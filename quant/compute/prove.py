"""Proving a product, in one place: the verdict for a kind of product, and the check of each new shape.

``decide``: the first time a kind of product (a ``book.Key``) is about to run, each candidate path runs on
a seeded activation of its shape class's token count (``M_CLASSES``) and the layer's own weight (on the CPU,
a weight of more than twice ``TIME_ROWS`` output rows: its first ``TIME_ROWS`` rows, those it is timed on);
each is proven against its eager twin and the reference of its math (``proof.judge``: every row compared up
to 256 rows), those that pass are timed against each other and the plain path, and the fastest is filed in
the book (a fast path must take at most ``WIN`` of the plain path's time). Forced: only that path is proven,
on the whole weight.

``check_call``: a verdict serves a call only at a shape its path was checked on. The first call at each
new (m, n, k, contiguity) runs the chosen path on the call's own activation and checks its output, every
row up to 256 rows (else the first and last 32 and 64 seeded ones between) and every column up to 512,
against the twin and the reference on those same inputs; passed, the shape is remembered; failed, the
path is refused for the whole kind of product, on record, and the call gets the plain path's output.

Cost, by construction: per kind, one run of each candidate, the twin and the reference on at most
256 x 512 outputs, then up to ``ROUNDS`` timed rounds (fewer once ``BUDGET_S`` of timed calls is spent or
one candidate took ``DECISIVE`` times another's time); per new shape, the twin and the reference on the
same sample. A product under ``SMALL_MACS`` multiply-adds at its class's token count is not proven under
"auto": it takes the plain path, by rule. Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from ..runtime import first_line, is_oom, log_once
from . import proof
from .book import M_CLASSES, Book, Key, Verdict, shape_class
from .paths import REGISTRY
from .paths.base import ref_product, weight_reference

logger = logging.getLogger("fp8_engram.quant.compute.linear")

__all__ = ["decide", "check_call", "too_small", "settle", "extrapolate", "timed_on_rows", "WIN", "ROUNDS", "BUDGET_S",
           "DECISIVE", "TIME_ROWS", "SMALL_ROWS", "SMALL_MACS", "M_CLASSES"]

WIN = 0.97
ROUNDS = 3
BUDGET_S = 0.5
DECISIVE = 2.0  # timing stops after a round in which one candidate took this many times another's time
# On the CPU, a weight of more than twice TIME_ROWS output rows is timed on its first SMALL_ROWS and its
# first TIME_ROWS rows, and each candidate's time for the whole weight is the line through the two (a part
# per call, as int8's activation quantizer, plus a part per row): a 12288-row layer is timed at about a
# tenth of its cost, and a per-call part does not weigh more than it does on the whole layer. (Fewer rows are
# too few where the per-call part is large: at 4096 tokens and an input 15360 wide, slices of 128 and 256 rows
# put int8 at 1.35x weight-only where 128 and 1024 rows measured 4.4x.)
TIME_ROWS = 1024
SMALL_ROWS = 128  # a multiple of every block height the layouts cut at (128 x 128 blocks)
SMALL_MACS = 1 << 24  # multiply-adds of a call at its class's token count below which nothing is proven


def too_small(book: Book, m: int, n: int, k: int, plain_extra_macs: int = 0) -> bool:
    """Whether an ``[m, k] x [k, n]`` product is too small to be worth proving: its multiply-adds at its
    class's token count, plus what the plain path spends beyond them (rotating an int8 weight back), under
    SMALL_MACS; never where the book proves every size (``Book.every_size``, the selftest)."""
    return not book.every_size and shape_class(m, n, k)[1] * n * k + plain_extra_macs < SMALL_MACS


def settle(book: Book, device, key: Key, chosen: str, why: str) -> Verdict:
    """File a verdict found by a rule, not measured (``too_small``): in memory, not in the file."""
    return book.file(device, Verdict(key=key, chosen=chosen, why=why, source="rule"), persist=False)


def _judge(path, run, x, wop, bias, cdt, cfg, sample: proof.Sample, wref) -> tuple:
    """(Proof, output) of ``run()`` against ``path``'s twin and reference on ``sample`` of ``x``'s product."""
    out = run()
    got = sample(out)
    if path.plain:
        rdt = proof.reference_dtype(x.device)
        db = proof.sqnr_db(got, ref_product(x.index_select(0, sample.rows), wref(), bias, sample, rdt))
        return proof.Proof(True, db, db, "the plain path"), out
    twin, reference, agrees = path.check(x, wop, bias, cdt, cfg, sample, wref)
    p = proof.judge(got, twin(), reference())
    if p.ok and agrees is not None:
        why = agrees(got)
        if why is not None:
            p = proof.Proof(False, p.sqnr_db, p.twin_db, why)
    return p, out


def _wref(wop, sample: proof.Sample):
    memo = []

    def get():
        if not memo:
            memo.append(weight_reference(wop, sample.cols))
        return memo[0]
    return get


def timed_on_rows(device, w, n: int | None = None) -> bool:
    """Whether candidates for ``w`` are judged and timed on its first rows (a CPU weight of more than twice
    TIME_ROWS rows; ``n``: the whole weight's, where ``w`` holds only its first rows), so that an operand of its
    first TIME_ROWS rows is all a proof needs."""
    return (torch.device(device).type == "cpu" and not w.transposed and w.qdata.dim() == 2
            and (w.qdata.shape[0] if n is None else n) > 2 * TIME_ROWS)


def _slices(device, w, bias, n: int | None = None) -> dict:
    """{rows: (weight, bias) of ``w``'s first rows} at SMALL_ROWS and TIME_ROWS, where candidates are timed
    on the CPU for a weight of more than twice TIME_ROWS rows (``n``: the whole weight's, where ``w`` holds only its
    first rows); empty to time the whole weight."""
    from ..tensor import QuantizedTensor

    if not timed_on_rows(device, w, n) or w.qdata.shape[0] < TIME_ROWS:
        return {}
    out = {}
    for rows in (SMALL_ROWS, TIME_ROWS):
        parts = w.layout.first_rows(w.qdata, w.scale, rows)
        if parts is None:
            return {}
        ws = QuantizedTensor.from_parts(parts[0], parts[1], w.layout, orig_dtype=w.orig_dtype, config=w.config)
        out[rows] = (ws, None if bias is None else bias[:rows])
    return out


def decide(book: Book, device, key: Key, operands: dict, bias, cdt, cfg, x_dtype, n: int, k: int,
           first_rows: frozenset = frozenset()) -> Verdict:
    """Prove the candidates (``operands``: path name -> the weight that path multiplies), time those that
    pass, and file the verdict under ``key``. ``first_rows``: the names whose operand holds only the weight's
    first TIME_ROWS rows (``Path.rows_operand``; only where ``timed_on_rows``): judged and timed on those as any
    candidate is, its time for the whole weight's ``n`` rows extrapolated as for the others. Raises nothing but
    out of memory: a candidate that raises fails its proof."""
    started = time.perf_counter()
    m = key.rep_m
    xp = proof.seeded_activation(m, k, x_dtype, device)
    sample = proof.Sample(m, n, device)
    forced = key.forced or None
    names = [forced] if forced else list(operands)
    plain = next(name for name in operands if REGISTRY[name].plain)
    proofs, passed, cands = {}, {}, {}
    slices_of: dict = {}
    for name in names:
        path, wop = REGISTRY[name], operands[name]
        if wop is None:  # a path whose operand cannot be made for this weight (an int8 conversion that overflows)
            proofs[name] = proof.Proof(False, -math.inf, math.nan, "its operand cannot be made from this weight")
            continue
        run = (lambda path=path, wop=wop: path.run(xp, wop, bias, cdt, cfg, op=True))
        cand = proof.Candidate(run=run)
        partial = name in first_rows
        if not forced:
            sl = slices_of.setdefault(id(wop), _slices(device, wop, bias, n if partial else None))
            if sl:
                cand.timed = {r: (lambda path=path, ws=ws, bs=bs: path.run(xp, ws, bs, cdt, cfg, op=True))
                              for r, (ws, bs) in sl.items()}
                cand.rows = n if partial else wop.qdata.shape[0]
        if partial and not cand.timed:  # never timed as if it were the whole weight
            proofs[name] = proof.Proof(False, -math.inf, math.nan, "its first rows' operand cannot be timed here")
            continue
        cands[name] = cand
        if path.plain and cand.timed:
            # the plain path is the reference math itself and always passes: timed on the slices only
            proofs[name] = proof.Proof(True, math.nan, math.nan, "the plain path")
            passed[name] = cand
            continue
        try:
            with torch.no_grad():
                if cand.timed:  # judged on the rows it is timed on; each real shape is checked at its first call
                    ws, bs = slices_of[id(wop)][TIME_ROWS]
                    rows = proof.Sample(m, TIME_ROWS, device)
                    p, _ = _judge(path, cand.timed[TIME_ROWS], xp, ws, bs, cdt, cfg, rows, _wref(ws, rows))
                else:
                    p, _ = _judge(path, run, xp, wop, bias, cdt, cfg, sample, _wref(wop, sample))
        except Exception as exc:  # noqa: BLE001 - a path that cannot run here is an answer
            if is_oom(exc):
                raise
            p = proof.Proof(False, -math.inf, math.nan, f"raised {type(exc).__name__}: {first_line(exc)}")
        proofs[name] = p
        if p.ok:
            passed[name] = cand
    seconds: dict = {}
    if forced:
        chosen = forced if proofs[forced].ok else plain
        why = "forced" if proofs[forced].ok else f"forced, refused: {proofs[forced].why}"
    else:
        if len(passed) > 1:
            fns = {(name, r): fn for name, c in passed.items() for r, fn in (c.timed or {0: c.run}).items()}
            with torch.no_grad():  # no warm-up call of the slices: a slow first call never decides (proof.py)
                combine = lambda raw: _whole_times(passed, raw)  # noqa: E731
                seconds = combine(proof.time_interleaved(fns, device, ROUNDS, BUDGET_S, DECISIVE, combine))
        chosen, why = _fastest(passed, seconds, plain)
    v = Verdict(key=key, chosen=chosen, why=why, proofs={n_: p.as_dict() for n_, p in proofs.items()},
                seconds={n_: round(s, 7) for n_, s in seconds.items()}, cost_s=time.perf_counter() - started)
    book.file(device, v)
    if not REGISTRY[chosen].plain:  # the shape its proof ran at (a CPU weight's first rows where timed on them)
        book.cover(device, key, chosen, (m, TIME_ROWS if cands[chosen].timed else n, k, True))
    _log(device, v, proofs)
    return v


def check_call(book: Book, device, key: Key, path, x2d, wop, bias, cdt, cfg, out) -> bool:
    """Check ``out``, ``path``'s output for this call, at the call's own shape (see the module docstring).
    True: right, and the shape is remembered; False: the path is refused for ``key`` on record."""
    started = time.perf_counter()
    try:
        return _check_call(book, device, key, path, x2d, wop, bias, cdt, cfg, out)
    finally:
        book.checks[0] += 1
        book.checks[1] += time.perf_counter() - started


def _check_call(book: Book, device, key: Key, path, x2d, wop, bias, cdt, cfg, out) -> bool:
    m, k = x2d.shape
    n = out.shape[-1]
    sample = proof.Sample(m, n, x2d.device, seed=m)
    with torch.no_grad():
        xd, bd = x2d.detach(), None if bias is None else bias.detach()
        try:
            p, _ = _judge(path, lambda: out.detach(), xd, wop, bd, cdt, cfg, sample, _wref(wop, sample))
        except Exception as exc:  # noqa: BLE001 - a check that cannot run is a failed check
            if is_oom(exc):
                raise
            p = proof.Proof(False, -math.inf, math.nan, f"its check raised {type(exc).__name__}: {first_line(exc)}")
    if p.ok:
        book.cover(device, key, path.name, (m, n, k, x2d.is_contiguous()))
        return True
    refuse(book, device, key, path.name, f"wrong at {m} x {k} -> {n}{'' if x2d.is_contiguous() else ' (strided)'}: {p.why}",
           p)
    return False


def refuse(book: Book, device, key: Key, name: str, why: str, p: proof.Proof | None = None) -> Verdict:
    """File that ``name`` is wrong for ``key`` on this device: the plain path runs those products from now on."""
    old = book.verdict(device, key)
    proofs = dict(old.proofs) if old is not None else {}
    figures = p.as_dict() if p is not None else {"ok": False, "sqnr_db": "not measured", "twin_db": "not measured"}
    proofs[name] = {**figures, "ok": False, "why": why}
    plain = next(n for n in key.paths if REGISTRY[n].plain)
    v = book.file(device, Verdict(key=key, chosen=plain, why=f"{name} refused", proofs=proofs,
                                  seconds=dict(old.seconds) if old is not None else {},
                                  cost_s=old.cost_s if old is not None else 0.0))
    log_once(logger, ("refused", key, name), logging.WARNING, "%s gives wrong numbers on %s for %s (%s); %s runs "
             "these from now on (logged once)", name, torch.device(device), key.text(), why, plain)
    return v


def extrapolate(t_small: float, t_slice: float, small: int, slice_rows: int, rows: int) -> float:
    """Seconds for ``rows`` rows on the line through (small, t_small) and (slice_rows, t_slice); where noise
    made the small slice the slower, in proportion to the rows from the larger slice."""
    if t_slice <= t_small:
        return t_slice * rows / slice_rows
    return t_small + (t_slice - t_small) * (rows - small) / (slice_rows - small)


def _whole_times(passed: dict, raw: dict) -> dict:
    out = {}
    for name, c in passed.items():
        if not c.timed:
            out[name] = raw[(name, 0)]
            continue
        small, big = sorted(c.timed)
        out[name] = extrapolate(raw[(name, small)], raw[(name, big)], small, big, c.rows)
    return out


def _fastest(passed: dict, seconds: dict, plain: str) -> tuple:
    if not passed:
        return plain, "no candidate passed its proof"
    if len(passed) == 1:
        return next(iter(passed)), "the only candidate that passed"
    order = sorted(seconds, key=seconds.get)
    best = order[0]
    base = plain if plain in seconds else None
    if base is not None and best != base and not seconds[best] <= WIN * seconds[base]:
        best = base  # within noise of the plain path: the plain path
    other = base if base is not None and base != best else order[1]
    ratio = seconds[other] / seconds[best] if seconds[best] > 0 else math.inf
    return best, f"{ratio:.2f}x {other}"


def _log(device, v: Verdict, proofs: dict) -> None:
    for name, p in proofs.items():
        if not p.ok:
            what = "failed" if p.why.startswith("raised ") else "gives wrong numbers, refused,"
            log_once(logger, ("refused", v.key, name), logging.WARNING,
                     "%s %s on %s for %s (%s); %s runs these from now on (logged once)", name, what,
                     torch.device(device), v.key.text(), p.why, v.chosen)
    log_once(logger, ("chosen", v.key), logging.INFO, "fast path for %s on %s: %s (%s; proving took %.0f ms)",
             v.key.text(), torch.device(device), v.chosen, v.why, v.cost_s * 1e3)

