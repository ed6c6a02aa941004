"""Fuzz: hostile and broken engram table files end in a TableFileError naming the file, or a correct
read. Never a crash, a hang, a huge allocation, or a read outside the file.

Seeded corruptions (tests/helpers/fuzz_files.py) of a BF16 and an FP8 table file: header length,
header JSON, truncation, data_offsets, dtypes, shapes, the `engram.*` metadata JSON (geometry,
format, version, hashing, streams), the packed scale tensors, data bytes. Each case is read whole with
`read_table_file`; a successful read must return exactly the rows and scales the file's own header
places at each key (checked with an independent parser). Counts go to
test-artifacts/fuzz_table_files.json.
"""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from fp8_engram.engram import ue8m0
from fp8_engram.engram.table_file import TableFileError, read_table_file, rows_key, scales_key, write_table_file
from helpers import fuzz_files as fz

pytestmark = pytest.mark.unit

SEED = 1201
SLOW_CASE_S = 5.0
HIDDEN = 128
ROWS = (64, 48)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("table_src")
    g = torch.Generator().manual_seed(5)
    tables = [torch.randn(n, HIDDEN, generator=g) for n in ROWS]
    bf16 = folder / "bf16.safetensors"
    write_table_file(bf16, [t.to(torch.bfloat16) for t in tables], hashing={"seed": 1, "heads": [8, 8]},
                     streams=[{"name": "clip_l", "rows": [0, 77]}])
    fp8 = folder / "fp8.safetensors"
    pairs = [ue8m0.quantize_rows(t) for t in tables]
    write_table_file(fp8, [q for q, _ in pairs], [sf for _, sf in pairs], hashing={"seed": 2}, streams=None)
    return {"bf16": bf16, "fp8": fp8}


def _geometry_rewrites(rng: random.Random, raw: bytes) -> dict[str, list[tuple[str, str]]]:
    header, _ = fz.split(raw)
    geo = json.loads(header["__metadata__"]["engram.geometry"])

    def g(**changes):
        return json.dumps({**geo, **changes})

    structural = [
        ("layers_plus_one", g(num_layers=geo["num_layers"] + 1)), ("layers_negative", g(num_layers=-1)),
        ("hidden_zero", g(hidden=0)), ("hidden_negative", g(hidden=-HIDDEN)), ("hidden_huge", g(hidden=2**62)),
        ("hidden_text", g(hidden="wide")), ("hidden_infinity", json.dumps(geo).replace(f'"hidden": {HIDDEN}', '"hidden": Infinity')),
        ("rows_longer", g(rows_per_layer=[n + 1 for n in geo["rows_per_layer"]])), ("rows_text", g(rows_per_layer="64,48")),
        ("rows_huge", g(rows_per_layer=[2**62] * geo["num_layers"])), ("dtype_unknown", g(dtype="float4")),
        ("dtype_list", g(dtype=["bfloat16"])), ("packs_wrong", g(num_sf_packs=geo["num_sf_packs"] + 1)),
        ("not_object", "[1, 2]"), ("missing_keys", "{}"),
    ]
    hostile = sorted(fz.HOSTILE_JSON.items())
    return {
        "engram.geometry": rng.sample(structural, 9) + rng.sample(hostile, 3),
        "engram.hashing": rng.sample(hostile, 2),
        "engram.streams": rng.sample(hostile, 2),
        "engram.format": [("other", "fp8-engram-tablez")],
        "engram.format_version": [("newer", "2")],
    }


def make_cases(files) -> list[fz.Case]:
    rng = random.Random(SEED)
    cases: list[fz.Case] = []
    for kind, path in files.items():
        raw = path.read_bytes()
        for _ in range(3):  # more draws of the generic corruptions: these files are small and fast
            cases += fz.header_length_cases(rng, raw)
            cases += fz.header_byte_cases(rng, raw)
            cases += fz.truncate_cases(rng, raw)
            cases += fz.offsets_cases(rng, raw)
            cases += fz.dtype_cases(rng, raw)
            cases += fz.shape_cases(rng, raw)
            cases += fz.data_byte_cases(rng, raw)
        cases += fz.metadata_cases(rng, raw, _geometry_rewrites(rng, raw))
        if kind == "fp8":
            for layer in range(len(ROWS)):
                key = scales_key(layer)
                dtype, shape, data = fz.tensor_bytes(raw, key)
                cases.append(fz.Case("tensor", f"scales_shape:{key}", fz.replace_tensor(raw, key, torch.zeros(shape[0], shape[1] + 1, dtype=torch.int32)), True))
                cases.append(fz.Case("tensor", f"scales_float:{key}", fz.replace_tensor(raw, key, torch.zeros(shape, dtype=torch.float32)), True))
                cases.append(fz.Case("tensor", f"scales_missing_rows:{key}", fz.replace_tensor(raw, key, torch.zeros(shape[0] - 1, shape[1], dtype=torch.int32)), True))
        for layer in range(len(ROWS)):
            key = rows_key(layer)
            dtype, shape, data = fz.tensor_bytes(raw, key)
            cases.append(fz.Case("tensor", f"rows_short:{key}", fz.replace_tensor(raw, key, dtype=None, shape=[shape[0] - 1, shape[1]],
                                                                                  data=data[: (shape[0] - 1) * shape[1] * dtype.itemsize]), True))
    return cases


def check_read(raw: bytes, tables, scales, metadata) -> str | None:
    header, _ = fz.split(raw)
    for layer, table in enumerate(tables):
        dtype, shape, data = fz.tensor_bytes(raw, rows_key(layer))
        if table.dtype != dtype or list(table.shape) != shape:
            return f"layer {layer}: rows {table.dtype} {list(table.shape)}, file {dtype} {shape}"
        if table.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() != data:
            return f"layer {layer}: row bytes differ from the file's"
        if scales is not None:
            sdt, sshape, sdata = fz.tensor_bytes(raw, scales_key(layer))
            if list(scales[layer].shape) != sshape or scales[layer].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() != sdata:
                return f"layer {layer}: scales differ from the file's"
    return None


def run_case(path, case: fz.Case) -> tuple[str, str | None]:
    path.write_bytes(case.data)
    try:
        tables, scales, metadata = read_table_file(path)
    except TableFileError as exc:
        if str(path) not in str(exc):
            return "error_without_file_name", f"TableFileError does not name the file: {exc}"
        return "named_error", None
    except Exception as exc:  # noqa: BLE001 - any other exception is the bug this test looks for
        return "crash", f"{type(exc).__name__}: {str(exc)[:300]}"
    if case.must_fail:
        return "loaded_but_must_fail", "the file was read, but only an error is right for it"
    problem = check_read(case.data, tables, scales, metadata)
    return ("loaded" if problem is None else "wrong_load"), problem


def test_good_table_files_pass_the_content_check(files):
    for path in files.values():
        tables, scales, metadata = read_table_file(path)
        assert check_read(path.read_bytes(), tables, scales, metadata) is None
        tables[0].view(torch.uint8)[0, 0] ^= 1  # the check can fail
        assert "differ" in check_read(path.read_bytes(), tables, scales, metadata)


def test_fuzzed_table_files_end_in_a_named_error_or_a_correct_read(files, tmp_path, artifacts_dir):
    cases = make_cases(files)
    assert len(cases) >= 150
    outcomes = fz.run_cases(cases, run_case, tmp_path / "fuzzed.safetensors", SLOW_CASE_S)
    record = outcomes.write("table_files", artifacts_dir)
    print(json.dumps(record))
    assert not outcomes.failures, "\n".join(outcomes.failures[:40])
    totals = outcomes.totals()
    assert totals.get("named_error", 0) > 100 and totals.get("loaded", 0) > 5


# --- the memory metadata (engram.hashing / engram.streams) of a loadable memory file ---------------------
# A file can set how many primes the loader searches and how many rows the tables get: every such value
# must be bounded and refused at once with an error naming the file and the key (issue 14: heads of 10^7
# or max_order 10^6 made Load Engram Memory run for > 20 s; a text format_version was a bare ValueError).

# Seconds of this thread's CPU time per case (not wall time: on a loaded machine wall time measures the
# other processes too, and the bug this guards against cost tens of seconds of CPU).
METADATA_CASE_S = 0.5


@pytest.fixture(scope="module")
def memory_file(tmp_path_factory):
    from fp8_engram.engram.hashing import HashConfig
    from fp8_engram.engram.memory import MemoryConfig
    from fp8_engram.engram.streams import Stream, StreamLayout

    config = MemoryConfig(StreamLayout("sd1", (Stream("clip_l", "l", 0, 64),)),
                          HashConfig(num_layers=1, vocab_sizes=(500,), max_order=3, heads=2, rows_per_head=16, seed=3), hidden=64)
    hashing, streams = config.to_metadata()
    rows = config.rows_per_layer()
    path = tmp_path_factory.mktemp("memory_src") / "memory.safetensors"
    write_table_file(path, [torch.zeros(n, 64, dtype=torch.bfloat16) for n in rows], hashing=hashing, streams=streams)
    return path


def _memory_metadata_cases(raw: bytes) -> list[tuple[str, str, str, str]]:
    """(case name, metadata key, new JSON text, word the error must contain)."""
    header, _ = fz.split(raw)
    hashing = json.loads(header["__metadata__"]["engram.hashing"])
    streams = json.loads(header["__metadata__"]["engram.streams"])

    def h(key, value, raw_text=None):
        if raw_text is not None:  # a JSON token json.dumps would not write (NaN, Infinity)
            return json.dumps({**hashing, key: "@@"}).replace('"@@"', raw_text)
        return json.dumps({**hashing, key: value})

    def s(key, value):
        return json.dumps({**streams, "streams": [{**streams["streams"][0], key: value}]})

    cases = []
    for key in ("heads", "max_order", "rows_per_head", "num_layers", "seed"):
        huge = {"rows_per_head": 10**12, "seed": 1 << 64}.get(key, 10**7)
        for name, value in (("huge", huge), ("enormous", 10**400),
                            ("negative", -1), ("zero", 0), ("float", 2.5), ("text", "8"), ("bool", True), ("list", [8])):
            if key == "seed" and name == "zero":
                continue  # seed 0 is valid
            cases.append((f"{key}_{name}", "engram.hashing", h(key, value), key))
    cases += [
        ("heads_1e7_exact", "engram.hashing", h("heads", 10_000_000), "heads"),
        ("max_order_1e6", "engram.hashing", h("max_order", 1_000_000), "max_order"),
        ("heads_nan", "engram.hashing", h("heads", None, "NaN"), "heads"),
        ("heads_infinity", "engram.hashing", h("heads", None, "Infinity"), "heads"),
        ("rows_past_int32", "engram.hashing", h("rows_per_head", 1 << 28), "rows_per_head"),
        ("rows_more_than_file", "engram.hashing", h("rows_per_head", 1 << 20), "rows_per_head"),
        ("heads_more_than_file", "engram.hashing", h("heads", 40), "heads"),
        ("vocab_huge", "engram.hashing", h("vocab_sizes", [1 << 40]), "vocab_sizes"),
        ("vocab_long", "engram.hashing", h("vocab_sizes", [500] * 100000), "vocab_sizes"),
        ("vocab_text", "engram.hashing", h("vocab_sizes", "500"), "vocab_sizes"),
        ("vocab_missing", "engram.hashing", json.dumps({k: v for k, v in hashing.items() if k != "vocab_sizes"}), "vocab_sizes"),
        ("hidden_huge", "engram.hashing", h("hidden", 1 << 40), "hidden"),
        ("hidden_text", "engram.hashing", h("hidden", "64"), "hidden"),
        ("fingerprints_list", "engram.hashing", h("fingerprints", ["x"]), "fingerprints"),
        ("fingerprints_many", "engram.hashing", h("fingerprints", {str(i): "x" for i in range(100000)}), "fingerprints"),
        ("format_version_text", "engram.hashing", h("format_version", "one"), "format_version"),
        ("format_version_float", "engram.hashing", h("format_version", 1.5), "format_version"),
        ("format_version_huge", "engram.hashing", h("format_version", 10**400), "format_version"),
        ("format_version_list", "engram.hashing", h("format_version", [1]), "format_version"),
        ("streams_many", "engram.streams", json.dumps({**streams, "streams": streams["streams"] * 100000}), "streams"),
        ("streams_text", "engram.streams", json.dumps({**streams, "streams": "clip_l"}), "streams"),
        ("streams_missing", "engram.streams", json.dumps({"family": "sd1"}), "streams"),
        ("family_list", "engram.streams", json.dumps({**streams, "family": ["sd1"]}), "family"),
        ("family_unknown", "engram.streams", json.dumps({**streams, "family": "sd9"}), "family"),
        ("width_huge", "engram.streams", s("width", 1 << 40), "width"),
        ("width_wider_than_rows", "engram.streams", s("width", 65), "wider"),
        ("width_zero", "engram.streams", s("width", 0), "width"),
        ("col_start_negative", "engram.streams", s("col_start", -5), "col_start"),
        ("col_start_huge", "engram.streams", s("col_start", 10**300), "col_start"),
        ("col_start_text", "engram.streams", s("col_start", "0"), "col_start"),
        ("name_number", "engram.streams", s("name", 7), "name"),
        ("stream_not_object", "engram.streams", json.dumps({**streams, "streams": [3]}), "streams"),
    ]
    return cases


def test_good_memory_file_loads_its_config(memory_file):
    from fp8_engram.engram.memory import config_from_table_file

    config, geometry = config_from_table_file(str(memory_file))
    assert (config.hashing.heads, config.hashing.max_order, config.hashing.rows_per_head) == (2, 3, 16)
    assert config.rows_per_layer() == geometry["rows_per_layer"]


def test_hostile_memory_metadata_is_refused_at_once_naming_the_file_and_key(memory_file, tmp_path, artifacts_dir):
    from fp8_engram.engram.memory import EngramMemoryError, config_from_table_file

    raw = memory_file.read_bytes()
    cases = _memory_metadata_cases(raw)
    assert len(cases) >= 60
    target = tmp_path / "hostile_memory.safetensors"
    failures, times = [], {}
    with fz.memory_ceiling(1 << 30):
        for name, key, text, word in cases:
            header, body = fz.split(raw)
            header["__metadata__"][key] = text
            target.write_bytes(fz.join(header, body))
            t0 = time.thread_time()
            try:
                config_from_table_file(str(target))
            except (EngramMemoryError, TableFileError) as exc:
                message = str(exc)
                if str(target) not in message or word not in message:
                    failures.append(f"{name}: the error does not name the file and {word!r}: {message[:300]}")
            except Exception as exc:  # noqa: BLE001 - any other exception is the bug this test looks for
                failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
            else:
                failures.append(f"{name}: loaded, but only an error is right")
            times[name] = time.thread_time() - t0
            if times[name] > METADATA_CASE_S:
                failures.append(f"{name}: took {times[name]:.2f} s of CPU")
    slowest = max(times, key=times.get)
    record = {"cases": len(cases), "failures": len(failures), "slowest": slowest, "slowest_cpu_s": round(times[slowest], 4)}
    (artifacts_dir / "fuzz_memory_metadata.json").write_text(json.dumps(record, indent=1))
    assert not failures, "\n".join(failures)
