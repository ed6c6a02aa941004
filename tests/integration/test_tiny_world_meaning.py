"""The demo's pictures mean something, checked through the real server: the tiny world's trained models
(scripts/train_tiny.py; a clean checkout unpacks their committed weights, scripts/tiny_world_cache.py)
draw what the prompt asks, the pack's FP8 model (Load FP8 Diffusion Model on the converter's per-tensor
file) draws what the bf16 model draws at the same seed, and an engram memory makes a word the
model never saw ("lighthouse") draw what it was memorized as ("blue triangle"), which it does not draw
without the memory. The judge (scripts/tiny_world.py) reads colour and shape from each picture.

Sampling is deterministic on the CPU, so these figures are the same on every run of one machine; the
thresholds leave room for another machine's rounding, and sit far above what an untrained or broken
model gets (colour by chance: 1/4, shape: 1/3, the memory's target: 1/12)."""

from __future__ import annotations

import numpy as np
import pytest

import tiny_world as world  # scripts/ is on sys.path (tests/conftest.py)
from example_graphs import PROMPT, TARGET_CLASS, prepare_inputs, world_comparison
from helpers.world_pictures import judged_pictures

pytestmark = pytest.mark.integration

PROMPTS = [world.prompt(c, s) for c, s in world.CLASSES]
SEEDS = [1, 2]
STEER_SEEDS = [1, 2, 3, 4, 5, 6, 7, 8]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


@pytest.fixture(scope="module")
def pictures(comfy_server, comfy):
    """{(kind, prompt, seed): (picture, verdict)} for kinds bf16 / fp8 / plain / memory."""
    prepare_inputs(comfy_server.base_dir)
    graph, saves = world_comparison(PROMPTS, SEEDS, steer_seeds=STEER_SEEDS)
    return judged_pictures(comfy, comfy.run(graph, timeout=900), saves)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_the_model_draws_what_the_prompt_asks(pictures, kind):
    colour = shape = 0
    wrong = []
    for prompt in PROMPTS:
        asked = world.parse_prompt(prompt)
        for seed in SEEDS:
            verdict = pictures[(kind, prompt, seed)][1]
            colour += verdict.colour == asked[0]
            shape += verdict.shape == asked[1]
            if not verdict.reads(*asked):
                wrong.append(f"{prompt} (seed {seed}): {verdict.label}")
    n = len(PROMPTS) * len(SEEDS)
    assert colour >= 0.9 * n and shape >= 0.75 * n, f"{kind}: colour {colour}/{n}, shape {shape}/{n}; wrong: {wrong}"


def test_fp8_draws_the_bf16_models_class_at_the_same_seed(pictures):
    same, differ, psnrs = 0, [], []
    for prompt in PROMPTS:
        for seed in SEEDS:
            (a, va), (b, vb) = pictures[("bf16", prompt, seed)], pictures[("fp8", prompt, seed)]
            psnrs.append(psnr(a, b))
            if va.label == vb.label:
                same += 1
            else:
                differ.append(f"{prompt} (seed {seed}): bf16 {va.label}, FP8 {vb.label}")
    n = len(PROMPTS) * len(SEEDS)
    assert same >= n - 2, f"FP8 drew another class than bf16 in {n - same}/{n}: {differ}"
    # Same picture, not merely the same class: FP8 rounding moves pixels a little.
    assert np.median(psnrs) >= 22.0, f"pixel PSNR FP8 vs bf16: median {np.median(psnrs):.1f} dB ({sorted(psnrs)[:4]} lowest)"
    assert any(p < float("inf") for p in psnrs), "FP8 and bf16 gave identical pictures: was the FP8 file FP8?"


def test_memorize_makes_the_unseen_word_draw_its_target(pictures):
    steered = [pictures[("memory", PROMPT, s)][1] for s in STEER_SEEDS]
    plain = [pictures[("plain", PROMPT, s)][1] for s in STEER_SEEDS]
    hits = sum(v.reads(*TARGET_CLASS) for v in steered)
    before = sum(v.reads(*TARGET_CLASS) for v in plain)
    n = len(STEER_SEEDS)
    detail = f"with the memory: {[v.label for v in steered]}; without: {[v.label for v in plain]}"
    assert hits >= n - 1, f"{PROMPT!r} drew {TARGET_CLASS} in {hits}/{n} with the memory; {detail}"
    assert before <= 2, f"{PROMPT!r} drew {TARGET_CLASS} in {before}/{n} without any memory: the test proves nothing; {detail}"
