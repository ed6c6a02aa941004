"""EngramMemory: a hashed n-gram memory over a RowStore, bound to one text-encoder family.

This is what ComfyUI's ENGRAM_MEMORY socket carries. It holds
- `config` (MemoryConfig): the stream layout (which CONDITIONING rows/columns each tokenizer fills),
  the hashing parameters, the row width, the gate setting and the fingerprint of every tokenizer's
  vocabulary (a memory refuses a tokenizer it was not built for) and the tokenizer compression rule
  (compress.py) its row ids were hashed under;
- `store`: the tables (LocalRowStore, or an EngramGroup of worker processes); the memory owns it and
  `close()` releases it;
- `version`: bumped by every write, so callers can tell a changed memory from an unchanged one;
- `name` and `source`: what to call the memory in messages, and the table file it was loaded from
  (None when it exists only in memory), so a memory that lost a worker can say how it is recovered.

`check()` says whether the memory can still serve: it raises when it was closed, or when a worker
process of its tables is gone (EngramWorkerError naming the rank). A memory that failed stays failed:
close it and make a new one.

Tokens come in ComfyUI's `tokenize(text, return_word_ids=True)` format (see streams.py).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from ..common.proc import process_state
from .compress import CompressedVocab, compressed_vocab
from .config import (  # noqa: F401 - the settings, their metadata and their bounds are re-exported
    MAX_COLUMN,
    MAX_HIDDEN,
    MAX_STREAMS,
    MEMORY_FORMAT,
    MEMORY_FORMAT_VERSION,
    MemoryConfig,
    config_from_table_file,
    make_config,
)
from .fit import FitResult, LayerExample, closed_form_write, fit, mean_squared_error
from .hashing import NgramHasher
from .errors import EngramMemoryError, EngramWorkerError
from .inject import combine, inject
from .rows import RowStore
from .streams import StreamTokens, place_tokens, total_rows

logger = logging.getLogger(__name__)


@dataclass
class Hit:
    """How one live token of one stream meets the memory."""

    stream: str
    row: int  # CONDITIONING row
    token_id: int
    entries_hit: int  # entries whose row holds a nonzero value
    entries: int
    norm: float  # L2 norm of the token's memory value v


class TableState:
    """What a memory knows about its store beyond the store itself, kept in its own object so that a
    new memory over the same store can take it over: which rows were written since the last clear
    (`rows`: per layer int64 row ids, or None when unknown, e.g. tables loaded from a file), and why the
    store was closed (`closed_reason`, None while open)."""

    __slots__ = ("rows", "closed_reason")

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] | None = {}
        self.closed_reason: str | None = None


class EngramMemory:
    def __init__(self, config: MemoryConfig, store: RowStore, vocabs: Mapping[str, CompressedVocab] | None = None):
        if store.num_layers != config.hashing.num_layers:
            raise EngramMemoryError(f"the tables have {store.num_layers} layers, the memory needs {config.hashing.num_layers}")
        if store.hidden != config.hidden:
            raise EngramMemoryError(f"the tables' rows are {store.hidden} wide, the memory's are {config.hidden}")
        self.hasher = NgramHasher(config.hashing)
        for layer, (have, need) in enumerate(zip(store.rows_per_layer, self.hasher.rows_needed)):
            if have < need:
                raise EngramMemoryError(f"layer {layer} has {have} rows, the hashing needs {need}")
        self.config = config
        self.store = store
        self.version = 0
        self.uid = uuid.uuid4().hex
        self._vocabs: dict[str, CompressedVocab] = {}
        self._lock = threading.RLock()
        # Rows written through this object, per layer (so `clear` zeroes only those); None = unknown
        # (tables loaded from a file), then `clear` zeroes everything. See TableState.
        self.state = TableState()
        self.name = "engram memory"
        self.source: str | None = None  # the table file the tables were loaded from
        self.saved_to: str | None = None  # the table file `save` last wrote
        if vocabs:
            for key, vocab in vocabs.items():
                self._accept_vocab(key, vocab)

    @property
    def _written(self) -> dict[int, torch.Tensor] | None:
        return self.state.rows

    @_written.setter
    def _written(self, rows: dict[int, torch.Tensor] | None) -> None:
        self.state.rows = rows

    def __repr__(self) -> str:
        legacy = (f", compression={self.config.compression} (legacy rule: CJK, Hangul, Thai and emoji tokens that CLIP "
                  "splits into bytes share rows; memorize into a New Engram Memory to use the current rule)"
                  if self.config.legacy_compression else "")
        return (f"EngramMemory({self.config.layout.family}: {self.config.layout.names}, rows={self.store.rows_per_layer}, "
                f"hidden={self.config.hidden}, dtype={self.store.table_dtype}, version={self.version}{legacy})")

    # ----- tokenizers -----

    def _accept_vocab(self, key: str, vocab: CompressedVocab) -> None:
        if vocab.rule != self.config.compression:
            raise EngramMemoryError(f"tokenizer {key!r} was compressed under rule {vocab.rule!r}, this memory was hashed "
                                    f"under {self.config.compression!r}")
        expected = self.config.fingerprints.get(key)
        if expected is not None and expected != vocab.fingerprint:
            raise EngramMemoryError(
                f"this memory was built for another {key!r} tokenizer (vocabulary fingerprint {expected[:12]}..., "
                f"got {vocab.fingerprint[:12]}...); use the CLIP it was made with"
            )
        layer = [i for i, s in enumerate(self.config.layout.streams) if s.token_key == key]
        for i in layer:
            if self.config.hashing.vocab_sizes[i] != vocab.num_compressed:
                raise EngramMemoryError(f"tokenizer {key!r} has {vocab.num_compressed} compressed ids, the memory expects {self.config.hashing.vocab_sizes[i]}")
        self._vocabs[key] = vocab

    def bind_tokenizers(self, tokenizers: Mapping[str, Any]) -> None:
        """Attach (and check) the tokenizers of the streams; cheap when already bound (cached)."""
        for s in self.config.layout.streams:
            if s.token_key in tokenizers:
                self._accept_vocab(s.token_key, compressed_vocab(tokenizers[s.token_key], self.config.compression))

    def _vocab(self, key: str) -> CompressedVocab:
        try:
            return self._vocabs[key]
        except KeyError:
            raise EngramMemoryError(f"no tokenizer bound for token key {key!r}; call bind_tokenizers first") from None

    # ----- lookup -----

    def place(self, tokens: Mapping[str, Any]) -> list[StreamTokens]:
        return place_tokens(self.config.layout, tokens)

    def indices(self, placed: Sequence[StreamTokens], num_rows: int | None = None) -> torch.Tensor:
        """int32 [layers, rows, entries]: every stream's row ids at its CONDITIONING rows, -1 elsewhere."""
        num_rows = total_rows(placed) if num_rows is None else num_rows
        out = torch.full((len(placed), num_rows, self.config.hashing.entries), -1, dtype=torch.int32)
        for layer, p in enumerate(placed):
            compressed = self._vocab(p.stream.token_key).compress(p.token_ids)
            out[layer, p.rows] = self.hasher.hash_layer(layer, compressed)
        return out

    def prefetch(self, tokens: Mapping[str, Any]) -> Future:
        """Start the lookup of `tokens` (hash + fetch, all known from the token ids) on a thread, so that it
        runs while the text encoder does; `.result()` gives what `values(tokens)` gives. The thread runs
        in the caller's inference mode; an error comes out of `.result()`."""
        inference = torch.is_inference_mode_enabled()

        def lookup():
            with torch.inference_mode(inference):
                return self.values(tokens)

        return _prefetch_pool().submit(lookup)

    def lookup_beside(self, tokens: Mapping[str, Any], work: Callable[[], Any]) -> tuple[Any, tuple]:
        """(work(), the lookup of `tokens`), the lookup running on a thread while `work` (the text
        encoder) runs here. When `work` raises, the lookup is waited for and the error propagates."""
        pending = self.prefetch(tokens)
        try:
            result = work()
        except BaseException:
            wait([pending])
            raise
        return result, pending.result()

    def values(self, tokens: Mapping[str, Any]) -> tuple[list[StreamTokens], list[torch.Tensor], list[torch.Tensor]]:
        """(placed streams, memory values v per stream float32 [n, width], fetched rows per stream)."""
        placed = self.place(tokens)
        idx = self.indices(placed)
        # Fetch only the rows of tokens that have an entry in some layer (BOS/EOS/padding are most of a
        # 77-token chunk), then put them back in place.
        live = (idx >= 0).any(dim=2).any(dim=0).nonzero().reshape(-1)
        with self._lock:
            fetched = self.store.fetch_rows(idx.index_select(1, live).contiguous())
        values, per_stream = [], []
        for layer, p in enumerate(placed):
            rows = torch.zeros(idx.shape[1], idx.shape[2], self.store.hidden, dtype=torch.float32)
            rows[live] = fetched[layer].to(rows.device)
            rows = rows[p.rows]
            per_stream.append(rows)
            v = combine(rows, p.stream.width)
            self._check_value_finite(v, rows, layer, p)
            values.append(v)
        return placed, values, per_stream

    def _where(self) -> str:
        """The memory as messages name it: its table file when it came from one, else its name."""
        return self.source or self.name

    def _check_value_finite(self, v: torch.Tensor, rows: torch.Tensor, layer: int, p: StreamTokens) -> None:
        """Refuse a combined value v [n, width] that is not finite though every fetched row is (the store
        checks each row): rows as large as bf16 allows (about 3.4e38) overflow when summed."""
        finite = torch.isfinite(v).all(dim=1)
        if bool(finite.all()):
            return
        bad = (~finite).nonzero().reshape(-1)
        positions = ", ".join(str(p.row_start + int(i)) for i in bad[:5]) + (", ..." if bad.numel() > 5 else "")
        largest = float(rows[bad].abs().max())
        raise EngramMemoryError(
            f"{self._where()}: layer {layer} (stream {p.stream.name}): the memory's value for {bad.numel()} token(s) "
            f"(conditioning rows {positions}) is not finite: the sum of their fetched rows overflows (each row is finite, "
            f"the largest value {largest:.3g}), so it cannot be injected. The memory's file is damaged or was edited; "
            "load a good copy of it")

    def _check_injected_finite(self, cond: torch.Tensor, out: torch.Tensor, placed: Sequence[StreamTokens],
                               values: Sequence[torch.Tensor], strength: float) -> None:
        """Refuse conditioning that injecting made non-finite where the input conditioning was finite."""
        for layer, (p, v) in enumerate(zip(placed, values)):
            touched = (v != 0).to(out.device)
            if not bool(touched.any()):
                continue
            before, after = cond[:, p.rows, p.cols], out[:, p.rows, p.cols]
            broken = touched.expand_as(after) & ~torch.isfinite(after) & torch.isfinite(before)
            if bool(broken.any()):
                raise EngramMemoryError(
                    f"{self._where()}: layer {layer} (stream {p.stream.name}): injecting the memory with strength {strength:g} "
                    f"makes {int(broken.sum())} conditioning value(s) infinite or NaN ({after.dtype} overflows); the "
                    f"memory's values reach {float(v.abs().max()):.3g}: use a lower strength, or a memory with smaller values")

    def apply(self, cond: torch.Tensor, tokens: Mapping[str, Any], strength: float = 1.0, gate: bool | None = None,
              looked_up: tuple | None = None) -> torch.Tensor:
        """CONDITIONING with the memory injected (a new tensor; bit-identical where nothing is stored).
        `looked_up`: what `values(tokens)` (or a `prefetch(tokens)`) returned, to skip the lookup."""
        placed, values, _ = looked_up if looked_up is not None else self.values(tokens)
        self._check_cond(cond, placed)
        out = inject(cond, placed, values, strength, self.config.gate if gate is None else gate)
        self._check_injected_finite(cond, out, placed, values, strength)
        return out

    def hits(self, tokens: Mapping[str, Any], looked_up: tuple | None = None) -> list[Hit]:
        placed, values, fetched = looked_up if looked_up is not None else self.values(tokens)
        out = []
        for p, v, rows in zip(placed, values, fetched):
            written = (rows != 0).any(dim=-1)  # [n, entries]
            for i in range(p.token_ids.numel()):
                tid = int(p.token_ids[i])
                if tid < 0:
                    continue
                out.append(Hit(p.stream.name, p.row_start + i, tid, int(written[i].sum()), int(written.shape[1]), float(v[i].norm())))
        return out

    def _check_cond(self, cond: torch.Tensor, placed: Sequence[StreamTokens]) -> None:
        if not isinstance(cond, torch.Tensor) or cond.dim() != 3:
            raise EngramMemoryError(f"CONDITIONING must be a [batch, rows, columns] tensor, got {getattr(cond, 'shape', type(cond).__name__)}")
        layout = self.config.layout
        if cond.shape[2] != layout.conditioning_width:
            raise EngramMemoryError(
                f"the CONDITIONING is {cond.shape[2]} columns wide, but {layout.family.upper()} text encoders "
                f"({', '.join(layout.names)}) make {layout.conditioning_width}: it comes from another type of text "
                "encoder than this memory was made for")
        for p in placed:
            if p.rows.stop > cond.shape[1] or p.cols.stop > cond.shape[2]:
                raise EngramMemoryError(
                    f"stream {p.stream.name} needs rows [{p.rows.start}, {p.rows.stop}) and columns [{p.cols.start}, {p.cols.stop}) "
                    f"but the CONDITIONING is {tuple(cond.shape)}: it was not made from this text by a "
                    f"{self.config.layout.family} text encoder of this width"
                )

    # ----- writing -----

    def _examples(self, tokens: Mapping[str, Any], base: torch.Tensor, target: torch.Tensor, internal_only: bool) -> list[LayerExample]:
        placed = self.place(tokens)
        self._check_cond(base, placed)
        if target.dim() != 3 or target.shape[2] != base.shape[2]:
            raise EngramMemoryError(f"target CONDITIONING {tuple(target.shape)} does not match the base {tuple(base.shape)}")
        idx = self.indices(placed).to(torch.int64)
        heads = self.config.hashing.heads
        out = []
        for layer, p in enumerate(placed):
            rows_end = min(p.rows.stop, target.shape[1])
            n = rows_end - p.row_start
            if n <= 0:
                continue
            layer_idx = idx[layer, p.row_start:rows_end].clone()
            if internal_only:
                # keep order-n entries only where the n-gram lies inside the text (no start padding)
                live = p.token_ids[:n] >= 0
                rank = torch.cumsum(live.to(torch.int64), 0) - 1
                for order in range(2, self.config.hashing.max_order + 1):
                    cols = slice((order - 2) * heads, (order - 1) * heads)
                    layer_idx[rank < order - 1, cols] = -1
            cols = p.cols
            out.append(LayerExample(
                layer=layer,
                indices=layer_idx,
                base=base[0, p.row_start:rows_end, cols].detach().float().clone(),
                target=target[0, p.row_start:rows_end, cols].detach().float().clone(),
            ))
        return out

    def _track(self, examples: Sequence[LayerExample]) -> None:
        if self._written is None:
            return
        for ex in examples:
            rows = ex.indices[ex.indices >= 0]
            if rows.numel():
                old = self._written.get(ex.layer)
                self._written[ex.layer] = torch.unique(rows if old is None else torch.cat([old, rows]))

    def mark_untracked(self) -> None:
        """Declare that the tables hold rows this object did not write (loaded from a file)."""
        self._written = None

    def clear(self) -> None:
        """Zero every written row (all rows when unknown); bumps the version."""
        with self._lock:
            if self._written is None:
                chunk = 1 << 16
                for layer, n in enumerate(self.store.rows_per_layer):
                    for start in range(0, n, chunk):
                        rows = torch.arange(start, min(n, start + chunk), dtype=torch.int64)
                        self.store.write_rows(layer, rows, torch.zeros(rows.numel(), self.store.hidden))
            else:
                for layer, rows in self._written.items():
                    self.store.write_rows(layer, rows, torch.zeros(rows.numel(), self.store.hidden))
            self._written = {}
            self.version += 1

    def memorize(self, tokens: Mapping[str, Any], base: torch.Tensor, target: torch.Tensor, internal_only: bool = True) -> dict[int, int]:
        """Closed-form write: the phrase `tokens` (whose plain CONDITIONING is `base`) is made to read as
        `target` at strength 1 with the gate off. Only n-grams inside the phrase are written when
        `internal_only` (so any prompt containing the phrase hits them). Returns rows written per layer."""
        examples = self._examples(tokens, base, target, internal_only)
        with self._lock:
            self._track(examples)
            written = closed_form_write(self.store, examples)
            self.version += 1
        if not written:
            logger.warning("engram memorize: the text has no n-gram to store (it needs at least two live tokens)")
        return written

    def examples(self, pairs: Sequence[tuple[Mapping[str, Any], torch.Tensor, torch.Tensor]]) -> list[list[LayerExample]]:
        """Training examples from (tokens, base CONDITIONING, target CONDITIONING) triples."""
        return [self._examples(t, b, g, internal_only=False) for t, b, g in pairs]

    def fit(self, examples: Sequence[Sequence[LayerExample]], **kwargs: Any) -> FitResult:
        """Row-sparse fit over examples (see fit.fit for the keyword arguments)."""
        with self._lock:
            result = fit(self.store, examples, **kwargs)
            if result.steps:
                self._track([ex for e in examples for ex in e])
                self.version += 1
        return result

    def error(self, examples: Sequence[Sequence[LayerExample]]) -> float:
        with self._lock:
            return mean_squared_error(self.store, examples)

    # ----- lifetime and files -----

    def metadata(self) -> tuple[dict, dict]:
        return self.config.to_metadata()

    def save(self, path: str) -> None:
        """Write the tables and the memory metadata to a table file (atomically, by the store)."""
        hashing, streams = self.metadata()
        saver: Callable | None = getattr(self.store, "save_table_file", None)
        if saver is None:
            raise EngramMemoryError(f"{type(self.store).__name__} cannot save table files")
        with self._lock:
            saver(path, hashing=hashing, streams=streams)
            self.saved_to = path

    @property
    def closed_reason(self) -> str | None:
        return self.state.closed_reason

    @property
    def closed(self) -> bool:
        return self.state.closed_reason is not None

    def check(self) -> None:
        """Raise unless the memory can serve: EngramMemoryError when it is closed, the store's
        EngramWorkerError (with `.rank`) when a worker process of its tables is gone."""
        if self.closed_reason is not None:
            raise EngramMemoryError(f"{self.name} was closed ({self.closed_reason})")
        store_health(self.store)

    def close(self, reason: str = "closed") -> None:
        """Release the tables (and the worker processes holding them). Idempotent; `reason` is kept for
        messages about the closed memory."""
        if self.state.closed_reason is None:
            self.state.closed_reason = reason
        self.store.close()


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _prefetch_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="engram-prefetch")
        return _pool


def _pid_gone(pid: int) -> bool:
    """True when process `pid` has ended (a zombie counts as ended; nothing is reaped here)."""
    state = process_state(pid)
    if state is not None:
        return state in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def store_health(store: Any) -> None:
    """Raise when a RowStore cannot serve any more (its health check, or a worker process gone).

    Uses the store's own `check()` when it has one, and looks at its `worker_pids` without
    touching the processes (a worker that died is reported as EngramWorkerError with its rank)."""
    check = getattr(store, "check", None)
    if callable(check):
        check()
    # Also look at the processes themselves: a SIGKILLed worker shows as a zombie in /proc before
    # waitpid (what a store's own check uses) can collect it, while its other threads are torn down.
    pids = getattr(store, "worker_pids", None)
    if callable(pids):
        pids = pids()
    for rank, pid in enumerate(pids or (), start=1):
        if _pid_gone(int(pid)):
            raise EngramWorkerError(f"engram worker rank {rank} (pid {pid}) is gone", rank)
