"""Seeded corruptions of safetensors files, for the hostile-file tests (FP8 models, engram tables).

Every corruption works on the raw bytes of a good file and returns a `Case` (category, name, bytes,
whether only an error is an acceptable outcome). Categories:

- header_length  the 8-byte length field: 0, short, long, past the file, huge
- header_bytes   random bytes of the JSON header flipped or replaced by JSON punctuation
- truncate       the file cut inside the length field, the header, the data, or by one byte
- offsets        one tensor's data_offsets moved, swapped, reversed, negative, huge, not ints
- dtype          one tensor's dtype renamed (valid and invalid names, non-strings)
- shape          one tensor's shape changed (bigger, smaller, extra dims, zeros, negative, huge, bools)
- metadata       the header metadata: not a map, non-string values, and per-key JSON rewrites given
                 by the caller (`metadata_rewrites`)
- tensor         a tensor replaced by other bytes, dtype or shape (scale values NaN/inf/zero/negative,
                 wrong shapes and dtypes; comfy_quant JSON garbage, oversized blobs)
- data_bytes     random bytes of the data section flipped

The file's own header is parsed here independently of the pack's reader, so tests can check what a
successful load returned against the bytes really in the file (`tensor_bytes`).
"""

from __future__ import annotations

import faulthandler
import json
import random
import struct
import time
from dataclasses import dataclass

import torch

ST_TORCH = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
            "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
ST_NAME = {v: k for k, v in ST_TORCH.items()}


@dataclass
class Case:
    category: str
    name: str
    data: bytes
    must_fail: bool = False  # only a named error is a right outcome


def split(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join(header: dict, body: bytes) -> bytes:
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob + body


def tensor_bytes(raw: bytes, key: str) -> tuple[torch.dtype, list[int], bytes]:
    """(dtype, shape, bytes) of one tensor as the file's own header places it."""
    header, body = split(raw)
    info = header[key]
    start, end = info["data_offsets"]
    return ST_TORCH[info["dtype"]], info["shape"], body[start:end]


def as_tensor(dtype: torch.dtype, shape: list[int], data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def replace_tensor(raw: bytes, key: str, tensor: torch.Tensor | None = None, *, dtype: str | None = None,
                   shape: list | None = None, data: bytes | None = None) -> bytes:
    """The file with one tensor's entry and bytes replaced (others keep their bytes, offsets re-tiled)."""
    header, body = split(raw)
    meta = header.pop("__metadata__", None)
    if tensor is not None:
        dtype = ST_NAME[tensor.dtype]
        shape = list(tensor.shape)
        data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    new_header: dict = {}
    chunks = []
    offset = 0
    for k in order:
        info = dict(header[k])
        s, e = info["data_offsets"]
        piece = body[s:e]
        if k == key:
            info["dtype"] = dtype if dtype is not None else info["dtype"]
            info["shape"] = shape if shape is not None else info["shape"]
            piece = data if data is not None else piece
        info["data_offsets"] = [offset, offset + len(piece)]
        offset += len(piece)
        chunks.append(piece)
        new_header[k] = info
    if meta is not None:
        new_header["__metadata__"] = meta
    return join(new_header, b"".join(chunks))


def _edit_header(raw: bytes, edit) -> bytes:
    header, body = split(raw)
    edit(header)
    return join(header, body)


def header_length_cases(rng: random.Random, raw: bytes) -> list[Case]:
    (n,) = struct.unpack("<Q", raw[:8])
    values = {"zero": 0, "one_short": n - 1, "one_long": n + 1, "past_end": len(raw), "huge": 2**63 + 5,
              "over_cap": 100 * 1024 * 1024 + 1, "random": rng.randrange(1, 2**40)}
    picked = rng.sample(sorted(values), 4)
    return [Case("header_length", f"header_length={k}", struct.pack("<Q", values[k]) + raw[8:], True) for k in picked]


def header_byte_cases(rng: random.Random, raw: bytes, count: int = 3) -> list[Case]:
    (n,) = struct.unpack("<Q", raw[:8])
    out = []
    for i in range(count):
        data = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            pos = 8 + rng.randrange(n)
            data[pos] = rng.choice(b'{}[]":,0123456789-eE.\x00\xff') if rng.random() < 0.5 else rng.randrange(256)
        out.append(Case("header_bytes", f"header_bytes#{i}", bytes(data)))
    for name in rng.sample(sorted(HOSTILE_JSON), 2):
        out.append(Case("header_bytes", f"header_json={name}", header_replaced(raw, HOSTILE_JSON[name]), True))
    return out


def header_replaced(raw: bytes, text: str) -> bytes:
    """The whole JSON header replaced by `text` (the length field kept truthful, the data kept)."""
    (n,) = struct.unpack("<Q", raw[:8])
    blob = text.encode()
    return struct.pack("<Q", len(blob)) + blob + raw[8 + n :]


def truncate_cases(rng: random.Random, raw: bytes) -> list[Case]:
    (n,) = struct.unpack("<Q", raw[:8])
    cuts = {"in_length_field": rng.randrange(0, 8), "in_header": 8 + rng.randrange(n),
            "in_data": 8 + n + rng.randrange(max(1, len(raw) - 8 - n)), "last_byte": len(raw) - 1}
    return [Case("truncate", f"truncate_{k}", raw[:v], True) for k, v in cuts.items() if v < len(raw)]


def offsets_cases(rng: random.Random, raw: bytes, count: int = 3) -> list[Case]:
    header, _ = split(raw)
    keys = [k for k in header if k != "__metadata__" and header[k]["data_offsets"][1] > header[k]["data_offsets"][0]]
    kinds = ["grow", "shift", "reverse", "negative", "huge", "float", "string", "null", "swap", "overlap", "three"]
    out = []
    for kind in rng.sample(kinds, count):
        key = rng.choice(keys)

        def edit(h, key=key, kind=kind):
            s, e = h[key]["data_offsets"]
            new = {"grow": [s, e + 1], "shift": [s + 1, e + 1], "reverse": [e, s], "negative": [-1, e],
                   "huge": [s, 2**64 + e], "float": [float(s), float(e)], "string": [str(s), str(e)],
                   "null": None, "three": [s, e, e]}.get(kind)
            if kind == "swap":
                other = rng.choice([k for k in keys if k != key] or [key])
                h[key]["data_offsets"], h[other]["data_offsets"] = h[other]["data_offsets"], h[key]["data_offsets"]
                return
            if kind == "overlap":
                other = rng.choice([k for k in keys if k != key] or [key])
                os_, _ = h[other]["data_offsets"]
                h[key]["data_offsets"] = [os_, os_ + (e - s)]
                return
            h[key]["data_offsets"] = new

        # a swap of two tensors of the same byte size is a valid file (its tensors trade bytes)
        out.append(Case("offsets", f"offsets_{kind}:{key}", _edit_header(raw, edit), kind not in ("swap", "overlap")))
    return out


def dtype_cases(rng: random.Random, raw: bytes, count: int = 2) -> list[Case]:
    header, _ = split(raw)
    keys = [k for k in header if k != "__metadata__"]
    values = ["F32", "F16", "BF16", "I8", "U8", "F8_E4M3", "F8_E5M2", "I64", "BOOL", "F4", "C64", "", 7, None,
              ["F32"], {"a": 1}]
    out = []
    for _ in range(count):
        key, value = rng.choice(keys), rng.choice(values)
        out.append(Case("dtype", f"dtype={value!r}:{key}", _edit_header(raw, lambda h: h[key].__setitem__("dtype", value))))
    return out


def shape_cases(rng: random.Random, raw: bytes, count: int = 3) -> list[Case]:
    header, _ = split(raw)
    keys = [k for k in header if k != "__metadata__"]
    kinds = {
        "double": lambda s: [d * 2 for d in s] or [2],
        "plus_one": lambda s: s[:-1] + [s[-1] + 1] if s else [1],
        "extra_dim": lambda s: s + [1],
        "drop_dim": lambda s: s[1:],
        "zero": lambda s: [0] + s[1:] if s else [0],
        "zero_and_huge": lambda s: [0, 2**62],
        "negative": lambda s: [-d for d in s] or [-1],
        "huge": lambda s: [2**62] + s[1:],
        "bools": lambda s: [True for _ in s] or [True],
        "floats": lambda s: [float(d) for d in s] or [1.0],
        "nested": lambda s: [s],
        "nine_dims": lambda s: [1] * 9,
        "string": lambda s: "x".join(map(str, s)),
    }
    out = []
    for kind in rng.sample(sorted(kinds), count):
        key = rng.choice(keys)
        out.append(Case("shape", f"shape_{kind}:{key}",
                        _edit_header(raw, lambda h, key=key, kind=kind: h[key].__setitem__("shape", kinds[kind](h[key]["shape"])))))
    return out


def data_byte_cases(rng: random.Random, raw: bytes, count: int = 2) -> list[Case]:
    (n,) = struct.unpack("<Q", raw[:8])
    out = []
    for i in range(count):
        data = bytearray(raw)
        for _ in range(rng.randint(1, 16)):
            pos = 8 + n + rng.randrange(max(1, len(raw) - 8 - n))
            if pos < len(data):
                data[pos] ^= 1 << rng.randrange(8)
        out.append(Case("data_bytes", f"data_bytes#{i}", bytes(data)))
    return out


# JSON texts that hostile metadata may hold: the parser must refuse each with a named error.
HOSTILE_JSON = {
    "not_json": "{layers: nope",
    "deep_nesting": "[" * 100_000 + "]" * 100_000,
    "deep_object": '{"a":' * 50_000 + "1" + "}" * 50_000,
    "long_int": "1" * 100_000,
    "infinity": "Infinity",
    "list": "[1, 2, 3]",
    "empty": "",
}


def metadata_cases(rng: random.Random, raw: bytes, rewrites: dict[str, list[tuple[str, str]]]) -> list[Case]:
    """`rewrites[key]` = [(name, new JSON text)] for metadata keys the file has (or should have)."""
    out = [
        Case("metadata", "metadata_not_a_map", _edit_header(raw, lambda h: h.__setitem__("__metadata__", ["x"])), True),
        Case("metadata", "metadata_non_string_value",
             _edit_header(raw, lambda h: h.setdefault("__metadata__", {}).__setitem__("x", {"y": 1})), True),
    ]
    for key, texts in rewrites.items():
        for name, text in texts:
            out.append(Case("metadata", f"metadata_{key}={name}",
                            _edit_header(raw, lambda h, key=key, text=text: h.setdefault("__metadata__", {}).__setitem__(key, text))))
    return out


def scale_cases(rng: random.Random, raw: bytes, scale_key: str) -> list[Case]:
    """A scale tensor with bad values (NaN, inf, zero, negative), a wrong shape, a wrong dtype, empty."""
    dtype, shape, data = tensor_bytes(raw, scale_key)
    base = as_tensor(dtype, shape, data).clone()
    out = []
    for name, value in (("nan", float("nan")), ("inf", float("inf")), ("neg_inf", float("-inf")), ("zero", 0.0),
                        ("negative", -1.0)):
        t = base.clone().reshape(-1)
        t[rng.randrange(t.numel())] = value
        out.append(Case("tensor", f"scale_{name}:{scale_key}", replace_tensor(raw, scale_key, t.reshape(base.shape)), True))
    # 2-D shapes can be legitimate block grids, so the wrong shapes here fit no layout at all
    out.append(Case("tensor", f"scale_shape_3d:{scale_key}", replace_tensor(raw, scale_key, torch.ones(2, 3, 5)), True))
    out.append(Case("tensor", f"scale_shape_long:{scale_key}", replace_tensor(raw, scale_key, torch.ones(100_003)), True))
    out.append(Case("tensor", f"scale_int:{scale_key}", replace_tensor(raw, scale_key, base.to(torch.int32)), True))
    out.append(Case("tensor", f"scale_empty:{scale_key}", replace_tensor(raw, scale_key, torch.ones(0)), True))
    return out


def comfy_quant_cases(rng: random.Random, raw: bytes, key: str) -> list[Case]:
    def blob(text: str) -> torch.Tensor:
        return torch.tensor(list(text.encode()), dtype=torch.uint8)

    texts = {
        "not_json": "{format: e4m3",
        "list": "[1, 2]",
        "unknown_format": '{"format": "int4"}',
        "format_list": '{"format": ["float8_e4m3fn"]}',
        "wrong_fp8": '{"format": "float8_e5m2"}',
        "block_size_text": '{"format": "float8_e4m3fn", "block_size": ["a", 1]}',
        "block_size_zero": '{"format": "float8_e4m3fn", "block_size": [0, 0]}',
        "block_size_bools": '{"format": "float8_e4m3fn", "block_size": [true, true]}',
        "deep_nesting": '{"format": ' + "[" * 5000 + "]" * 5000 + "}",
        "long_int": '{"format": "float8_e4m3fn", "x": ' + "9" * 10_000 + "}",
        "bad_utf8": None,
    }
    out = []
    for name in rng.sample(sorted(texts), 6):
        t = torch.tensor([0xFF, 0xFE, 0x7B], dtype=torch.uint8) if texts[name] is None else blob(texts[name])
        out.append(Case("tensor", f"comfy_quant_{name}:{key}", replace_tensor(raw, key, t), True))
    good = tensor_bytes(raw, key)[2]
    out.append(Case("tensor", f"comfy_quant_int8:{key}",
                    replace_tensor(raw, key, dtype="I8", shape=[len(good)], data=good), True))
    out.append(Case("tensor", f"comfy_quant_2d:{key}", replace_tensor(raw, key, dtype="U8", shape=[1, len(good)], data=good), True))
    out.append(Case("tensor", f"comfy_quant_oversized:{key}",
                    replace_tensor(raw, key, blob('{"format": "float8_e4m3fn", "pad": "' + "x" * 70_000 + '"}')), True))
    return out


class Outcomes:
    """Counts of what the cases ended in, per category, plus every wrong outcome with its reason."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = {}
        self.failures: list[str] = []
        self.slowest = (0.0, "")

    def add(self, case: Case, outcome: str, seconds: float, problem: str | None = None) -> None:
        per = self.counts.setdefault(case.category, {})
        per[outcome] = per.get(outcome, 0) + 1
        if seconds > self.slowest[0]:
            self.slowest = (seconds, case.name)
        if problem:
            self.failures.append(f"{case.category}/{case.name}: {problem}")

    def totals(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for per in self.counts.values():
            for k, v in per.items():
                out[k] = out.get(k, 0) + v
        return out

    def write(self, name: str, folder) -> dict:
        """The record of `name`, also written to `folder/fuzz_<name>.json` for the run's artifacts."""
        record = self.record(name)
        (folder / f"fuzz_{name}.json").write_text(json.dumps(record, indent=1))
        return record

    def record(self, name: str) -> dict:
        return {"fuzz": name, "cases": sum(self.totals().values()), "outcomes": self.totals(),
                "by_category": self.counts, "slowest_case_s": round(self.slowest[0], 3),
                "slowest_case": self.slowest[1], "wrong": len(self.failures)}


def run_cases(cases: list[Case], run_case, target, slow_s: float) -> Outcomes:
    """Run every case through `run_case(target, case) -> (outcome, problem)` under a 1 GiB memory
    ceiling; a case slower than `slow_s` counts as wrong, and a real hang (10 minutes) ends the whole
    run with a traceback instead of stalling it."""
    outcomes = Outcomes()
    faulthandler.dump_traceback_later(600, exit=True)
    try:
        with memory_ceiling(1 << 30):
            for case in cases:
                t0 = time.perf_counter()
                outcome, problem = run_case(target, case)
                dt = time.perf_counter() - t0
                if dt > slow_s and problem is None:
                    outcome, problem = "slow", f"took {dt:.1f} s"
                outcomes.add(case, outcome, dt, problem)
    finally:
        faulthandler.cancel_dump_traceback_later()
    return outcomes


def vm_data_bytes() -> int | None:
    """This process's data segment size (VmData), which RLIMIT_DATA bounds."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class memory_ceiling:
    """Lower this process's RLIMIT_DATA to its current data size plus `extra` bytes for the block, so that a
    case that tries a huge allocation fails loudly (MemoryError / allocator error, counted as a crash)
    instead of succeeding or swapping. Restored on exit. Does nothing where the limit cannot be read."""

    def __init__(self, extra: int) -> None:
        self.extra = extra
        self.saved = None

    def __enter__(self):
        import resource

        used = vm_data_bytes()
        if used is None:
            return self
        self.saved = resource.getrlimit(resource.RLIMIT_DATA)
        hard = self.saved[1]
        soft = used + self.extra
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        return self

    def __exit__(self, *exc) -> None:
        import resource

        if self.saved is not None:
            resource.setrlimit(resource.RLIMIT_DATA, self.saved)
