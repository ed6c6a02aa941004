"""The CUDA IPC exchange of engram shards (engram/cuda_ipc.py), down to the ctypes calls.

Without a GPU, a stand-in driver library compiled here (same entry points and signatures as libcuda,
memory in POSIX shared memory, the "IPC handle" names the file) checks what no GPU-less run could
otherwise see: out-parameters come back, the 64-byte handle survives every byte (it starts with a zero
byte on purpose) across processes, the handle struct is passed by value, every driver call runs with a
context pushed and popped again, and driver errors become CudaIpcError naming the call. On a GPU the
real driver is used: allocate, export, open in another process, read back what was written.
"""

import contextlib
import ctypes
import gc
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from fp8_engram.engram import cuda_ipc

pytestmark = pytest.mark.unit

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".host", "pkg")

FAKE_DRIVER = r"""
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef unsigned long long CUdeviceptr;
typedef struct { unsigned char reserved[64]; } CUipcMemHandle;
struct rec { CUdeviceptr p; size_t n; char name[40]; int own; };
static struct rec recs[64];
static int depth = 0, counter = 0, calls_without_context = 0;

int fake_depth(void) { return depth; }
int fake_live(void) { int n = 0; for (int i = 0; i < 64; i++) n += recs[i].p != 0; return n; }
int fake_calls_without_context(void) { return calls_without_context; }
static void need_context(void) { if (depth <= 0) calls_without_context++; }
static struct rec *find(CUdeviceptr p) { for (int i = 0; i < 64; i++) if (recs[i].p == p) return &recs[i]; return 0; }
static struct rec *slot(void) { return find(0); }
static void *map(const char *name, size_t n, int create) {
    int fd = shm_open(name, create ? O_CREAT | O_RDWR : O_RDWR, 0600);
    if (fd < 0) return 0;
    if (create && ftruncate(fd, n) != 0) { close(fd); return 0; }
    void *m = mmap(0, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    return m == MAP_FAILED ? 0 : m;
}

int cuInit(unsigned flags) { return flags == 0 ? 0 : 1; }
int cuGetErrorString(int error, const char **text) {
    *text = error == 1 ? "CUDA_ERROR_INVALID_VALUE (fake)" : error == 3 ? "freed while another process maps it (fake)" : "other (fake)";
    return 0;
}
int cuCtxSynchronize(void) { need_context(); return 0; }
/* Each allocation carries a trailer after its n bytes: how many processes have it open. Freeing it
   while that is not 0 is what CUDA leaves undefined; here it fails with error 3. */
static long *opens(struct rec *r) { return (long *)((char *)r->p + r->n); }
int cuDeviceGet(int *device, int ordinal) { *device = 100 + ordinal; return 0; }
int cuDevicePrimaryCtxRetain(void **ctx, int device) { if (device < 100) return 1; *ctx = (void *)(long)(0x1000 + device); return 0; }
int cuCtxPushCurrent_v2(void *ctx) { if (!ctx) return 1; depth++; return 0; }
int cuCtxPopCurrent_v2(void **ctx) { depth--; if (ctx) *ctx = 0; return 0; }

int cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    need_context();
    struct rec *r = slot();
    if (!r) return 2;
    snprintf(r->name, sizeof r->name, "/fakecuda-%d-%d", (int)getpid(), counter++);
    void *m = map(r->name, n + sizeof(long), 1);
    if (!m) return 2;
    r->p = (CUdeviceptr)m; r->n = n; r->own = 1;
    *opens(r) = 0;
    *p = r->p;
    return 0;
}
int cuMemFree_v2(CUdeviceptr p) {
    need_context();
    struct rec *r = find(p);
    if (!r || !r->own) return 1;
    if (__sync_fetch_and_add(opens(r), 0) != 0) return 3;
    munmap((void *)p, r->n + sizeof(long)); shm_unlink(r->name); memset(r, 0, sizeof *r);
    return 0;
}
int cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
    need_context();
    struct rec *r = find(p);
    if (!r || !r->own) return 1;
    memset(h, 0, sizeof *h);          /* byte 0 stays zero: a reader that stops at NUL loses the rest */
    memcpy(h->reserved + 1, &r->n, sizeof r->n);
    memcpy(h->reserved + 16, r->name, strlen(r->name) + 1);
    h->reserved[63] = 0xA5;
    return 0;
}
int cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned flags) {
    need_context();
    if (flags != 1 || h.reserved[0] != 0 || h.reserved[63] != 0xA5) return 1;
    struct rec *r = slot();
    if (!r) return 2;
    memcpy(&r->n, h.reserved + 1, sizeof r->n);
    memcpy(r->name, h.reserved + 16, sizeof r->name);
#ifdef OPEN_OTHER_MEMORY   /* a broken driver: the handle opens fresh memory, not the owner's */
    snprintf(r->name, sizeof r->name, "/fakecuda-other-%d-%d", (int)getpid(), counter++);
    void *m = map(r->name, r->n + sizeof(long), 1);
    shm_unlink(r->name);
#else
    void *m = map(r->name, r->n + sizeof(long), 0);
#endif
    if (!m) { memset(r, 0, sizeof *r); return 1; }
    r->p = (CUdeviceptr)m; r->own = 0;
    __sync_fetch_and_add(opens(r), 1);
    *p = r->p;
    return 0;
}
int cuIpcCloseMemHandle(CUdeviceptr p) {
    need_context();
    struct rec *r = find(p);
    if (!r || r->own) return 1;
    __sync_fetch_and_sub(opens(r), 1);
    munmap((void *)p, r->n + sizeof(long)); memset(r, 0, sizeof *r);
    return 0;
}
"""


def build_driver(folder, *defines: str) -> str:
    """The stand-in driver compiled into `folder` (with `-D` `defines`); returns the library's path."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler (cc) to build the stand-in CUDA driver")
    source = folder / "fakecuda.c"
    source.write_text(FAKE_DRIVER)
    library = folder / f"libfakecuda{''.join('-' + d.lower() for d in defines)}.so"
    flags = [f"-D{d}" for d in defines]
    build = subprocess.run([compiler, "-shared", "-fPIC", "-O1", *flags, "-o", str(library), str(source), "-lrt"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return str(library)


@pytest.fixture(scope="module", autouse=True)
def _fake_memory_freed_at_exit():
    """What a driver frees when a process exits, the stand-in's files in /dev/shm outlive: an allocation the engram
    leaves to the process's exit (a peer still maps it) is removed once this module is done."""
    before = set(glob.glob("/dev/shm/fakecuda-*"))
    yield
    for path in set(glob.glob("/dev/shm/fakecuda-*")) - before:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@pytest.fixture
def fake_driver(tmp_path, monkeypatch):
    library = build_driver(tmp_path)
    monkeypatch.setattr(cuda_ipc, "_LIBRARY", str(library))
    monkeypatch.setattr(cuda_ipc, "_driver", None)
    monkeypatch.setattr(cuda_ipc, "_contexts", {})
    yield ctypes.CDLL(str(library))


def test_shard_exchange_through_the_driver_calls(fake_driver):
    device = torch.device("cuda", 1)
    pattern = bytes(range(256)) * 16
    address = cuda_ipc.allocate_raw(len(pattern), device)
    ctypes.memmove(address, pattern, len(pattern))  # the stand-in's "device memory" is host memory
    handle = cuda_ipc.export_handle(address, device)
    assert len(handle) == cuda_ipc.IPC_HANDLE_SIZE and handle[0] == 0 and handle[63] == 0xA5, handle
    # Another process opens the handle (as a worker or the host does) and reads the rows written here.
    script = textwrap.dedent(
        f"""
        import ctypes, sys
        sys.path.insert(0, {PKG!r})
        import torch
        from fp8_engram.engram import cuda_ipc
        cuda_ipc._LIBRARY = {cuda_ipc._LIBRARY!r}
        address = cuda_ipc.open_raw(bytes.fromhex({handle.hex()!r}), torch.device("cuda", 0))
        data = ctypes.string_at(address, {len(pattern)})
        ctypes.memmove(address, b"written by the peer", 19)
        cuda_ipc.close_handle(address, torch.device("cuda", 0))
        lib = cuda_ipc._load()
        print(data.hex(), lib.fake_depth(), lib.fake_calls_without_context())
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen, depth, bare = proc.stdout.split()
    assert bytes.fromhex(seen) == pattern, "the peer read other bytes than were written"
    assert (depth, bare) == ("0", "0"), "driver calls in the peer ran without a pushed context, or contexts leaked"
    assert ctypes.string_at(address, 19) == b"written by the peer", "the peer's write did not reach the owner's memory"
    cuda_ipc.free(address, device)
    lib = fake_driver  # the same loaded library as the module's (dlopen hands back one instance)
    assert lib.fake_depth() == 0 and lib.fake_calls_without_context() == 0
    with pytest.raises(cuda_ipc.CudaIpcError, match=r"cuMemFree on cuda:1 failed: CUDA driver error 1 \(CUDA_ERROR_INVALID_VALUE"):
        cuda_ipc.free(address, device)  # already freed
    with pytest.raises(cuda_ipc.CudaIpcError, match="64 bytes"):
        cuda_ipc.open_raw(handle[:10], device)
    assert lib.fake_depth() == 0, "a failed call left a context pushed"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_driver_exchange_between_processes():
    device = torch.device("cuda", 0)
    address, view = cuda_ipc.allocate(1 << 20, device)
    try:
        assert view.device == device and view.numel() == 1 << 20 and int(view.sum()) == 0, "not zeroed"
        view[:256] = torch.arange(256, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)
        handle = cuda_ipc.export_handle(address, device)
        script = textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {PKG!r})
            import torch
            from fp8_engram.engram import cuda_ipc
            device = torch.device("cuda", 0)
            address, view = cuda_ipc.open_handle(bytes.fromhex({handle.hex()!r}), 1 << 20, device)
            print(view[:256].tolist() == list(range(256)))
            view[256:260] = 7
            torch.cuda.synchronize(device)
            del view
            cuda_ipc.close_handle(address, device)
            """
        )
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stdout + proc.stderr[-3000:]
        assert view[256:260].tolist() == [7] * 4, "the peer's write did not arrive"
    finally:
        del view
        cuda_ipc.free(address, device)


def test_a_view_kept_after_release_keeps_its_memory(fake_driver):
    """Views own their mapping: the memory is freed when release is allowed AND the last view
    (here a slice kept past the release, as one taken from shard() could be) is gone."""
    lib = fake_driver
    device = torch.device("cuda", 1)
    mapping = cuda_ipc.Mapping.allocate(4096, device, view_device="cpu")
    view = mapping.view()
    assert view.numel() == 4096 and int(view.sum()) == 0, "not zeroed"
    view[:8] = 7
    kept = view[2:6]
    del view
    mapping.permit_release()
    assert not mapping.released and lib.fake_live() == 1, "freed while a view was still alive"
    assert kept.tolist() == [7, 7, 7, 7]
    del kept
    gc.collect()
    assert mapping.released and lib.fake_live() == 0
    assert lib.fake_depth() == 0 and lib.fake_calls_without_context() == 0
    # without an escaped view the release is immediate
    other = cuda_ipc.Mapping.allocate(4096, device, view_device="cpu")
    v = other.view()
    del v
    other.permit_release()
    assert other.released and lib.fake_live() == 0


RANK_SCRIPT = textwrap.dedent(
    """
    import json, logging, os, sys, time
    from datetime import timedelta
    sys.path.insert(0, PKG)
    import torch
    import torch.distributed as dist
    from fp8_engram.engram import allocators, cuda_ipc
    from fp8_engram.engram.worker import gloo_group
    cuda_ipc._LIBRARY = LIBRARY
    rank, world = RANK, WORLD
    records = []
    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    logging.getLogger("fp8_engram").addHandler(Keep())
    store = dist.FileStore(STORE, world)
    group = gloo_group(store, rank, world, timedelta(seconds=60))
    memory = allocators._ipc_shards(group, 4096, torch.device("cuda", rank), torch.device("cpu"))
    memory.local[:4] = rank + 1
    allocators.barrier(group, torch.device("cpu"))
    seen = [int(p[0]) for p in memory.peers]
    kept = memory.peers[2][:16] if rank == 1 else None  # a view of rank 2's shard kept past close
    allocators.barrier(group, torch.device("cpu"))
    if rank == 0:
        time.sleep(1.0)  # the slowest rank to unmap: owners must wait for it
    unmapped = []
    memory.on_peer_unmapped = unmapped.append
    memory.release()
    lib = cuda_ipc._load()
    live_after_release = lib.fake_live()
    kept_value = int(kept[0]) if kept is not None else None
    unmapped_before = list(unmapped)
    del kept
    import gc; gc.collect()
    print(json.dumps({"rank": rank, "seen": seen, "live_after_release": live_after_release,
                      "live_at_end": lib.fake_live(), "kept_value": kept_value, "log": records,
                      "held_peers": memory.held_peers, "held_by": memory.held_by,
                      "unmapped_before": unmapped_before, "unmapped_after": unmapped}), flush=True)
    os._exit(0)  # not through the gloo group's teardown at exit, which can abort ("terminate called") while a peer leaves
    """
)


def _run_ranks(script: str, library: str, store: str, world: int) -> dict[int, dict]:
    procs = []
    for rank in range(world):
        code = f"PKG, LIBRARY, STORE, RANK, WORLD = {PKG!r}, {library!r}, {store!r}, {rank}, {world}\n" + script
        procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = {}
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
        row = json.loads(out.strip().splitlines()[-1])
        results[row["rank"]] = row
    return results


def test_ranks_unmap_their_peers_before_owners_free(fake_driver, tmp_path):
    """Three CPU ranks (gloo) over the stand-in driver, which fails a free while another process
    still maps the memory: every rank unmaps, the ranks agree, then owners free; rank 1 keeps a
    view of rank 2's shard past close, so rank 2 leaves its shard to the process exit (logged)
    instead of freeing memory that is still mapped, and rank 1's view still reads it."""
    results = _run_ranks(RANK_SCRIPT, cuda_ipc._LIBRARY, str(tmp_path / "store"), 3)
    for rank, row in results.items():
        assert row["seen"] == [1, 2, 3], row
        assert not [m for m in row["log"] if "failed" in m], (rank, row["log"])
    assert results[0]["live_after_release"] == 0 and results[0]["live_at_end"] == 0
    assert results[1]["kept_value"] == 3 and results[1]["live_after_release"] == 1  # rank 2's, still mapped
    assert results[1]["live_at_end"] == 0
    assert results[2]["live_after_release"] == 1  # its own shard, left to the process exit
    assert any("ranks [1] still map it" in m for m in results[2]["log"])
    # what a host uses to keep a worker alive while it holds a view of the worker's shard
    assert results[1]["held_peers"] == [2] and results[2]["held_by"] == [1]
    assert results[1]["unmapped_before"] == [] and results[1]["unmapped_after"] == [2]
    assert results[0]["held_by"] == [] and results[0]["held_peers"] == []


def test_one_rank_frees_its_own_shard_at_release(fake_driver, tmp_path):
    """One rank (a single-GPU machine): nobody to agree with and nobody mapping its shard, so it frees it."""
    row = _run_ranks(RANK_SCRIPT, cuda_ipc._LIBRARY, str(tmp_path / "store"), 1)[0]
    assert row["seen"] == [1] and row["live_after_release"] == 0 and row["live_at_end"] == 0, row
    assert row["held_by"] == [] and row["held_peers"] == [] and not [m for m in row["log"] if "failed" in m], row


BUFFER_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from datetime import timedelta
    sys.path.insert(0, PKG)
    import torch
    import torch.distributed as dist
    from fp8_engram.engram import allocators, cuda_ipc
    from fp8_engram.engram.buffer import LocalEngramBuffer
    from fp8_engram.engram.worker import gloo_group
    cuda_ipc._LIBRARY = LIBRARY
    rank, world = RANK, WORLD
    group = gloo_group(dist.FileStore(STORE, world), rank, world, timedelta(seconds=60))
    # the CUDA IPC allocator over the stand-in driver, its views on the CPU
    ipc = lambda g, n, device: allocators._ipc_shards(g, n, torch.device("cuda", rank), torch.device("cpu"))
    try:
        buffer = LocalEngramBuffer(group, [8, 4], 64, 16, 2, torch.bfloat16, device="cpu", allocator=ipc, gather="fixed_shape")
    except allocators.ShardSharingError as e:
        print(json.dumps({"rank": rank, "error": str(e), "live": cuda_ipc._load().fake_live()}), flush=True)
        os._exit(0)  # not through the gloo group's teardown at exit, which aborts while a peer leaves
    memory = buffer._memory
    probes = [int(p[:buffer.num_bytes].count_nonzero()) for p in memory.peers]
    rows = torch.full((8, 64), float(rank + 1), dtype=torch.bfloat16)
    buffer.write([rows, rows[:4]])
    ids = torch.tensor([[[0, 8]], [[0, 4]]], dtype=torch.int32)  # row 0 of rank 0 and of rank 1, both layers
    seen = [hook()[0, ::64].tolist() for hook in buffer.fetch(ids)]
    buffer.destroy()
    print(json.dumps({"rank": rank, "probes": probes, "seen": seen, "live": cuda_ipc._load().fake_live()}), flush=True)
    os._exit(0)
    """
)


def test_ranks_read_back_each_others_shards_at_start(tmp_path):
    """LocalEngramBuffer over the CUDA IPC allocator (stand-in driver): at start every rank writes
    probe rows into its shard and reads its peers' back through the gather; with a working driver that
    passes, the probe rows are put back (every shard still all zero), and rows written by each rank fetch
    from the other."""
    results = _run_ranks(BUFFER_SCRIPT, build_driver(tmp_path), str(tmp_path / "store"), 2)
    for rank, row in results.items():
        assert "error" not in row, row
        assert row["probes"] == [0, 0], f"rank {rank}: the start check left its pattern in a shard: {row}"
        assert row["seen"] == [[1.0, 2.0], [1.0, 2.0]], row
        assert row["live"] == 0, row


def test_a_driver_that_maps_other_memory_is_refused_on_every_rank(tmp_path):
    """A driver whose IPC open hands back other memory than the owner's (zeros): every rank raises
    ShardSharingError naming both directions, and frees what it allocated."""
    results = _run_ranks(BUFFER_SCRIPT, build_driver(tmp_path, "OPEN_OTHER_MEMORY"), str(tmp_path / "store"), 2)
    for rank, row in results.items():
        assert "error" in row, f"rank {rank} served a buffer whose peers it cannot read: {row}"
        assert re.search(r"rank 0 read \d+ of \d+ probe rows of rank 1's shard wrong \(the first: layer 0, row 0\); rank 1 read \d+ of \d+ probe rows of rank 0's", row["error"]), row
        assert "not shared correctly between the 2 ranks" in row["error"]
        assert row["live"] == 0, row
