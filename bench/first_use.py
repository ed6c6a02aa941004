"""First-use cost of proving the fast paths (quant/compute/prove.py), on the CPU, through ComfyUI in-process.

For each model, the pack's Load FP8 Diffusion Model (node defaults: compute path auto, fast paths
"proven on this device") loads the FP8 file and ComfyUI's KSampler runs 20 steps (euler, cfg 1), each
run in a fresh process of its own:
  first    the verdict cache (fast_paths.json) absent: every path kind and shape class the model meets
           is proven and timed during its first calls
  second   the cache the first run wrote: nothing is proven again
Per run: the sampling wall time (KSampler's call), the first step (to the end of the first model call),
the median later step, and what the choice itself reports: verdicts measured in this process and their
summed cost (proof + timing), verdicts read from the cache, the calls checked at a new shape and their
time, and the time of int8 conversions at first use (both are paid again by every process: a shape's check
and a conversion are not kept in the file). "proving_vs_run" is the measured cost over the second run's
sampling time: what proving adds to a 20-step run; the second run's measured cost must be 0.

Models (random weights, made here with bench/e2e.py's makers):
  sd3    the tiny SD3 MMDiT the demo workflow uses (scripts/tiny_models.py's shape), 32x32 latent pixels
  flux   Flux.1-dev's layer sizes (hidden 3072, mlp 12288, context 4096) at --flux-depth double,single
         blocks (default 1,1; bench/e2e.py's is 5,10), 128x128 pixels (64 image tokens), 64 text tokens.
         Proving costs the same per shape class at any depth, so its share falls with the depth.

    .venv/bin/python bench/first_use.py [--models sd3,flux] [--steps 20] [--flux-depth 5,10]

Prints one line per run and, as the last line, one JSON object {"bench": "first_use", ...}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402  (bench/e2e.py: ComfyUI in-process, model makers, the step clock)

logger = logging.getLogger("bench.first_use")


def shape_of(model: str, steps: int, flux_depth: tuple = (1, 1)) -> e2e.Shape:
    if model == "sd3":
        return e2e.Shape("sd3", double=2, single=0, image=32, text_tokens=16, steps=steps, vec_dim=2048, engram_repeats=0)
    if model == "flux":
        return e2e.Shape("flux", double=flux_depth[0], single=flux_depth[1], image=128, text_tokens=64, steps=steps,
                         vec_dim=768, engram_repeats=0)
    raise SystemExit(f"unknown model {model!r}: sd3 or flux")


def child(args) -> dict:
    """One run in this process: load with the pack's loader, sample, report the choice's figures."""
    c = e2e.Comfy(tiny=True, models_dir=Path(args.models_dir))
    # the loaders keep their verdict book in ComfyUI's user folder; here the bench's own file
    c.pack_fp8._verdict_file = lambda: str(args.cache)
    book = c.pack_fp8.verdict_book()
    shape = shape_of(args.child, args.steps, _depth(args))
    positive = e2e.conditioning(c, shape)
    inputs = c.defaults(c.pack_fp8.LoadFP8DiffusionModel)
    inputs.update(unet_name=args.file)
    t0 = time.perf_counter()
    (model,) = c.run(c.pack_fp8.LoadFP8DiffusionModel, **inputs)
    load_s = time.perf_counter() - t0
    clock = e2e.StepClock(c)
    t1 = time.perf_counter()
    e2e.sample(c, model, shape, positive, clock)
    sample_s = time.perf_counter() - t1
    later = clock.later_steps_s()
    verdicts = book.verdicts(c.device)
    measured = [v for v in verdicts if v.source == "measured"]
    ruled = [v for v in verdicts if v.source == "rule"]  # too small to prove: the plain path, by rule
    return {"load_s": round(load_s, 3), "sample_s": round(sample_s, 3), "first_step_s": round(clock.first_done - t1, 3),
            "later_step_s": round(statistics.median(later), 4) if later else None,
            "measured": len(measured), "by_rule": len(ruled), "from_cache": len(verdicts) - len(measured) - len(ruled),
            "proving_s": round(sum(v.cost_s for v in measured), 4),
            "checked_shapes": book.checks[0], "checking_s": round(book.checks[1], 4),
            "converting_s": (book.conversions(c.device) or {}).get("seconds", 0.0),
            "chosen": book.summary_lines(c.device),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def _depth(args) -> tuple:
    double, single = (int(v) for v in args.flux_depth.split(","))
    return double, single


def run_child(model: str, file: str, models_dir: Path, cache: Path, steps: int, flux_depth: str) -> dict:
    cmd = [sys.executable, __file__, "--child", model, "--file", file, "--models-dir", str(models_dir),
           "--cache", str(cache), "--steps", str(steps), "--flux-depth", flux_depth]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"the {model} run failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="sd3,flux")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--flux-depth", default="1,1", help="double,single blocks of the Flux-shaped model (bench/e2e.py's "
                    "GPU default is 5,10; proving costs the same per shape class at any depth)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--models-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.child:
        print(json.dumps(child(args)))
        return
    load_before = os.getloadavg()[0]
    results = {}
    with tempfile.TemporaryDirectory(prefix="fp8_engram_first_use_", dir=e2e.scratch_dir(shape_of("flux", 1, _depth(args)))) as tmp:
        models_dir = Path(tmp) / "models"
        c = e2e.Comfy(tiny=True, models_dir=models_dir)
        for model in args.models.split(","):
            shape = shape_of(model, args.steps, _depth(args))
            files = e2e.make_files(c, shape, models_dir, c.torch.device("cpu"))
            cache = Path(tmp) / f"fast_paths_{model}.json"
            runs = {name: run_child(model, files["fp8"], models_dir, cache, args.steps, args.flux_depth)
                    for name in ("first", "second")}
            first, second = runs["first"], runs["second"]
            row = {"params": files["params"], "runs": runs,
                   "proving_vs_run": round(first["proving_s"] / second["sample_s"], 4),
                   "first_vs_second_sample": round(first["sample_s"] / second["sample_s"], 3),
                   "second_proves": second["measured"]}
            results[model] = row
            for name, r in runs.items():
                print(f"{model:5s} {name:6s} sample {r['sample_s']:8.2f} s  first step {r['first_step_s']:7.3f} s  "
                      f"later step {r['later_step_s']} s  proved {r['measured']} ({r['proving_s']:.3f} s)  "
                      f"from cache {r['from_cache']}  too small to prove {r['by_rule']}  shapes checked "
                      f"{r['checked_shapes']} ({r['checking_s']:.3f} s)  int8 conversions {r['converting_s']:.3f} s")
            print(f"{model:5s} proving adds {100 * row['proving_vs_run']:.2f} % to a {args.steps}-step run; "
                  f"first/second sampling time {row['first_vs_second_sample']}; the second run proved {row['second_proves']}")
            for line in first["chosen"]:
                print(f"{model:5s} chosen: {line}")
    summary = {"bench": "first_use", "device": "cpu", "steps": args.steps, "flux_depth": args.flux_depth, "loadavg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
               "statistic": "one run each, fresh processes; proving_vs_run = first run's measured proving cost / second run's sampling time",
               "models": results}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
