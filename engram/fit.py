"""Making engram tables useful: a closed-form write for one phrase, and a row-sparse fit over pairs.

Both work on `LayerExample`s: for one engram layer (stream) and one prompt, the row ids each token
fetches (`indices` int64 [n, entries], -1 = not used), the conditioning of that stream without
memory (`base` [n, width]) and the conditioning it should become (`target` [n, width]). With the gate
off and strength 1 the memory turns `base` into `base + A @ R @ P`, where A [n, U] counts how often
token t fetches row u, R [U, hidden] are the rows and P maps a summed row to the stream width (the
first `width` columns, or a projection [hidden, width]).

- `closed_form_write`: R' = R + pinv(A) @ (D - A R P) @ pinv(P), D = target - base: the minimum-norm
  change of exactly the touched rows that makes `base + A R' P` the least-squares closest to the
  target (exact when the phrase's rows are independent: collisions inside a phrase are handled by the
  pseudo-inverse, not by last-write-wins).
- `fit`: minimises the mean squared error over many examples with Adam whose state lives only on the
  rows the examples touch (lazy: a row's moments and value change only in steps where it is used); no
  weight decay. Rows are trained in float32 master copies and written back once at the end, so FP8
  tables are not requantized at every step.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .rows import RowStore

logger = logging.getLogger(__name__)


@dataclass
class LayerExample:
    layer: int
    indices: torch.Tensor  # int64 [n, entries], -1 = no row
    base: torch.Tensor  # float [n, width]
    target: torch.Tensor  # float [n, width]
    projection: torch.Tensor | None = None  # [hidden, width] or None (first `width` columns)

    def __post_init__(self) -> None:
        self.indices = torch.as_tensor(self.indices).to(torch.int64)
        if self.indices.dim() != 2:
            raise ValueError(f"indices must be [tokens, entries], got {tuple(self.indices.shape)}")
        if self.base.shape != self.target.shape or self.base.dim() != 2 or self.base.shape[0] != self.indices.shape[0]:
            raise ValueError(
                f"base {tuple(self.base.shape)} and target {tuple(self.target.shape)} must both be [tokens, width] "
                f"with {self.indices.shape[0]} tokens"
            )


Example = Sequence[LayerExample]  # one prompt: its layers


def _project_out(rows: torch.Tensor, width: int, projection: torch.Tensor | None) -> torch.Tensor:
    """Stream values of summed rows [..., hidden] (the `P` of the module docstring)."""
    if projection is not None:
        return rows @ projection.to(device=rows.device, dtype=rows.dtype)
    return rows[..., :width]


def _project_back(delta: torch.Tensor, hidden: int, projection: torch.Tensor | None) -> torch.Tensor:
    """Minimum-norm rows [..., hidden] whose projection is closest to `delta` [..., width]."""
    if projection is not None:
        return delta @ torch.linalg.pinv(projection.to(device=delta.device, dtype=delta.dtype))
    out = torch.zeros(*delta.shape[:-1], hidden, dtype=delta.dtype)
    out[..., : delta.shape[-1]] = delta
    return out


def incidence(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique rows int64 [U], A float64 [n, U] with A[t, u] = how often token t fetches row u)."""
    valid = indices >= 0
    rows = torch.unique(indices[valid])
    a = torch.zeros(indices.shape[0], rows.numel(), dtype=torch.float64)
    if rows.numel():
        t_idx = torch.arange(indices.shape[0]).unsqueeze(1).expand_as(indices)[valid]
        u_idx = torch.searchsorted(rows, indices[valid])
        a.index_put_((t_idx, u_idx), torch.ones(t_idx.numel(), dtype=torch.float64), accumulate=True)
    return rows, a


def closed_form_write(store: RowStore, examples: Sequence[LayerExample]) -> dict[int, int]:
    """Write the rows that make each example's base conditioning move to its target (strength 1, gate
    off). Examples of the same layer are solved jointly. Returns rows written per layer."""
    written: dict[int, int] = {}
    by_layer: dict[int, list[LayerExample]] = {}
    for ex in examples:
        by_layer.setdefault(ex.layer, []).append(ex)
    for layer, exs in by_layer.items():
        indices = torch.cat([ex.indices for ex in exs])
        rows, a = incidence(indices)
        if rows.numel() == 0:
            continue
        keep = a.sum(dim=1) > 0  # tokens without rows cannot move
        projections = {id(ex.projection) for ex in exs}
        if len(projections) != 1:
            raise ValueError(f"layer {layer}: examples disagree on the projection")
        projection = exs[0].projection
        # the solve runs on the CPU in float64, whichever device the store and the conditioning live on
        delta = torch.cat([(ex.target.double().cpu() - ex.base.double().cpu()) for ex in exs])
        width = delta.shape[1]
        current = store.read_rows(layer, rows).double().cpu()
        residual = delta - a @ _project_out(current, width, projection)
        a, residual = a[keep], residual[keep]
        change = torch.linalg.pinv(a) @ _project_back(residual, store.hidden, projection)
        store.write_rows(layer, rows, (current + change).float())
        written[layer] = int(rows.numel())
    return written


@dataclass
class FitResult:
    losses: list[float] = field(default_factory=list)  # mean squared error per step (before its update)
    steps: int = 0
    stopped_early: bool = False
    rows_written: dict[int, int] = field(default_factory=dict)


def mean_squared_error(store: RowStore, examples: Sequence[Example]) -> float:
    """Mean over every (token with a row, column) of (base + memory - target)^2 with the store's rows."""
    total, count = 0.0, 0
    for example in examples:
        for ex in example:
            valid = ex.indices >= 0
            rows = ex.indices.clamp(min=0)
            live = valid.any(dim=1)
            if not bool(live.any()):
                continue
            sel = rows[live]
            fetched = store.read_rows(ex.layer, sel.reshape(-1)).view(*sel.shape, -1)  # [n_live, E, hidden]
            fetched = fetched * valid[live].unsqueeze(-1)
            pred = ex.base[live].float() + _project_out(fetched.sum(1), ex.base.shape[1], ex.projection)
            total += float((pred - ex.target[live].float()).pow(2).sum())
            count += int(live.sum()) * ex.base.shape[1]
    return total / max(count, 1)


def fit(
    store: RowStore,
    examples: Sequence[Example],
    *,
    steps: int = 200,
    lr: float = 0.05,
    batch_size: int = 16,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    seed: int = 0,
    progress: Callable[[int, int, float], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    cancel: Callable[[], None] | None = None,
) -> FitResult:
    """Fit the rows the examples touch so that base + memory approaches target (see module doc).

    `progress(step, steps, loss)` is called after every step; `should_stop()` is polled before every
    step: True stops early and writes what was learned so far. `cancel()` is called along the preparation
    of the examples (which takes a while for many examples) and raises to stop. An exception raised by any
    callback propagates and leaves the store untouched."""
    if steps < 0 or batch_size < 1 or not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"need steps >= 0, batch_size >= 1, lr > 0; got {steps}, {batch_size}, {lr}")
    result = FitResult()
    cancel = cancel or (lambda: None)
    examples = [list(e) for e in examples if len(e)]
    if not examples:
        return result
    with torch.inference_mode(False), torch.enable_grad():
        # The union of touched rows per layer, and every example's indices remapped onto it.
        union: dict[int, torch.Tensor] = {}
        for layer in sorted({ex.layer for e in examples for ex in e}):
            cancel()
            parts = [ex.indices[ex.indices >= 0] for e in examples for ex in e if ex.layer == layer]
            union[layer] = torch.unique(torch.cat(parts)) if parts else torch.zeros(0, dtype=torch.int64)
        master = {layer: store.read_rows(layer, rows).float().clone() for layer, rows in union.items() if rows.numel()}
        moment1 = {layer: torch.zeros_like(p) for layer, p in master.items()}
        moment2 = {layer: torch.zeros_like(p) for layer, p in master.items()}
        row_step = {layer: torch.zeros(p.shape[0], dtype=torch.int64) for layer, p in master.items()}
        prepared = []
        for number, e in enumerate(examples):
            if number % 64 == 0:
                cancel()
            items = []
            for ex in e:
                if ex.layer not in master:
                    continue
                local = torch.searchsorted(union[ex.layer], ex.indices.clamp(min=0))
                local = torch.where(ex.indices >= 0, local, -1)
                live = (local >= 0).any(dim=1)
                if bool(live.any()):
                    items.append((ex.layer, local[live], ex.base[live].detach().float().clone(),
                                  ex.target[live].detach().float().clone(), ex.projection))
            if items:
                prepared.append(items)
        if not prepared:
            return result
        generator = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(prepared), generator=generator).tolist()
        cursor = 0
        for step in range(steps):
            if should_stop is not None and should_stop():
                result.stopped_early = True
                break
            batch = []
            while len(batch) < min(batch_size, len(prepared)):
                if cursor == len(order):
                    order = torch.randperm(len(prepared), generator=generator).tolist()
                    cursor = 0
                batch.append(prepared[order[cursor]])
                cursor += 1
            # Gather only the rows this batch uses, as leaves.
            used: dict[int, torch.Tensor] = {}
            for items in batch:
                for layer, local, *_ in items:
                    used.setdefault(layer, []).append(local[local >= 0])
            used = {layer: torch.unique(torch.cat(parts)) for layer, parts in used.items()}
            leaves = {layer: master[layer][rows].clone().requires_grad_(True) for layer, rows in used.items()}
            loss_sum = torch.zeros((), dtype=torch.float32)
            count = 0
            for items in batch:
                for layer, local, base, target, projection in items:
                    pos = torch.searchsorted(used[layer], local.clamp(min=0))
                    gathered = leaves[layer][pos] * (local >= 0).unsqueeze(-1)
                    pred = base + _project_out(gathered.sum(1), base.shape[1], projection)
                    loss_sum = loss_sum + (pred - target).pow(2).sum()
                    count += target.numel()
            loss = loss_sum / max(count, 1)
            grads = torch.autograd.grad(loss, list(leaves.values()))
            with torch.no_grad():
                for (layer, rows), grad in zip(used.items(), grads):
                    row_step[layer][rows] += 1
                    t = row_step[layer][rows].unsqueeze(1).float()
                    m = moment1[layer][rows].mul_(betas[0]).add_(grad, alpha=1 - betas[0])
                    v = moment2[layer][rows].mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
                    moment1[layer][rows] = m
                    moment2[layer][rows] = v
                    m_hat = m / (1 - betas[0] ** t)
                    v_hat = v / (1 - betas[1] ** t)
                    master[layer][rows] -= lr * m_hat / (v_hat.sqrt() + eps)
            loss_value = float(loss.detach())
            result.losses.append(loss_value)
            result.steps = step + 1
            if progress is not None:
                progress(step + 1, steps, loss_value)
    # Written back outside the grad-enabled block: under ComfyUI the tables are inference tensors,
    # which may only be updated in place inside inference mode.
    if result.steps:
        for layer, rows in union.items():
            if layer in master:
                store.write_rows(layer, rows, master[layer].detach())
                result.rows_written[layer] = int(rows.numel())
    if not math.isfinite(result.losses[-1] if result.losses else 0.0):
        logger.warning("engram fit ended with a non-finite loss; lower the learning rate")
    return result
