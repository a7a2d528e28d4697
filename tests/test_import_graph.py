"""smf_kernels' and smf's modules import each other without cycles (imports inside functions included): the
backend registry loads the adapters, the adapters load raw kernels, and nothing below points back up. smf's
packages follow the layer order of smf/__init__.py, and import smf modules inside functions only where that defers
a heavy dependency (:data:`DEFERRED`). An import is an ``import``, a ``from ... import`` (relative ones resolved
against the importing module's package) or an ``importlib.import_module`` / ``__import__`` call with a literal name;
the checks run on any tree (``root``), which the planted-import tests use."""
import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# smf/__init__.py's layers, top to bottom, by package (smf.<name>): an import goes to the importer's own package or
# to a lower layer; packages in one layer do not import each other.
SMF_LAYERS = (("cli",), ("commands",), ("suite",), ("train", "eval", "report"), ("model",), ("data",),
              ("tiny", "options", "threads", "environment", "files", "_lazy"), ("vocabulary",), ("errors",))
# smf_kernels/__init__.py's layers, top to bottom, by package or top-level module (smf_kernels.<name>), the same rule.
KERNELS_LAYERS = (("hf",), ("fsdp", "sparse", "patch"), ("sharded",), ("memory",), ("ops",), ("backends",),
                  ("triton_kernels", "reference", "build_ext", "_checks", "projection", "huge_pages"), ("_rows", "_precision", "names"))

# The imports of smf / smf_kernels modules made inside functions, by importing module. Each defers what the target
# loads and the importer does not: torch and transformers, so that the command line builds its parser and checks a
# config without them (tests/test_cli_reliability.py checks the parser's imports); the suite config's schema, which
# `smf --help` does not need; transformers' Qwen-2 model code and tokenizers (smf.tiny, about 1.5 s); or smf itself,
# in the file saved beside a model that runs without smf.
DEFERRED = {
    "smf.commands.eval": {"smf.eval.tasks", "smf.model.loading", "smf.train.distributed",  # when `smf eval` runs
                          "smf.suite.config"},  # the suite config's schema (pydantic): 30 ms of `smf --help`
    "smf.commands.report": {"smf.suite.report", "smf.suite.shipped"},  # matplotlib, torch: when `smf report` runs
    "smf.commands.suite": {"smf.suite.report", "smf.suite.runner",  # torch: after the config's checks
                           "smf.suite.config", "smf.suite.dry_run"},  # the suite config's schema, as above
    "smf.commands.train": {"smf.train.background", "smf.train.loop"},  # when the stage runs
    "smf.model.loading": {"smf.tiny"},  # Qwen-2 model code and tokenizers, for --model tiny only
    "smf.model.sizes": {"smf.tiny"},  # the same
    "smf.model.remote_code": {"smf.model.attach", "smf_kernels.memory"},  # the saved copy of this file runs without smf
    "smf.suite.config": {"smf.data.own_data", "smf.train.pretrain"},  # torch: `smf suite` / `smf eval` parse
    "smf.suite.dry_run": {"smf.train.pretrain"},  # torch: `smf suite --dry-run` of a config without a world
    "smf.train.config": {"smf.model.sizes", "smf.train.distributed",
                         "smf_kernels.backends"},  # torch: the CLI's parser reads the options defined here
    "smf.train.rules": {"smf.model.adapter", "smf.model.loading",  # torch: the CLI checks a config's rules
                        "smf_kernels.sparse.fill_plan"},
    "smf.train.pretrain": {"smf.data.world_tokenizer",  # transformers: suite config checks import PretrainOptions
                           "smf.model.adapter", "smf.model.attach",  # the same, for pretrain.memory
                           "smf.model.loading"},  # the same, for --upgrade
    "smf.train.shipped_layout": {"smf.model.adapter", "smf.model.loading"},  # the same (smf.train.pretrain imports it)
}


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _ours(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def _modules(*packages: str, root: Path = ROOT) -> dict[str, Path]:
    """The modules of ``packages``; not the package data (``smf/assets``: the code saved beside a shipped model)."""
    return {_module_name(p, root): p for package in packages for p in (root / package).rglob("*.py")
            if "assets" not in p.relative_to(root / package).parts}


def _resolve(name: str, level: int, package: str) -> str | None:
    """The absolute name of ``name`` imported ``level`` packages up from ``package`` (``from ..x import y`` in
    ``a.b.c``: name "x", level 2, package "a.b" -> "a.x"); ``name`` itself at level 0; None beyond the top."""
    if level == 0:
        return name
    parts = package.split(".")
    if level > len(parts):
        return None
    base = ".".join(parts[:len(parts) - level + 1])
    return f"{base}.{name}" if name else base


def _literal(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _dynamic_import(node: ast.Call, name: str, package: str) -> tuple[str | None, list[str]]:
    """``(module, names)`` that the call ``node`` in module ``name`` (of package ``package``) imports when it is
    ``importlib.import_module("literal"[, package])`` or ``__import__("literal"[, globals, locals, fromlist,
    level])``; ``(None, [])`` for any other call, or a name that is no literal."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    target = _literal(node.args[0]) if node.args else None
    if called not in ("import_module", "__import__") or target is None:
        return None, []
    keywords = {keyword.arg: keyword.value for keyword in node.keywords}
    if called == "import_module":  # a leading dot counts from the package argument, as importlib's resolve_name
        level = len(target) - len(target.lstrip("."))
        anchor = node.args[1] if len(node.args) > 1 else keywords.get("package")
        anchor = {"__package__": package, "__name__": name}.get(getattr(anchor, "id", None)) or _literal(anchor)
        return (_resolve(target[level:], level, anchor) if anchor else None) if level else target, []
    fromlist = node.args[3] if len(node.args) > 3 else keywords.get("fromlist")
    level = node.args[4] if len(node.args) > 4 else keywords.get("level")
    names = [_literal(item) for item in getattr(fromlist, "elts", ()) if _literal(item)]
    return _resolve(target, getattr(level, "value", 0), package), names


def _imports(package: str, of: tuple[str, ...], root: Path = ROOT):
    """``(module, line, imported module, inside a function)`` for every import in ``package``'s files (under
    ``root``) of a module of the packages ``of``: ``import``, ``from ... import`` (a relative one resolved against
    the importing module's package; ``from pkg import name`` of a submodule counts as that submodule), and
    ``importlib.import_module`` / ``__import__`` calls with a literal name."""
    modules = _modules(*of, root=root)
    for name, path in _modules(package, root=root).items():
        own = name if path.name == "__init__.py" else name.rpartition(".")[0]  # where its relative imports start
        tree = ast.parse(path.read_text())
        functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        inner = {id(node) for function in functions for node in ast.walk(function)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found = [(alias.name, []) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                found = [(_resolve(node.module or "", node.level, own), [alias.name for alias in node.names])]
            elif isinstance(node, ast.Call):
                found = [_dynamic_import(node, name, own)]
            else:
                continue
            for module, names in found:
                if module is None or not any(_ours(module, p) for p in of):
                    continue
                targets = {f"{module}.{n}" if f"{module}.{n}" in modules else module for n in names} or {module}
                for target in sorted(targets):
                    yield name, node.lineno, target, id(node) in inner


def _edges(package: str = "smf_kernels") -> dict[str, set[str]]:
    """module -> ``package``'s modules it imports, at any depth, or names as a string (for importlib)."""
    modules = _modules(package)
    graph = {name: set() for name in modules}
    for name, _, target, _ in _imports(package, (package,)):
        graph[name].add(target)
    for name, path in modules.items():
        graph[name].update(node.value for node in ast.walk(ast.parse(path.read_text()))  # for importlib
                           if isinstance(node, ast.Constant) and node.value in modules and "." in node.value)
    return {name: {t for t in targets if t in modules and t != name} for name, targets in graph.items()}


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


def _layer_of(module: str) -> str | None:
    """The package of ``module`` that SMF_LAYERS places: smf.suite.plan -> suite, smf.errors -> errors (None: smf)."""
    return module.split(".")[1] if "." in module else None


def _against_layers(package: str, layers: tuple[tuple[str, ...], ...], root: Path = ROOT) -> list[str]:
    """Each import in ``package`` (under ``root``) from a package of the same or a higher layer of ``layers``, with
    its line; first checks that ``layers`` places every package of ``package`` (its ``__init__``, the public
    surface, is above all)."""
    depth = {name: index for index, layer in enumerate(layers) for name in layer}
    placed = {_layer_of(name) for name in _modules(package, root=root)} - {None}
    assert placed == set(depth), f"packages of {package} not in its layers (or listed but gone): {placed ^ set(depth)}"
    return [f"{name}:{line} imports {target} ({_layer_of(name)} -> {_layer_of(target)})"
            for name, line, target, _ in _imports(package, (package,), root)
            if None not in (_layer_of(name), _layer_of(target)) and _layer_of(target) != _layer_of(name)
            and depth[_layer_of(target)] <= depth[_layer_of(name)]]


PLANTED_LAYERS = (("high",), ("low",))  # the planted tree's: pkg.low may import nothing of pkg.high


def _planted_tree(root: Path, leaf: str) -> Path:
    """A package ``pkg`` under ``root``: ``pkg.high.mod``, ``pkg.low.sibling`` and ``pkg.low.leaf``, whose text is
    ``leaf``."""
    files = {"__init__.py": "", "high/__init__.py": "", "high/mod.py": "thing = 1\n", "low/__init__.py": "",
             "low/sibling.py": "x = 1\n", "low/leaf.py": leaf}
    for name, text in files.items():
        (root / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "pkg" / name).write_text(text)
    return root


@pytest.mark.parametrize("leaf, target", [
    ("from ..high import mod\n", "pkg.high.mod"),
    ("from ..high.mod import thing\n", "pkg.high.mod"),
    ("from .. import high\n", "pkg.high"),
    ("import importlib\nimportlib.import_module('pkg.high.mod')\n", "pkg.high.mod"),
    ("from importlib import import_module\nimport_module('..high', __package__)\n", "pkg.high"),
    ("import importlib\nimportlib.import_module('..high.mod', package='pkg.low')\n", "pkg.high.mod"),
    ("__import__('pkg.high')\n", "pkg.high"),
    ("__import__('high', globals(), locals(), ['mod'], 2)\n", "pkg.high.mod"),
    ("def load():\n    import importlib\n    return importlib.import_module('pkg.high')\n", "pkg.high"),
], ids=["relative", "relative-module", "relative-package", "import_module", "import_module-relative",
        "import_module-package", "__import__", "__import__-level", "inside-a-function"])
def test_a_planted_upward_import_is_flagged(tmp_path, leaf, target):
    """Relative imports and importlib / ``__import__`` calls with a literal name count as imports: each planted
    in a tree of two layers (pkg.low under pkg.high) is reported with its line (the checker missed the first kind
    and both importlib kinds before)."""
    line = leaf.count("\n")  # each planted import is on the leaf's last line
    assert _against_layers("pkg", PLANTED_LAYERS, _planted_tree(tmp_path, leaf)) == [
        f"pkg.low.leaf:{line} imports {target} (low -> high)"]


@pytest.mark.parametrize("leaf", ["from . import sibling\n", "from .sibling import x\n",
                                  "import importlib\nimportlib.import_module('.sibling', __package__)\n",
                                  "__import__('sibling', globals(), locals(), ['x'], 1)\n"])
def test_a_planted_import_of_the_own_package_is_resolved_and_allowed(tmp_path, leaf):
    root = _planted_tree(tmp_path, leaf)
    assert [target for name, _, target, _ in _imports("pkg", ("pkg",), root) if name == "pkg.low.leaf"] == [
        "pkg.low.sibling"]
    assert _against_layers("pkg", PLANTED_LAYERS, root) == []


def test_smf_packages_import_only_their_own_or_a_lower_layer():
    """Before: report imported suite (the suite directory's report) and eval (metric keys), eval imported suite and
    train (``smf eval --config``, the device checks), train imported report (a model's architecture). A failure
    names each import against the order with its line."""
    upward = _against_layers("smf", SMF_LAYERS)
    assert not upward, "imports against smf's layer order (smf/__init__.py):\n" + "\n".join(upward)
    assert not list(_imports("smf_kernels", ("smf",))), "smf_kernels imports smf"


def test_smf_kernels_packages_import_only_their_own_or_a_lower_layer():
    """The Hugging Face integration above the sparse step, the step above the memory module, the memory above its
    ops, the ops above the backends, the backends above the raw kernels; nothing inside a function."""
    upward = _against_layers("smf_kernels", KERNELS_LAYERS)
    assert not upward, "imports against smf_kernels' layer order (smf_kernels/__init__.py):\n" + "\n".join(upward)
    inside = [f"{name}:{line} imports {target}" for name, line, target, inner in
              _imports("smf_kernels", ("smf_kernels",)) if inner]
    assert not inside, "imports of smf_kernels modules inside functions:\n" + "\n".join(inside)


def test_smf_imports_smf_modules_inside_functions_only_to_defer_heavy_ones():
    found = defaultdict(set)
    where = {}
    for name, line, target, inside in _imports("smf", ("smf", "smf_kernels")):
        if inside:
            found[name].add(target)
            where.setdefault((name, target), line)
    unlisted = [f"{name}:{where[name, target]} imports {target} inside a function: move it to the top, or list it in "
                "DEFERRED with what it defers" for name, targets in sorted(found.items())
                for target in sorted(targets - DEFERRED.get(name, set()))]
    assert not unlisted, "\n".join(unlisted)
    stale = {name: targets - found[name] for name, targets in DEFERRED.items() if targets - found[name]}
    assert not stale, f"DEFERRED lists imports no longer made inside a function: {stale}"
