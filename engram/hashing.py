"""N-gram hashing of compressed token ids into engram table rows (DeepSeek's Engram scheme).

For engram layer `l` and a sequence of compressed ids x[0..T):
- orders n = 2..max_order; `heads` hash heads per order; entries per token = (max_order-1) * heads,
  ordered order-major: entry (n-2)*heads + h.
- `m_l[k]` (k = 0..max_order-1) are odd multipliers drawn from SplitMix64 seeded by (seed, l, k),
  bounded so that `x * m_l[k]` never exceeds int64 (the products and their XOR are exact on every
  machine; there is no overflow to depend on).
- `mix_n[t] = XOR_{k<n} (x[t-k] * m_l[k])`, with x[t-k] = the pad id when t-k < 0.
- head h of order n: `row = offset[l,n,h] + mix_n[t] mod p[l,n,h]`, where every (layer, order, head)
  has its own prime p >= rows_per_head (all primes distinct), and offset is the running sum of the
  primes of that layer (so each head owns a disjoint block of the layer's rows).
- dead tokens (compressed id < 0: BOS/EOS/PAD, embeddings, image tokens) are skipped: they get -1 in
  every entry and the n-grams of live tokens are taken over the live tokens only, so a chunk boundary
  (EOS, PAD, BOS of the next 77-token chunk) does not break a phrase.

Where this departs from DeepSeek's reference on purpose: the multipliers come from SplitMix64 (the
reference draws them from numpy's generator), the pad id is a fresh id (the compressed vocabulary's
size) rather than the compressed id of the tokenizer's pad token, and dead tokens are skipped rather
than hashed. The compressed ids themselves follow the reference's rule (compress.py).

Output of `NgramHasher.hash_layer`: int32 [tokens, entries]; `hash` stacks layers to
[layers, tokens, entries] (the shape `RowStore.fetch_rows` takes).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

_MASK64 = (1 << 64) - 1
_INT64_MAX = (1 << 63) - 1
# The largest global row id must fit int32 (the fetch index dtype).
_INT32_MAX = (1 << 31) - 1


def splitmix64(state: int) -> tuple[int, int]:
    """One SplitMix64 step: returns (next_state, output), both unsigned 64-bit Python ints."""
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for every n < 3.3e24)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


# (lowest, highest) accepted value of each HashConfig field. Generous for real memories (DeepSeek's
# Engram uses orders up to 3-4 and 8 heads; the nodes offer at most order 6, 32 heads, 2^26 rows per head),
# small enough that a hostile file cannot make the prime search or the tables take long or much memory.
HASH_LIMITS: dict[str, tuple[int, int]] = {
    "num_layers": (1, 8),
    "vocab_sizes": (1, 1 << 24),
    "max_order": (2, 8),
    "heads": (1, 64),
    "rows_per_head": (2, 1 << 28),
    "seed": (0, _MASK64),
}


def _check_int(name: str, value, low: int, high: int) -> None:
    """Raise ValueError naming `name` unless value is an integer (not a bool or float) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        try:
            text = repr(value)[:60]
        except Exception:  # noqa: BLE001 - a value that cannot even be shown
            text = type(value).__name__
        raise ValueError(f"{name} must be an integer, got {text}")
    value = int(value)
    if not low <= value <= high:
        shown = str(value) if abs(value) < 10**30 else f"a {value.bit_length()}-bit integer"
        raise ValueError(f"{name} = {shown} is out of range (allowed {low}..{high})")


@dataclass(frozen=True)
class HashConfig:
    """Hashing parameters of a memory; everything needed to reproduce its row ids.

    `vocab_sizes[l]` is the number of compressed ids of layer l's tokenizer (its pad id is that
    number), which bounds the multipliers."""

    num_layers: int
    vocab_sizes: tuple[int, ...]
    max_order: int = 3
    heads: int = 8
    rows_per_head: int = 1 << 16
    seed: int = 0

    def __post_init__(self) -> None:
        # Every field is checked against a bound before anything is computed from it: a table file is
        # untrusted input, and these values drive how many primes are searched and how many rows exist.
        for name in ("num_layers", "max_order", "heads", "rows_per_head", "seed"):
            _check_int(name, getattr(self, name), *HASH_LIMITS[name])
        if not isinstance(self.vocab_sizes, tuple):
            raise ValueError(f"vocab_sizes must be a list of integers, got {type(self.vocab_sizes).__name__}")
        if len(self.vocab_sizes) != self.num_layers:
            raise ValueError(f"vocab_sizes has {len(self.vocab_sizes)} entries for {self.num_layers} layers")
        for v in self.vocab_sizes:
            _check_int("vocab_sizes", v, *HASH_LIMITS["vocab_sizes"])
        rows = (self.max_order - 1) * self.heads * self.rows_per_head
        if rows > _INT32_MAX:
            raise ValueError(
                f"(max_order - 1) * heads * rows_per_head = {self.max_order - 1} * {self.heads} * {self.rows_per_head} "
                f"= {rows} rows per layer, more than int32 row ids can address; lower rows_per_head or heads"
            )

    @property
    def entries(self) -> int:
        return (self.max_order - 1) * self.heads

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "vocab_sizes": list(self.vocab_sizes),
            "max_order": self.max_order,
            "heads": self.heads,
            "rows_per_head": self.rows_per_head,
            "seed": self.seed,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "HashConfig":
        """The config of a `to_dict` object (e.g. a table file's metadata). Raises KeyError for a missing
        key and ValueError naming the key for a value of the wrong type or out of its bounds."""
        vocab = data["vocab_sizes"]
        if not isinstance(vocab, (list, tuple)):
            raise ValueError(f"vocab_sizes must be a list of integers, got {type(vocab).__name__}")
        if len(vocab) > HASH_LIMITS["num_layers"][1]:
            raise ValueError(f"vocab_sizes has {len(vocab)} entries, at most {HASH_LIMITS['num_layers'][1]} layers are allowed")
        return cls(
            num_layers=data["num_layers"],
            vocab_sizes=tuple(vocab),
            max_order=data["max_order"],
            heads=data["heads"],
            rows_per_head=data["rows_per_head"],
            seed=data["seed"],
        )


def layer_multipliers(config: HashConfig, layer: int) -> list[int]:
    """The odd multipliers m_l[0..max_order) of one layer, as Python ints."""
    # (vocab+1) ids including the pad id: x <= vocab, so x * m < (vocab+1) * bound <= INT64_MAX.
    bound = _INT64_MAX // (config.vocab_sizes[layer] + 1)
    half = max(1, bound // 2)
    out = []
    for k in range(config.max_order):
        state = (config.seed * 0x100000001B3 + layer * 0x9E37 + k) & _MASK64
        _, value = splitmix64(state)
        out.append((value % half) * 2 + 1)
    return out


def head_primes(config: HashConfig) -> list[list[list[int]]]:
    """primes[layer][order-2][head]: distinct primes >= rows_per_head, assigned in layer, order, head
    order, each the smallest unused prime at or above the previous one."""
    primes: list[list[list[int]]] = []
    candidate = config.rows_per_head
    for _layer in range(config.num_layers):
        per_order = []
        for _order in range(2, config.max_order + 1):
            per_head = []
            for _head in range(config.heads):
                while not is_prime(candidate):
                    candidate += 1
                per_head.append(candidate)
                candidate += 1
            per_order.append(per_head)
        primes.append(per_order)
    return primes


class NgramHasher:
    """Hashes compressed-id sequences into global row ids of each engram layer (see module doc)."""

    def __init__(self, config: HashConfig):
        self.config = config
        self.primes = head_primes(config)
        self.multipliers = [layer_multipliers(config, layer) for layer in range(config.num_layers)]
        self.offsets: list[list[list[int]]] = []
        self.rows_needed: list[int] = []
        for layer in range(config.num_layers):
            running = 0
            per_order = []
            for per_head in self.primes[layer]:
                offs = []
                for p in per_head:
                    offs.append(running)
                    running += p
                per_order.append(offs)
            self.offsets.append(per_order)
            self.rows_needed.append(running)
            if running - 1 > _INT32_MAX:
                raise ValueError(
                    f"layer {layer} would need {running} rows, more than int32 row ids can address; "
                    "lower rows_per_head or heads"
                )

    @cached_property
    def _tensors(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        # per layer: multipliers [max_order], primes [orders, heads], offsets [orders, heads] (int64)
        out = []
        for layer in range(self.config.num_layers):
            out.append((
                torch.tensor(self.multipliers[layer], dtype=torch.int64),
                torch.tensor(self.primes[layer], dtype=torch.int64),
                torch.tensor(self.offsets[layer], dtype=torch.int64),
            ))
        return out

    def hash_layer(self, layer: int, compressed: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Row ids of one layer for a sequence of compressed ids (int64 [tokens], -1 = dead).

        Returns int32 [tokens, entries]; dead tokens get -1 everywhere."""
        cfg = self.config
        if not 0 <= layer < cfg.num_layers:
            raise IndexError(f"layer {layer} out of range for a memory of {cfg.num_layers} layers")
        x = torch.as_tensor(compressed, dtype=torch.int64).reshape(-1)
        pad = cfg.vocab_sizes[layer]
        if x.numel() and int(x.max()) >= pad:
            raise ValueError(f"compressed id {int(x.max())} is not below layer {layer}'s vocabulary size {pad}")
        out = torch.full((x.numel(), cfg.entries), -1, dtype=torch.int32)
        live = (x >= 0).nonzero().reshape(-1)
        if live.numel() == 0:
            return out
        seq = x[live]
        mults, primes, offsets = self._tensors[layer]
        n_live = seq.numel()
        padded = torch.cat([torch.full((cfg.max_order - 1,), pad, dtype=torch.int64), seq])
        mix = torch.zeros(n_live, dtype=torch.int64)
        rows = []
        for k in range(cfg.max_order):
            start = cfg.max_order - 1 - k
            shifted = padded[start:start + n_live]
            mix = mix ^ (shifted * mults[k])
            if k >= 1:  # mix now covers order n = k+1
                n_idx = k - 1
                rows.append(torch.remainder(mix[:, None], primes[n_idx][None, :]) + offsets[n_idx][None, :])
        out[live] = torch.cat(rows, dim=1).to(torch.int32)
        return out

    def hash(self, compressed_per_layer: Sequence[torch.Tensor]) -> torch.Tensor:
        """int32 [layers, tokens, entries] from one compressed sequence per layer (all of one length)."""
        if len(compressed_per_layer) != self.config.num_layers:
            raise ValueError(f"got {len(compressed_per_layer)} sequences for {self.config.num_layers} layers")
        return torch.stack([self.hash_layer(l, seq) for l, seq in enumerate(compressed_per_layer)])
