"""minfer's imports run one way: the layer table below, no circles, and the library never imports course code.

Every module is read with `ast`, imports at any depth included (inside functions too: a lazy import
is still a dependency); only the bodies of `if TYPE_CHECKING:` blocks are left out. Importing
``minfer.a.b`` also runs ``minfer/a/__init__.py``: that counts as an import of ``minfer.a`` too
(except for the packages the importing module lives in, which are already running).

A new module must find its row here: the longest prefix that matches it gives its layer.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minfer"

# ------------------------------------------------------------------------------------------------ the contract
# Bottom to top. A module may import modules of its own layer and of the layers below it, never one above.
#  layer      modules (a prefix matches a package and everything in it; "minfer" alone is the root __init__.py)
LAYERS = [
    ("formats", ["minfer.formats"]),                      # number formats: plain tensor functions
    ("kernels", ["minfer.kernels"]),                      # Triton kernels: a leaf, they import only formats
    ("core", ["minfer.config", "minfer.texts",            # shared leaf modules: configuration, the fixed texts,
              "minfer.sampling_params", "minfer.logprobs",  # a request's settings and outputs
              "minfer.outputs", "minfer.detokenizer", "minfer.sequence",
              "minfer.host_copy"]),                       # and host data onto the device without waiting
    ("layers", ["minfer.layers", "minfer.kv_cache"]),     # what the model is built from and the engine calls
    ("models", ["minfer.models"]),                        # the decoder and its loading
    ("quant", ["minfer.quant", "minfer.moe",              # transforms of a loaded model: quantizers, carved experts
               "minfer.moe.carve"]),
    ("engine", ["minfer.engine", "minfer.speculative",    # the serving engine, speculative decoding, its metrics,
                "minfer.metrics", "minfer.generate"]),    # and the simple static-batch loop
    ("llm", ["minfer.llm"]),                              # LLM, the entry point
    ("serving", ["minfer.serving"]),                      # the HTTP server around an LLM
    ("package", ["minfer"]),                              # minfer/__init__.py: the public names
    ("lab", LAB := ["minfer.lab", "minfer.__main__"]),    # course code: may import all of the above
]
# The library (every layer but "lab") never imports course code.
LIBRARY_MAY_NOT_IMPORT = LAB
RANK = {name: rank for rank, (name, _) in enumerate(LAYERS)}


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    target: str  # the minfer module it imports (or whose package __init__ the import runs)
    path: Path
    line: int
    via_package: bool = False  # the target is a package whose __init__.py runs on the way to the named module

    def where(self) -> str:
        how = f" (runs {self.target.replace('.', '/')}/__init__.py)" if self.via_package else ""
        return f"{self.path.relative_to(ROOT)}:{self.line} imports {self.target}{how}"


def module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


MODULES = module_names()


def layer_of(module: str) -> str | None:
    best = None
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            matches = module == prefix or (prefix != "minfer" and module.startswith(prefix + "."))
            if matches and (best is None or len(prefix) > len(best[1])):
                best = (name, prefix)
    return best and best[0]


def is_lab(module: str) -> bool:
    return layer_of(module) == "lab"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST):
    """Every Import / ImportFrom under node, at any depth, outside `if TYPE_CHECKING:` bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _import_nodes_of(other)
            continue
        yield from _import_nodes_of(child)


def _import_nodes_of(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _import_nodes(node)


def _known(name: str) -> str | None:
    """The longest prefix of a dotted name that is a minfer module."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def imports_of(module: str) -> list[Import]:
    path = MODULES[module]
    is_package = path.name == "__init__.py"
    found = []
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [_known(alias.name) for alias in node.names if alias.name.split(".")[0] == "minfer"]
        else:
            if node.level:  # relative: from the importer's package, up level - 1
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "minfer":
                continue
            targets = [_known(f"{source}.{alias.name}") or _known(source) for alias in node.names]
        for target in dict.fromkeys(t for t in targets if t and t != module):
            found.append(Import(module, target, path, node.lineno))
            # the packages the import runs on its way: minfer.a.b runs minfer/a/__init__.py (not the root facade,
            # nor the importer itself or a package it is part of: those are already running)
            parts = target.split(".")
            for i in range(2, len(parts)):
                package = ".".join(parts[:i])
                if package in MODULES and package != module and not module.startswith(package + "."):
                    found.append(Import(module, package, path, node.lineno, via_package=True))
    return found


ALL_IMPORTS = [imp for module in MODULES for imp in imports_of(module)]


# ------------------------------------------------------------------------------------------------ the checks
def test_every_module_has_a_layer():
    missing = [f"{path.relative_to(ROOT)} ({module})" for module, path in MODULES.items() if layer_of(module) is None]
    assert not missing, ("modules with no row in LAYERS (tests/test_import_layers.py): add each to the layer its "
                         "imports allow:\n  " + "\n  ".join(missing))


def test_no_module_imports_a_layer_above_its_own():
    wrong = []
    for imp in ALL_IMPORTS:
        mine, theirs = layer_of(imp.importer), layer_of(imp.target)
        if mine is None or theirs is None or (is_lab(imp.target) and not is_lab(imp.importer)):
            continue  # no layer: test_every_module_has_a_layer; library -> course code: its own test below
        if RANK[theirs] > RANK[mine]:
            wrong.append(f"{imp.where()}: layer {mine!r} may not import layer {theirs!r} (above it)")
    assert not wrong, "imports against the layer order (" + " < ".join(name for name, _ in LAYERS) + "):\n  " + \
        "\n  ".join(wrong)


def test_the_library_never_imports_course_code():
    wrong = [f"{imp.where()}: the library ({layer_of(imp.importer)!r}) may not import course code ({imp.target})"
             for imp in ALL_IMPORTS if not is_lab(imp.importer) and is_lab(imp.target)]
    assert not wrong, ("the library imports course code (minfer.lab and minfer.__main__, see "
                       "tests/test_import_layers.py); move what it needs down into the library:\n  " + "\n  ".join(wrong))


def find_cycles(imports: list[Import]) -> list[list[Import]]:
    """Cycles (each as its imports, in order) in every strongly connected group of modules (Tarjan): a shortest
    one through the group's first module, then through each module no cycle so far went through."""
    graph: dict[str, dict[str, Import]] = {}
    for imp in imports:
        graph.setdefault(imp.importer, {}).setdefault(imp.target, imp)
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def connect(v: str) -> None:  # recursive: the graph is ~100 modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for group in groups:
        covered: set[str] = set()
        for start in sorted(group):
            if start in covered:
                continue
            came_from: dict[str, Import] = {}  # a shortest way back to start, by breadth-first search
            frontier = [start]
            while frontier and start not in came_from:
                following = []
                for v in frontier:
                    for w, imp in sorted(graph.get(v, {}).items()):
                        if w in group and w not in came_from:
                            came_from[w] = imp
                            following.append(w)
                frontier = following
            path, v = [], start
            while True:
                path.append(came_from[v])
                v = came_from[v].importer
                if v == start:
                    break
            cycles.append(path[::-1])
            covered.update(imp.importer for imp in path)
    return cycles


def test_no_import_cycles():
    cycles = find_cycles(ALL_IMPORTS)
    assert not cycles, "import cycles among minfer's modules (move the shared piece down into a module both can " \
        "import):\n" + "\n".join("  " + " -> ".join([c[0].importer] + [imp.target for imp in c]) + "\n    " +
                                 "\n    ".join(imp.where() for imp in c) for c in cycles)


def test_the_checks_see_lazy_imports_and_package_inits():
    """The parser itself: an import inside a function counts, one under `if TYPE_CHECKING:` does not, and a
    cycle through a package's __init__.py is found."""
    tree = ast.parse("import os\nif TYPE_CHECKING:\n    from minfer.llm import LLM\nelse:\n    import minfer.texts\n"
                     "def f():\n    from minfer.speculative.ngram import NgramProposer\n")
    assert [getattr(n, "module", None) or n.names[0].name for n in _import_nodes(tree)] == \
        ["os", "minfer.texts", "minfer.speculative.ngram"]
    a, b, c = (Import(x, y, PACKAGE / "x.py", 1) for x, y in (("m.a", "m.p"), ("m.p", "m.b"), ("m.b", "m.a")))
    assert [[imp.importer for imp in cycle] for cycle in find_cycles([a, b, c])] == [["m.a", "m.p", "m.b"]]
    assert layer_of("minfer.lab.distill") == "lab" and layer_of("minfer.speculative.ngram") == "engine"
    assert layer_of("minfer") == "package" and layer_of("minfer.kernels.fused_moe") == "kernels"


# ------------------------------------------------------------------------------------------------ the maps
def test_every_package_docstring_lists_its_modules():
    """Each package's __init__.py docstring is its map: every module of the package appears there by file name."""
    missing = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()), clean=False) or ""
        for path in sorted(init.parent.glob("*.py")):
            if path.name != "__init__.py" and not re.search(rf"(?<![\w./]){re.escape(path.name)}\b", doc):
                missing.append(f"{init.relative_to(ROOT)}: no line for {path.name}")
    assert not missing, "package maps without some of their modules (add a line: the file, what it is for):\n  " + \
        "\n  ".join(missing)
