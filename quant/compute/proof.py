"""Proof by value and timing of a fast path: the two measurements a path must pass before it runs.

A fast path (a Triton GEMM, a scaled matmul, an int8 GEMM) is accepted on a device only when its output,
on a layer's own weight and a seeded activation, is as close to a reference of the same math as its eager
twin's is. The reference never runs the kernel under proof: it takes the same quantized operands,
dequantized, and multiplies them in float64 (float32 on a GPU, where float64 matmuls are slow; its
rounding is still some thousand times below a bfloat16 output's). Rules, stated once here:

- error is measured as SQNR (dB) against the reference over the positions where the reference is finite;
- a path passes when its SQNR is at least the twin's minus ``MARGIN_DB``, the twin's counted as at most
  ``CEILING_DB`` (a twin with float32 output is nearly exact; a kernel need not match that, only stay far
  above what a wrong kernel gives): a kernel 1% off everywhere measures 40 dB and fails against any twin
  of 43 dB or better (a bfloat16 output rounds at ~59 dB);
- its NaN/Inf positions must be the reference's.

Timing: ``time_interleaved`` runs every candidate in turn, round after round (so a machine busy for a
moment slows all of them alike), after the proof run warmed each one up: CUDA events on a GPU, the
process's clock on the CPU, the median of the rounds. Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["MARGIN_DB", "CEILING_DB", "Proof", "sqnr_db", "judge", "seeded_activation", "checked_index", "Sample",
           "time_interleaved", "reference_dtype", "ALL_ROWS", "ALL_COLS", "Candidate"]

MARGIN_DB = 3.0
CEILING_DB = 60.0


@dataclass(frozen=True)
class Proof:
    """One path's proof: its SQNR and its twin's against the reference, and the verdict."""

    ok: bool
    sqnr_db: float
    twin_db: float
    why: str = ""

    def as_dict(self) -> dict:
        return {"ok": self.ok, "sqnr_db": _finite_or_text(self.sqnr_db), "twin_db": _finite_or_text(self.twin_db),
                "why": self.why}


@dataclass
class Candidate:
    """One way to compute a kind of product, ready to prove: ``run()`` gives the full ``[M, N]`` output on
    the proof's activation; ``twin()`` the eager twin's output and ``reference()`` the reference's, both on
    the sampled rows and columns (``twin`` None for the plain path, the reference math itself, judged by
    its SQNR only and always passing). ``agrees(sampled output)``: a further check once it passed against
    its twin (the reason it fails, or None). ``timed``: what timing calls instead of ``run`` for a large
    weight of ``rows`` output rows, {row count: the same product on the weight's first rows}."""

    run: Callable[[], torch.Tensor]
    twin: Callable[[], torch.Tensor] | None = None
    reference: Callable[[], torch.Tensor] | None = None
    agrees: Callable[[torch.Tensor], str | None] | None = None
    timed: dict | None = None
    rows: int = 0


def _finite_or_text(v: float):
    if math.isnan(v):
        return "not measured"
    return round(v, 2) if math.isfinite(v) else ("inf" if v > 0 else "-inf")


def reference_dtype(device) -> torch.dtype:
    return torch.float64 if torch.device(device).type == "cpu" else torch.float32


def sqnr_db(y: torch.Tensor, ref: torch.Tensor) -> float:
    """SQNR (dB) of ``y`` against ``ref`` over the positions where ``ref`` is finite; a non-finite ``y``
    there makes it -inf. Sums in float64."""
    ref = ref.to(torch.float64)
    y = y.to(device=ref.device, dtype=torch.float64)
    keep = torch.isfinite(ref)
    r, v = ref[keep], y[keep]
    if not bool(torch.isfinite(v).all()):
        return -math.inf
    err = float((v - r).pow(2).sum())
    sig = float(r.pow(2).sum())
    if err == 0.0:
        return math.inf
    return 10.0 * math.log10(sig / err) if sig > 0 else -math.inf


def _bad_positions(y: torch.Tensor, ref: torch.Tensor) -> int:
    """How many positions are finite in one of ``y`` and ``ref`` and not in the other, or NaN in one and
    an infinity in the other."""
    y = y.to(device=ref.device)
    differ = torch.isfinite(y) != torch.isfinite(ref)
    differ |= torch.isnan(y) != torch.isnan(ref)
    return int(differ.sum())


def judge(out: torch.Tensor, twin: torch.Tensor, ref: torch.Tensor) -> Proof:
    """Does ``out`` (the fast path's output) pass against ``ref``, given what ``twin`` (its eager twin's
    output on the same operands) achieves?"""
    got, twin_db = sqnr_db(out, ref), sqnr_db(twin, ref)
    bad = _bad_positions(out, ref)
    if bad:
        return Proof(False, got, twin_db, f"{bad} NaN/Inf positions differ from the reference")
    need = min(twin_db, CEILING_DB) - MARGIN_DB
    if not got >= need:  # NaN-safe
        return Proof(False, got, twin_db, f"{got:.1f} dB, twin {twin_db:.1f} dB (needs {need:.1f})")
    return Proof(True, got, twin_db)


def seeded_activation(m: int, k: int, dtype: torch.dtype, device, seed: int = 0) -> torch.Tensor:
    """A reproducible ``[m, k]`` activation shaped like a diffusion transformer's: unit normal values with a
    few channels 30 times larger (the outliers that per-token scales must live with)."""
    g = torch.Generator().manual_seed(seed * 1000003 + k)
    x = torch.randn(m, k, generator=g)
    channels = torch.randperm(k, generator=g)[: max(1, k // 128)]
    x[:, channels] *= 30.0
    return x.to(device=device, dtype=dtype)


# Which outputs a proof compares: every row up to ALL_ROWS (a wrong row anywhere is seen), else the first
# and last EDGE_ROWS (the tiles at both ends: the tail is where masking goes wrong) and RANDOM_ROWS seeded
# rows between; every column up to ALL_COLS, else EDGE_COLS at both ends and RANDOM_COLS between.
ALL_ROWS, EDGE_ROWS, RANDOM_ROWS = 256, 32, 64
ALL_COLS, EDGE_COLS, RANDOM_COLS = 512, 64, 128


def checked_index(n: int, every: int, edge: int, spread: int, device, seed: int = 0) -> torch.Tensor:
    """Indices into ``range(n)`` a proof compares: all of them up to ``every``, else the first and last
    ``edge`` and ``spread`` seeded ones between, sorted."""
    if n <= every:
        return torch.arange(n, device=device)
    g = torch.Generator().manual_seed(seed * 7919 + n)
    middle = torch.randperm(n - 2 * edge, generator=g)[:spread] + edge
    idx = torch.cat([torch.arange(edge), middle, torch.arange(n - edge, n)]).sort().values
    return idx.to(device)


class Sample:
    """The rows and columns of an ``[m, n]`` output that a proof compares (``checked_index``)."""

    def __init__(self, m: int, n: int, device, seed: int = 0):
        self.rows = checked_index(m, ALL_ROWS, EDGE_ROWS, RANDOM_ROWS, device, seed)
        self.cols = checked_index(n, ALL_COLS, EDGE_COLS, RANDOM_COLS, device, seed + 1)

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        return out.index_select(0, self.rows).index_select(1, self.cols)


def _clock(device):
    device = torch.device(device)
    if device.type == "cuda":
        def timed(fn):
            with torch.cuda.device(device):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                return start.elapsed_time(end) / 1e3
        return timed

    def timed_cpu(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return timed_cpu


clock_for = _clock  # tests put a fake clock here: no test times real work


def time_interleaved(fns: dict, device, rounds: int = 3, budget_s: float | None = None,
                     decisive: float | None = None, combine=None) -> dict:
    """Seconds per call of each of ``fns`` (name -> callable without arguments), timed in turn for
    ``rounds`` rounds: the lower median of each one's calls (of two, the faster: a call slowed once by
    something else running never decides). When ``budget_s`` is given, rounds stop early once it is
    spent, and with ``decisive`` after the second round once the slowest figure is that many times the
    fastest (at least one round always runs); ``combine`` maps the figures to those compared there
    (several timed calls making one candidate's figure)."""
    timed = clock_for(device)
    samples: dict = {name: [] for name in fns}
    spent = 0.0

    def figure(v):
        return sorted(v)[(len(v) - 1) // 2]

    for i in range(max(1, rounds)):
        for name, fn in fns.items():
            s = timed(fn)
            samples[name].append(s)
            spent += s
        if budget_s is not None and spent >= budget_s:
            break
        if decisive is not None and len(fns) > 1 and i >= 1:
            figures = {name: figure(v) for name, v in samples.items()}
            figures = list((combine(figures) if combine is not None else figures).values())
            if min(figures) > 0 and max(figures) >= decisive * min(figures):
                break
    return {name: figure(v) for name, v in samples.items()}
