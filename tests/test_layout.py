"""The package layout is the architecture: each subpackage imports only the layers below it,
the algorithm runs without DeepSpeed, and only apt_ds.distributed touches DeepSpeed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "apt_ds"

# Each layer and what it may import besides itself (apt_ds/__init__.py re-exports public names).
ALLOWED = {
    "models": set(),  # architecture descriptions: data every layer reads
    "config": {"models"},  # (the adapter targets a config may name are the families' projections)
    "algorithm": {"config", "models"},
    "io": {"config", "models", "algorithm"},
    "distributed": {"config", "models", "algorithm", "io"},
    "export": {"config", "models", "algorithm", "io"},
    "training": {"config", "models", "algorithm", "io", "distributed"},
    "evaluation": {"config", "models", "algorithm", "io"},
    "cli": {"config", "models", "algorithm", "io", "distributed", "export", "training", "evaluation"},
}


def _layer(module: str) -> str:
    """apt_ds.algorithm.units -> algorithm; apt_ds.config -> config."""
    return module.split(".")[1]


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path) -> list[str]:
    """Every module a file imports, at top level or inside functions (lazy imports count)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: use absolute imports (apt_ds.layer.module), got a relative one"
            names.append(node.module)
    return names


def test_every_module_belongs_to_a_known_layer():
    layers = {_layer(name) for name in _modules() if name != "apt_ds"}
    assert layers <= set(ALLOWED), f"new top-level module(s) {layers - set(ALLOWED)}: add them to a layer"


def test_layers_import_only_the_layers_below_them():
    wrong = []
    for name, path in _modules().items():
        if name == "apt_ds":
            continue
        layer = _layer(name)
        for imported in _imports(path):
            if imported.startswith("apt_ds."):
                target = _layer(imported)
                if target != layer and target not in ALLOWED[layer]:
                    wrong.append(f"{name} imports {imported}")
    assert not wrong, "layering broken:\n" + "\n".join(wrong)


def test_the_allowed_layer_graph_has_no_cycles():
    seen, done = set(), set()

    def visit(layer, trail):
        assert layer not in seen - done, f"cycle: {' -> '.join(trail + [layer])}"
        if layer in done:
            return
        seen.add(layer)
        for below in ALLOWED[layer]:
            visit(below, trail + [layer])
        done.add(layer)

    for layer in ALLOWED:
        visit(layer, [])


def _resolve(imported: str, modules: dict) -> str | None:
    """The apt_ds module an import names (`from apt_ds.x import y` may name module x.y or a name in x)."""
    while imported and imported not in modules:
        imported = imported.rpartition(".")[0]
    return imported or None


def test_no_module_import_cycles_even_through_lazy_imports():
    """Module by module, top-level and function-level imports alike (a lazy import only hides a
    cycle: the two modules still cannot be read or changed one without the other)."""
    modules = _modules()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            for target in targets:
                resolved = _resolve(target, modules) if target.startswith("apt_ds.") else None
                if resolved and resolved != name and resolved != "apt_ds" and not name.startswith(resolved + "."):
                    graph[name].add(resolved)
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def connect(node):  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    assert not cycles, f"modules that import each other: {cycles}"


def test_only_the_distributed_layer_imports_deepspeed():
    outside = [name for name, path in _modules().items()
               if not name.startswith("apt_ds.distributed")
               and any(m == "deepspeed" or m.startswith("deepspeed.") for m in _imports(path))]
    assert not outside, f"deepspeed imported outside apt_ds.distributed: {outside}"


def test_algorithm_io_and_export_import_with_deepspeed_blocked():
    """A newcomer can read and run the algorithm without DeepSpeed installed."""
    names = [n for n in _modules() if n != "apt_ds" and _layer(n) in ("config", "algorithm", "io", "export")]
    code = (
        "import importlib, sys\n"
        "sys.modules['deepspeed'] = None  # any import of deepspeed now raises ImportError\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "assert 'deepspeed' not in {m.split('.')[0] for m, v in sys.modules.items() if v is not None}\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok")


MAX_MODULE_LINES = 310  # "one concept, under ~300 lines": a reader can hold a module in their head


def test_modules_stay_small():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these modules (over {MAX_MODULE_LINES} lines): {long}"


def test_the_code_passes_the_linter():
    """pyflakes, pycodestyle's errors and import order ([tool.ruff.lint] in pyproject.toml)."""
    root = PACKAGE.parent
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "apt_ds", "tests", "benchmarks", "launch"],
                            cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
