"""`load_file(defer=True)`: FP8 codes read after the load returns (the loader nodes' way), each weight waiting for
its own at its first use (quant/safetensors_file.py ``DeferredReads``, quant/tensor.py ``defer_codes``).

- every format reads the same bytes as the eager load; nothing is mapped to the file;
- what ComfyUI does to a weight at load (``nn.Parameter``, ``detach``, ``with_config``, shapes and sizes)
  waits for nothing; any use of the codes waits for exactly its own read (held back here, so the thread
  that needs a tensor reads it itself);
- a file truncated or rewritten in place before its tensors are read gives a FormatError naming the file and
  the key where they are used, for that weight and every later one; a file renamed over the name is not read;
- the file is closed once everything is read, and by a load that fails half way;
- ``background_reads_done`` waits for every reading thread (the load itself never does);
- ``background_reads_held``: loads in the block (in its thread) start their reads when it ends, however it ends;
  reads of ``HOLD_MAX_BYTES`` or more start at once.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from fp8_engram.quant import ComputeConfig, formats, safetensors_file
from fp8_engram.quant.tensor import QuantizedTensor
from helpers import fp8_files

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def defer_small_files(monkeypatch):
    """These files are small: defer them all the same (a real load reads their tensors at once: each is under
    DEFER_TENSOR_MIN_BYTES)."""
    monkeypatch.setattr(safetensors_file, "DEFER_MIN_BYTES", 0)
    monkeypatch.setattr(safetensors_file, "DEFER_TENSOR_MIN_BYTES", 0)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return fp8_files.write_all(fp8_files.small_float_sd(4), tmp_path_factory.mktemp("deferred"))


@pytest.fixture
def model_file(tmp_path) -> Path:
    path = tmp_path / "model.safetensors"
    fp8_files.write_format(fp8_files.small_float_sd(2), path, "comfy_quant_per_layer")
    return path


@pytest.fixture
def held(monkeypatch):
    """No background thread: every read is made by the thread that first needs it (or by ``release``)."""
    monkeypatch.setattr(safetensors_file.DeferredReads, "start", lambda self: None)


def _bytes(t) -> torch.Tensor:
    return (t.qdata if isinstance(t, QuantizedTensor) else t).view(torch.uint8)


def _open_fds(path) -> int:
    fds = Path("/proc/self/fd")
    count = 0
    for fd in fds.iterdir():
        try:
            count += os.readlink(fd) == str(path)
        except OSError:
            pass
    return count


@pytest.mark.parametrize("fmt", fp8_files.FORMATS)
def test_every_format_reads_the_bytes_of_the_eager_load(files, fmt):
    path, _ = files[fmt]
    sd, report = formats.load_file(path, defer=True)
    eager, _ = formats.load_file(path)
    assert sd.keys() == eager.keys() and report.layers
    for key, value in sd.items():
        assert torch.equal(_bytes(value), _bytes(eager[key])), key
        if isinstance(value, QuantizedTensor):
            assert torch.equal(value.scale, eager[key].scale), key


@pytest.mark.skipif(not safetensors_file.DEFERRED_READS or not os.path.exists("/proc/self/fd"),
                    reason="needs positioned reads (os.preadv) and Linux /proc/self/fd")
def test_loading_waits_for_nothing_and_each_use_waits_for_its_own_read(model_file, held):
    sd, _ = formats.load_file(model_file, defer=True, config=ComputeConfig())
    eager, _ = formats.load_file(model_file)
    weights = {k: v for k, v in sd.items() if isinstance(v, QuantizedTensor)}
    assert weights and all(w.codes_pending() for w in weights.values())
    assert _open_fds(model_file) == 1  # the reads keep the file the header came from
    (k1, w1), (k2, w2) = list(weights.items())[:2]
    # what a load does to a weight reads no byte: the results wait for the same read
    made = [torch.nn.Parameter(w1, requires_grad=False), w1.detach(), w1.with_config(None)]
    assert all(isinstance(m, QuantizedTensor) and m.codes_pending() for m in made)
    assert w1.element_size() == 1 and w1.is_contiguous() and w1.nelement() == eager[k1].nelement()
    assert w1.codes_pending() and w2.codes_pending()
    # a use of one weight's codes reads those codes only
    assert torch.equal(_bytes(made[0]), _bytes(eager[k1]))
    assert not made[0].codes_pending() and w2.codes_pending()
    assert torch.equal(w1.dequantize(torch.float32), eager[k1].dequantize(torch.float32))
    for key, w in weights.items():
        assert torch.equal(_bytes(w), _bytes(eager[key])), key
    assert _open_fds(model_file) == 0  # closed once every tensor is read


def test_the_background_thread_reads_everything_without_a_use(model_file):
    sd, _ = formats.load_file(model_file, defer=True)
    fill = next(v for v in sd.values() if isinstance(v, QuantizedTensor)).__dict__["_pending_codes"][1]
    assert fill.done.wait(30)  # read by the thread, nobody asked
    eager, _ = formats.load_file(model_file)
    assert all(torch.equal(_bytes(v), _bytes(eager[k])) for k, v in sd.items())


def _hold_reads(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """(gate, started): every read waits for ``gate``; ``started`` is set when the first one does."""
    gate, started = threading.Event(), threading.Event()
    read = safetensors_file.DeferredReads._read_into

    def held_read(self, fill):
        started.set()
        assert gate.wait(30)
        read(self, fill)

    monkeypatch.setattr(safetensors_file.DeferredReads, "_read_into", held_read)
    return gate, started


def test_background_reads_done_waits_for_every_reading_thread(model_file, monkeypatch):
    gate, started = _hold_reads(monkeypatch)
    sd, _ = formats.load_file(model_file, defer=True)  # returns while its thread is held in its first read
    assert started.wait(30)
    assert not safetensors_file.background_reads_done(timeout=0.05)
    gate.set()
    assert safetensors_file.background_reads_done(timeout=30)
    assert not safetensors_file._ACTIVE
    fills = [v.__dict__["_pending_codes"][1] for v in sd.values() if isinstance(v, QuantizedTensor)]
    assert fills and all(f.done.is_set() and f.error is None for f in fills)
    assert _open_fds(model_file) == 0


def test_a_file_truncated_before_its_tensors_are_read_names_the_file_and_key_where_used(model_file, held):
    sd, _ = formats.load_file(model_file, defer=True)
    keys = [k for k, v in sd.items() if isinstance(v, QuantizedTensor)]
    with open(model_file, "r+b") as f:
        f.truncate(os.path.getsize(model_file) // 2)
    for key in (keys[-1], keys[0]):  # the last tensor's bytes are gone; after that failure, every read fails
        with pytest.raises(formats.FormatError) as err:
            sd[key].dequantize(torch.float32)
        assert str(model_file) in str(err.value) and f"'{key}'" in str(err.value), err.value
        assert "truncated or rewritten in place" in str(err.value)
    with pytest.raises(formats.FormatError):  # and again at the next use: no garbage codes are ever handed out
        sd[keys[-1]].qdata


def test_a_file_rewritten_in_place_is_refused_and_a_renamed_in_one_is_not_read(model_file, tmp_path, held):
    other = tmp_path / "other.safetensors"
    fp8_files.write_format(fp8_files.small_float_sd(9), other, "comfy_quant_per_layer")
    eager, _ = formats.load_file(model_file)
    renamed, _ = formats.load_file(model_file, defer=True)
    os.replace(other, model_file)  # a new file renamed over the name: the load reads the file it opened
    for key, value in renamed.items():
        assert torch.equal(_bytes(value), _bytes(eager[key])), key

    fp8_files.write_format(fp8_files.small_float_sd(2), other, "comfy_quant_per_layer")
    sd, _ = formats.load_file(other, defer=True)
    data = bytearray(other.read_bytes())
    st = os.stat(other)
    data[-64:] = bytes(64)  # same size, other bytes, a later modification time (as a rewriting tool leaves it)
    with open(other, "r+b") as f:
        f.write(data)
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    key = next(k for k, v in sd.items() if isinstance(v, QuantizedTensor))
    with pytest.raises(formats.FormatError, match="truncated or rewritten in place"):
        sd[key].qdata


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="needs Linux /proc/self/fd")
def test_a_load_that_fails_half_way_leaves_no_file_open(model_file):
    def cancel(done, total):
        if done == 3:
            raise KeyboardInterrupt("cancelled")

    with pytest.raises(KeyboardInterrupt):
        formats.load_file(model_file, defer=True, progress=cancel)
    assert _open_fds(model_file) == 0


def test_without_positioned_reads_everything_is_read_at_load(model_file, monkeypatch):
    monkeypatch.setattr(safetensors_file, "DEFERRED_READS", False)
    sd, _ = formats.load_file(model_file, defer=True)
    assert not any(v.codes_pending() for v in sd.values() if isinstance(v, QuantizedTensor))


def test_a_file_under_the_threshold_is_read_at_load(model_file, monkeypatch):
    monkeypatch.setattr(safetensors_file, "DEFER_MIN_BYTES", os.path.getsize(model_file))
    sd, _ = formats.load_file(model_file, defer=True)
    weights = [t for t in sd.values() if isinstance(t, QuantizedTensor)]
    assert weights and not any(w.codes_pending() for w in weights)


def test_only_tensors_over_the_tensor_threshold_are_read_in_the_background(model_file, monkeypatch):
    sd, _ = formats.load_file(model_file)
    sizes = {k: v.qdata.numel() * v.qdata.element_size() for k, v in sd.items() if isinstance(v, QuantizedTensor)}
    assert len(set(sizes.values())) > 1
    threshold = max(sizes.values())  # the largest weight (qkv, 384 x 128) only
    monkeypatch.setattr(safetensors_file, "DEFER_TENSOR_MIN_BYTES", threshold)
    monkeypatch.setattr(safetensors_file, "DEFER_MIN_BYTES", threshold)  # what such tensors hold: just enough
    sd, _ = formats.load_file(model_file, defer=True)
    pending = {k for k, v in sd.items() if isinstance(v, QuantizedTensor) and "_pending_codes" in v.__dict__}
    assert pending == {k for k, n in sizes.items() if n >= threshold}
    monkeypatch.setattr(safetensors_file, "DEFER_MIN_BYTES", threshold + 1)  # they hold less: nothing deferred
    sd, _ = formats.load_file(model_file, defer=True)
    assert not any("_pending_codes" in v.__dict__ for v in sd.values() if isinstance(v, QuantizedTensor))
    assert safetensors_file.background_reads_done(timeout=30)


def test_at_exit_reading_threads_stop_after_their_tensor(model_file, monkeypatch):
    """What runs at exit (``_stop_background_reads``): a thread reading ends after the tensor it reads, leaves the
    rest unread with an error for anyone still waiting, and ends before the interpreter's teardown."""
    gate, started = _hold_reads(monkeypatch)
    monkeypatch.setattr(safetensors_file, "_EXITING", threading.Event())
    sd, _ = formats.load_file(model_file, defer=True)
    assert started.wait(30)
    fills = [v.__dict__["_pending_codes"][1] for v in sd.values() if isinstance(v, QuantizedTensor)]
    assert len(fills) > 1
    stopper = threading.Thread(target=safetensors_file._stop_background_reads)  # sets _EXITING, waits for the thread
    stopper.start()
    assert safetensors_file._EXITING.wait(30)  # raised while the first read is still held
    gate.set()
    stopper.join(30)
    assert not stopper.is_alive() and not safetensors_file._ACTIVE
    assert all(f.done.is_set() for f in fills)
    read_ok = [f for f in fills if f.error is None]
    assert len(read_ok) == 1 and all("the process is exiting" in str(f.error) for f in fills if f.error is not None)
    assert _open_fds(model_file) == 0  # closed all the same


def _fills(sd) -> dict:
    return {k: v.__dict__["_pending_codes"][1] for k, v in sd.items() if isinstance(v, QuantizedTensor)}


def _reads(sd) -> safetensors_file.DeferredReads:
    return next(v.__dict__["_pending_codes"][0] for v in sd.values() if isinstance(v, QuantizedTensor))


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="needs Linux /proc/self/fd")
def test_held_reads_start_when_the_block_ends_and_a_weight_used_inside_reads_itself(model_file):
    eager, _ = formats.load_file(model_file)
    with safetensors_file.background_reads_held():
        sd, _ = formats.load_file(model_file, defer=True)
        fills, reads = _fills(sd), _reads(sd)
        assert len(fills) > 1 and _open_fds(model_file) == 1
        used = next(iter(fills))
        assert torch.equal(_bytes(sd[used]), _bytes(eager[used]))  # read by this thread, now
        # no thread was started (a started one is in _ACTIVE until it has read everything): nothing else is claimed
        assert reads not in safetensors_file._ACTIVE and [k for k, f in fills.items() if f.claimed] == [used]
    assert safetensors_file.background_reads_done(timeout=30)
    assert all(f.done.is_set() and f.error is None for f in fills.values())
    assert all(torch.equal(_bytes(v), _bytes(eager[k])) for k, v in sd.items())
    assert _open_fds(model_file) == 0


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="needs Linux /proc/self/fd")
def test_held_reads_start_when_the_block_fails_and_nested_blocks_start_at_the_outermost_end(model_file, monkeypatch):
    with pytest.raises(RuntimeError, match="model build failed"):
        with safetensors_file.background_reads_held():
            sd, _ = formats.load_file(model_file, defer=True)
            raise RuntimeError("model build failed")
    assert safetensors_file.background_reads_done(timeout=30)
    assert all(f.done.is_set() and f.error is None for f in _fills(sd).values())
    assert _open_fds(model_file) == 0  # the failed load's file is read and closed, not left open

    gate, _ = _hold_reads(monkeypatch)  # a started thread stays in its first read (and in _ACTIVE) until the gate
    with safetensors_file.background_reads_held():
        with safetensors_file.background_reads_held():
            sd, _ = formats.load_file(model_file, defer=True)
        assert _reads(sd) not in safetensors_file._ACTIVE  # the inner block's end started nothing
    assert _reads(sd) in safetensors_file._ACTIVE  # the outer one's did
    gate.set()
    assert safetensors_file.background_reads_done(timeout=30)
    assert all(f.done.is_set() for f in _fills(sd).values())


def test_a_hold_holds_only_its_own_threads_loads(model_file, monkeypatch):
    gate, started = _hold_reads(monkeypatch)
    with safetensors_file.background_reads_held():
        loaded = {}
        other = threading.Thread(target=lambda: loaded.update(sd=formats.load_file(model_file, defer=True)[0]))
        other.start()
        other.join(30)
        assert started.wait(30)  # the other thread's load started its reads at once, inside this thread's hold
        gate.set()
    assert safetensors_file.background_reads_done(timeout=30)
    assert all(f.done.is_set() and f.error is None for f in _fills(loaded["sd"]).values())


def test_large_reads_are_not_held(model_file, monkeypatch):
    gate, started = _hold_reads(monkeypatch)
    monkeypatch.setattr(safetensors_file, "HOLD_MAX_BYTES", 1)  # every file's reads count as large
    with safetensors_file.background_reads_held():
        sd, _ = formats.load_file(model_file, defer=True)
        assert _reads(sd) in safetensors_file._ACTIVE  # started at once, inside the block
        assert started.wait(30)
        gate.set()
    assert safetensors_file.background_reads_done(timeout=30)
    assert all(f.done.is_set() and f.error is None for f in _fills(sd).values())


@pytest.mark.skipif(not hasattr(torch._C, "_storage_Use_Count"), reason="needs torch's storage use count")
@pytest.mark.parametrize("defer", [False, True])
def test_every_tensor_read_owns_its_storage_alone(model_file, defer):
    """No loaded tensor is a view of a byte buffer (a view keeps its base: its storage would have a second user for
    its whole life, and int8's in-place conversion, which rewrites only codes nobody else reads, refuses those)."""
    sd, _ = formats.load_file(model_file, defer=defer)
    assert safetensors_file.background_reads_done(timeout=30)
    tensors = {k: (v.qdata if isinstance(v, QuantizedTensor) else v) for k, v in sd.items()}
    assert any(isinstance(v, QuantizedTensor) for v in sd.values()) and len(tensors) > 2
    for key, t in tensors.items():
        assert t._base is None, key
        assert torch._C._storage_Use_Count(t.untyped_storage()._cdata) == 2, key  # the tensor and the storage asked
