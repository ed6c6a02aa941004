"""The pack's floors: which module may import which. The import test and README's Architecture section
both read these tables (``tests/unit/test_import_floors.py`` checks both).

A module may import modules of its own floor (without a cycle) and of the floors below it, never of a
floor above. Imports inside functions count. Names are relative to the package; a name ending in "/" is
a subpackage (all its modules). Packages: ``common`` is below everything and imports no other package
(nor torch, nor ComfyUI); ``quant`` and ``engram`` may import ``common`` only, never ``nodes`` nor each
other; ``nodes`` (the only code that imports ComfyUI) may import all three.
"""

PACKAGES = ("common", "quant", "engram", "nodes")
ALLOWED_PACKAGES = {"common": (), "quant": ("common",), "engram": ("common",), "nodes": ("common", "quant", "engram")}

# quant/, lowest floor first: (floor name, its modules, its one job)
QUANT_FLOORS = (
    ("base", ("errors", "numerics", "config", "runtime"),
     "errors, numeric rules, compute options, run-time helpers; no imports from the pack"),
    ("layouts", ("layouts/",),
     "one module per layout family, and the registry: scale math, eager twins, shape checks, file forms"),
    ("kernels", ("kernels/",),
     "Triton kernels beside their twins, and their custom ops for torch.compile"),
    ("tensor", ("tensor", "dispatch", "expert_bank"),
     "QuantizedTensor, its generic op tables and the expert-bank ops"),
    ("compute", ("compute/",),
     "the registry of linear paths (paths/), proving a product once (prove.py), the verdict book and its file, "
     "scaled-matmul probing"),
    ("files", ("safetensors_file", "format_report", "format_scales", "formats", "save", "quantize_model",
               "convert", "summary", "selftest", "__init__"),
     "file I/O: safetensors reading, format detection and loading, save, quantize, convert CLI, the selftest CLI"),
)

# engram/, lowest floor first
ENGRAM_FLOORS = (
    ("base", ("errors", "ue8m0", "hashing", "compress", "streams", "pairs"),
     "errors that cross floors, the UE8M0 row format, n-gram hashing, tokenizer compression, stream layouts, "
     "training pairs files"),
    ("rows", ("rows", "inject", "fit"),
     "the row-store protocol and the rules every store applies, injection into conditioning, table fitting"),
    ("files", ("table_file",),
     "the table file: validated, mapped reading and atomic writing"),
    ("stores", ("store", "cuda_ipc", "allocators", "shard_layout", "shard_gathers", "gather_triton", "buffer", "worker",
                "processes", "group", "host_tier"),
     "the row stores: one process, LocalEngramBuffer and its shard memory, the worker group and its processes, the host tier"),
    ("memory", ("config", "memory", "placement", "__init__"),
     "a memory's settings and their file metadata, EngramMemory over a row store, where a memory lives and why"),
)

# nodes/, lowest floor first
NODES_FLOORS = (
    ("extension", ("__init__",),
     "the extension that lists the nodes, the category and node id prefix"),
    ("adapters", ("ops", "gpt_oss", "engram_live", "engram_clip", "engram_inputs", "engram_images", "progress"),
     "ComfyUI adapters below the nodes: FP8 operations, gpt-oss encoder sizes, the live memories, CLIP "
     "families and tokenizers, inputs and folders, images, progress"),
    ("nodes", ("basic", "fp8", "engram"),
     "node classes: schema, execute, UI text"),
)

FLOORS = {"common": (), "quant": QUANT_FLOORS, "engram": ENGRAM_FLOORS, "nodes": NODES_FLOORS}


def floor_of(package: str, module: str) -> int | None:
    """Floor index of a module of `package` ("quant", "engram", "nodes"; "common" has one floor, 0),
    named relative to the package ("layouts.fp8", "tensor", "__init__")."""
    if package == "common":
        return 0
    for i, (_, members, _) in enumerate(FLOORS[package]):
        for m in members:
            if m.endswith("/") and (module == m[:-1] or module.startswith(m[:-1] + ".")):
                return i
            if module == m:
                return i
    return None


def quant_floor_of(module: str) -> int | None:
    """Floor index of a quant/ module name relative to the package ("layouts.fp8", "tensor", "__init__")."""
    return floor_of("quant", module)


def readme_lines(package: str = "quant") -> list[str]:
    """The lines README's Architecture section shows for a package's floors (the test checks they are there)."""
    lines = []
    for i, (name, members, job) in enumerate(FLOORS[package], 1):
        lines.append(f"{i}. {name} ({', '.join(members)}): {job}")
    return lines
