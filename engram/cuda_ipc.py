"""CUDA shard memory outside torch's allocator, shared between processes with CUDA IPC (driver API).

Why not torch's own routes:

* torch's symmetric memory keeps one process-wide exchange counter that every rendezvous advances, so
  a second group's fresh workers start at 0 while the host is ahead and the rendezvous hangs (pytorch
  issue 196082). Groups must come and go freely in one process.
* torch.multiprocessing's CUDA sharing (`reduce_tensor`) goes through the caching allocator, and
  ComfyUI runs torch with `PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync` by default, whose backend
  refuses to export or open IPC handles ("cudaMallocAsync does not yet support shareIpcHandle").

So each rank allocates its shard with `cuMemAlloc` (through ctypes on libcuda, present wherever CUDA
runs; no extra package), exports a `cuIpcGetMemHandle` handle, and opens its peers' handles with
`cuIpcOpenMemHandle` (peer access enabled lazily for shards on other GPUs). Nothing here is state of
the process that a later group could find out of step. Tensors over this memory are non-owning views
(`torch._C._construct_storage_from_data_pointer`) placed on the opening rank's device; the owner of the
views (ShardMemory.release) frees the memory after every view is gone: `cuIpcCloseMemHandle` for
opened peers, `cuMemFree` for the rank's own shard, so closing a group hands its GPU memory straight
back to the driver (not to a cache).

Driver calls run with the device's primary context (torch's) pushed on the calling thread, so any
thread (a watcher thread, the garbage collector) may allocate or release.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

import torch

IPC_HANDLE_SIZE = 64
_LIBRARY = "libcuda.so.1"  # tests point this at a stand-in driver
_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
_lock = threading.Lock()
_driver: ctypes.CDLL | None = None
_contexts: dict[int, ctypes.c_void_p] = {}


class CudaIpcError(RuntimeError):
    """A CUDA driver call for engram shard memory failed."""


class _IpcHandle(ctypes.Structure):
    # Bytes, not c_char: a c_char array field reads back cut at its first zero byte.
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_SIZE)]


def _load() -> ctypes.CDLL:
    global _driver
    with _lock:
        if _driver is not None:
            return _driver
        try:
            lib = ctypes.CDLL(_LIBRARY)
        except OSError as e:
            raise CudaIpcError(f"the CUDA driver library {_LIBRARY} could not be loaded ({e}); CUDA engram shards need it") from e
        u64p = ctypes.POINTER(ctypes.c_uint64)
        signatures = {
            "cuInit": [ctypes.c_uint],
            "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
            "cuCtxPushCurrent_v2": [ctypes.c_void_p],
            "cuCtxPopCurrent_v2": [ctypes.POINTER(ctypes.c_void_p)],
            "cuMemAlloc_v2": [u64p, ctypes.c_size_t],
            "cuMemFree_v2": [ctypes.c_uint64],
            "cuIpcGetMemHandle": [ctypes.POINTER(_IpcHandle), ctypes.c_uint64],
            "cuIpcCloseMemHandle": [ctypes.c_uint64],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        # cuda.h maps cuIpcOpenMemHandle to the _v2 entry point on current drivers.
        open_fn = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
        open_fn.argtypes = [u64p, _IpcHandle, ctypes.c_uint]
        open_fn.restype = ctypes.c_int
        lib.engram_ipc_open = open_fn
        _check(lib, lib.cuInit(0), "cuInit")
        _driver = lib
        return lib


def _check(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        try:
            lib.cuGetErrorString(result, ctypes.byref(text))
        except Exception:  # noqa: BLE001 - the code alone still says what failed
            pass
        message = text.value.decode(errors="replace") if text.value else "unknown error"
        raise CudaIpcError(f"{what} failed: CUDA driver error {result} ({message})")


@contextlib.contextmanager
def _primary_context(device_index: int):
    """Make the device's primary context (the one torch uses) current on this thread for driver calls."""
    lib = _load()
    with _lock:
        ctx = _contexts.get(device_index)
        if ctx is None:
            dev = ctypes.c_int()
            _check(lib, lib.cuDeviceGet(ctypes.byref(dev), device_index), f"cuDeviceGet({device_index})")
            ctx = ctypes.c_void_p()
            _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev.value), f"cuDevicePrimaryCtxRetain({device_index})")
            _contexts[device_index] = ctx
    _check(lib, lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
    try:
        yield lib
    finally:
        popped = ctypes.c_void_p()
        lib.cuCtxPopCurrent_v2(ctypes.byref(popped))


def _view(address: int, num_bytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over device memory it does not own (the caller frees the memory after the views)."""
    storage = torch._C._construct_storage_from_data_pointer(address, device, num_bytes)
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (num_bytes,), (1,))


def allocate_raw(num_bytes: int, device: torch.device) -> int:
    """`num_bytes` of device memory on `device` (not initialized); its address."""
    with _primary_context(device.index) as lib:
        address = ctypes.c_uint64()
        _check(lib, lib.cuMemAlloc_v2(ctypes.byref(address), num_bytes), f"cuMemAlloc of {num_bytes} bytes on {device}")
    return address.value


def allocate(num_bytes: int, device: torch.device) -> tuple[int, torch.Tensor]:
    """Device memory of `num_bytes` (zeroed) on `device`: (address, uint8 view)."""
    address = allocate_raw(num_bytes, device)
    try:
        view = _view(address, num_bytes, device)
    except BaseException:
        free(address, device)
        raise
    with torch.cuda.device(device):
        view.zero_()
    torch.cuda.synchronize(device)
    return address, view


def free(address: int, device: torch.device) -> None:
    with _primary_context(device.index) as lib:
        _check(lib, lib.cuMemFree_v2(address), f"cuMemFree on {device}")


def export_handle(address: int, device: torch.device) -> bytes:
    """The IPC handle of memory from `allocate` (64 bytes, for another process to open)."""
    handle = _IpcHandle()
    with _primary_context(device.index) as lib:
        _check(lib, lib.cuIpcGetMemHandle(ctypes.byref(handle), address), f"cuIpcGetMemHandle on {device}")
    return ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_SIZE)


def open_raw(handle: bytes, device: torch.device) -> int:
    """Map another process's exported memory into this one, for use from `device`; its address here."""
    if not isinstance(handle, bytes) or len(handle) != IPC_HANDLE_SIZE:
        raise CudaIpcError(f"a CUDA IPC handle is {IPC_HANDLE_SIZE} bytes, got {type(handle).__name__} of length {len(handle)}")
    raw = _IpcHandle()
    ctypes.memmove(ctypes.byref(raw), handle, IPC_HANDLE_SIZE)
    address = ctypes.c_uint64()
    with _primary_context(device.index) as lib:
        _check(lib, lib.engram_ipc_open(ctypes.byref(address), raw, _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), f"cuIpcOpenMemHandle on {device}")
    return address.value


def open_handle(handle: bytes, num_bytes: int, device: torch.device) -> tuple[int, torch.Tensor]:
    """`open_raw` plus a uint8 view of `num_bytes` on `device`: (address, view)."""
    address = open_raw(handle, device)
    try:
        return address, _view(address, num_bytes, device)
    except BaseException:
        close_handle(address, device)
        raise


def close_handle(address: int, device: torch.device) -> None:
    with _primary_context(device.index) as lib:
        _check(lib, lib.cuIpcCloseMemHandle(address), f"cuIpcCloseMemHandle on {device}")
