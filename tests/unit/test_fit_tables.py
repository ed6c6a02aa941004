"""Writing tables: closed-form phrase writes (collisions included) and the row-sparse fit, which must
beat zero and random tables on held-out prompts that share the phrases."""


import pytest
import torch

from fp8_engram.engram.fit import LayerExample, closed_form_write, fit, incidence, mean_squared_error
from fp8_engram.engram.memory import EngramMemory, make_config
from fp8_engram.engram.store import LocalRowStore
from fp8_engram.engram.streams import family_layout
from helpers.numerics import sqnr

pytestmark = pytest.mark.unit

WIDTH = 16
VOCAB = [f"w{i}" for i in range(200)]


def comfy_tokens(ids):
    """One 77-token chunk in ComfyUI's tokenize(..., return_word_ids=True) format (BOS 198, EOS 199)."""
    chunk = [(198, 1.0, 0)] + [(t, 1.0, i + 1) for i, t in enumerate(ids)] + [(199, 1.0, 0)]
    return {"l": [chunk + [(199, 1.0, 0)] * (77 - len(chunk))]}


def make_memory(rows_per_head, heads=4, dtype=torch.bfloat16):
    config, vocabs = make_config(family_layout("sd1", widths={"clip_l": WIDTH}), {"l": VOCAB}, heads=heads, rows_per_head=rows_per_head, seed=3)
    store = LocalRowStore(config.rows_per_layer(1), config.hidden, dtype)
    return EngramMemory(config, store, vocabs)


def test_incidence_counts_repeats():
    rows, a = incidence(torch.tensor([[3, 3, -1], [5, -1, -1], [-1, -1, -1]]))
    assert rows.tolist() == [3, 5]
    assert a.tolist() == [[2.0, 0.0], [0.0, 1.0], [0.0, 0.0]]


def test_closed_form_write_reaches_target_despite_collisions():
    memory = make_memory(rows_per_head=2, heads=2)  # primes 2, 3, 5, 7: nearly every entry collides
    store = memory.store
    torch.manual_seed(0)
    phrase = [10, 11, 12, 13, 14]
    tokens = comfy_tokens(phrase)
    base, target = torch.randn(1, 77, WIDTH), torch.randn(1, 77, WIDTH)
    before = [t.clone() for t in store.tables]
    memory.memorize(tokens, base, target)
    out = memory.apply(base, tokens)
    # tokens 2..5 have internal n-grams (the first phrase token has none; with this many collisions
    # its rows may be shared, so it is not checked); BOS, EOS and padding never move
    assert sqnr(target[0, 2:6], out[0, 2:6]) > 35  # bf16 table rounding
    assert torch.equal(out[0, 0], base[0, 0]) and torch.equal(out[0, 6:], base[0, 6:])
    # only the rows the phrase's internal n-grams touch changed
    idx = memory.indices(memory.place(tokens))[0, 2:6]
    touched = set(idx[:, :2][idx[:, :2] >= 0].tolist()) | set(idx[1:, 2:][idx[1:, 2:] >= 0].tolist())
    changed = set((store.tables[0].float() != before[0].float()).any(1).nonzero().flatten().tolist())
    assert changed and changed <= touched


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (a store on it)")
def test_closed_form_write_into_a_cuda_store_writes_what_a_cpu_store_gets():
    """ComfyUI's conditioning is on the CPU, a store may live on a GPU: the solve runs on the CPU either way."""
    config, vocabs = make_config(family_layout("sd1", widths={"clip_l": WIDTH}), {"l": VOCAB}, heads=2,
                                 rows_per_head=64, seed=3)
    tokens = comfy_tokens([10, 11, 12, 13, 14])
    torch.manual_seed(0)
    base, target = torch.randn(1, 77, WIDTH), torch.randn(1, 77, WIDTH)
    tables = []
    for device in ("cpu", "cuda"):
        store = LocalRowStore(config.rows_per_layer(1), config.hidden, torch.bfloat16, device=device)
        EngramMemory(config, store, vocabs).memorize(tokens, base, target)
        tables.append(store.tables[0].cpu())
    assert tables[0].abs().sum() > 0 and torch.equal(tables[0], tables[1])


def test_closed_form_write_is_min_norm_change():
    store = LocalRowStore([50], 4, torch.bfloat16)
    store.write_rows(0, torch.arange(50), torch.randn(50, 4))
    before = store.read_rows(0, torch.arange(50)).double()
    ex = LayerExample(0, torch.tensor([[1, 2], [2, 3]]), torch.zeros(2, 4), torch.randn(2, 4))
    closed_form_write(store, [ex])
    after = store.read_rows(0, torch.arange(50)).double()
    change = after[[1, 2, 3]] - before[[1, 2, 3]]
    a = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]], dtype=torch.float64)
    # minimum-norm solutions lie in the row space of A: change = A^T y for some y
    y = torch.linalg.lstsq(a.T, change).solution
    assert sqnr(change, a.T @ y) > 40
    assert torch.equal(after[[0] + list(range(4, 50))], before[[0] + list(range(4, 50))])


def _pairs(memory, phrases, meanings, embed, fillers):
    out = []
    for p, phrase in enumerate(phrases):
        for filler in fillers:
            ids = filler[:2] + phrase + filler[2:]
            tokens = comfy_tokens(ids)
            base = torch.zeros(1, 77, WIDTH)
            base[0, 1:1 + len(ids)] = embed[torch.tensor(ids)]
            target = base.clone()
            target[0, 4:3 + len(phrase)] += meanings[p]  # phrase tokens after the first
            out.append((tokens, base, target))
    return memory.examples(out)


def test_fit_beats_zero_and_random_tables_on_held_out_prompts():
    torch.manual_seed(0)
    memory = make_memory(rows_per_head=101)
    phrases = [[20 + 3 * i, 21 + 3 * i, 22 + 3 * i] for i in range(6)]
    meanings = torch.randn(6, 2, WIDTH)
    embed = torch.randn(200, WIDTH)
    gen = torch.Generator().manual_seed(5)
    fillers = lambda n: [torch.randint(100, 190, (4,), generator=gen).tolist() for _ in range(n)]  # noqa: E731
    train = _pairs(memory, phrases, meanings, embed, fillers(6))
    held_out = _pairs(memory, phrases, meanings, embed, fillers(3))
    zero_error = memory.error(held_out)
    steps_seen = []
    result = memory.fit(train, steps=150, lr=0.05, batch_size=8, progress=lambda s, n, loss: steps_seen.append(s))
    assert steps_seen == list(range(1, 151)) and len(result.losses) == 150
    assert result.losses[-1] < 0.2 * result.losses[0]
    trained_error = memory.error(held_out)
    # a random table of the trained rows' scale
    rand = make_memory(rows_per_head=101)
    for layer, rows in enumerate(rand.store.rows_per_layer):
        scale = float(memory.store.tables[layer].float().std())
        rand.store.write_rows(layer, torch.arange(rows), torch.randn(rows, WIDTH) * scale)
    random_error = rand.error(held_out)
    assert trained_error < 0.2 * zero_error, (trained_error, zero_error)
    assert trained_error < 0.2 * random_error, (trained_error, random_error)
    assert memory.version == 1


def test_fit_touches_only_used_rows_and_stops_on_request():
    memory = make_memory(rows_per_head=101)
    torch.manual_seed(1)
    tokens = comfy_tokens([5, 6, 7])
    base, target = torch.zeros(1, 77, WIDTH), torch.randn(1, 77, WIDTH)
    examples = memory.examples([(tokens, base, target)])
    used = set(memory.indices(memory.place(tokens))[0][memory.indices(memory.place(tokens))[0] >= 0].tolist())
    calls = []
    result = memory.fit(examples, steps=50, should_stop=lambda: len(calls) >= 5 or calls.append(1))
    assert result.stopped_early and result.steps == 5
    changed = set((memory.store.tables[0].float() != 0).any(1).nonzero().flatten().tolist())
    assert changed and changed <= used


def test_fit_exception_in_callback_writes_nothing():
    memory = make_memory(rows_per_head=101)
    examples = memory.examples([(comfy_tokens([5, 6, 7]), torch.zeros(1, 77, WIDTH), torch.ones(1, 77, WIDTH))])

    def interrupt(step, steps, loss):
        raise KeyboardInterrupt("cancelled")

    with pytest.raises(KeyboardInterrupt):
        memory.fit(examples, steps=10, progress=interrupt)
    assert not bool(memory.store.tables[0].float().any())
    assert memory.version == 0


def test_fit_runs_under_inference_mode_with_fp8_tables():
    memory = make_memory(rows_per_head=101, dtype=torch.float8_e4m3fn)
    with torch.inference_mode():
        base, target = torch.zeros(1, 77, WIDTH), torch.randn(1, 77, WIDTH)
        examples = memory.examples([(comfy_tokens([5, 6, 7, 8]), base, target)])
        result = memory.fit(examples, steps=100, lr=0.1)
        assert result.losses[-1] < 0.1 * result.losses[0]
        assert mean_squared_error(memory.store, examples) < 0.2 * float(target[0, 2:5].pow(2).mean())
