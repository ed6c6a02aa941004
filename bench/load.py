"""Load benchmark: this pack's FP8 loader vs stock ComfyUI UNETLoader on the same >= 1 GB FP8 file.

Makes a synthetic SD3-shaped (MMDiT) FP8 checkpoint in a temporary folder (per-tensor e4m3fn with
`.weight_scale` + `_quantization_metadata`, the form both loaders read), then runs each loader in its
own fresh subprocess: time until the model has run its first sampling step (load + first step: the file
is mapped lazily, so a load that never touches the weights would measure nothing), time of a second
step, and peak RSS (ru_maxrss) above the process baseline measured after imports. The file is deleted
at the end. Targets: time ratios pack/stock <= 1.0; peak RSS above baseline <= file size x 1.15.

The pack reads the file into its own memory (nothing stays mapped, so a file replaced under a loaded
model cannot crash the server), as the loader nodes do: the FP8 codes in the background (from the load on for a file
this large; a small one's once ComfyUI has built the model), each weight waiting for its own at its first use
(`defer=True`), so `load s` is the header, the
other tensors and ComfyUI's model, and the reads not done by then land in the first step; `pack_mmap` is the same loader mapping the file instead (what it did
before, and what stock does), measured in the same run so the cost of reading shows as
`read_vs_mmap_*` ratios. `pack` runs the node default compute path ("auto": on a CPU with VNNI/AMX the
layers whose calls int8 proves faster are converted at first use, inside the first step); `pack_weight_only` is the same loader with compute path weight-only, so `auto_vs_weight_only_*`
ratios show what auto's proofs and conversions add to the first step and to the peak RSS;
`pack` keeps a converted layer's FP8 form only while it serves (`fp8_form="serving"`, the default: a layer whose
calls all ran int8 becomes int8 in place); `pack_memory_first` always drops it (`fp8_form="drop"`) and
`pack_both_forms` always keeps it (`fp8_form="keep"`, what "auto" did before).

    python bench/load.py [--hidden 1536] [--repeats 1] [--keep-dir DIR] [--loaders stock,pack,pack_weight_only]

Prints a table and, as the last line, one JSON object {"bench": "load", ...}.

Measured (2-core AMX CPU in a VM, hidden 1536 = 1.92 GiB file, one run per loader, twice, machine quiet):
pack (auto: the codes read in the background, layers that run int8 converted in place) load 0.35 s vs stock
0.19-0.28 s, first step 6.24-6.37 s vs 6.52-6.54 s (ratio 0.96-0.97), second step 0.43 s vs 6.32-6.35 s
(0.07), peak RSS above baseline 1.146 x file (stock 1.12-1.13); pack_weight_only first step 3.0 s, 1.10 x;
pack_both_forms (what auto did before) first step 15.9-16.6 s at 2.12-2.15 x the file.
On a 2-core AMD EPYC Zen 5 VM (AVX-512 VNNI, no AMX), conversions in 4 MiB chunks, best of 2-3 per loader, three
runs within 20 minutes, machine quiet: first step 0.85, 0.91 and 1.19 of stock's (pack 6.7-9.7 s, of it the
conversion 4.4, 4.9 and 6.6 s: the same code, the host's memory moving), peak RSS 1.11 x the file (stock 1.10-1.12).
The shared CPU makes wall times swing 2-5x when other jobs run: compare the CPU-time ratio too.

`1st minflt` counts the minor page faults of the load and first step: each is a page of fresh memory (or a
mapped page of the file, for stock and pack_mmap). Fresh pages are what owned memory costs, and on a virtual
machine whose host backs guest memory on first touch they cost tens of microseconds each (this bench's
2-core VM: 2 GiB of fresh pages took 1.6-8.7 s to touch, varying with what ran before), so on such machines
the columns that allocate (pack's read, auto's int8 copies) swing with the host, while stock's mapped page
cache does not. Auto and memory first convert a proven layer in its FP8 form's own storage, so their conversions
fault in almost nothing (37k more first-step faults than weight-only's 553k; pack_both_forms 514-522k more: one
fresh byte per converted parameter). Reads into owned memory made before the load returned cost it 3-27 s on that VM
(the same 2 GiB of fresh pages); in the background they overlap ComfyUI building the model and the first layers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTEXT, POOLED = 4096, 2048


def comfy_root() -> Path:
    """COMFYUI_PATH, else the 0.3.75 tree of scripts/setup.sh (scripts/comfyhost.py's rule)."""
    if os.environ.get("COMFYUI_PATH"):
        return Path(os.environ["COMFYUI_PATH"])
    return ROOT / ".host" / "comfyui"


def setup_paths():
    sys.path.insert(0, str(comfy_root()))
    sys.path.insert(0, str(ROOT / ".host" / "pkg"))
    import comfy.cli_args

    comfy.cli_args.args.cpu = True


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def make_file(path: Path, hidden: int) -> int:
    """Stream a random SD3-shaped FP8 file to `path` without holding the model in memory."""
    setup_paths()
    import json as _json

    import torch
    from comfy.ldm.modules.diffusionmodules import mmdit

    from fp8_engram.quant import save

    depth = hidden // 64
    with torch.device("meta"):
        model = mmdit.MMDiT(patch_size=2, in_channels=16, out_channels=16, depth=depth, adm_in_channels=POOLED,
                            context_embedder_config={"target": "torch.nn.Linear",
                                                     "params": {"in_features": CONTEXT, "out_features": hidden}},
                            pos_embed_max_size=96, num_patches=96 * 96, qk_norm="rms", dtype=torch.bfloat16,
                            device="meta", operations=torch.nn)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    entries, layers = [], {}
    gen = torch.Generator().manual_seed(0)
    for k, shape in shapes.items():
        if k.endswith(".weight") and len(shape) == 2:
            layer = k[: -len(".weight")]
            entries += [(k, torch.float8_e4m3fn, shape), (layer + ".weight_scale", torch.float32, ())]
            layers[layer] = {"format": "float8_e4m3fn"}
        else:
            entries.append((k, torch.bfloat16, shape))

    def get(name):
        shape = dict((n, s) for n, _, s in entries)[name]
        if name.endswith(".weight_scale"):
            return torch.tensor(1.0 / (448 * 8 * 32), dtype=torch.float32)
        w_shape = shapes.get(name)
        if name.endswith(".weight") and len(shape) == 2:
            # values ~ N(0, 1/fan_in) after the scale: draw the fp8 codes directly
            q = (torch.randn(shape, generator=gen) * 448 / 4).clamp(-448, 448)
            return q.to(torch.float8_e4m3fn)
        if "norm" in name:
            return torch.ones(w_shape, dtype=torch.bfloat16)
        return (torch.randn(w_shape, generator=gen) * 0.02).to(torch.bfloat16)

    meta = {"_quantization_metadata": _json.dumps({"format_version": "1.0", "layers": layers})}
    return save.write_safetensors(path, entries, get, meta)


def child(loader: str, path: str) -> None:
    setup_paths()
    import torch
    import comfy.model_management
    import comfy.sample
    import comfy.sd

    baseline = rss_mb()
    noise = torch.randn(1, 16, 16, 16, generator=torch.Generator().manual_seed(0))
    latent = torch.zeros(1, 16, 16, 16)
    cond = [[torch.randn(1, 77, CONTEXT, generator=torch.Generator().manual_seed(1)),
             {"pooled_output": torch.randn(1, POOLED, generator=torch.Generator().manual_seed(2))}]]
    t0, cpu0, f0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with torch.inference_mode():
        if loader == "stock":
            model = comfy.sd.load_diffusion_model(path)
        else:
            from fp8_engram.nodes.ops import make_fp8_ops
            from fp8_engram.quant import ComputeConfig, formats

            cfg = {"pack_weight_only": lambda: ComputeConfig(path="weight_only"),
                   "pack_memory_first": lambda: ComputeConfig(fp8_form="drop"),
                   "pack_both_forms": lambda: ComputeConfig(fp8_form="keep")}.get(loader, ComputeConfig)()
            from fp8_engram.quant.safetensors_file import background_reads_held

            with background_reads_held():  # as the loader node (a file of HOLD_MAX_BYTES or more is not held)
                sd, _ = formats.load_file(path, config=cfg, mmap=(loader == "pack_mmap"), defer=(loader != "pack_mmap"))
                options = {"custom_operations": make_fp8_ops(cfg)}
                model = comfy.sd.load_diffusion_model_state_dict(sd, model_options=options)
        t_load = time.perf_counter() - t0
        comfy.sample.sample(model, noise, 1, 1.0, "euler", "simple", cond, cond, latent, seed=0, disable_pbar=True)
        t_first, c_first = time.perf_counter() - t0, time.process_time() - cpu0
        f_first = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        r0, c0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
        t1 = time.perf_counter()
        comfy.sample.sample(model, noise, 1, 1.0, "euler", "simple", cond, cond, latent, seed=0, disable_pbar=True)
        t_second = time.perf_counter() - t1
        c_second, r1 = time.process_time() - c0, resource.getrusage(resource.RUSAGE_SELF)
    peak = r1.ru_maxrss / 1024  # KiB -> MiB
    conv = {}
    if loader != "stock":  # what auto converted at first use (the in-process book of ComputeConfig())
        from fp8_engram.quant.compute import default_book

        conv = default_book().conversions("cpu") or {}
    # CPU seconds and page faults of the second step: less sensitive to other processes than wall time
    print(json.dumps({"loader": loader, "load_s": t_load, "first_step_s": t_first, "first_step_cpu_s": c_first,
                      "converted_layers": conv.get("layers", 0), "converted_params": conv.get("parameters", 0),
                      "converting_s": conv.get("seconds", 0.0), "dropped_layers": conv.get("dropped_layers", 0),
                      "second_step_s": t_second,
                      "second_step_cpu_s": c_second, "first_step_minflt": f_first, "second_step_minflt": r1.ru_minflt - r0.ru_minflt,
                      "second_step_majflt": r1.ru_majflt - r0.ru_majflt, "baseline_mb": baseline, "peak_mb": peak}))


def run_child(loader: str, path: Path, script: str = __file__) -> dict:
    """``script --child LOADER FILE`` in a fresh process: its last stdout line, a JSON object."""
    r = subprocess.run([sys.executable, script, "--child", loader, str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{loader} child failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1536, help="MMDiT hidden size (depth = hidden/64); 1536 -> ~1.4 GB")
    p.add_argument("--repeats", type=int, default=2, help="runs per loader, interleaved (order alternates)")
    p.add_argument("--keep-dir", help="make the file here and keep it (default: a temp dir, deleted)")
    p.add_argument("--loaders", default="stock,pack,pack_mmap,pack_weight_only,pack_memory_first,pack_both_forms",
                   help="which loaders to run (stock and pack are needed for the ratios)")
    p.add_argument("--child", nargs=2, metavar=("LOADER", "FILE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child)
        return 0
    folder = Path(args.keep_dir) if args.keep_dir else Path(tempfile.mkdtemp(prefix="fp8_bench_load_"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"synthetic_sd3_h{args.hidden}_fp8.safetensors"
    try:
        if not path.exists():
            t = time.perf_counter()
            size = make_file(path, args.hidden)
            print(f"made {path.name}: {size / 2**30:.2f} GiB in {time.perf_counter() - t:.1f} s")
        size = path.stat().st_size
        order = tuple(v for v in ("stock", "pack", "pack_mmap", "pack_weight_only", "pack_memory_first", "pack_both_forms")
                      if v in args.loaders.split(","))
        results = {k: [] for k in order}
        load0 = os.getloadavg()[0]
        for i in range(args.repeats):
            for loader in (order if i % 2 == 0 else order[::-1]):
                results[loader].append(run_child(loader, path))
        best = {k: {m: min(r[m] for r in v) for m in v[0]} for k, v in results.items() if v}
        print(f"best of {args.repeats} interleaved runs per loader; load average (1 min) before/after: "
              f"{load0:.2f}/{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
        print(f"{'loader':<18}{'load s':>9}{'to 1st step s':>15}{'2nd step s':>12}{'2nd cpu s':>11}{'2nd minflt':>12}"
              f"{'2nd majflt':>12}{'peak-base MiB':>15}{'x file':>8}{'1st cpu s':>10}{'1st minflt':>12}{'converted':>10}"
              f"{'conv s':>8}")
        for k in order:
            b = best[k]
            above = b["peak_mb"] - b["baseline_mb"]
            print(f"{k:<18}{b['load_s']:>9.2f}{b['first_step_s']:>15.2f}{b['second_step_s']:>12.2f}"
                  f"{b['second_step_cpu_s']:>11.2f}{b['second_step_minflt']:>12d}{b['second_step_majflt']:>12d}"
                  f"{above:>15.0f}{above * 2**20 / size:>8.2f}{b['first_step_cpu_s']:>10.2f}{b['first_step_minflt']:>12d}"
                  f"{b['converted_params'] / 1e6:>9.0f}M{b['converting_s']:>8.2f}")
        pk, st = best["pack"], best["stock"]
        pack_above = (pk["peak_mb"] - pk["baseline_mb"]) * 2**20
        out = {
            "bench": "load", "file_bytes": size, "hidden": args.hidden,
            "first_step_ratio": round(pk["first_step_s"] / st["first_step_s"], 3),
            "second_step_ratio": round(pk["second_step_s"] / st["second_step_s"], 3),
            "pack_first_step_s": round(pk["first_step_s"], 3), "stock_first_step_s": round(st["first_step_s"], 3),
            "pack_second_step_s": round(pk["second_step_s"], 3), "stock_second_step_s": round(st["second_step_s"], 3),
            "second_step_cpu_ratio": round(pk["second_step_cpu_s"] / st["second_step_cpu_s"], 3),
            "pack_second_step_minflt": pk["second_step_minflt"], "stock_second_step_minflt": st["second_step_minflt"],
            "repeats": args.repeats, "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "pack_peak_rss_above_baseline_x_file": round(pack_above / size, 3),
            "stock_peak_rss_above_baseline_x_file": round((st["peak_mb"] - st["baseline_mb"]) * 2**20 / size, 3),
            "pack_load_s": round(pk["load_s"], 3),
            "first_step_cpu_s": {k: round(v["first_step_cpu_s"], 2) for k, v in best.items()},
            "first_step_minflt": {k: v["first_step_minflt"] for k, v in best.items()},
            "converted_params": {k: v["converted_params"] for k, v in best.items()},
            "converting_s": {k: round(v["converting_s"], 2) for k, v in best.items()},
            "dropped_layers": {k: v["dropped_layers"] for k, v in best.items()},
        }
        if "pack_mmap" in best:
            mm = best["pack_mmap"]
            mmap_above = (mm["peak_mb"] - mm["baseline_mb"]) * 2**20
            out.update({"pack_mmap_peak_rss_above_baseline_x_file": round(mmap_above / size, 3),
                        "pack_mmap_load_s": round(mm["load_s"], 3),
                        "read_vs_mmap_first_step_ratio": round(pk["first_step_s"] / mm["first_step_s"], 3),
                        "read_vs_mmap_second_step_ratio": round(pk["second_step_s"] / mm["second_step_s"], 3),
                        "read_vs_mmap_peak_rss_ratio": round(pack_above / mmap_above, 3)})
        if "pack_weight_only" in best:
            wo = best["pack_weight_only"]
            wo_above = (wo["peak_mb"] - wo["baseline_mb"]) * 2**20
            out.update({"pack_weight_only_peak_rss_above_baseline_x_file": round(wo_above / size, 3),
                        "auto_vs_weight_only_first_step_ratio": round(pk["first_step_s"] / wo["first_step_s"], 3),
                        "auto_vs_weight_only_second_step_ratio": round(pk["second_step_s"] / wo["second_step_s"], 3),
                        "auto_vs_weight_only_peak_rss_ratio": round(pack_above / wo_above, 3),
                        "pack_weight_only_first_step_s": round(wo["first_step_s"], 3)})
        if "pack_memory_first" in best:
            mf = best["pack_memory_first"]
            mf_above = (mf["peak_mb"] - mf["baseline_mb"]) * 2**20
            out.update({"pack_memory_first_peak_rss_above_baseline_x_file": round(mf_above / size, 3),
                        "memory_first_vs_auto_peak_rss_ratio": round(mf_above / pack_above, 3),
                        "memory_first_vs_auto_first_step_ratio": round(mf["first_step_s"] / pk["first_step_s"], 3),
                        "memory_first_vs_auto_second_step_ratio": round(mf["second_step_s"] / pk["second_step_s"], 3)})
        if "pack_both_forms" in best:
            bf = best["pack_both_forms"]
            bf_above = (bf["peak_mb"] - bf["baseline_mb"]) * 2**20
            out.update({"pack_both_forms_peak_rss_above_baseline_x_file": round(bf_above / size, 3),
                        "auto_vs_both_forms_peak_rss_ratio": round(pack_above / bf_above, 3),
                        "auto_vs_both_forms_first_step_ratio": round(pk["first_step_s"] / bf["first_step_s"], 3)})
        print(json.dumps(out))
    finally:
        if not args.keep_dir:
            if path.exists():
                path.unlink()
            try:
                folder.rmdir()
            except OSError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
