"""N-gram hashing: exact row ids against an independent slow pure-Python implementation, and fixed
literal ids that must come out the same on every machine."""

import pytest
import torch

from fp8_engram.engram.hashing import HashConfig, NgramHasher, head_primes

pytestmark = pytest.mark.unit

M64 = (1 << 64) - 1


def slow_multipliers(seed, layer, vocab, max_order):
    bound = ((1 << 63) - 1) // (vocab + 1)
    half = max(1, bound // 2)
    out = []
    for k in range(max_order):
        s = (seed * 1099511628211 + layer * 40503 + k) & M64
        s = (s + 0x9E3779B97F4A7C15) & M64  # one SplitMix64 step, written out
        z = ((s ^ (s >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        z ^= z >> 31
        out.append((z % half) * 2 + 1)
    return out


def slow_primes(cfg):
    def prime(n):
        return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))
    out, c = [], cfg.rows_per_head
    for _ in range(cfg.num_layers * (cfg.max_order - 1) * cfg.heads):
        while not prime(c):
            c += 1
        out.append(c)
        c += 1
    return out


def slow_hash(cfg, layer, seq):
    """Row ids of one layer, token by token, in Python ints."""
    primes = slow_primes(cfg)
    per_layer = (cfg.max_order - 1) * cfg.heads
    my_primes = primes[layer * per_layer:(layer + 1) * per_layer]
    offsets = [sum(my_primes[:i]) for i in range(per_layer)]
    mult = slow_multipliers(cfg.seed, layer, cfg.vocab_sizes[layer], cfg.max_order)
    pad = cfg.vocab_sizes[layer]
    live = [x for x in seq if x >= 0]
    rows, j = [], 0
    for x in seq:
        if x < 0:
            rows.append([-1] * per_layer)
            continue
        entry = []
        for n in range(2, cfg.max_order + 1):
            mix = 0
            for k in range(n):
                prev = live[j - k] if j - k >= 0 else pad
                mix ^= prev * mult[k]
            assert 0 <= mix < (1 << 63)
            for h in range(cfg.heads):
                e = (n - 2) * cfg.heads + h
                entry.append(offsets[e] + mix % my_primes[e])
        rows.append(entry)
        j += 1
    return rows


CFG = HashConfig(num_layers=2, vocab_sizes=(40000, 30000), max_order=3, heads=4, rows_per_head=1000, seed=7)


def test_matches_slow_reference():
    hasher = NgramHasher(CFG)
    gen = torch.Generator().manual_seed(1)
    for layer in range(2):
        seq = torch.randint(0, CFG.vocab_sizes[layer], (50,), generator=gen)
        seq[[0, 10, 11, 30, 49]] = -1  # dead tokens: BOS, chunk boundary, an embedding, EOS
        got = hasher.hash_layer(layer, seq)
        assert got.dtype == torch.int32 and got.shape == (50, CFG.entries)
        assert got.tolist() == slow_hash(CFG, layer, seq.tolist())


def test_fixed_vectors():
    """Literal ids: any change of the hashing scheme (or a platform difference) breaks stored tables."""
    hasher = NgramHasher(CFG)
    got = hasher.hash_layer(0, torch.tensor([5, 17, 123, 39999]))
    assert got[0].tolist() == FIXED_ROWS_TOKEN0
    assert got[3].tolist() == FIXED_ROWS_TOKEN3
    assert hasher.multipliers[1][0] == FIXED_MULTIPLIER_L1K0


def test_primes_distinct_and_offsets_disjoint():
    primes = [p for layer in head_primes(CFG) for order in layer for p in order]
    assert primes == slow_primes(CFG)
    assert len(set(primes)) == len(primes) and min(primes) >= CFG.rows_per_head
    hasher = NgramHasher(CFG)
    assert hasher.rows_needed == [sum(primes[:8]), sum(primes[8:])]
    rows = hasher.hash_layer(0, torch.randint(0, 40000, (500,)))
    for e in range(CFG.entries):  # each entry stays inside its own head's block
        lo = hasher.offsets[0][e // CFG.heads][e % CFG.heads]
        p = hasher.primes[0][e // CFG.heads][e % CFG.heads]
        assert int(rows[:, e].min()) >= lo and int(rows[:, e].max()) < lo + p


def test_ngrams_skip_dead_tokens_and_depend_on_context():
    hasher = NgramHasher(CFG)
    a = hasher.hash_layer(0, torch.tensor([-1, 3, 4, 5, -1, -1]))
    b = hasher.hash_layer(0, torch.tensor([3, 4, -1, 5]))  # a chunk boundary inside the phrase
    assert torch.equal(a[1:4], b[[0, 1, 3]])
    assert (a[[0, 4, 5]] == -1).all() and (b[2] == -1).all()
    c = hasher.hash_layer(0, torch.tensor([9, 4, 5]))
    # bigram (4, 5) is shared, trigram (3|9, 4, 5) is not
    assert torch.equal(a[3, :4], c[2, :4])
    assert not torch.equal(a[3, 4:], c[2, 4:])
    assert torch.equal(hasher.hash([torch.tensor([3, 4]), torch.tensor([3, 4])])[0], hasher.hash_layer(0, torch.tensor([3, 4])))


def test_bad_input():
    with pytest.raises(ValueError, match="max_order"):
        HashConfig(num_layers=1, vocab_sizes=(10,), max_order=1)
    with pytest.raises(ValueError, match="vocab_sizes"):
        HashConfig(num_layers=2, vocab_sizes=(10,))
    hasher = NgramHasher(HashConfig(num_layers=1, vocab_sizes=(10,), heads=2, rows_per_head=16))
    with pytest.raises(ValueError, match="not below"):
        hasher.hash_layer(0, torch.tensor([10]))
    with pytest.raises(ValueError, match="int32"):
        NgramHasher(HashConfig(num_layers=1, vocab_sizes=(10,), heads=64, rows_per_head=1 << 27))
# Computed once with this scheme (seed 7, heads 4, rows_per_head 1000); never regenerate casually.
FIXED_ROWS_TOKEN0 = [834, 1263, 2996, 3326, 4938, 6076, 7070, 7514]
FIXED_ROWS_TOKEN3 = [266, 1930, 2876, 3797, 4498, 5718, 6203, 8100]
FIXED_MULTIPLIER_L1K0 = 177094046168351


def test_every_field_is_bounded_and_checked_before_any_work():
    import time

    from fp8_engram.engram.hashing import HASH_LIMITS

    good = CFG.to_dict()
    for key, value in (("heads", 10_000_000), ("max_order", 1_000_000), ("rows_per_head", 1 << 40), ("num_layers", 10**6),
                       ("seed", -1), ("seed", 1 << 64), ("heads", 2.0), ("heads", "8"), ("max_order", True)):
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match=key):
            HashConfig.from_dict({**good, key: value})
        assert time.perf_counter() - t0 < 0.1
    with pytest.raises(ValueError, match="vocab_sizes"):
        HashConfig.from_dict({**good, "vocab_sizes": [1 << 30, 5]})
    with pytest.raises(ValueError, match="vocab_sizes"):
        HashConfig.from_dict({**good, "vocab_sizes": [5] * 10**6})
    # the largest accepted config is still quick to build a hasher for (the prime search is bounded)
    low, high = HASH_LIMITS["heads"]
    biggest = HashConfig(num_layers=3, vocab_sizes=(49408,) * 3, max_order=HASH_LIMITS["max_order"][1], heads=high,
                         rows_per_head=_INT32_LIMIT // ((HASH_LIMITS["max_order"][1] - 1) * high) - 20000)
    t0 = time.perf_counter()
    hasher = NgramHasher(biggest)
    assert time.perf_counter() - t0 < 5.0 and max(hasher.rows_needed) <= _INT32_LIMIT
    # real sizes stay allowed: DeepSeek-like order 4, 8 heads, tens of millions of rows per layer
    real = HashConfig(num_layers=2, vocab_sizes=(49408, 32100), max_order=4, heads=8, rows_per_head=1 << 21)
    assert sum(NgramHasher(real).rows_needed) > 80_000_000


_INT32_LIMIT = (1 << 31) - 1
