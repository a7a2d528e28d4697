"""smf_kernels' and smf's modules import each other without cycles (imports inside functions included): the
backend registry loads the adapters, the adapters load raw kernels, and nothing below points back up. smf's
packages follow the layer order of smf/__init__.py, and import smf modules inside functions only where that defers
a heavy dependency (:data:`DEFERRED`)."""
import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# smf/__init__.py's layers, top to bottom, by package (smf.<name>): an import goes to the importer's own package or
# to a lower layer; packages in one layer do not import each other.
SMF_LAYERS = (("cli",), ("commands",), ("suite",), ("train", "eval", "report"), ("model",), ("data",),
              ("tiny", "options", "threads", "environment", "files", "_lazy"), ("vocabulary",), ("errors",))
# smf_kernels/__init__.py's layers, top to bottom, by package or top-level module (smf_kernels.<name>), the same rule.
KERNELS_LAYERS = (("hf",), ("fsdp", "sparse"), ("sharded",), ("memory",), ("ops",), ("backends",),
                  ("triton_kernels", "reference", "build_ext", "_checks", "projection"), ("_rows", "_precision"))

# The imports of smf / smf_kernels modules made inside functions, by importing module. Each defers what the target
# loads and the importer does not: torch and transformers, so that the command line builds its parser and checks a
# config without them (tests/test_cli_reliability.py checks the parser's imports); the suite config's schema, which
# `smf --help` does not need; transformers' Qwen-2 model code and tokenizers (smf.tiny, about 1.5 s); or smf itself,
# in the file saved beside a model that runs without smf.
DEFERRED = {
    "smf.commands.eval": {"smf.eval.tasks", "smf.model.loading", "smf.train.distributed",  # when `smf eval` runs
                          "smf.suite.config"},  # the suite config's schema (pydantic): 30 ms of `smf --help`
    "smf.commands.report": {"smf.suite.report"},  # matplotlib, torch: when `smf report` runs
    "smf.commands.suite": {"smf.suite.report", "smf.suite.runner",  # torch: after the config's checks
                           "smf.suite.config", "smf.suite.dry_run"},  # the suite config's schema, as above
    "smf.commands.train": {"smf.train.background", "smf.train.loop"},  # when the stage runs
    "smf.model.loading": {"smf.tiny"},  # Qwen-2 model code and tokenizers, for --model tiny only
    "smf.model.sizes": {"smf.tiny"},  # the same
    "smf.model.remote_code": {"smf.model.attach", "smf_kernels.memory"},  # the saved copy of this file runs without smf
    "smf.suite.config": {"smf.data.own_data", "smf.train.pretrain"},  # torch: `smf suite` / `smf eval` parse
    "smf.suite.dry_run": {"smf.train.pretrain"},  # torch: `smf suite --dry-run` of a config without a world
    "smf.train.config": {"smf.model.adapter", "smf.model.loading", "smf.model.sizes", "smf.train.distributed",
                         "smf_kernels.backends"},  # torch: the CLI's parser reads the options defined here
    "smf.train.pretrain": {"smf.data.world_tokenizer",  # transformers: suite config checks import PretrainOptions
                           "smf.model.adapter", "smf.model.attach"},  # the same, for pretrain.memory
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _ours(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def _modules(*packages: str) -> dict[str, Path]:
    return {_module_name(p): p for package in packages for p in (ROOT / package).rglob("*.py")}


def _imports(package: str, of: tuple[str, ...]):
    """``(module, line, imported module, inside a function)`` for every import in ``package``'s files of a module of
    the packages ``of`` (``from pkg import name`` of a submodule counts as that submodule)."""
    modules = _modules(*of)
    for name, path in _modules(package).items():
        tree = ast.parse(path.read_text())
        functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        inner = {id(node) for function in functions for node in ast.walk(function)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and any(_ours(node.module, p) for p in of):
                targets = {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names}
            elif isinstance(node, ast.Import):
                targets = {a.name for a in node.names if any(_ours(a.name, p) for p in of)}
            else:
                continue
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


def _against_layers(package: str, layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Each import in ``package`` from a package of the same or a higher layer of ``layers``, with its line; first
    checks that ``layers`` places every package of ``package`` (its ``__init__``, the public surface, is above all)."""
    depth = {name: index for index, layer in enumerate(layers) for name in layer}
    placed = {_layer_of(name) for name in _modules(package)} - {None}
    assert placed == set(depth), f"packages of {package} not in its layers (or listed but gone): {placed ^ set(depth)}"
    return [f"{name}:{line} imports {target} ({_layer_of(name)} -> {_layer_of(target)})"
            for name, line, target, _ in _imports(package, (package,))
            if None not in (_layer_of(name), _layer_of(target)) and _layer_of(target) != _layer_of(name)
            and depth[_layer_of(target)] <= depth[_layer_of(name)]]


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
