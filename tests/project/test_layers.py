"""The package's layering (docs/architecture.md): every import of an hfquant module, at module level or inside a
function, points to the same layer or a lower one; no two modules import each other, even through others; only the
integration layer imports transformers' private loading modules; ruff's lint and format are clean."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import hfquant

PACKAGE = Path(hfquant.__file__).parent
LAYERS = {  # module prefix -> layer, lowest first; the longest matching prefix wins
    "hfquant.config": 0,
    "hfquant.version": 0,
    "hfquant.core": 0,
    "hfquant.ops": 1,
    "hfquant.nn": 2,
    "hfquant.checkpoint": 3,
    "hfquant.integration": 4,
    # the library users call: checkpoints made from checkpoints, reading them, checking them, measuring models
    "hfquant.conversion": 5,
    "hfquant.inspection": 5,
    "hfquant.verification": 5,
    "hfquant.evaluation": 5,
    "hfquant.publishing": 6,  # model cards (from inspection's report) and the Hub
    "hfquant.commands": 7,  # the command line only
    "hfquant": 8,  # the package root registers the integration and wires publishing's Hub hook; peft.py
}
LIBRARY = LAYERS["hfquant.conversion"]
PRIVATE_LOADING = (
    "transformers.core_model_loading",
    "transformers.conversion_mapping",
    "transformers.quantizers",
    "transformers.integrations",
    "transformers.modeling_utils",
)
PRIVATE_ALLOWED = {"hfquant.integration.quantizer", "hfquant.integration.conversions"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _layer(module: str) -> int:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def _imports(path: Path, module: str, known: set[str]) -> tuple[set[str], set[str]]:
    """(hfquant modules imported, other top-level module paths imported), at any depth of the syntax tree."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    ours, others = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            target = name
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                ours.add(target)
            elif not name.startswith("hfquant"):
                others.add(name)
    return ours, others


def _graph():
    modules = _modules()
    return modules, {m: _imports(p, m, set(modules)) for m, p in modules.items()}


def test_every_module_has_a_layer_and_imports_only_its_own_or_lower_layers():
    modules, graph = _graph()
    assert len(modules) > 30, sorted(modules)  # the scan sees the whole package
    upward = [
        f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
        for m, (ours, _) in graph.items()
        for t in ours
        if _layer(t) > _layer(m) and not (m == "hfquant" or t == "hfquant")
    ]
    assert upward == []
    # the package root is imported by no module of the package
    assert [m for m, (ours, _) in graph.items() if "hfquant" in ours and m != "hfquant"] == []


def test_no_import_cycle():
    modules, graph = _graph()
    edges = {m: {t for t in ours if t != "hfquant" and m != "hfquant"} for m, (ours, _) in graph.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state:
            assert visit(start, []) is None


def test_transformers_private_loading_modules_only_in_the_integration_layer():
    _, graph = _graph()
    users = {m for m, (_, others) in graph.items() if any(o.startswith(PRIVATE_LOADING) for o in others)}
    assert users <= PRIVATE_ALLOWED, sorted(users - PRIVATE_ALLOWED)


def _imported_from(roots: list[str], graph) -> set[str]:
    """`roots` and every hfquant module they import, directly or through others."""
    seen, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += [t for t in graph[module][0] if t != "hfquant"]
    return seen


def test_the_loading_path_never_imports_the_hub_or_the_cards():
    """What from_pretrained runs (the integration layer and everything it imports) never imports huggingface_hub, the
    cards or the command line; the checkpoint layer's file-to-file helpers (`sharding`, `source`) may use the Hub
    client, the loading path does not reach them."""
    _, graph = _graph()
    loading = _imported_from([m for m in graph if m.startswith("hfquant.integration")], graph)
    assert "hfquant.integration.quantizer" in loading and "hfquant.checkpoint.files" in loading
    for module in loading:
        ours, others = graph[module]
        assert _layer(module) < LIBRARY, module
        assert not any(o.startswith("huggingface_hub") for o in others), module
    assert not any(m.startswith(("hfquant.publishing", "hfquant.commands")) for m in loading)


def test_only_the_command_line_lives_in_commands():
    """`hfquant.commands` is imported by nothing else of the package; every module in it parses arguments."""
    modules, graph = _graph()
    users = {m for m, (ours, _) in graph.items() if not m.startswith("hfquant.commands") and m != "hfquant"}
    assert not [m for m in users if any(t.startswith("hfquant.commands") for t in graph[m][0])]
    for module, path in modules.items():
        if module.startswith("hfquant.commands.") and module != "hfquant.commands.options":
            text = path.read_text(encoding="utf-8")
            assert "def add_parser(" in text or "add_subparsers(" in text, module


def test_ruff_lint_and_format_are_clean():
    """The settings in pyproject.toml ([tool.ruff]); the module-length bound is retired (functions stay short)."""
    root = PACKAGE.parent
    for args in (["check", "."], ["format", "--check", "."]):
        result = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=root, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
