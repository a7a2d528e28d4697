"""smf_kernels' and smf's modules import each other without cycles (imports inside functions included): the
backend registry loads the adapters, the adapters load raw kernels, and nothing below points back up."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _ours(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def _edges(package: str = "smf_kernels") -> dict[str, set[str]]:
    """module -> ``package``'s modules it imports, at any depth, or names as a string (for importlib)."""
    modules = {_module_name(p): p for p in (ROOT / package).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and _ours(node.module, package):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if _ours(a.name, package))
            elif isinstance(node, ast.Constant) and node.value in modules and "." in node.value:  # for importlib
                targets.add(node.value)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycle(graph):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_smf_kernels_has_no_import_cycle():
    graph = _edges()
    assert "smf_kernels.backends.triton_impl" in graph["smf_kernels.backends"], "the registry loads its adapters"
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_smf_has_no_import_cycle_between_files():
    """smf.suite.config and smf.suite.plan imported each other (through a function-level import)."""
    graph = _edges("smf")
    assert "smf.suite.config" in graph["smf.suite.plan"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_raw_triton_kernels_do_not_know_the_backends():
    graph = _edges()
    for name, targets in graph.items():
        if name.startswith("smf_kernels.triton_kernels"):
            assert not any(t.startswith("smf_kernels.backends") for t in targets), (name, targets)
