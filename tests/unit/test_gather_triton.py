"""The one-pass engram gather kernel (engram/gather_triton.py) against an independent gather.

Shards of several "ranks" are separate tensors laid out as LocalEngramBuffer lays them out (ShardLayout),
filled with random bytes; the kernel gets a table of where each lies relative to one of them (the
anchor), exactly as on the GPU. On the CPU it runs in Triton's interpreter, which follows those raw
addresses, so the indexing code that runs on the GPU (owner = id // rows, local = id % rows, shard from
the table, scale-factor strides) is
checked here bit for bit: rows, scale factors in both layouts, zeros for invalid ids, nothing written
outside the output. One case also runs under TRITON_INTERPRET=1 in a fresh process (Triton's own switch),
and the same cases run compiled on a CUDA GPU when there is one. The single-rank LocalEngramBuffer with
the kernel forced is compared with the CPU's index_select fetch.
"""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.unit

triton = pytest.importorskip("triton")

from fp8_engram.engram import gather_triton  # noqa: E402
from fp8_engram.engram.buffer import ShardLayout, align  # noqa: E402

# (hidden, fp8): row words 128 (exact column steps), 160 (a masked step), 1792 + 56 packs (DeepSeek-V3), 128 + 4 packs
GEOMETRIES = [(256, False), (320, False), (7168, True), (512, True)]
ROWS = [7, 5]  # per rank and layer
RANKS = 3
ENTRIES = 3
SENTINEL = -123456789


def _make_shards(hidden: int, fp8: bool, device: str, seed: int):
    row_bytes = hidden * (1 if fp8 else 2)
    packs = hidden // 128 if fp8 else 0
    layout = ShardLayout.build(ROWS, row_bytes, packs * 4)
    g = torch.Generator().manual_seed(seed)
    # Separate allocations (not one range): the kernel must follow the table, not a stride.
    shards = [torch.randint(0, 256, (layout.num_bytes,), generator=g, dtype=torch.uint8).to(device) for _ in range(RANKS)]
    # The anchor is the middle shard: the others lie before or after it (negative and positive offsets).
    anchor = shards[1].view(torch.int32)
    rel = torch.tensor(gather_triton.shard_table([s.data_ptr() for s in shards], anchor.data_ptr()), dtype=torch.int64, device=device)
    sf_offsets = layout.sf_offsets if fp8 else (0,) * len(ROWS)
    meta = torch.tensor([[n, layout.table_offsets[l] // 4, sf_offsets[l] // 4] for l, n in enumerate(ROWS)], dtype=torch.int64, device=device)
    return layout, packs, shards, (anchor, rel), meta


def _expected(layout: ShardLayout, packs: int, shards: list, ids: torch.Tensor):
    """Row bytes and scale words of every id, looked up one by one in the CPU copies of the shards."""
    cpu = [s.cpu() for s in shards]
    layers, k = ids.shape
    rows = torch.zeros(layers, k, layout.row_bytes, dtype=torch.uint8)
    sfs = torch.zeros(layers, k, packs, dtype=torch.int32)
    for layer in range(layers):
        n = ROWS[layer]
        for i, g in enumerate(ids[layer].tolist()):
            if not 0 <= g < RANKS * n:
                continue
            rank, local = divmod(g, n)
            start = layout.table_offsets[layer] + local * layout.row_bytes
            rows[layer, i] = cpu[rank][start : start + layout.row_bytes]
            if packs:
                start = layout.sf_offsets[layer] + local * layout.sf_row_bytes
                sfs[layer, i] = cpu[rank][start : start + layout.sf_row_bytes].view(torch.int32)
    return rows, sfs


def _ids(tokens: int, seed: int, dtype=torch.int32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-4, RANKS * max(ROWS) + 4, (len(ROWS), tokens * ENTRIES), generator=g).to(dtype)
    ids[0, 0] = -1
    ids[-1, -1] = RANKS * ROWS[-1]  # first id past the table
    ids[0, -1] = torch.iinfo(torch.int32).max
    return ids


def check_kernel(device: str, hidden: int, fp8: bool, tokens: int, tma: bool, seed: int) -> None:
    layout, packs, shards, (anchor, rel), meta = _make_shards(hidden, fp8, device, seed)
    ids = _ids(tokens, seed + 1)
    layers, k = ids.shape
    out = torch.full((layers, k, layout.row_bytes // 4), SENTINEL, dtype=torch.int32, device=device)
    sf_kwargs = {}
    sf_out = None
    width = ENTRIES * packs
    if fp8:
        mn = align(tokens, 4) if tma else tokens
        layer_stride = width * mn
        strides = (1, mn) if tma else (width, 1)
        # One spare element either side: a write out of bounds shows up as a changed sentinel.
        backing = torch.full((layers * layer_stride + 2,), SENTINEL, dtype=torch.int32, device=device)
        sf_out = backing[1:]
        sf_kwargs = dict(sf_layer_stride=layer_stride, sf_stride_t=strides[0], sf_stride_j=strides[1])
    gather_triton.gather_rows(
        ids.to(device), anchor, rel, meta, out, sf_out, num_ranks=RANKS, row_words=layout.row_bytes // 4, sf_words=packs, entries=ENTRIES, **sf_kwargs
    )
    want_rows, want_sfs = _expected(layout, packs, shards, ids)
    assert torch.equal(out.cpu().view(torch.uint8).view(layers, k, -1), want_rows), f"rows differ (hidden {hidden}, fp8 {fp8}, tokens {tokens})"
    if fp8:
        got = backing.cpu()
        assert got[0] == SENTINEL and got[-1] == SENTINEL, "the kernel wrote outside the scale layout"
        for layer in range(layers):
            view = got.as_strided((tokens, width), strides, 1 + layer * layer_stride)  # element 0 is the spare
            assert torch.equal(view, want_sfs[layer].view(tokens, width)), f"scales of layer {layer} differ (tma={tma})"
        if tma and mn > tokens:  # TMA padding tokens are left alone (fetch zeroes them itself)
            pad = got[1:-1].view(layers, width, mn)[:, :, tokens:]
            assert torch.all(pad == SENTINEL), "the kernel wrote into the TMA padding"


@pytest.mark.parametrize("hidden,fp8", GEOMETRIES, ids=[f"h{h}-{'fp8' if f else 'bf16'}" for h, f in GEOMETRIES])
@pytest.mark.parametrize("tokens,tma", [(1, True), (5, True), (6, False)])
def test_kernel_matches_independent_gather_in_the_interpreter(hidden, fp8, tokens, tma):
    check_kernel("cpu", hidden, fp8, tokens, tma, seed=hidden + tokens)


def test_kernel_reads_int64_ids_for_row_reads():
    """read_global_rows passes int64 ids, one layer, row-major scales with one entry per token."""
    layout, packs, shards, (anchor, rel), meta = _make_shards(512, True, "cpu", seed=3)
    ids = _ids(4, seed=4, dtype=torch.int64)[1:2].clamp(min=0, max=RANKS * ROWS[1] - 1)
    k = ids.shape[1]
    out = torch.empty((1, k, layout.row_bytes // 4), dtype=torch.int32)
    sf = torch.empty((k, packs), dtype=torch.int32)
    gather_triton.gather_rows(ids, anchor, rel, meta[1:2], out, sf, num_ranks=RANKS, row_words=layout.row_bytes // 4, sf_words=packs, entries=1, sf_layer_stride=0, sf_stride_t=packs, sf_stride_j=1)
    want_rows, want_sfs = _expected(layout, packs, shards, torch.cat([torch.full_like(ids, -1), ids]))
    assert torch.equal(out.view(torch.uint8).view(k, -1), want_rows[1]) and torch.equal(sf, want_sfs[1])


def test_kernel_under_triton_interpret_env():
    """The same check with Triton's own switch, TRITON_INTERPRET=1, set before Triton is imported."""
    pkg = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".host", "pkg")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (
        f"import sys; sys.path[:0] = [{pkg!r}, {tests!r}]\n"
        "from unit.test_gather_triton import check_kernel\n"
        "check_kernel('cpu', 7168, True, 5, True, seed=11)\n"
        "check_kernel('cpu', 320, False, 3, False, seed=12)\n"
        "print('checked')\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "checked" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def _compile_for_hopper(row_words: int, sf_words: int):
    """Compile the kernel ahead of time for sm_90 (no GPU needed: Triton's own LLVM and ptxas) as fetch launches it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = gather_triton._compiled()
    if not isinstance(fn, triton.runtime.JITFunction):
        pytest.skip("TRITON_INTERPRET=1 is set in this process: nothing is compiled")
    block_r, block_c, block_p = gather_triton.block_sizes(row_words, sf_words)
    names = ["ids_ptr", "ids_layer_stride", "anchor_ptr", "rel_ptr", "meta_ptr", "out_ptr", "out_layer_stride", "sf_out_ptr", "sf_layer_stride", "sf_stride_t", "sf_stride_j", "num_rows", "num_ranks", "entries"]
    types = ["*i32", "i32", "*i32", "*i64", "*i64", "*i32", "i64", "*i32", "i32", "i32", "i32", "i32", "i32", "i32"]
    constants = dict(ROW_WORDS=row_words, SF_WORDS=max(1, sf_words), BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_P=block_p, HAS_SF=sf_words > 0, EVEN_C=row_words % block_c == 0)
    signature = dict(zip(names, types)) | {name: "constexpr" for name in constants}
    # What Triton infers at launch for 4096 tokens x 16 entries: tensors and these sizes divisible by 16.
    aligned = [names.index(n) for n in ("ids_ptr", "ids_layer_stride", "anchor_ptr", "rel_ptr", "meta_ptr", "out_ptr", "out_layer_stride", "sf_out_ptr", "num_rows")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    try:
        return triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    except (RuntimeError, FileNotFoundError) as e:
        if "ptxas" in str(e).lower():
            pytest.skip(f"needs Triton's CUDA toolchain (ptxas): {e}")
        raise


@pytest.mark.parametrize("hidden,fp8", [(1024, False), (7168, True)], ids=["h1024-bf16", "h7168-fp8"])
def test_kernel_compiles_for_hopper_with_128_bit_row_accesses(hidden, fp8):
    """The compiled gather moves rows in 16-byte loads and stores (the bandwidth floor needs them)."""
    row_words = hidden * (1 if fp8 else 2) // 4
    kernel = _compile_for_hopper(row_words, hidden // 128 if fp8 else 0)
    ptx = kernel.asm["ptx"]
    _, block_c, _ = gather_triton.block_sizes(row_words, 0)
    steps = -(-row_words // block_c)
    per_thread = gather_triton._TILE_WORDS // (8 * 32)  # words per thread and step
    want = steps * per_thread // 4
    assert ptx.count("ld.global.v4.b32") >= want, f"{ptx.count('ld.global.v4.b32')} 128-bit loads, expected {want}: rows are read in narrower pieces"
    assert ptx.count("st.global.v4.b32") >= want, f"{ptx.count('st.global.v4.b32')} 128-bit stores, expected {want}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hidden,fp8", GEOMETRIES, ids=[f"h{h}-{'fp8' if f else 'bf16'}" for h, f in GEOMETRIES])
@pytest.mark.parametrize("tokens,tma", [(1, True), (5, True), (6, False), (257, True)])
def test_kernel_matches_independent_gather_on_cuda(hidden, fp8, tokens, tma):
    check_kernel("cuda", hidden, fp8, tokens, tma, seed=hidden + tokens)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_single_rank_buffer_kernel_equals_index_select_fetch(fp8):
    """LocalEngramBuffer with the kernel forced (interpreted) == the CPU's one-select fetch, bit for bit."""
    from datetime import timedelta

    import torch.distributed as dist

    from fp8_engram.engram import ue8m0
    from fp8_engram.engram.buffer import LocalEngramBuffer
    from fp8_engram.engram.worker import gloo_group

    group = gloo_group(dist.HashStore(), 0, 1, timedelta(seconds=30))
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    packs = ue8m0.num_sf_packs(256) if fp8 else 0
    plain = LocalEngramBuffer(group, [40, 24], 256, 16, ENTRIES, dtype, packs, device="cpu")
    kernel = LocalEngramBuffer(group, [40, 24], 256, 16, ENTRIES, dtype, packs, device="cpu", gather="triton")
    try:
        assert plain.gather_mode == "unified" and kernel.gather_mode == "triton"
        g = torch.Generator().manual_seed(5)
        full = [torch.randn(n, 256, generator=g) for n in (40, 24)]
        if fp8:
            pairs = [ue8m0.quantize_rows(t) for t in full]
            for buffer in (plain, kernel):
                buffer.write([q for q, _ in pairs], [s for _, s in pairs])
        else:
            for buffer in (plain, kernel):
                buffer.write([t.bfloat16() for t in full])
        for tokens in (1, 7, 16):
            for tma in (True, False):
                indices = torch.randint(-3, 45, (2, tokens, ENTRIES), generator=g, dtype=torch.int32)
                for a, b in zip(plain.fetch(indices, use_tma_aligned_col_major_sf=tma), kernel.fetch(indices, use_tma_aligned_col_major_sf=tma)):
                    a, b = a(), b()
                    if fp8:
                        assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
                        assert a[1].stride() == b[1].stride() and a[1].storage_offset() == b[1].storage_offset()
                        assert torch.equal(a[1]._base, b[1]._base), "scale backings differ (padding included)"
                    else:
                        assert torch.equal(a, b)
        rows = torch.randint(0, 24, (9,), generator=g)
        (da, sa), (db, sb) = plain.read_global_rows(1, rows), kernel.read_global_rows(1, rows)
        assert torch.equal(da.view(torch.uint8), db.view(torch.uint8)) and (sa is None or torch.equal(sa, sb))
    finally:
        plain.destroy()
        kernel.destroy()
