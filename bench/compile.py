"""Eager vs torch.compile per sampling step: the pack's FP8 model through ComfyUI's TorchCompileModel node.

In one process, with ComfyUI's own nodes (as bench/e2e.py calls them): the demo's diffusion model (the tiny
SD3 of scripts/tiny_models.py: MMDiT hidden 128, depth 2) at the demo's image size (256 x 256, 256 image
tokens), quantized by the pack (per-tensor e4m3fn) and loaded by Load FP8 Diffusion Model; then sampled
(euler, cfg 1: one model call per step) as loaded (eager) and after TorchCompileModel (inductor). The
compiled model is warmed up by one untimed sampling run (the compile itself, timed and reported apart);
then eager and compiled runs alternate --repeats times, each giving the median of its later steps, and
the ratio eager / compiled is the median over those pairs (above 1: compiled is faster). The compiled
latent is compared with the eager one (SQNR, float64).

    python bench/compile.py [--size 256] [--steps 8] [--repeats 3] [--compute-path auto] [--keep-dir DIR]

Prints a table and, as the last line, one JSON object {"bench": "compile", ...}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("bench.compile")

COMPUTE_PATHS = {"auto": "auto", "fp8": "fp8 matmul", "weight_only": "weight-only"}


def _e2e():
    """bench/e2e.py as a module: its ComfyUI setup, model files, step clock and sampler."""
    spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "bench" / "e2e.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_e2e"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=256, help="image side in pixels (the demo's: 256)")
    p.add_argument("--steps", type=int, default=8, help="sampling steps per run (the demo's: 8)")
    p.add_argument("--repeats", type=int, default=3, help="eager / compiled run pairs")
    p.add_argument("--compute-path", choices=list(COMPUTE_PATHS), default="auto",
                   help="Load FP8 Diffusion Model's compute path")
    p.add_argument("--keep-dir", help="make the files here and keep them (default: a temp dir, deleted)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)

    e2e = _e2e()
    shape = e2e.Shape(arch="sd3", double=2, single=0, image=args.size, text_tokens=16, steps=args.steps,
                      vec_dim=2048, engram_repeats=1)
    work = Path(args.keep_dir) if args.keep_dir else Path(tempfile.mkdtemp(prefix="fp8_compile_"))
    result: dict = {"bench": "compile", "compute_path": args.compute_path, "image": args.size,
                    "image_tokens": shape.image_tokens, "steps": args.steps, "repeats": args.repeats}
    try:
        c = e2e.Comfy(not _has_cuda(), work / "models")
        result.update(device=str(c.device), torch=c.torch.__version__)
        with c.torch.inference_mode():  # as ComfyUI's executor runs every node
            run(c, e2e, shape, args, result, work / "models")
    except Exception as exc:  # still print what was measured, and say what broke
        logger.exception("the run stopped")
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        if not args.keep_dir:
            shutil.rmtree(work, ignore_errors=True)

    print_table(result)
    print(json.dumps(result))
    return 1 if "error" in result else 0


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run(c, e2e, shape, args, result: dict, models_dir: Path) -> None:
    from comfy_extras.nodes_torch_compile import TorchCompileModel

    files = e2e.make_files(c, shape, models_dir, c.device)
    inputs = c.defaults(c.pack_fp8.LoadFP8DiffusionModel)
    inputs.update(unet_name=files["fp8"], compute_path=COMPUTE_PATHS[args.compute_path])
    (eager_model,) = c.run(c.pack_fp8.LoadFP8DiffusionModel, **inputs)
    (compiled_model,) = c.run(TorchCompileModel, model=eager_model, backend="inductor")
    positive = e2e.conditioning(c, shape)

    def timed(model):
        clock = e2e.StepClock(c)
        samples = e2e.sample(c, model, shape, positive, clock)
        return statistics.median(clock.later_steps_s()), samples

    t0 = time.perf_counter()
    e2e.sample(c, compiled_model, shape, positive)  # compiles
    result["compile_and_first_run_s"] = round(time.perf_counter() - t0, 2)
    timed(eager_model)  # the eager model's first run (allocations, caches) is not measured either

    eager_s, compiled_s, ratios = [], [], []
    for _ in range(args.repeats):
        e, eager_latent = timed(eager_model)
        k, compiled_latent = timed(compiled_model)
        eager_s.append(e)
        compiled_s.append(k)
        ratios.append(e / k)
    result.update(
        eager_step_ms=round(1e3 * statistics.median(eager_s), 3),
        compiled_step_ms=round(1e3 * statistics.median(compiled_s), 3),
        eager_over_compiled=round(statistics.median(ratios), 3),
        ratios=[round(r, 3) for r in ratios],
        compiled_vs_eager_sqnr_db=round(e2e.sqnr_db(eager_latent, compiled_latent), 1),
        compiled_no_slower=statistics.median(ratios) >= 1.0,
    )


def print_table(result: dict) -> None:
    rows = [("eager step (ms)", result.get("eager_step_ms")), ("compiled step (ms)", result.get("compiled_step_ms")),
            ("eager / compiled", result.get("eager_over_compiled")),
            ("compile + first run (s)", result.get("compile_and_first_run_s")),
            ("compiled vs eager latent SQNR (dB)", result.get("compiled_vs_eager_sqnr_db"))]
    print(f"torch.compile bench: {result.get('device')}, {result.get('image')}px ({result.get('image_tokens')} "
          f"image tokens), {result.get('steps')} steps, path {result.get('compute_path')}")
    for name, value in rows:
        print(f"  {name:<36} {value}")
    if "error" in result:
        print(f"  error: {result['error']}")


if __name__ == "__main__":
    sys.exit(main())
