"""bench/e2e.py's image sizes: --image's list, the defaults per mode, and the per-size rows and ratios
its JSON line and table carry, on synthetic rows (no ComfyUI, no timing)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import pathlib
import sys

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("bench_e2e_sizes", ROOT / "bench" / "e2e.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_e2e_sizes"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _row(variant, load, first, step, sqnr):
    return {"variant": variant, "load_s": load, "first_step_s": first, "step_s": step, "steps_timed": 1,
            "model_bytes": 1, "peak_alloc_gib": None, "peak_reserved_gib": None, "device_used_gib": None,
            "sqnr_db": sqnr, "finite": True}


def _rows(scale):
    return [_row("stock_bf16", 1.0, 4.0 * scale, 2.0 * scale, math.inf),
            _row("stock_fp8_mixed", 2.0, 5.0 * scale, 2.5 * scale, 30.0),
            _row("pack_auto", 3.0, 6.0 * scale, 1.0 * scale, 28.0),
            _row("pack_weight_only", 1.5, 4.0 * scale, 4.0 * scale, 31.0),
            _row("pack_memory_first", 2.5, 5.0 * scale, 1.2 * scale, 27.5),
            _row("pack_weight_only_copies", 1.5, 4.5 * scale, 2.2 * scale, 31.0)]


def test_image_takes_one_size_or_a_list(e2e):
    assert e2e.parse_sizes("32") == [32]
    assert e2e.parse_sizes("32,512") == [32, 512]
    for bad in ("", "24", "32,x", "0", "32,32"):
        with pytest.raises(argparse.ArgumentTypeError):
            e2e.parse_sizes(bad)


def test_default_sizes_keep_the_tiny_sd3_run_at_one(e2e):
    assert e2e.default_sizes(tiny=True, arch=None) == [32]
    assert e2e.default_sizes(tiny=True, arch="sd3") == [32]
    assert e2e.default_sizes(tiny=True, arch="flux") == [32, 512]
    assert e2e.default_sizes(tiny=False, arch=None) == [1024]


def test_size_ratios_are_the_issues_figures(e2e):
    q = e2e.size_ratios(_rows(1.0))
    assert q == {"pack_auto_later_step_over_stock_bf16": 0.5,
                 "pack_weight_only_later_step_over_stock_bf16": 2.0,
                 "pack_weight_only_copies_later_step_over_stock_bf16": 1.1,
                 "pack_auto_load_over_pack_weight_only": 2.0,
                 "pack_auto_load_over_stock_fp8_mixed": 1.5,
                 "pack_auto_first_step_over_pack_weight_only": 1.5,
                 "pack_auto_minus_pack_weight_only_sqnr_db": -3.0,
                 "pack_memory_first_later_step_over_stock_bf16": 0.6,
                 "pack_memory_first_first_step_over_pack_weight_only": 1.25,
                 "pack_memory_first_minus_pack_weight_only_sqnr_db": -3.5}


def test_size_ratios_say_none_for_what_is_missing(e2e):
    rows = [r for r in _rows(1.0) if r["variant"] != "pack_weight_only"]
    rows.append({"variant": "pack_weight_only", "error": "RuntimeError: broken"})
    rows[0]["step_s"] = None
    q = e2e.size_ratios(rows)
    assert q["pack_auto_later_step_over_stock_bf16"] is None
    assert q["pack_auto_load_over_pack_weight_only"] is None
    assert q["pack_auto_minus_pack_weight_only_sqnr_db"] is None
    assert q["pack_auto_load_over_stock_fp8_mixed"] == 1.5
    inf = _rows(1.0)
    inf[2]["sqnr_db"] = math.inf  # identical latents: no finite difference to give
    assert e2e.size_ratios(inf)["pack_auto_minus_pack_weight_only_sqnr_db"] is None


def test_a_two_size_result_prints_a_row_per_size_and_keeps_the_first_sizes_keys(e2e, capsys):
    shape = e2e.Shape(arch="flux", double=1, single=1, image=32, text_tokens=16, steps=2, vec_dim=2048,
                      engram_repeats=1)
    big = e2e.Shape(arch="flux", double=1, single=1, image=512, text_tokens=16, steps=2, vec_dim=2048,
                    engram_repeats=1)
    first = _rows(1.0)
    result = {"bench": "e2e", "mode": "tiny", "device": "cpu", "gpu": None, "skipped": [],
              "shape": {"arch": "flux", "hidden": 3072, "double": 1, "single": 1, "flux_dev_blocks_fraction": 0.035,
                        "image": 32, "image_tokens": shape.image_tokens, "text_tokens": 16, "steps": 2,
                        "images": [32, 512]},
              "variants": first,
              "sizes": [e2e.size_entry(shape, first, []),
                        e2e.size_entry(big, _rows(10.0), ["stock_fp8_cast", "stock_fp8_fast"])]}
    e2e.print_table(result)
    table = capsys.readouterr().out
    line = json.loads(json.dumps(e2e._finite(result)))
    assert [s["tokens"] for s in line["sizes"]] == [20, 1040]
    assert line["variants"] == line["sizes"][0]["variants"]
    assert line["sizes"][1]["ratios"]["pack_auto_first_step_over_pack_weight_only"] == 1.5
    assert line["sizes"][1]["variants_skipped"] == ["stock_fp8_cast", "stock_fp8_fast"]
    assert sum(" 1040  pack_auto " in l for l in table.splitlines()) == 1
    assert sum("   20  pack_auto " in l for l in table.splitlines()) == 1
    assert "not run at this size (first size only): stock_fp8_cast, stock_fp8_fast" in table
    assert "512 px (1040 tokens), time over time: later step pack_auto / stock_bf16 0.50," in table


def test_interleaved_loads_count_each_variants_second_load_in_turn(e2e, monkeypatch):
    """Each round loads every variant twice in a row and counts the second (a load right after one of its own
    variant); the variants take turns; no rounds loads nothing. The clock is a fake one that advances by what
    each load is charged: a load after another variant's costs more, and is never counted."""
    order, now = [], [0.0]
    charge = {"a": 1.0, "b": 10.0}

    def loader(name):
        def load():
            after_another = not order or order[-1] != name
            order.append(name)
            now[0] += charge[name] * (3 if after_another else 1)
            return object()
        return load

    class FakeComfy:  # what settle() asks of ComfyUI: freeing memory (nothing held here)
        def free(self):
            pass

    monkeypatch.setattr(e2e.time, "perf_counter", lambda: now[0])
    got = e2e.interleaved_loads(FakeComfy(), {"a": loader("a"), "b": loader("b")}, 3)
    assert order == ["a", "a", "b", "b"] * 3
    assert got == {"a": [1.0, 1.0, 1.0], "b": [10.0, 10.0, 10.0]}
    order.clear()
    assert e2e.interleaved_loads(FakeComfy(), {"a": loader("a")}, 0) == {} and order == []
