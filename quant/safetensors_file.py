"""The safetensors container, read defensively: the header, parsed and bounded, and tensors read or mapped.

Every bound on what a file may make the reader parse or allocate is here; anything malformed raises
``FormatError`` naming the file and the key. Floor 6 (file I/O); imports only the errors and common.reads.
"""

from __future__ import annotations

import json
import logging
import math
import os
import _thread
import atexit
import contextlib
import struct
import threading
from dataclasses import dataclass, field

import torch

from ..common import reads
from .errors import FormatError

logger = logging.getLogger(__name__)

# safetensors dtype strings -> torch dtypes (the ones a checkpoint can hold)
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _attr):
        ST_DTYPES[_name] = getattr(torch, _attr)
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}

# Bounds on what a file may make the reader parse or allocate before any tensor is touched.
# safetensors itself allows 100 MB, but parsing a hostile 100 MB JSON header costs Python up to ~1 GB;
# real headers (thousands of tensors, training metadata, embedded workflows) stay far below 32 MiB.
MAX_HEADER_BYTES = 32 * 1024 * 1024
MAX_METADATA_JSON_BYTES = 16 * 1024 * 1024  # one JSON value of the header metadata
MAX_COMFY_QUANT_BYTES = 64 * 1024  # one `.comfy_quant` tensor (a few dozen bytes of JSON in practice)
MAX_DIMS = 8
MAX_DIM = 1 << 40



def _err(path, key, problem: str, expected: str | None = None) -> FormatError:
    where = f"{os.fspath(path)}" + (f", key '{key}'" if key else "")
    msg = f"{where}: {problem}"
    if expected:
        msg += f"; expected {expected}"
    return FormatError(msg)


# --------------------------------------------------------------------------------------------------
# Header
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # offsets inside the data section
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class SafetensorsHeader:
    path: str
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def _read_header_bytes(path: str, f) -> tuple[int, int, bytes]:
    """(file size, header length, header bytes) of an open file, with the checks that need no parsing."""
    file_size = os.fstat(f.fileno()).st_size
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        raise _err(path, None, f"file is {file_size} bytes long, too short to be safetensors",
                   "an 8-byte header length followed by a JSON header")
    (n,) = struct.unpack("<Q", head)
    if n > file_size - 8:
        raise _err(path, None, _not_a_header(path, head, n, file_size),
                   f"a header length of at most {min(MAX_HEADER_BYTES, file_size - 8)}")
    if n > MAX_HEADER_BYTES:
        raise _err(path, None, f"the JSON header is {n:,} bytes long, more than this reader accepts",
                   f"at most {MAX_HEADER_BYTES:,} bytes (real checkpoints use well under 1 MB)")
    raw = f.read(n)
    if len(raw) < n:
        raise _err(path, None, f"the file ended inside its {n:,}-byte header (it shrank while being read)",
                   "a complete safetensors file")
    return file_size, n, raw


def _not_a_header(path: str, head: bytes, n: int, file_size: int) -> str:
    """Why a header length field that points past the end of the file is wrong, in words a user can act on."""
    link = ""
    if os.path.islink(path):
        link = f" (a link to {os.path.realpath(path)})"
    if head.startswith(b"PK\x03\x04"):
        kind = "a zip archive (a PyTorch .ckpt/.pt pickle?), not safetensors"
    elif head.startswith((b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")):
        kind = "a Python pickle (.ckpt/.pt), not safetensors"
    elif head.startswith(b"GGUF"):
        kind = "a GGUF file, not safetensors"
    elif all(32 <= c < 127 or c in (9, 10, 13) for c in head):
        kind = f"text (it begins {head.decode('ascii')!r}), not a safetensors file"
    else:
        return (f"header length field says {n} bytes but the file{link} has {file_size - 8} bytes after it "
                "(truncated file, or not a safetensors file)")
    return f"the file{link} is {kind}"


def read_header(path, *, file=None) -> SafetensorsHeader:
    """Parse and check a safetensors header: every tensor's dtype, shape and byte range must agree.

    `file`: the file already open (binary, seekable); its header is read from it, so that the tensors
    read later through the same file belong to this header even if the name is replaced meanwhile."""
    path = os.fspath(path)
    try:
        if file is None:
            with open(path, "rb") as f:
                file_size, n, raw = _read_header_bytes(path, f)
        else:
            file_size, n, raw = _read_header_bytes(path, file)
    except OSError as exc:
        raise FormatError(f"{path}: cannot read the file ({exc})") from exc
    header = _loads(path, None, raw, "a safetensors JSON header")
    if not isinstance(header, dict):
        raise _err(path, None, "the header is not a JSON object", "a safetensors JSON header")

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _err(path, "__metadata__", "metadata is not a map of strings", "{name: string}")
    data_start = 8 + n
    data_size = file_size - data_start
    tensors: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if not isinstance(info, dict):
            raise _err(path, name, "header entry is not an object", "{dtype, shape, data_offsets}")
        dtype = ST_DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
        if dtype is None:
            raise _err(path, name, f"unsupported tensor dtype {_short(info.get('dtype'))}",
                       "one of " + ", ".join(sorted(ST_DTYPES)))
        shape = info.get("shape")
        offsets = info.get("data_offsets")
        # (`type(v) is int`: an int and not a bool; plain loops, as this runs once per tensor of every load)
        if (type(shape) is not list or len(shape) > MAX_DIMS or type(offsets) is not list or len(offsets) != 2
                or not _dims_ok(shape) or type(offsets[0]) is not int or type(offsets[1]) is not int
                or offsets[0] < 0 or offsets[1] < offsets[0]):
            raise _err(path, name, f"malformed shape {_short(shape)} or data_offsets {_short(offsets)}",
                       f"a list of at most {MAX_DIMS} non-negative ints and [begin, end] with begin <= end")
        entry = TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])
        itemsize = dtype.itemsize
        want = entry.numel * itemsize
        if entry.nbytes != want:
            raise _err(path, name, f"header says shape {list(shape)} of {info['dtype']} ({want} bytes) but its "
                       f"data_offsets span {entry.nbytes} bytes (the header lies about sizes)",
                       f"data_offsets spanning exactly {want} bytes")
        if entry.end > data_size:
            raise _err(path, name, f"tensor data ends at byte {entry.end} of the data section, which has only "
                       f"{data_size} bytes (truncated file)", f"a file of at least {data_start + entry.end} bytes")
        tensors[name] = entry
    # Like safetensors itself: tensors tile the data section exactly, without gaps or overlaps.
    end = 0
    for entry in sorted(tensors.values(), key=lambda e: (e.start, e.end)):
        if entry.start != end:
            what = "overlaps the tensor before it" if entry.start < end else f"leaves a gap of {entry.start - end} bytes"
            raise _err(path, entry.name, f"data_offsets {[entry.start, entry.end]} {what}",
                       f"tensors stored back to back (this one starting at byte {end})")
        end = entry.end
    if end != data_size:
        raise _err(path, None, f"{data_size - end} bytes follow the last tensor's data",
                   "a file that ends with the last tensor (safetensors refuses trailing data)")
    return SafetensorsHeader(path, tensors, dict(metadata), data_start, file_size)


def _dims_ok(shape: list) -> bool:
    for d in shape:
        if type(d) is not int or d < 0 or d > MAX_DIM:
            return False
    return True


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(value, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _loads(path, key, raw, expected: str):
    """json.loads that turns every way a hostile text can fail (bad UTF-8, bad JSON, nesting deeper
    than Python's recursion limit, integers too long to convert) into a FormatError."""
    try:
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8")
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _err(path, key, f"not valid JSON ({exc})", expected) from exc
    except RecursionError:
        raise _err(path, key, "JSON nested too deeply", expected) from None
    except ValueError as exc:  # e.g. an integer literal beyond Python's digit limit
        raise _err(path, key, f"unreadable JSON ({str(exc)[:200]})", expected) from None


class _FileReader:
    """Reads tensors with ordinary file reads into memory this process owns.

    Nothing stays mapped to the file: a model file that is replaced, rewritten or truncated while the
    model is in use (a download tool rewriting it in place) cannot take the process down with SIGBUS
    on a mapped page, as a memory-mapped tensor would at its next use. Everything is read through one
    open file, the one the header was read from; `close()` when done. With ``defer`` (CPU tensors, where the
    platform has positioned reads) ``later`` leaves a tensor to ``DeferredReads``, started by ``start_later``."""

    def __init__(self, path: str, device: str = "cpu", header: SafetensorsHeader | None = None, defer: bool = False):
        self.path = path
        self.device = device
        self.header = header
        self._file = None
        self._reads = None
        self._defer = defer and DEFERRED_READS and torch.device(device).type == "cpu"
        self._deferrable = None  # bytes of the tensors large enough to defer

    def later(self, key: str):
        """``(tensor, (reads, fill))``: ``key``'s tensor, allocated, its bytes read after ``start_later`` (the
        caller marks its weight: ``QuantizedTensor.defer_codes``); ``(tensor, None)``, read now: without defer, for
        a tensor under ``DEFER_TENSOR_MIN_BYTES``, and in a file whose tensors of that size hold less than
        ``DEFER_MIN_BYTES`` in all."""
        if self._defer and self.header is not None and self._deferrable_bytes() < DEFER_MIN_BYTES:
            self._defer = False
        if not self._defer or self.header.tensors[key].nbytes < DEFER_TENSOR_MIN_BYTES:
            return self.get(key), None
        if self._reads is None:
            self._reads = DeferredReads(self.path, self.open(), self.header)
        t, fill = self._reads.add(key, self.header.tensors[key])
        return t, (self._reads, fill)

    def _deferrable_bytes(self) -> int:
        if self._deferrable is None:
            self._deferrable = sum(e.nbytes for e in self.header.tensors.values() if e.nbytes >= DEFER_TENSOR_MIN_BYTES)
        return self._deferrable

    def start_later(self) -> None:
        """Start reading what ``later`` left, in the background; the reads own the open file from now on."""
        if self._reads is not None:
            self._file, reads, self._reads = None, self._reads, None
            reads.start()

    def open(self):
        if self._file is None:
            try:
                self._file = open(self.path, "rb", buffering=0)
            except OSError as exc:
                raise FormatError(f"{self.path}: cannot read the file ({exc})") from exc
        return self._file

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def get(self, key: str) -> torch.Tensor:
        if self.header is None:
            self.header = read_header(self.path, file=self.open())
        entry = self.header.tensors[key]
        t, buf = _allocate(entry)
        if entry.nbytes:
            f = self.open()
            view = buf.numpy()  # 1-D uint8: a writable buffer as it is
            pos = self.header.data_start + entry.start
            try:
                done = reads.read_into(f.fileno(), view, pos) if reads.HAS_PREADV else _read_sequential(f, view, pos)
            except OSError as exc:
                raise _err(self.path, key, f"reading this tensor failed ({exc})") from exc
            if done < entry.nbytes:
                raise _err(self.path, key, f"the file ended at byte {pos + done:,} while reading this tensor "
                           "(it was truncated or rewritten while loading)",
                           f"a file of at least {self.header.data_start + entry.end:,} bytes")
        return t if self.device == "cpu" else t.to(self.device)


def _read_sequential(f, view, pos: int) -> int:
    """Where there are no positioned reads: seek, then read until ``view`` is full or the file ends."""
    f.seek(pos)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            break
        done += n
    return done


def _allocate(entry: TensorEntry) -> tuple[torch.Tensor, torch.Tensor]:
    """``entry``'s tensor, allocated (its bytes not read), and a flat uint8 view of them to read into. The tensor is
    not itself a view of a byte buffer: such a view keeps its base, so its storage has a second user for as long as
    it lives, and a check that rewrites codes only where no other tensor reads them (int8's in-place conversion,
    ``compute.int8._codes_unshared``) refuses a weight that still holds such a view."""
    t = torch.empty(entry.shape, dtype=entry.dtype)
    return t, t.reshape(-1).view(torch.uint8)


DEFERRED_READS = reads.HAS_PREADV  # positioned reads into a buffer (not on Windows: everything is read at load)
# Which tensors are read in the background: those of DEFER_TENSOR_MIN_BYTES or more, in a file where such tensors hold
# DEFER_MIN_BYTES or more in all; the rest are read at load. Reading in the background is not free: the reading
# thread takes the GIL back at every tensor, each time the load's torch calls release it, and shares two cores with
# the load; a large tensor's read is worth that, a small one's is not. Measured (AMD EPYC Zen 5, 2 cores; medians of
# 15 interleaved loads of the tiny test models, garbage collected before each; ms): hunyuan-dit's 44 MB file read
# at once 13.1, every FP8 tensor deferred 13.5, those of 4 MiB or more 12.0 (stock ComfyUI 7.9); z-image's 8 MB
# 11.8 / 13.4 / 11.3 (stock 8.8); files of 3-4 MB, with no such tensors, 1-3 ms slower with every tensor deferred.
# A 617 MB Flux-shaped file (37 MB layers): 46 ms deferred, 219 ms read at once (stock 48). (Measured with the thread
# started beside the model's build; the loader nodes now hold it until the build is done (``background_reads_held``):
# hunyuan-dit's converted file then loads in 7.3 ms with these thresholds, 6.9 with every FP8 tensor deferred.)
DEFER_MIN_BYTES = 8 << 20
DEFER_TENSOR_MIN_BYTES = 4 << 20


_ACTIVE: set = set()  # DeferredReads whose thread runs
_ACTIVE_LOCK = threading.Lock()


def background_reads_done(timeout: float | None = None) -> bool:
    """Wait until every background read started so far has ended (True), or ``timeout`` seconds passed (False).
    For benches and tests that must not time one load while an earlier one's reads still run."""
    with _ACTIVE_LOCK:
        active = list(_ACTIVE)
    return all(reads._thread_done.wait(timeout) for reads in active)


_HELD = threading.local()  # .pending: the DeferredReads whose start this thread's background_reads_held holds
# Reads of this many bytes or more are not held: they take far longer than a build (a 1.92 GiB SD3-shaped file's
# first step was 0.3 s later with its reads held through the 0.45 s load), where a small file's reads are over in
# a few ms and cost the build more than they save.
HOLD_MAX_BYTES = 256 << 20


@contextlib.contextmanager
def background_reads_held():
    """Loads in this block (in this thread) whose background reads total less than ``HOLD_MAX_BYTES`` start them when
    it ends, in order, however it ends; a weight used inside the block reads its own bytes, as it would before the
    thread reached them. For a loader that builds the model right after the load: a reading thread started at once
    runs beside the build and slows it (hunyuan-dit's 44 MB tiny model on two cores: the build took 5.8 ms beside
    the thread, 3.4 ms without it; stock ComfyUI's whole load 5.0-5.5 ms). Nested blocks: the outermost starts them."""
    if getattr(_HELD, "pending", None) is not None:
        yield
        return
    _HELD.pending = pending = []
    try:
        yield
    finally:
        _HELD.pending = None
        failed = None
        for reads in pending:
            try:
                reads.start()
            except Exception as exc:  # noqa: BLE001 - start the rest; their weights may still read themselves
                failed = failed or exc
        if failed is not None:
            raise failed


_EXITING = threading.Event()


@atexit.register
def _stop_background_reads() -> None:
    """At exit: every reading thread ends after the tensor it is reading (the rest are not read; nothing is left to
    use them) before the interpreter tears down. A thread still inside torch then would be ended from within C++
    code that may not be unwound ("terminate called without an active exception", an abort at exit)."""
    _EXITING.set()
    background_reads_done(timeout=10.0)


class _Fill:
    """One tensor's bytes still to be read into ``buffer`` (uint8, allocated, not yet written)."""

    __slots__ = ("key", "offset", "nbytes", "buffer", "claimed", "done", "error")

    def __init__(self, key: str, offset: int, nbytes: int, buffer: torch.Tensor):
        self.key, self.offset, self.nbytes, self.buffer = key, offset, nbytes, buffer
        self.claimed = False  # a thread reads it (under DeferredReads._lock)
        self.done = threading.Event()
        self.error: FormatError | None = None


class DeferredReads:
    """Tensors of one open file read after the load returned: by a background thread in file order, or by the
    first thread that needs one before the thread reached it (``wait``), with ordinary reads into memory this
    process owns, as ``_FileReader`` reads (nothing is mapped: a file truncated or rewritten later cannot crash
    the process). The load then costs what parsing the header and allocating cost, and the reads (the fresh
    pages they fault in) overlap what runs next: building the model, encoding the prompt, the first layers.

    Reads go through the file object the header was read from (a file renamed over it meanwhile is not read);
    each read is followed by a look at the file's size and modification time: a file truncated or rewritten in
    place while its tensors are read fails that tensor and every later one with a ``FormatError`` naming the
    file and the key, raised where the tensor is first used. The file is closed once every tensor is read."""

    def __init__(self, path: str, file, header: SafetensorsHeader):
        self.path, self._file, self._header = path, file, header
        st = os.fstat(file.fileno())
        self._stat = (st.st_size, st.st_mtime_ns)
        self._lock = threading.Lock()
        self._fills: list[_Fill] = []
        self._left = 0
        self._bytes = 0  # of the tensors added
        self._failed: FormatError | None = None
        self._thread_done = threading.Event()

    def add(self, key: str, entry: TensorEntry) -> tuple[torch.Tensor, _Fill]:
        """A buffer for ``entry``'s tensor (its dtype and shape; bytes not read yet) and the fill that reads it."""
        t, buf = _allocate(entry)
        fill = _Fill(key, self._header.data_start + entry.start, entry.nbytes, buf)
        self._fills.append(fill)
        self._left += 1
        self._bytes += entry.nbytes
        return t, fill

    def start(self) -> None:
        """Start the background thread (no tensor added after this; inside ``background_reads_held``, when that
        block ends, unless they are large); closes the file at once when none was.
        The load does not wait for the thread to be scheduled (``threading.Thread.start`` does: 0.6-1.1 ms of a
        small model's 10 ms load on two busy cores); ``background_reads_done`` waits for every such thread."""
        if not self._fills:
            self._close()
            return
        held = getattr(_HELD, "pending", None)
        if held is not None and self._bytes < HOLD_MAX_BYTES:
            held.append(self)
            return
        with _ACTIVE_LOCK:
            _ACTIVE.add(self)
        try:
            _thread.start_new_thread(self._run, ())
        except BaseException:
            self._finished()
            raise

    def wait(self, fill: _Fill) -> None:
        """Return once ``fill``'s bytes are in its buffer (reading them now where no thread has started them);
        raises its read's FormatError."""
        if not fill.done.is_set():
            if self._claim(fill):
                self._read(fill)
            fill.done.wait()
        if fill.error is not None:
            raise fill.error

    def _claim(self, fill: _Fill) -> bool:
        with self._lock:
            if fill.claimed:
                return False
            fill.claimed = True
            return True

    def _run(self) -> None:
        try:
            for fill in self._fills:
                if self._claim(fill):
                    self._read(fill)
            self._fills = []
        finally:
            self._finished()

    def _finished(self) -> None:
        with _ACTIVE_LOCK:
            _ACTIVE.discard(self)
        self._thread_done.set()

    def _read(self, fill: _Fill) -> None:
        try:
            if self._failed is not None:  # an earlier tensor found the file changed: nothing after it is read
                fill.error = _err(self.path, fill.key, f"not read: {self._failed}")
            elif _EXITING.is_set():  # not read: whoever still waits for it gets an error, not a hang
                fill.error = _err(self.path, fill.key, "not read: the process is exiting")
            else:
                self._read_into(fill)
        except FormatError as exc:  # names this tensor's key
            fill.error = exc
        except Exception as exc:  # noqa: BLE001 - an I/O or memory error while reading is this tensor's error
            fill.error = _err(self.path, fill.key, f"reading this tensor failed ({type(exc).__name__}: {exc})")
        finally:
            fill.buffer = None
            fill.done.set()
            with self._lock:
                self._left -= 1
                last = self._left == 0
            if last:
                self._close()

    def _read_into(self, fill: _Fill) -> None:
        fd = self._file.fileno()
        try:
            done = reads.read_at(fd, fill.buffer.numpy(), fill.offset)  # one thread: the load goes on beside it
            st = os.fstat(fd)
        except OSError as exc:
            raise _err(self.path, fill.key, f"reading this tensor failed ({exc})") from exc
        if done < fill.nbytes or (st.st_size, st.st_mtime_ns) != self._stat:
            self._failed = _err(self.path, fill.key, "the file was truncated or rewritten in place while its tensors "
                                "were being read (its size or modification time changed)",
                                "a model file left as it is while it loads")
            raise self._failed

    def _close(self) -> None:
        try:
            self._file.close()
        except OSError as exc:
            logger.debug("closing %s: %s", self.path, exc)


class _MappedReader:
    """Opens the file with safetensors (memory-mapped) on first use; wraps its errors with the path.

    Tensors stay mapped to the file: pages are read when first touched and the kernel may drop them
    again, so this suits a file that nobody changes while it is open (a conversion script), not a
    server that keeps a model for hours."""

    def __init__(self, path: str, device: str = "cpu"):
        self.path = path
        self.device = device
        self._handle = None

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        try:
            if self._handle is None:
                self._handle = safe_open(self.path, framework="pt", device=self.device)
            return self._handle.get_tensor(key)
        except FormatError:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise _err(self.path, key, f"safetensors could not read this tensor ({exc})",
                       "a complete, valid safetensors file") from exc

    def later(self, key: str):
        return self.get(key), None  # mapped: read when first touched anyway

    def start_later(self) -> None:
        pass

    def close(self) -> None:
        self._handle = None  # the mapping lives as long as the tensors made from it


def _parse_json_metadata(path, key: str, text: str, what: str):
    """A JSON value of the header's ``__metadata__`` (a string), refused above MAX_METADATA_JSON_BYTES."""
    if len(text) > MAX_METADATA_JSON_BYTES:
        raise _err(path, key, f"metadata value is {len(text):,} characters long",
                   f"at most {MAX_METADATA_JSON_BYTES:,} ({what})")
    return _loads(path, key, text, what)
