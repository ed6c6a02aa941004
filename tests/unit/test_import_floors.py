"""The imports of common/, quant/, engram/ and nodes/ (read with ast, imports inside functions included)
form no cycle and never go up a floor (floors.py); README shows the same floors."""

import ast
import importlib.util
import pathlib

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _floors():
    spec = importlib.util.spec_from_file_location("pack_floors", ROOT / "floors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FLOORS = _floors()


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in FLOORS.PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


MODULES = _modules()


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """Pack modules an import names (a `from X import y` names X.y where that is a module, else X)."""
    if node.level == 0:
        base = node.module or ""
        if not base.startswith("fp8_engram."):
            return []
        base = base.removeprefix("fp8_engram.")
    else:
        parts = importer.split(".") if is_package else importer.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        if node.level - 1 > len(importer.split(".")):
            return []
        base = ".".join(parts + ([node.module] if node.module else []))
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}" if base else alias.name
        if sub in MODULES:
            out.append(sub)
        elif base in MODULES:
            out.append(base)
    return out


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                edges.update(_resolve(name, path.name == "__init__.py", node))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    target = alias.name.removeprefix("fp8_engram.")
                    if alias.name.startswith("fp8_engram.") and target in MODULES:
                        edges.add(target)
        edges.discard(name)
        graph[name] = edges
    return graph


GRAPH = _graph()


def test_the_reader_sees_the_imports_it_must():
    """The parser itself: known arrows of today's code are found, a function-level one included."""
    assert "quant.layouts.fp8" in GRAPH["quant.layouts.mxfp8"]
    assert "quant.compute.scaled_mm" in GRAPH["quant.compute.linear"]
    assert "quant.kernels" in GRAPH["quant.kernels.ops"]  # `from .. import kernels`
    assert {"quant", "quant.quantize_model"} <= GRAPH["nodes.fp8"]


def _cycle(graph) -> list[str] | None:
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycle():
    assert _cycle(GRAPH) is None, "import cycle: " + " -> ".join(_cycle(GRAPH))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_packages_import_only_what_they_may():
    wrong = []
    for name, edges in GRAPH.items():
        package = name.split(".")[0]
        for target in edges:
            other = target.split(".")[0]
            if other != package and other not in FLOORS.ALLOWED_PACKAGES[package]:
                wrong.append(f"{name} -> {target}")
    assert not wrong, wrong


def _floors_of(package: str) -> dict[str, int | None]:
    return {n: FLOORS.floor_of(package, n.removeprefix(package + ".") if n != package else "__init__")
            for n in GRAPH if n.split(".")[0] == package}


def _upward(package: str) -> list[str]:
    floor = _floors_of(package)
    return [f"{n} (floor {floor[n]}) -> {t} (floor {floor[t]})"
            for n, edges in GRAPH.items() if n in floor for t in edges if t in floor and floor[t] > floor[n]]


def test_every_quant_module_has_a_floor_and_imports_nothing_above_it():
    floor = {n: FLOORS.quant_floor_of(n.removeprefix("quant.") if n != "quant" else "__init__")
             for n in GRAPH if n.split(".")[0] == "quant"}
    assert not [n for n, f in floor.items() if f is None], "modules without a floor in floors.py"
    upward = [f"{n} (floor {floor[n]}) -> {t} (floor {floor[t]})"
              for n, edges in GRAPH.items() if n in floor for t in edges if t in floor and floor[t] > floor[n]]
    assert not upward, upward


@pytest.mark.parametrize("package", ["engram", "nodes"])
def test_every_module_has_a_floor_and_imports_nothing_above_it(package):
    floor = _floors_of(package)
    assert floor, f"no modules found in {package}/"
    assert not [n for n, f in floor.items() if f is None], f"{package}/ modules without a floor in floors.py"
    assert not _upward(package), _upward(package)


def test_floors_name_only_modules_that_exist():
    """A floor table naming a module that is gone (renamed, split) would vouch for nothing."""
    stale = []
    for package in ("quant", "engram", "nodes"):
        for _, members, _ in FLOORS.FLOORS[package]:
            for m in members:
                name = package if m == "__init__" else f"{package}.{m.rstrip('/')}"
                if name not in MODULES:
                    stale.append(name)
    assert not stale, stale


def test_common_is_below_everything_and_needs_neither_torch_nor_comfy():
    names = [n for n in MODULES if n.split(".")[0] == "common"]
    assert {"common.files", "common.proc", "common.fingerprint"} <= set(names)
    foreign = []
    for name in names:
        for node in ast.walk(ast.parse(MODULES[name].read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            foreign += [f"{name} -> {m}" for m in mods if m.split(".")[0] in ("torch", "comfy", "comfy_api", "folder_paths", "numpy")]
        foreign += [f"{name} -> {t}" for t in GRAPH[name] if t.split(".")[0] != "common"]
    assert not foreign, foreign


def test_the_libraries_reach_their_shared_rules_through_common():
    """quant/ and engram/ share the atomic writer and the /proc readers without importing each other."""
    assert "common.files" in GRAPH["quant.save"] and "common.files" in GRAPH["engram.table_file"]
    assert "common.files" in GRAPH["quant.compute.verdict_file"]
    assert "common.proc" in GRAPH["engram.group"] and "common.proc" in GRAPH["engram.memory"]
    assert "common.fingerprint" in GRAPH["quant.tensor"] and "common.fingerprint" in GRAPH["quant.compute.book"]


def test_an_upward_import_in_engram_is_caught():
    """The floor rule on made-up arrows: the row rules importing the table file, the memory imported by a store."""
    graph = {"engram.rows": {"engram.table_file"}, "engram.group": {"engram.memory"}}
    floor = _floors_of("engram")
    upward = [f"{n} -> {t}" for n, edges in graph.items() for t in edges if floor[t] > floor[n]]
    assert upward == ["engram.rows -> engram.table_file", "engram.group -> engram.memory"]


def test_an_upward_import_is_caught(tmp_path):
    """The floor rule on a made-up arrow: a layout importing the compute floor is refused."""
    f_layout = FLOORS.quant_floor_of("layouts.fp8")
    f_compute = FLOORS.quant_floor_of("compute.linear")
    assert f_layout is not None and f_compute is not None and f_compute > f_layout
    tree = ast.parse("from ..compute.linear import linear")
    assert _resolve("quant.layouts.fp8", False, tree.body[0]) == ["quant.compute.linear"]


def test_no_quant_module_over_600_lines():
    long = {n: len(p.read_text().splitlines()) for n, p in MODULES.items() if n.startswith("quant")}
    assert not {n: c for n, c in long.items() if c > 600}


@pytest.mark.parametrize("package", ["engram", "nodes"])
def test_no_module_over_600_lines(package):
    long = {n: len(p.read_text().splitlines()) for n, p in MODULES.items() if n.split(".")[0] == package}
    assert long, f"no modules found in {package}/"
    assert not {n: c for n, c in long.items() if c > 600}


@pytest.mark.parametrize("package", ["quant", "engram", "nodes"])
def test_readme_shows_the_floors(package):
    readme = (ROOT / "README.md").read_text()
    missing = [line for line in FLOORS.readme_lines(package) if line not in readme]
    assert not missing, missing


def test_each_module_says_its_job_in_its_first_line():
    silent = [n for n, p in MODULES.items() if not (ast.get_docstring(ast.parse(p.read_text())) or "").strip()]
    assert not silent, silent
