"""LocalEngramBuffer: engram tables sharded over the ranks of one machine, DeepEP `EngramBuffer` contract.

Contract (the one of DeepEP's `EngramBuffer`, see shared/DESIGN.md, engine section):

* Constructed collectively over a process group with `num_entries_per_layer[l]` = rows of layer l held
  by EACH rank, `hidden`, `num_max_tokens`, `num_entries_per_token`, `dtype` (bfloat16, or float8_e4m3fn
  with `num_sf_packs` > 0 packed 4-byte scale factors per row). Every rank must pass the same values.
* Global row `g` of layer `l` lives on rank `g // n_l` at local row `g % n_l`.
* `write(storages, sfs)`: each rank copies its own shards `[n_l, hidden]`; `sfs[l]` is either its own
  scale rows `[n_l, num_sf_packs]` or the group-wide table `[num_ranks * n_l, num_sf_packs]`.
* `fetch(indices, num_qps=0, use_tma_aligned_col_major_sf=True)` with int32 `[layers, tokens, entries]`
  returns one hook per layer. A hook returns, for BF16, `data` `[tokens, entries * hidden]` contiguous;
  for FP8 `(data, sf)` with `sf` `[tokens, entries * num_sf_packs]` in the scale dtype that was written:
  MN-major and TMA aligned (strides `(1, align(tokens, 4))`, a view into a backing tensor
  `[layers, entries * num_sf_packs * align(tokens, 4)]`, layer l at offset `l * layer_stride`) or
  row-major (strides `(entries * num_sf_packs, 1)`). Negative or out-of-range ids give zero data and
  zero scale factors. Ranks fetch independently: no collective per fetch.

Gather modes (`gather_mode`):

* "triton" (the default on CUDA): one Triton kernel per fetch (gather_triton.py) over a device table of
  the shards' base addresses: every requested row of every layer is read once from its owner's shard
  and written once into the output, scale factors straight into the requested layout, zeros for
  invalid ids; no host sync, CUDA-graph capturable; ranks on one GPU or on several use the same code.
  Forced on CPU buffers it runs in Triton's interpreter (tests of the indexing).
* "unified" (the default on the CPU): every shard is mapped into one virtual range (CPU shared memory,
  any one-rank group), global ids become row numbers of that range with integer arithmetic, and ALL
  rows are gathered by one `index_select` straight into the output (invalid ids read a zero row kept in
  the layout).
* "grouped" (CPU, shards in separate mappings): one select per peer over only its ids.
* "fixed_shape" (CUDA without Triton): fixed-shape device ops only: per peer one select of all ids in
  which foreign and invalid ids read that peer's zero row, into a stack `[ranks, n, row]`, then one
  select that picks each id's row from its owner's slice.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .allocators import ShardAllocator, ShardMemory, ShardSharingError, all_gather_int64, barrier, collective_device, default_allocator
from .rows import check_buffer_indices, check_buffer_storages, make_hook, word_dtype
from .shard_gathers import ShardGathers
from .shard_layout import ROW_ALIGNMENT_BYTES, ShardLayout, align  # noqa: F401 - re-exported: the layout the gather kernels read

logger = logging.getLogger(__name__)

# DeepGEMM's TMA alignment of MN-major 4-byte scale factors (and DeepEP's kNumAlignedSFPacks).
NUM_ALIGNED_SF_PACKS = 4
# Limits of DeepEP's EngramBuffer configuration.
NUM_MAX_LAYERS = 128
_WRITE_CHUNK_BYTES = 1 << 30
# Rows each rank writes into every layer of its shard at start, besides the first, middle and last ones,
# for the check that every rank reads them back through the gather fetch uses (seeded positions).
PROBE_SEEDED_ROWS = 3
_DTYPE_CODES = {torch.bfloat16: 1, torch.float8_e4m3fn: 2}

_allocator_override: ShardAllocator | None = None


def set_shard_allocator(allocator: ShardAllocator | None) -> None:
    """Override how shard buffers are allocated (None restores the default for the device)."""
    global _allocator_override
    _allocator_override = allocator


def _triton_available() -> bool:
    try:
        from . import gather_triton
    except ImportError:
        return False
    return gather_triton.available()


class LocalEngramBuffer(ShardGathers):
    """Engram tables sharded over one machine's ranks; see the module docstring for the contract."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_entries_per_layer: Sequence[int],
        hidden: int,
        num_max_tokens: int,
        num_entries_per_token: int,
        dtype: torch.dtype = torch.bfloat16,
        num_sf_packs: int = 0,
        *,
        device: torch.device | str | None = None,
        allocator: ShardAllocator | None = None,
        gather: str | None = None,
    ) -> None:
        if dtype not in _DTYPE_CODES:
            raise ValueError(f"unsupported engram table dtype {dtype}; use torch.bfloat16 or torch.float8_e4m3fn")
        if (dtype == torch.float8_e4m3fn) != (num_sf_packs > 0):
            raise ValueError(f"FP8 tables need num_sf_packs > 0 and BF16 tables need 0, got dtype={dtype} num_sf_packs={num_sf_packs}")
        if num_max_tokens <= 0 or num_entries_per_token <= 0 or hidden <= 0:
            raise ValueError(f"sizes must be positive, got num_max_tokens={num_max_tokens} num_entries_per_token={num_entries_per_token} hidden={hidden}")
        rows = [int(n) for n in num_entries_per_layer]
        if not 0 < len(rows) <= NUM_MAX_LAYERS or any(n <= 0 for n in rows):
            raise ValueError(f"num_entries_per_layer must hold 1..{NUM_MAX_LAYERS} positive row counts, got {list(num_entries_per_layer)}")
        if hidden * dtype.itemsize % ROW_ALIGNMENT_BYTES:
            raise ValueError(f"a row of {hidden} {dtype} values is {hidden * dtype.itemsize} bytes, not a multiple of {ROW_ALIGNMENT_BYTES}")

        if gather not in (None, "triton", "unified", "fixed_shape", "grouped"):
            raise ValueError(f"gather must be None, 'triton', 'unified', 'fixed_shape' or 'grouped', got {gather!r}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.group = group
        self.rank_idx = group.rank()
        self.num_ranks = group.size()
        self.num_entries_per_layer = rows
        self.num_layers = len(rows)
        self.hidden = hidden
        self.dtype = dtype
        self.num_max_tokens = num_max_tokens
        self.num_entries_per_token = num_entries_per_token
        self.num_sf_packs = num_sf_packs
        self.use_fp8 = num_sf_packs > 0
        self.sf_dtype = torch.int32  # the dtype of the scales given to write() wins
        self.layout = ShardLayout.build(rows, hidden * dtype.itemsize, num_sf_packs * 4)
        self.num_bytes = self.layout.num_bytes
        self._coll_device = collective_device(group, self.device)
        self._check_same_config_on_all_ranks()

        allocator = allocator or _allocator_override or default_allocator(self.device)
        memory: ShardMemory = allocator(group, self.num_bytes, self.device)
        if len(memory.peers) != self.num_ranks or any(p.dtype != torch.uint8 or p.numel() < self.num_bytes for p in memory.peers):
            raise RuntimeError("the shard allocator returned buffers that do not fit the layout")
        self._memory = memory
        self._build_views()
        # How fetch gathers (see the module docstring); `gather` forces a mode (tests run the Triton
        # kernel in the interpreter and the fixed-shape path on CPU ranks with it).
        if gather is None:
            if self.device.type == "cuda":
                gather = "triton" if _triton_available() else "fixed_shape"
            else:
                gather = "unified" if self._unified else "grouped"
        if (gather == "unified" and not self._unified) or (gather == "grouped" and self.device.type != "cpu") or (gather == "triton" and not _triton_available()):
            self.destroy()
            raise ValueError(
                f"gather={gather!r} is not possible here: 'unified' needs every shard in one address range (CPU shared memory or one rank), "
                f"'grouped' serves CPU buffers only (buffer on {self.device}), 'triton' needs Triton installed"
            )
        self.gather_mode = gather
        if gather == "triton":
            try:
                self._build_kernel_tables()
            except BaseException:
                self.destroy()
                raise
        try:
            problem = self._peer_read_problem()
        except BaseException:
            self.destroy()
            raise
        if problem is not None:  # raised with no view of a shard alive (a traceback's frames would keep one mapped)
            self.destroy()
            raise ShardSharingError(problem)
        barrier(group, self._coll_device, self.device)

    # ----- setup -----

    def _check_same_config_on_all_ranks(self) -> None:
        mine = [self.num_bytes, self.hidden, _DTYPE_CODES[self.dtype], self.num_sf_packs, self.num_entries_per_token, self.num_max_tokens, self.num_layers]
        mine += self.num_entries_per_layer + [-1] * (NUM_MAX_LAYERS - self.num_layers)
        gathered = all_gather_int64(self.group, mine, self._coll_device)
        differing = [r for r, theirs in enumerate(gathered) if theirs != mine]
        if differing:
            raise RuntimeError(
                f"engram buffer configuration differs across ranks (rank {self.rank_idx} has {mine[:7 + self.num_layers]}, "
                f"ranks {differing} differ: {[gathered[r][:7 + max(gathered[r][6], 0)] for r in differing]})"
            )

    def _probe_plan(self, nonce: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """What the rank with `nonce` probes, per layer: (local rows int64 [k] sorted and unique, their
        pattern uint8 [k, row_bytes], their scale pattern uint8 [k, sf_row_bytes] or None). The rows are
        the first, the middle and the last of the layer and PROBE_SEEDED_ROWS seeded ones; every rank
        derives every peer's plan from the peer's nonce."""
        generator = torch.Generator().manual_seed(nonce)
        plan = []
        for n in self.num_entries_per_layer:
            seeded = torch.randint(0, n, (PROBE_SEEDED_ROWS,), generator=generator)
            rows = torch.unique(torch.cat([torch.tensor([0, n // 2, n - 1]), seeded]))
            data = torch.randint(0, 256, (rows.numel(), self.layout.row_bytes), dtype=torch.uint8, generator=generator)
            sf = torch.randint(0, 256, (rows.numel(), self.layout.sf_row_bytes), dtype=torch.uint8, generator=generator) if self.use_fp8 else None
            plan.append((rows, data, sf))
        return plan

    def _gather_probe(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Global ids int32 [layers, k] -> (row bytes uint8 [layers, k, row_bytes], scale bytes uint8
        [layers, k, sf_row_bytes] or None), read by the gather fetch and read_global_rows use: the Triton
        kernel over this buffer's own shard table, else the CPU/fixed-shape gather over its own views."""
        layers, k = ids.shape
        out = torch.empty((layers, k, self.layout.row_bytes), dtype=torch.uint8, device=self.device)
        sf = torch.empty((layers, k, self.layout.sf_row_bytes), dtype=torch.uint8, device=self.device) if self.use_fp8 else None
        if self.gather_mode == "triton":
            packs = self.num_sf_packs
            self._launch(ids, self._meta, out, sf, 1, (k * packs, packs, 1))
        else:
            for layer in range(layers):
                self._gather(layer, ids[layer], out[layer], None if sf is None else sf[layer])
        return out, sf

    def _peer_read_problem(self) -> str | None:
        """Collective, once at start: every rank writes random probe rows (first, middle, last and seeded
        rows of every layer, table rows and scale rows, from a nonce it shares) into its own shard; every
        rank reads every rank's probe rows back through the product's own gather (`_gather_probe`: the
        Triton kernel and its shard table on CUDA, the CPU fetch's views on the CPU), so a pointer table
        or a mapping that is wrong anywhere the probes land (a partial mapping, an offset, other memory)
        fails here instead of serving wrong rows. The ranks put the saved rows back, gather how many
        probe rows each read wrong, and all return the same text naming the pairs (None when none was)."""
        if self.num_ranks == 1:
            return None
        nonces = [row[0] for row in all_gather_int64(self.group, [secrets.randbits(62)], self._coll_device)]
        plans = [self._probe_plan(nonce) for nonce in nonces]
        own_tables = self._tables[self.rank_idx]
        own_sfs = self._sfs[self.rank_idx] if self.use_fp8 else None
        saved = []
        for layer, (rows, data, sf) in enumerate(plans[self.rank_idx]):
            rows = rows.to(self.device)
            saved.append((rows, own_tables[layer].index_select(0, rows), own_sfs[layer].index_select(0, rows) if own_sfs is not None else None))
            own_tables[layer].index_copy_(0, rows, data.to(self.device))
            if own_sfs is not None:
                own_sfs[layer].index_copy_(0, rows, sf.to(self.device))
        barrier(self.group, self._coll_device, self.device)
        # One read of every rank's probe rows, all layers at once; layers with fewer probes pad with -1.
        width = max(sum(plan[layer][0].numel() for plan in plans) for layer in range(self.num_layers))
        ids = torch.full((self.num_layers, width), -1, dtype=torch.int32)
        owner = torch.full((self.num_layers, width), -1, dtype=torch.int64)
        local = torch.zeros((self.num_layers, width), dtype=torch.int64)
        expected = torch.zeros((self.num_layers, width, self.layout.row_bytes), dtype=torch.uint8)
        expected_sf = torch.zeros((self.num_layers, width, self.layout.sf_row_bytes), dtype=torch.uint8) if self.use_fp8 else None
        for layer, n in enumerate(self.num_entries_per_layer):
            at = 0
            for peer, plan in enumerate(plans):
                rows, data, sf = plan[layer]
                k = rows.numel()
                ids[layer, at : at + k] = (rows + peer * n).to(torch.int32)
                owner[layer, at : at + k] = peer
                local[layer, at : at + k] = rows
                expected[layer, at : at + k] = data
                if expected_sf is not None:
                    expected_sf[layer, at : at + k] = sf
                at += k
        got, got_sf = self._gather_probe(ids.to(self.device))
        wrong_rows = (got.cpu() != expected).any(dim=-1)
        if got_sf is not None:
            wrong_rows |= (got_sf.cpu() != expected_sf).any(dim=-1)
        barrier(self.group, self._coll_device, self.device)  # every rank has read before any puts its rows back
        for layer, (rows, table_rows, sf_rows) in enumerate(saved):
            own_tables[layer].index_copy_(0, rows, table_rows)
            if sf_rows is not None:
                own_sfs[layer].index_copy_(0, rows, sf_rows)
        mine = []  # per owner: rows read wrong, and the first one (layer, local row; -1 when none)
        for peer in range(self.num_ranks):
            hits = torch.nonzero(wrong_rows & (owner == peer))
            first = hits[0].tolist() if hits.numel() else None
            mine += [hits.shape[0], first[0] if first else -1, int(local[first[0], first[1]]) if first else -1]
        reports = all_gather_int64(self.group, mine, self._coll_device)
        totals = [sum(plan[layer][0].numel() for layer in range(self.num_layers)) for plan in plans]
        bad = [f"rank {reader} read {row[3 * owner_rank]} of {totals[owner_rank]} probe rows of rank {owner_rank}'s shard wrong "
               f"(the first: layer {row[3 * owner_rank + 1]}, row {row[3 * owner_rank + 2]})"
               for reader, row in enumerate(reports) for owner_rank in range(self.num_ranks) if row[3 * owner_rank]]
        if not bad:
            return None
        return (f"the engram shards are not shared correctly between the {self.num_ranks} ranks: {'; '.join(bad)} "
                f"(each rank wrote probe rows over its own shard and read every rank's back through the gather that fetch uses)")

    def _build_views(self) -> None:
        layout, memory = self.layout, self._memory
        self._table_word = word_dtype(layout.row_bytes)
        self._row_words = layout.row_bytes // self._table_word.itemsize
        self._sf_word = word_dtype(layout.sf_row_bytes) if self.use_fp8 else torch.uint8
        self._sf_words = layout.sf_row_bytes // self._sf_word.itemsize if self.use_fp8 else 0

        def region(buf: torch.Tensor, offset: int, n: int, row_bytes: int) -> torch.Tensor:
            return buf[offset : offset + n * row_bytes].view(n, row_bytes)

        # [rank][layer] -> uint8 [n_l, row_bytes] / [n_l, sf_row_bytes]
        self._tables = [[region(p, layout.table_offsets[l], n, layout.row_bytes) for l, n in enumerate(self.num_entries_per_layer)] for p in memory.peers]
        self._sfs = (
            [[region(p, layout.sf_offsets[l], n, layout.sf_row_bytes) for l, n in enumerate(self.num_entries_per_layer)] for p in memory.peers]
            if self.use_fp8
            else []
        )
        # [rank] -> every table row of the shard plus its zero row (resp. every scale row plus the zero
        # scale row) as words: row (offset // row_bytes) + r is local row r of the layer at that offset.
        table_span = layout.zero_row_offset + layout.row_bytes
        self._peer_rows = [p[:table_span].view(self._table_word).view(-1, self._row_words) for p in memory.peers]
        self._table_zero_row = layout.zero_row_offset // layout.row_bytes
        if self.use_fp8:
            sf_span = layout.zero_sf_offset + layout.sf_row_bytes
            self._peer_sf_rows = [p[:sf_span].view(self._sf_word).view(-1, self._sf_words) for p in memory.peers]
            self._sf_zero_row = layout.zero_sf_offset // layout.sf_row_bytes
        else:
            self._peer_sf_rows = []
        unified = memory.unified
        stride = memory.stride
        self._unified = unified is not None and stride % layout.row_bytes == 0 and (not self.use_fp8 or stride % layout.sf_row_bytes == 0)
        if self._unified:
            span = self.num_ranks * stride
            self._all_rows = unified[:span].view(self._table_word).view(span // layout.row_bytes, self._row_words)
            self._seg_rows = stride // layout.row_bytes
            self._zero_row = layout.zero_row_offset // layout.row_bytes
            self._index_dtype = torch.int32 if span // min(layout.row_bytes, layout.sf_row_bytes or layout.row_bytes) < 2**31 - 1 else torch.int64
            self._geometry = None  # per layer [layers, 1] tensors of the one-select gather, made at first use
            if self.use_fp8:
                self._all_sfs = unified[:span].view(self._sf_word).view(span // layout.sf_row_bytes, self._sf_words)
                self._seg_sf_rows = stride // layout.sf_row_bytes
                self._zero_sf_row = layout.zero_sf_offset // layout.sf_row_bytes

    def _build_kernel_tables(self) -> None:
        """Device tables of the one-pass kernel: where each shard is (from this rank's own), and per layer (rows, offsets)."""
        from .gather_triton import gather_rows, shard_table

        self._gather_rows = gather_rows  # looked up once here, not by an import statement in every fetch
        layout = self.layout
        self._anchor = self._memory.local.view(torch.int32)
        rel = shard_table([p.data_ptr() for p in self._memory.peers], self._anchor.data_ptr())
        self._bases = torch.tensor(rel, dtype=torch.int64).to(self.device)
        sf_offsets = layout.sf_offsets if self.use_fp8 else (0,) * self.num_layers
        meta = [[n, layout.table_offsets[l] // 4, sf_offsets[l] // 4] for l, n in enumerate(self.num_entries_per_layer)]
        self._meta = torch.tensor(meta, dtype=torch.int64).to(self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _launch(self, ids: torch.Tensor, meta: torch.Tensor, out: torch.Tensor, sf_out: torch.Tensor | None, entries: int, sf_strides: tuple[int, int, int]) -> None:
        if ids.numel() == 0:
            return
        layers = ids.shape[0]
        kwargs = dict(
            num_ranks=self.num_ranks,
            row_words=self.layout.row_bytes // 4,
            sf_words=self.num_sf_packs,
            entries=entries,
            sf_layer_stride=sf_strides[0],
            sf_stride_t=sf_strides[1],
            sf_stride_j=sf_strides[2],
        )
        words = out.view(torch.uint8).view(torch.int32).view(layers, ids.shape[1], -1)
        sf_words = sf_out.view(torch.int32) if sf_out is not None else None
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                self._gather_rows(ids, self._anchor, self._bases, meta, words, sf_words, **kwargs)
        else:
            self._gather_rows(ids, self._anchor, self._bases, meta, words, sf_words, **kwargs)

    def _check_alive(self) -> None:
        if self._memory is None:
            raise RuntimeError("this LocalEngramBuffer has been destroyed")

    # ----- DeepEP EngramBuffer API -----

    def destroy(self, between: Callable[[], None] | None = None) -> None:
        """Drop every view and release the shard memory (idempotent).

        `between` runs once the peers' shards are unmapped and before this rank's own shard is freed
        (EngramGroup waits for its workers there); it runs even when there was nothing to release.
        With CUDA IPC shards this is collective (every rank calls it: they agree that nobody maps a
        shard before its owner frees it); CPU shards need no agreement.
        """
        memory, self._memory = getattr(self, "_memory", None), None
        self._tables = self._sfs = []
        self._peer_rows = self._peer_sf_rows = []
        self._all_rows = self._all_sfs = None
        self._bases = self._meta = self._anchor = None
        if memory is not None:
            memory.release(between)
        elif between is not None:
            between()

    def write(self, storages: Sequence[torch.Tensor], sfs: Sequence[torch.Tensor] | None = None) -> None:
        """Collective: copy this rank's shards `[n_l, hidden]` (and scale factors) into the buffer."""
        self._check_alive()
        barrier(self.group, self._coll_device, self.device)
        check_buffer_storages(storages, self.num_entries_per_layer, self.hidden, self.dtype)
        if self.use_fp8:
            if sfs is None or len(sfs) != self.num_layers:
                raise ValueError(f"FP8 engram tables need one scale-factor tensor per layer ({self.num_layers}), got {None if sfs is None else len(sfs)}")
            sf_dtype = sfs[0].dtype
            local_sfs = []
            for layer, sf in enumerate(sfs):
                n = self.num_entries_per_layer[layer]
                if sf.dim() != 2 or sf.size(1) != self.num_sf_packs or sf.element_size() != 4 or not sf.is_contiguous():
                    raise ValueError(f"layer {layer}: scale factors must be contiguous [rows, {self.num_sf_packs}] with 4-byte elements, got {sf.dtype} {tuple(sf.shape)}")
                if sf.dtype != sf_dtype:
                    raise ValueError(f"layer {layer}: scale-factor dtype {sf.dtype} differs from layer 0's {sf_dtype}")
                if sf.size(0) == self.num_ranks * n and self.num_ranks > 1:
                    sf = sf[self.rank_idx * n : (self.rank_idx + 1) * n]
                elif sf.size(0) != n:
                    raise ValueError(f"layer {layer}: {sf.size(0)} scale rows, expected {n} (own rows) or {self.num_ranks * n} (group-wide)")
                local_sfs.append(sf)
        elif sfs is not None:
            raise ValueError("BF16 engram tables take no scale factors")

        for layer, storage in enumerate(storages):
            source = storage.view(torch.uint8).view(storage.shape[0], self.layout.row_bytes)
            destination = self._tables[self.rank_idx][layer]
            step = max(1, _WRITE_CHUNK_BYTES // self.layout.row_bytes)
            for start in range(0, source.shape[0], step):
                destination[start : start + step].copy_(source[start : start + step])
        if self.use_fp8:
            self.sf_dtype = sf_dtype
            for layer, sf in enumerate(local_sfs):
                self._sfs[self.rank_idx][layer].copy_(sf.contiguous().view(torch.uint8).view(sf.shape[0], self.layout.sf_row_bytes))
        barrier(self.group, self._coll_device, self.device)

    def fetch(self, indices: torch.Tensor, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = True) -> list[Callable[[], object]]:
        """Gather the requested rows of every layer; one hook per layer (see the module docstring).

        `num_qps` is accepted for DeepEP compatibility and ignored (no queue pairs here).
        """
        del num_qps
        self._check_alive()
        num_layers, num_tokens, entries = check_buffer_indices(indices, self.num_layers, self.num_entries_per_token, self.num_max_tokens, self.device)

        n = num_tokens * entries
        data = torch.empty((num_layers, num_tokens, entries * self.hidden), dtype=self.dtype, device=self.device)
        if self.use_fp8:
            sf_width = entries * self.num_sf_packs
            if use_tma_aligned_col_major_sf:
                mn_stride = align(num_tokens, NUM_ALIGNED_SF_PACKS)
                sf_layer_stride = sf_width * mn_stride
                sf_strides = (1, mn_stride)
            else:
                sf_layer_stride = sf_width * num_tokens
                sf_strides = (sf_width, 1)
            if self.gather_mode == "triton":
                # The kernel writes every scale; only the TMA padding tokens need zeros.
                sf_backing = torch.empty((num_layers, sf_layer_stride), dtype=self.sf_dtype, device=self.device)
                if use_tma_aligned_col_major_sf and mn_stride > num_tokens:
                    sf_backing.view(num_layers, sf_width, mn_stride)[:, :, num_tokens:].zero_()
            else:
                sf_backing = torch.zeros((num_layers, sf_layer_stride), dtype=self.sf_dtype, device=self.device)

        if self.gather_mode == "triton":
            # One launch for every layer: rows and scale factors land in their final places.
            sf_arg = sf_backing if self.use_fp8 else None
            sf_arg_strides = (sf_layer_stride, sf_strides[0], sf_strides[1]) if self.use_fp8 else (0, 0, 0)
            self._launch(indices.view(num_layers, n), self._meta, data, sf_arg, entries, sf_arg_strides)
            results = []
            for layer in range(num_layers):
                if self.use_fp8:
                    results.append((data[layer], sf_backing.as_strided((num_tokens, sf_width), sf_strides, layer * sf_layer_stride)))
                else:
                    results.append(data[layer])
            return [make_hook(r) for r in results]

        rows, sf_rows = self.gather_layers(indices.view(num_layers, n))
        data = rows.view(num_layers, num_tokens, entries * self.hidden)
        results: list[object] = []
        for layer in range(num_layers):
            if self.use_fp8:
                sf = sf_backing.as_strided((num_tokens, sf_width), sf_strides, layer * sf_layer_stride)
                sf.copy_(sf_rows[layer].view(num_tokens, sf_width))
                results.append((data[layer], sf))
            else:
                results.append(data[layer])
        return [make_hook(r) for r in results]

    # ----- row access for the host-side group (no collectives; writes go straight to the owner's shard) -----

    def shard(self, rank: int, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rank `rank`'s rows of a layer as (table dtype [n_l, hidden], scale dtype [n_l, packs] or None)."""
        self._check_alive()
        table = self._tables[rank][layer].view(self.dtype).view(self.num_entries_per_layer[layer], self.hidden)
        sf = self._sfs[rank][layer].view(self.sf_dtype).view(self.num_entries_per_layer[layer], self.num_sf_packs) if self.use_fp8 else None
        return table, sf

    def gather_layers(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every layer's rows in one pass: global ids [layers, n] (negative or past a layer: zero rows and
        zero scales) -> (table dtype [layers, n, hidden], scale dtype [layers, n, packs] or None). Triton:
        one launch for all layers; CPU shared memory: one select over every shard; else one gather per layer."""
        self._check_alive()
        layers, n = indices.shape
        if layers != self.num_layers:
            raise ValueError(f"indices cover {layers} layers, the buffer has {self.num_layers}")
        out = torch.empty((layers, n, self.layout.row_bytes), dtype=torch.uint8, device=self.device)
        sf = torch.empty((layers, n, self.layout.sf_row_bytes), dtype=torch.uint8, device=self.device) if self.use_fp8 else None
        ids = indices.to(self.device)
        if n and self.gather_mode == "triton":
            self._launch(ids.contiguous(), self._meta, out, sf, 1, (n * self.num_sf_packs, self.num_sf_packs, 1))
        elif n and self.gather_mode == "unified":
            self._gather_unified(None, ids, out, sf)
        elif n:
            for layer in range(layers):
                self._gather(layer, ids[layer], out[layer], sf[layer] if sf is not None else None)
        data = out.view(self.dtype).view(layers, n, self.hidden)
        return data, (sf.view(self.sf_dtype).view(layers, n, self.num_sf_packs) if sf is not None else None)

    def read_global_rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Valid global ids int64 [k] -> (table dtype [k, hidden], scales [k, packs] or None)."""
        self._check_alive()
        k = rows.numel()
        out = torch.empty((k, self.layout.row_bytes), dtype=torch.uint8, device=self.device)
        sf = torch.empty((k, self.layout.sf_row_bytes), dtype=torch.uint8, device=self.device) if self.use_fp8 else None
        ids = rows.to(self.device, torch.int64)
        if self.gather_mode == "triton":
            packs = self.num_sf_packs
            self._launch(ids.view(1, k), self._meta[layer : layer + 1], out, sf, 1, (0, packs, 1))
        else:
            self._gather(layer, ids, out, sf)
        data = out.view(self.dtype).view(k, self.hidden)
        return data, (sf.view(self.sf_dtype).view(k, self.num_sf_packs) if sf is not None else None)

    def write_global_rows(self, layer: int, rows: torch.Tensor, data: torch.Tensor, sf: torch.Tensor | None) -> None:
        """Write encoded rows (unique valid global ids) straight into their owners' shards."""
        self._check_alive()
        n = self.num_entries_per_layer[layer]
        rows = rows.to(self.device, torch.int64)
        data = data.to(self.device).contiguous().view(torch.uint8).view(-1, self.layout.row_bytes)
        if sf is not None:
            sf = sf.to(self.device).contiguous().view(torch.uint8).view(-1, self.layout.sf_row_bytes)
        owner = torch.div(rows, n, rounding_mode="floor")
        for peer in torch.unique(owner).tolist():
            positions = torch.nonzero(owner == peer).squeeze(1)
            local = rows.index_select(0, positions) - peer * n
            self._tables[peer][layer].index_copy_(0, local, data.index_select(0, positions))
            if sf is not None:
                self._sfs[peer][layer].index_copy_(0, local, sf.index_select(0, positions))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
