"""The pack's floors: which module may import which. The import test and README's Architecture section
both read this one table (``tests/unit/test_import_floors.py`` checks both).

A module may import modules of its own floor (without a cycle) and of the floors below it, never of a
floor above. Imports inside functions count. Names are relative to the package; a name ending in "/" is
a subpackage (all its modules). Packages: ``nodes`` (the only code that imports ComfyUI) may import
``quant`` and ``engram``; those two never import ``nodes`` nor each other.
"""

PACKAGES = ("quant", "engram", "nodes")
ALLOWED_PACKAGES = {"quant": (), "engram": (), "nodes": ("quant", "engram")}

# quant/, lowest floor first: (floor name, its modules, its one job)
QUANT_FLOORS = (
    ("base", ("errors", "numerics", "config", "runtime"),
     "errors, numeric rules, compute options, run-time helpers; no imports from the pack"),
    ("layouts", ("layouts/",),
     "one module per layout family, and the registry: scale math, eager twins, shape checks, file forms"),
    ("kernels", ("kernels/",),
     "Triton kernels beside their twins, and their custom ops for torch.compile"),
    ("tensor", ("tensor", "dispatch"),
     "QuantizedTensor and its generic op tables"),
    ("compute", ("compute/",),
     "the registry of linear paths (paths/), proving a product once (prove.py), the verdict book and its file, "
     "scaled-matmul probing"),
    ("files", ("safetensors_file", "format_report", "format_scales", "formats", "save", "quantize_model",
               "convert", "summary", "selftest", "__init__"),
     "file I/O: safetensors reading, format detection and loading, save, quantize, convert CLI, the selftest CLI"),
)


def quant_floor_of(module: str) -> int | None:
    """Floor index of a quant/ module name relative to the package ("layouts.fp8", "tensor", "__init__")."""
    for i, (_, members, _) in enumerate(QUANT_FLOORS):
        for m in members:
            if m.endswith("/") and (module == m[:-1] or module.startswith(m[:-1] + ".")):
                return i
            if module == m:
                return i
    return None


def readme_lines() -> list[str]:
    """The lines README's Architecture section shows for quant/'s floors (the test checks they are there)."""
    lines = []
    for i, (name, members, job) in enumerate(QUANT_FLOORS, 1):
        lines.append(f"{i}. {name} ({', '.join(members)}): {job}")
    return lines
