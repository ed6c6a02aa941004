"""Fuzz: hostile and broken FP8 model files, in every format the pack reads, end in a named error or a
correct load. Never a crash, a hang, a huge allocation, or a read outside the file.

A few hundred seeded cases (tests/helpers/fuzz_files.py): header length, header JSON bytes,
truncation, data_offsets, dtypes, shapes, metadata JSON (`_quantization_metadata`,
`quantization_config`), `.comfy_quant` tensors, scale tensors (NaN/inf/zero/negative/wrong
shape/dtype), data bytes. Each case is loaded with `formats.load_file`:
- a FormatError must name the file;
- a load must return exactly the bytes the file's own header places at each key (checked with an
  independent parser), scales that are finite and positive and equal to the file's, and drop only
  scale/marker keys;
- cases marked must_fail (truncations, bad scales, ...) must end in the error.
The loop runs under an RLIMIT_DATA ceiling of 1 GiB above the process's size (a huge allocation fails
as a crash) and a per-case time check; the counts go to test-artifacts/fuzz_fp8_files.json.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from fp8_engram.quant import formats
from fp8_engram.quant.tensor import QuantizedTensor
from helpers import fp8_files
from helpers import fuzz_files as fz

pytestmark = pytest.mark.unit

SEED = 1130
CONSUMED_SUFFIXES = (".scale_weight", ".weight_scale", ".weight_scale_inv", ".input_scale", ".scale_input",
                     ".comfy_quant", "scaled_fp8")
SLOW_CASE_S = 5.0


def _meta_rewrites(rng: random.Random, fmt: str, raw: bytes) -> dict[str, list[tuple[str, str]]]:
    header, _ = fz.split(raw)
    layers = sorted(k[: -len(".weight")] for k, v in header.items()
                    if k.endswith(".weight") and k != "__metadata__" and len(v["shape"]) == 2)
    good = {"format_version": "1.0", "layers": {n: {"format": "float8_e4m3fn"} for n in layers}}
    qm = [(name, text) for name, text in fz.HOSTILE_JSON.items()]
    qm += [
        ("string_entries", json.dumps({"layers": {n: "float8_e4m3fn" for n in layers}})),
        ("layers_list", json.dumps({"layers": layers})),
        ("format_list", json.dumps({"layers": {n: {"format": ["float8_e4m3fn"]} for n in layers}})),
        ("format_e5m2", json.dumps({"layers": {n: {"format": "float8_e5m2"} for n in layers}})),
        ("extra_layer", json.dumps({"layers": {**good["layers"], "ghost.layer": {"format": "float8_e4m3fn"}}})),
        ("no_layers", json.dumps({"format_version": "1.0", "layers": {}})),
        ("all_layers", json.dumps(good)),
    ]
    qc = [(name, text) for name, text in fz.HOSTILE_JSON.items() if name != "empty"]
    qc += [("int4", '{"quant_method": "int4"}'), ("block_text", '{"quant_method": "fp8", "weight_block_size": ["a", 2]}'),
           ("block_huge", '{"quant_method": "fp8", "weight_block_size": [' + str(2**70) + ", 1]}"),
           ("block_bools", '{"quant_method": "fp8", "weight_block_size": [true, true]}')]
    if fmt == "comfy_quant_metadata":
        return {"_quantization_metadata": rng.sample(qm, 8), "quantization_config": rng.sample(qc, 1)}
    if fmt == "blockwise_scale_inv":
        return {"quantization_config": rng.sample(qc, 5), "_quantization_metadata": rng.sample(qm, 1)}
    return {"_quantization_metadata": rng.sample(qm, 2), "quantization_config": rng.sample(qc, 1)}


def make_cases(files) -> list[fz.Case]:
    rng = random.Random(SEED)
    cases: list[fz.Case] = []
    for fmt in fp8_files.FORMATS:
        raw = files[fmt].read_bytes()
        header, _ = fz.split(raw)
        cases += fz.header_length_cases(rng, raw)
        cases += fz.header_byte_cases(rng, raw)
        cases += fz.truncate_cases(rng, raw)
        cases += fz.offsets_cases(rng, raw)
        cases += fz.dtype_cases(rng, raw)
        cases += fz.shape_cases(rng, raw)
        cases += fz.metadata_cases(rng, raw, _meta_rewrites(rng, fmt, raw))
        scale_keys = sorted(k for k in header if k.endswith((".scale_weight", ".weight_scale", ".weight_scale_inv")))
        if scale_keys:
            cases += fz.scale_cases(rng, raw, rng.choice(scale_keys))
        cq = sorted(k for k in header if k.endswith(".comfy_quant"))
        if cq:
            cases += fz.comfy_quant_cases(rng, raw, rng.choice(cq))
        cases += fz.data_byte_cases(rng, raw)
    # Metadata past the size cap, once (a 17 MB string).
    raw = files["comfy_quant_metadata"].read_bytes()
    cases.append(fz.Case("metadata", "metadata_over_size_cap",
                         fz._edit_header(raw, lambda h: h["__metadata__"].__setitem__("_quantization_metadata",
                                                                                       '"' + "x" * (17 << 20) + '"')), True))
    return cases


def check_load(raw: bytes, sd: dict, report: formats.FormatReport) -> str | None:
    """None if what load_file returned is exactly what the file holds, else what is wrong."""
    header, _ = fz.split(raw)
    header.pop("__metadata__", None)
    by_weight = {info.weight_key: info for info in report.layers}
    for key, value in sd.items():
        if key not in header:
            return f"returned key {key!r} that the file does not have"
        dtype, shape, data = fz.tensor_bytes(raw, key)
        if isinstance(value, QuantizedTensor):
            if list(value.shape) != shape or value.qdata.dtype != dtype:
                return f"{key}: quantized weight {value.qdata.dtype} {list(value.shape)}, file {dtype} {shape}"
            if value.qdata.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() != data:
                return f"{key}: FP8 bytes differ from the file's"
            scale = value.scale.float()
            if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
                return f"{key}: scale not finite and positive"
            info = by_weight.get(key)
            if info is not None and info.scale_key is not None:
                sdt, sshape, sdata = fz.tensor_bytes(raw, info.scale_key)
                file_scale = fz.as_tensor(sdt, sshape, sdata).float().reshape(-1)
                if not torch.equal(file_scale, scale.reshape(-1)):
                    return f"{key}: scale differs from the file's {info.scale_key}"
        else:
            if value.dtype != dtype or list(value.shape) != shape:
                return f"{key}: {value.dtype} {list(value.shape)}, file {dtype} {shape}"
            got = value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b""
            if got != data:
                return f"{key}: bytes differ from the file's"
    for key in set(header) - set(sd):
        if not key.endswith(CONSUMED_SUFFIXES):
            return f"key {key!r} of the file was dropped"
    return None


def run_case(path, case: fz.Case) -> tuple[str, str | None]:
    path.write_bytes(case.data)
    try:
        sd, report = formats.load_file(path)
    except formats.FormatError as exc:
        if str(path) not in str(exc):
            return "error_without_file_name", f"FormatError does not name the file: {exc}"
        return "named_error", None
    except Exception as exc:  # noqa: BLE001 - any other exception is the bug this test looks for
        return "crash", f"{type(exc).__name__}: {str(exc)[:300]}"
    if case.must_fail:
        return "loaded_but_must_fail", "the file loaded, but only an error is right for it"
    problem = check_load(case.data, sd, report)
    return ("loaded" if problem is None else "wrong_load"), problem


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz_src")
    sd = fp8_files.small_float_sd(3)
    for fmt in fp8_files.FORMATS:
        fp8_files.write_format(sd, folder / f"{fmt}.safetensors", fmt)
    return {fmt: folder / f"{fmt}.safetensors" for fmt in fp8_files.FORMATS}


def test_good_files_load_and_pass_the_content_check(files):
    """The check below is able to pass: every untouched file loads and matches its own bytes."""
    for fmt, path in files.items():
        sd, report = formats.load_file(path)
        assert check_load(path.read_bytes(), sd, report) is None, fmt


def test_content_check_catches_a_wrong_load(files):
    """...and able to fail: a loaded dict with one byte changed is reported."""
    path = files["comfy_quant_per_layer"]
    sd, report = formats.load_file(path)
    key = next(k for k, v in sd.items() if isinstance(v, QuantizedTensor))
    bad = dict(sd)
    q = sd[key].qdata.clone()
    q.view(torch.uint8)[0, 0] ^= 1
    bad[key] = QuantizedTensor.from_parts(q, sd[key].scale, sd[key].layout)
    assert "bytes differ" in check_load(path.read_bytes(), bad, report)


def test_fuzzed_fp8_files_end_in_a_named_error_or_a_correct_load(files, tmp_path, artifacts_dir):
    cases = make_cases(files)
    assert len(cases) >= 300
    outcomes = fz.run_cases(cases, run_case, tmp_path / "fuzzed.safetensors", SLOW_CASE_S)
    record = outcomes.write("fp8_files", artifacts_dir)
    print(json.dumps(record))
    assert not outcomes.failures, "\n".join(outcomes.failures[:40])
    totals = outcomes.totals()
    assert set(totals) <= {"named_error", "loaded"}
    assert totals.get("named_error", 0) > 200 and totals.get("loaded", 0) > 10  # both outcomes really occur


def test_memory_ceiling_turns_a_huge_allocation_into_an_error():
    """The guard the fuzz loop runs under really refuses a 2 GiB allocation (and lifts afterwards)."""
    if fz.vm_data_bytes() is None:
        pytest.skip("needs Linux /proc/self/status to read the data segment size")
    with fz.memory_ceiling(1 << 30):
        with pytest.raises((MemoryError, RuntimeError)):
            torch.empty(2 << 30, dtype=torch.uint8)
    assert torch.empty(2 << 30, dtype=torch.uint8).numel() == 2 << 30  # untouched pages: no real memory


def test_header_over_the_size_cap_is_refused_before_parsing(tmp_path):
    """A complete file whose JSON header is larger than the cap (parsing a hostile one this size would
    cost Python many times its size) gets a named error, not a parse."""
    path = tmp_path / "big_header.safetensors"
    blob = b'{"__metadata__": {"pad": "' + b"x" * (formats.MAX_HEADER_BYTES + 16) + b'"}}'
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(len(blob).to_bytes(8, "little") + blob)
    with pytest.raises(formats.FormatError, match="more than this reader accepts") as info:
        formats.read_header(path)
    assert str(path) in str(info.value)
