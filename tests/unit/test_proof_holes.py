"""What a proof must not let through, through the real dispatch on the CPU: each test injects a kernel wrong
in one way a kernel goes wrong (a tail, one row, a strided activation, m = 1, the N or K tail), or damages
the verdict file, or asks through autograd or torch.compile, and checks that no wrong product is served.

The int8 GEMM (``compute.int8.int8_linear_mm``, ``torch._int_mm`` beneath) and the scaled matmul
(``compute.scaled_mm._scaled_mm``, which the custom op ``fp8_engram::scaled_mm`` calls) are replaced; the
proof runs at the shape class's token count (16 / 128 / 1024 / 4096) and each new call shape is checked.
Timing runs on a fake clock (no wall-clock margin decides anything here).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fp8_engram
from fp8_engram.quant import ComputeConfig, PerRow, QuantizedTensor, linear
from fp8_engram.quant.compute import Book, book as book_module, default_book, int8 as qint8, proof
from fp8_engram.quant.compute.linear import route_of

sm = importlib.import_module("fp8_engram.quant.compute.scaled_mm")
PKG = str(Path(fp8_engram.__file__).parent.parent)
WO = ComputeConfig(path="weight_only")


@pytest.fixture(autouse=True)
def _fake_clock(monkeypatch):
    state = {"now": 0.0}

    def clock(device):
        def timed(fn):
            fn()
            state["now"] += 1e-3
            return 1e-3
        return timed

    monkeypatch.setattr(proof, "clock_for", clock)


def _w(n=256, k=512, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    fp8 = QuantizedTensor.from_float(w, PerRow())
    return fp8, qint8.to_int8(fp8)


def _x(m, k=512, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _int8_wrong_where(monkeypatch, wrong):
    """The int8 GEMM, with ``wrong(out, xq, wq)`` applied to its output (a kernel wrong on some calls)."""
    real = qint8.int8_linear_mm

    def fake(xq, sa, wq, sb, bias, out_dtype):
        return wrong(real(xq, sa, wq, sb, bias, out_dtype), xq, wq)

    monkeypatch.setattr(qint8, "int8_linear_mm", fake)


def _served_right(y, x, w, cfg_wo=WO):
    """The output equals the plain path's (the only right answer once a kernel is refused)."""
    return torch.equal(y, linear(x, w, None, cfg_wo))


def _tail_rows_zeroed(out, xq, wq):
    full = out.shape[0] // 16 * 16
    if full < out.shape[0]:
        out = out.clone()
        out[full:] = 0
    return out


@pytest.mark.parametrize("m", [40, 77])
def test_a_kernel_that_drops_the_rows_past_its_last_full_tile_is_refused_at_that_shape(monkeypatch, m):
    """Proven at 128 tokens (whole tiles), such a kernel passed and then served m = 40 and 77 (CLIP's)."""
    _, w8 = _w()
    _int8_wrong_where(monkeypatch, _tail_rows_zeroed)
    y = linear(_x(m), w8, None, ComputeConfig(path="int8"))
    assert _served_right(y, _x(m), w8)
    v = [v for v in default_book().verdicts("cpu") if v.kind == "int8"][0]
    assert v.chosen == "weight-only" and v.proofs["int8"]["ok"] is False and f"wrong at {m} x 512" in v.proofs["int8"]["why"]
    assert _served_right(linear(_x(m), w8, None, ComputeConfig(path="int8")), _x(m), w8)  # and stays refused
    assert route_of(_x(128), w8, None, ComputeConfig(path="int8")) == "weight-only"  # for the whole kind


def test_a_kernel_that_writes_nan_into_one_row_is_refused(monkeypatch):
    """64 sampled rows of 128 (every second one) missed row 1; every row up to 256 is compared now."""
    _, w8 = _w()

    def nan_row_1(out, xq, wq):
        out = out.clone()
        if out.shape[0] > 1:
            out[1] = float("nan")
        return out

    _int8_wrong_where(monkeypatch, nan_row_1)
    y = linear(_x(100), w8, None, ComputeConfig(path="int8"))
    assert not y.isnan().any() and _served_right(y, _x(100), w8)


def test_a_kernel_wrong_only_at_one_token_is_refused(monkeypatch):
    _, w8 = _w()
    _int8_wrong_where(monkeypatch, lambda out, xq, wq: out * 1.05 if out.shape[0] == 1 else out)
    right = linear(_x(16), w8, None, ComputeConfig(path="int8"))  # proven at 16 and checked: fine
    assert not _served_right(right, _x(16), w8)  # (the int8 product, not the plain one)
    y = linear(_x(1), w8, None, ComputeConfig(path="int8"))
    assert _served_right(y, _x(1), w8)


@pytest.mark.parametrize("tail", ["n", "k"])
def test_a_kernel_wrong_in_the_n_or_k_tail_is_refused(monkeypatch, tail):
    """A weight of 1000 outputs (not a multiple of 64), or 1000 inputs: the kernel drops the last partial tile."""
    n, k = (1000, 512) if tail == "n" else (256, 1000)
    _, w8 = _w(n, k)

    def drop_tail(out, xq, wq):
        if tail == "n" and out.shape[1] % 64:
            out = out.clone()
            out[:, out.shape[1] // 64 * 64:] = 0
        elif tail == "k" and xq.shape[1] % 64:
            keep = xq.shape[1] // 64 * 64
            return (xq[:, :keep].float() @ wq[:, :keep].float().t()).to(out.dtype) * 0 + out * 0.9
        return out

    _int8_wrong_where(monkeypatch, drop_tail)
    x = _x(40, k)
    assert _served_right(linear(x, w8, None, ComputeConfig(path="int8")), x, w8)


def test_a_kernel_wrong_on_a_strided_activation_is_refused(monkeypatch):
    """A contiguous call is checked and served; the first strided call of that shape is checked on its own."""
    from fp8_engram.quant.compute.paths import INT8

    _, w8 = _w()
    real_run = INT8.run

    def run(x2d, *a, **k):
        out = real_run(x2d, *a, **k)
        return out if x2d.is_contiguous() else out * 1.05

    monkeypatch.setattr(INT8, "run", run)
    cfg = ComputeConfig(path="int8")
    x = _x(40)
    right = linear(x, w8, None, cfg)
    assert not _served_right(right, x, w8)
    strided = _x(40, 1024)[:, ::2]
    assert not strided.is_contiguous()
    assert _served_right(linear(strided, w8, None, cfg), strided, w8)


# ----- the verdict file -----

def _proved(book_path: Path) -> dict:
    """Prove the int8 kind once into ``book_path``; its file's document."""
    _, w8 = _w()
    linear(_x(40), w8, None, ComputeConfig(book=Book(book_path)))
    return json.loads(book_path.read_text())


def _entries(doc):
    (sid, stack), = doc["stacks"].items()
    return sid, stack["verdicts"]


@pytest.mark.parametrize("forgery", ["unregistered", "refused proof"])
def test_a_forged_verdict_is_dropped_and_the_kernel_proven_again(tmp_path, monkeypatch, caplog, forgery):
    path = tmp_path / "fast_paths.json"
    doc = _proved(path)
    _, entries = _entries(doc)
    for e in entries:
        if forgery == "unregistered":
            e["chosen"] = "anything"
        else:  # the fast path chosen, its own proof failed
            e["chosen"] = "int8"
            e["proofs"]["int8"]["ok"] = False
    path.write_text(json.dumps(doc))
    _, w8 = _w()
    _int8_wrong_where(monkeypatch, lambda out, xq, wq: out * 1.5)
    with caplog.at_level("WARNING"):
        y = linear(_x(40), w8, None, ComputeConfig(book=Book(path)))
    assert _served_right(y, _x(40), w8)
    assert any("dropped" in r.getMessage() for r in caplog.records)


DAMAGE = {
    "nested": lambda doc: "[" * 100000 + "]" * 100000,
    "junk stack": lambda doc: json.dumps({"format": doc["format"], "stacks": {"junk": 1}}),
    "updated yesterday": lambda doc: json.dumps({**doc, "stacks": {s: {**e, "updated": "yesterday"}
                                                                   for s, e in doc["stacks"].items()}}),
    "string proofs": lambda doc: json.dumps(_each(doc, lambda e: e.update(proofs="ok"))),
    "list chosen": lambda doc: json.dumps(_each(doc, lambda e: e.update(chosen=["int8"]))),
    "not json": lambda doc: "{ not json",
}


def _each(doc, change):
    for e in _entries(doc)[1]:
        change(e)
    return doc


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_verdict_file_leaves_every_call_working_and_is_rewritten(tmp_path, damage):
    path = tmp_path / "fast_paths.json"
    path.write_text(DAMAGE[damage](_proved(path)))
    book = Book(path)
    _, w8 = _w()
    y = linear(_x(40), w8, None, ComputeConfig(book=book))
    assert y.shape == (40, 256) and torch.isfinite(y).all()
    assert book.summary_lines("cpu")  # the loaders' summary reads it
    doc = json.loads(path.read_text())  # rewritten whole and valid, the new verdict in it
    _, entries = _entries({"stacks": {s: e for s, e in doc["stacks"].items() if isinstance(e, dict)}})
    assert entries and all(isinstance(e["chosen"], str) for e in entries)
    assert Book(path).verdicts("cpu"), "the rewritten file does not read back"


@pytest.mark.parametrize("kind", ["dev/zero", "fifo", "huge"])
def test_a_verdict_path_that_is_not_a_small_regular_file_is_not_read(tmp_path, kind):
    """/dev/zero would be read until memory runs out, a FIFO blocks the prompt, a 200 MB file was rewritten
    at every proof: none is read, the call is served, and nothing is written over a device or a FIFO."""
    if kind == "dev/zero":
        path = Path("/dev/zero")
    elif kind == "fifo":
        path = tmp_path / "fast_paths.json"
        os.mkfifo(path)
    else:
        path = tmp_path / "fast_paths.json"
        with open(path, "wb") as f:
            f.truncate(book_module.MAX_FILE_BYTES + 1)
    result = {}

    def call():
        _, w8 = _w()
        result["y"] = linear(_x(40), w8, None, ComputeConfig(book=Book(path)))

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the call hangs on the verdict file"
    assert result["y"].shape == (40, 256)
    if kind == "fifo":
        assert path.is_fifo()
    if kind == "huge":
        assert path.stat().st_size < 1 << 20  # rewritten small, with this process's verdicts only


_WRITER = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from fp8_engram.quant.compute.book import Book, Key, Verdict
book = Book(sys.argv[2])
for i in range(int(sys.argv[4])):
    key = Key(kind="int8", paths=("int8", "weight-only"), forced="", mode="auto", layout=sys.argv[3] + str(i),
              m_class=0, n_class=256, k_class=512, x_dtype="bfloat16", w_dtype="int8", out_dtype="bfloat16", bias=False)
    book.file("cpu", Verdict(key=key, chosen="weight-only", why="test"))
print("done")
"""


def test_two_processes_writing_at_once_lose_no_verdict(tmp_path):
    path = tmp_path / "fast_paths.json"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, PKG, str(path), name, "60"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
    layouts = {e["key"]["layout"] for e in _entries(json.loads(path.read_text()))[1]}
    assert layouts == {f"{name}{i}" for name in "ab" for i in range(60)}


def test_the_stack_covers_layouts_kitchen_and_the_pack(tmp_path, monkeypatch):
    """A changed layout file is a changed stack (the plain path's dequantization and the rotation live
    there); comfy-kitchen's version is a fact of it."""
    import shutil

    copy = tmp_path / "quant"
    shutil.copytree(Path(book_module.__file__).parents[1], copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(book_module, "_QUANT", copy)
    monkeypatch.setattr(book_module, "_digest", {})
    before = book_module._sources_digest()
    (copy / "layouts" / "fp8.py").write_text((copy / "layouts" / "fp8.py").read_text() + "\n# changed\n")
    monkeypatch.setattr(book_module, "_digest", {})
    assert book_module._sources_digest() != before
    monkeypatch.setattr(book_module, "_stacks", {})
    facts = book_module.stack_facts("cpu")[1]
    assert "comfy_kitchen" in facts and facts["sources"] == book_module._sources_digest()


# ----- autograd and torch.compile obey the verdicts -----

def _wrong_scaled_mm(monkeypatch):
    if sm.scaled_mm_api("cpu") is None:
        pytest.skip(f"torch {torch.__version__} has no scaled matmul with a CPU kernel (the fp8 path cannot run)")
    real = sm._scaled_mm
    monkeypatch.setattr(sm, "_scaled_mm", lambda *a: real(*a) * 1.5)


def test_autograd_never_runs_a_refused_path(monkeypatch):
    fp8, _ = _w()
    _wrong_scaled_mm(monkeypatch)
    cfg = ComputeConfig(path="fp8")
    with torch.no_grad():
        linear(_x(40), fp8, None, cfg)  # refused on record
    x = _x(40).requires_grad_(True)
    y = linear(x, fp8, None, cfg)
    want = F.linear(x.detach(), fp8.dequantize(torch.bfloat16))
    assert torch.equal(y.detach(), want)
    y.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_autograd_with_no_verdict_yet_proves_first(monkeypatch):
    fp8, _ = _w()
    _wrong_scaled_mm(monkeypatch)
    x = _x(40).requires_grad_(True)
    y = linear(x, fp8, None, ComputeConfig(path="fp8"))
    assert torch.equal(y.detach(), F.linear(x.detach(), fp8.dequantize(torch.bfloat16)))


@pytest.mark.parametrize("first", ["eager", "compiled"])
def test_torch_compile_never_compiles_a_refused_path_in(monkeypatch, first):
    """eager first: the refusal is on record when tracing starts; compiled first: no verdict exists while
    tracing, and the plain path is traced (nothing is proven on fake tensors)."""
    fp8, _ = _w()
    _wrong_scaled_mm(monkeypatch)
    cfg = ComputeConfig(path="fp8")
    w = fp8.with_config(cfg)
    x = _x(40)
    if first == "eager":
        with torch.no_grad():
            linear(x, w)
    torch._dynamo.reset()
    fn = torch.compile(lambda a: F.linear(a, w), fullgraph=True, backend="inductor")
    with torch.no_grad():
        got = fn(x)
    want = F.linear(x, fp8.dequantize(torch.bfloat16))
    assert (got.float() - want.float()).abs().max() <= 0.05 * want.float().abs().max()
    wrong = proof.sqnr_db(got, want)
    assert wrong > 40, f"{wrong:.1f} dB: the compiled graph serves the wrong kernel"


def test_a_proven_fast_path_is_compiled_in_through_its_custom_op(monkeypatch):
    """Eagerly proven and checked at the traced shape: the compiled graph calls the scaled matmul's custom
    op, the callable the proof ran (counted through the function the op calls)."""
    if sm.scaled_mm_api("cpu") is None:
        pytest.skip(f"torch {torch.__version__} has no scaled matmul with a CPU kernel (the fp8 path cannot run)")
    fp8, _ = _w()
    w = fp8.with_config(ComputeConfig(path="fp8"))
    x = _x(40)
    with torch.no_grad():
        eager = linear(x, w)
    calls = []
    real = sm._scaled_mm
    monkeypatch.setattr(sm, "_scaled_mm", lambda *a: calls.append(1) or real(*a))
    torch._dynamo.reset()
    fn = torch.compile(lambda a: F.linear(a, w), fullgraph=True, backend="inductor")
    with torch.no_grad():
        got = fn(x)
    assert calls, "the compiled graph does not call the proven scaled matmul"
    assert proof.sqnr_db(got, eager) > 40
    assert default_book().verdicts("cpu")[0].chosen == "fp8"
