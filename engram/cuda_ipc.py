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
the process that a later group could find out of step.

A `Mapping` (one allocation, or one opened peer allocation) hands out tensor views that OWN it
through DLPack: the memory is unmapped or freed only when the last view is gone AND the group's
teardown allowed it (`permit_release`), so a view kept after a group closed (a slice of `shard()`,
say) keeps reading valid memory instead of freed memory. CUDA leaves it undefined to free memory
that another process still maps, so the owners free only after every rank has unmapped its peers
(allocators.py orders that: everyone unmaps, one all-gather, then owners free); memory a peer still
holds a view of is left to the process exit and logged. `cuIpcCloseMemHandle` for opened peers,
`cuMemFree` for the rank's own shard: a closed group hands its GPU memory straight back to the driver.

Driver calls run with the device's primary context (torch's) pushed on the calling thread, so any
thread (a watcher thread, the garbage collector) may allocate or release.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

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
            "cuCtxSynchronize": [],
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


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on the device's primary context (driver call: safe in a deleter)."""
    with _primary_context(device.index) as lib:
        _check(lib, lib.cuCtxSynchronize(), f"cuCtxSynchronize on {device}")


# ----- views that own their mapping (DLPack) -----

_KDL_CPU, _KDL_CUDA = 1, 2


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                             ("deleter", _Deleter)]
_views: dict[int, tuple] = {}  # struct address -> (struct, shape array, Mapping): alive until deleted


def _view_deleted(managed) -> None:
    try:
        entry = _views.pop(ctypes.addressof(managed.contents), None)
        if entry is not None:
            entry[2]._view_gone()
    except Exception:  # noqa: BLE001 - an exception must not cross into C++
        logger.exception("engram: releasing a CUDA shard after its last view failed")


_DELETER = _Deleter(_view_deleted)
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class Mapping:
    """One allocation of this rank (`owned`) or one peer's allocation opened here.

    `view()` gives a uint8 tensor over it that owns the mapping (slices share its storage); the
    memory is released (`cuMemFree` / `cuIpcCloseMemHandle`, after a device synchronize) once every
    view's storage is gone and `permit_release()` was called, whichever comes last; never before.
    `mapped_by_views` says whether views still exist (a view kept after close)."""

    def __init__(self, address: int, num_bytes: int, device: torch.device, owned: bool,
                 view_device: torch.device | None = None) -> None:
        self.address = address
        self.num_bytes = num_bytes
        self.device = device
        self.owned = owned
        self.view_device = torch.device(view_device) if view_device is not None else device
        self._lock = threading.Lock()
        self._live_views = 0
        self._permitted = False
        self.released = False
        self.on_release: Callable[[], None] | None = None  # called once the memory is released

    @classmethod
    def allocate(cls, num_bytes: int, device: torch.device, view_device=None) -> Mapping:
        """Zeroed device memory of this rank (`view_device`: where the views live; tests put the
        stand-in driver's host memory on the CPU)."""
        mapping = cls(allocate_raw(num_bytes, device), num_bytes, device, True, view_device)
        try:
            view = mapping.view()
            if view.is_cuda:
                with torch.cuda.device(view.device):
                    view.zero_()
            else:
                view.zero_()
            del view
            synchronize(device)
        except BaseException:
            mapping.permit_release()
            raise
        return mapping

    @classmethod
    def open(cls, handle: bytes, num_bytes: int, device: torch.device, view_device=None) -> Mapping:
        return cls(open_raw(handle, device), num_bytes, device, False, view_device)

    def view(self) -> torch.Tensor:
        """A uint8 tensor over the whole allocation, owning it (see the class docstring)."""
        with self._lock:
            if self._permitted:
                raise RuntimeError("this CUDA shard has been released; it has no new views")
            self._live_views += 1
        shape = (ctypes.c_int64 * 1)(self.num_bytes)
        managed = _DLManagedTensor()
        cuda = self.view_device.type == "cuda"
        managed.dl_tensor = _DLTensor(
            ctypes.c_void_p(self.address),
            _DLDevice(_KDL_CUDA if cuda else _KDL_CPU, (self.view_device.index or 0) if cuda else 0),
            1, _DLDataType(1, 8, 1), shape, None, 0)  # code 1: unsigned int
        managed.deleter = _DELETER
        _views[ctypes.addressof(managed)] = (managed, shape, self)
        capsule = _capsule_new(ctypes.addressof(managed), b"dltensor", None)
        return torch.utils.dlpack.from_dlpack(capsule)

    @property
    def mapped_by_views(self) -> bool:
        return self._live_views > 0

    def _view_gone(self) -> None:
        with self._lock:
            self._live_views -= 1
        self._release_if_due()

    def permit_release(self) -> None:
        """The group no longer needs this memory: release it now, or when its last view goes."""
        with self._lock:
            self._permitted = True
        self._release_if_due()

    def _release_if_due(self) -> None:
        with self._lock:
            if self.released or not self._permitted or self._live_views:
                return
            self.released = True
        try:
            synchronize(self.device)  # nothing queued still reads or writes it
        except Exception as e:  # noqa: BLE001 - a broken device must not stop the release
            logger.warning("engram: synchronizing %s before releasing a shard failed: %s", self.device, e)
        try:
            if self.owned:
                free(self.address, self.device)
            else:
                close_handle(self.address, self.device)
        except Exception as e:  # noqa: BLE001 - e.g. the owner already died; the mapping goes with the process
            logger.warning("engram: %s a CUDA shard failed: %s", "freeing" if self.owned else "unmapping", e)
        if self.on_release is not None:
            try:
                self.on_release()
            except Exception:  # noqa: BLE001 - may run in a tensor's deleter
                logger.exception("engram: a CUDA shard's release callback failed")
