"""Engram Train teaches the tiny world's models new words, checked through the real server: a pairs file
of three words the models never saw ("a lighthouse" -> "blue triangle", "a teapot" -> "red circle",
"a volcano" -> "green square"; example_graphs.TRAINED_WORDS), in the server's input folder, trains a new
memory; with it each word draws its class (the judge of scripts/tiny_world.py) at almost every seed, and
without it the word does not (the models draw yellow shapes for these words). The trained
memory is saved, and a second prompt that reads it back with Load Engram Memory (on one rank in the
server's process, where the trained memory lived in two worker processes: the tables are the file's,
nothing is carried over) draws the very same pixels: the save is bit-exact and CPU sampling is
deterministic, so anything less would be a lossy save or load.

Chance of drawing a given class is 1/12; the thresholds sit far from it both ways."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import tiny_world as world  # scripts/ is on sys.path (tests/conftest.py)
from example_graphs import TRAINED_WORDS, WORDS_PAIRS_FILE, prepare_inputs, words_pairs_text, world_loaded_words, world_trained_words
from helpers.world_pictures import judged_pictures

pytestmark = pytest.mark.integration
logger = logging.getLogger(__name__)

SEEDS = [1, 2, 3, 4, 5, 6]
LOADED_SEEDS = SEEDS[:3]  # the loaded memory must give the same pixels: a few seeds show it


@pytest.fixture(scope="module")
def trained(comfy_server, comfy):
    """{(kind, word, seed): (picture, verdict)} for kinds plain / trained, one graph for all of them."""
    prepare_inputs(comfy_server.base_dir)
    (comfy_server.base_dir / "input" / WORDS_PAIRS_FILE).write_text(words_pairs_text())
    graph, saves = world_trained_words(SEEDS)
    return judged_pictures(comfy, comfy.run(graph, timeout=900), saves)


@pytest.fixture(scope="module")
def loaded(trained, comfy):
    """{("loaded", word, seed): (picture, verdict)}: the memory `trained` saved, loaded in a second prompt."""
    graph, saves = world_loaded_words(LOADED_SEEDS)
    return judged_pictures(comfy, comfy.run(graph, timeout=900), saves)


def _hits(pictures: dict, kind: str, word: str, seeds: list[int]) -> tuple[int, list[str]]:
    target = world.parse_prompt(TRAINED_WORDS[word])
    verdicts = [pictures[(kind, word, seed)][1] for seed in seeds]
    return sum(v.reads(*target) for v in verdicts), [v.label for v in verdicts]


@pytest.mark.parametrize("word", list(TRAINED_WORDS))
def test_trained_word_draws_its_class_and_not_without_the_memory(trained, word):
    hits, with_labels = _hits(trained, "trained", word, SEEDS)
    before, plain_labels = _hits(trained, "plain", word, SEEDS)
    n = len(SEEDS)
    logger.info("%r -> %r: %d/%d with the trained memory, %d/%d without", word, TRAINED_WORDS[word], hits, n, before, n)
    detail = f"with the memory: {with_labels}; without: {plain_labels}"
    assert hits >= n - 1, f"{word!r} drew {TRAINED_WORDS[word]!r} in {hits}/{n} with the trained memory; {detail}"
    assert before <= 2, f"{word!r} drew {TRAINED_WORDS[word]!r} in {before}/{n} without any memory: the test proves nothing; {detail}"


def test_saved_and_loaded_memory_draws_the_same_pixels(trained, loaded):
    changed, misses = [], []
    for word in TRAINED_WORDS:
        target = world.parse_prompt(TRAINED_WORDS[word])
        for seed in LOADED_SEEDS:
            (a, _), (b, verdict) = trained[("trained", word, seed)], loaded[("loaded", word, seed)]
            if not np.array_equal(a, b):
                changed.append(f"{word} (seed {seed}): {int((a != b).any(axis=-1).sum())} pixels differ")
            if not verdict.reads(*target):
                misses.append(f"{word} (seed {seed}): {verdict.label}")
    n = len(TRAINED_WORDS) * len(LOADED_SEEDS)
    # Same pixels alone would also pass if neither memory did anything: the loaded one must steer too.
    assert len(misses) <= 1, f"the loaded memory drew its words' classes in {n - len(misses)}/{n}: {misses}"
    assert not changed, f"the loaded memory drew other pictures than the memory it was saved from: {changed}"
