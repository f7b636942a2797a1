"""Which cells of a notebook a given cell needs: the names each cell defines and reads, read from its source.

A notebook's cells share one namespace, so a cell needs the cells that last defined, before it, the names
it reads, and those cells need theirs in turn. `needed_cells` follows that closure (plus the first code
cell, which sets a notebook up: imports, threads, %matplotlib), so that a few cells can run without the
rest: the browser test runs the widget cells this way (tests/browser/notebooks_in_browser.py), and
benchmarks/run_notebooks.py --cells gpu the GPU cells (`cells_calling(cells, {"gpu_cell"})`).

A cell counts as defining a name when it binds it (assignment, import, def, class, for, with ... as) or
mutates it through an attribute or a subscript (`x.attr = ...`, `x[i] += ...`, `del x[k]`): a later reader
of x then needs that cell too, and that cell needs x's earlier definition. What the analysis cannot see is
state changed by calls (`x.append(1)`, `torch.manual_seed(0)`) or by names a cell never spells out.

Cells are nbformat dicts (or the plain dicts of the .ipynb JSON): "cell_type", "source" (a string or a
list of lines), and optionally "metadata".
"""
from __future__ import annotations

import ast
import builtins
import symtable
from collections.abc import Iterable
from datetime import datetime


def cell_source(cell: dict) -> str:
    """The cell's source as one string (the JSON stores a list of lines, nbformat a string)."""
    source = cell["source"]
    return source if isinstance(source, str) else "".join(source)


def python_source(cell: dict) -> str:
    """The cell as plain Python (IPython magics turned into calls), so that ast and symtable can read it."""
    from IPython.core.inputtransformer2 import TransformerManager  # (IPython comes with the notebooks' kernel)

    return TransformerManager().transform_cell(cell_source(cell))


def mutated_names(tree: ast.AST) -> set[str]:
    """The top-level names the module-level statements of tree change through an attribute or a subscript:
    x in `x.a = ...`, `x[i] = ...`, `x.a.b[i] += ...`, `del x[k]` (not inside functions, which change nothing
    until called, and whose own locals are not the notebook's)."""
    names: set[str] = set()
    pending = list(ast.iter_child_nodes(tree))
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)):
            target = node
            while isinstance(target, (ast.Attribute, ast.Subscript)):
                target = target.value
            if isinstance(target, ast.Name):
                names.add(target.id)
        pending += ast.iter_child_nodes(node)
    return names


def read_before_bound(tree: ast.Module) -> set[str]:
    """The names a cell reads at module level before it binds them itself, so from an earlier cell: x in
    `x = x + 1`, `x += 1`, `print(x)` followed by `x = 2`. Walked in the order Python runs it (an assignment's
    value before its targets, a loop's iterable, then its target, then its body); nested scopes (functions,
    classes, lambdas, comprehensions) are left to symtable: their names are their own, or globals the cell
    does not bind."""
    bound: set[str] = set()
    early: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load) and node.id not in bound:
                early.add(node.id)
            elif not isinstance(node.ctx, ast.Load):
                bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.AugAssign):
            visit(node.value)
            if isinstance(node.target, ast.Name) and node.target.id not in bound:
                early.add(node.target.id)  # x += 1 reads x first
            visit(node.target)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)):
            if node.value is not None:
                visit(node.value)
            for target in getattr(node, "targets", None) or [node.target]:
                visit(target)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            for part in (node.iter, node.target, *node.body, *node.orelse):
                visit(part)
        elif isinstance(node, ast.ExceptHandler):
            if node.type is not None:
                visit(node.type)
            if node.name:
                bound.add(node.name)
            for statement in node.body:
                visit(statement)
        elif not isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            for child in ast.iter_child_nodes(node):
                visit(child)

    visit(tree)
    return early


def defined_and_read(source: str) -> tuple[set[str], set[str]]:
    """The global names a cell defines (binds, or mutates through an attribute or subscript), and the global
    names it reads that it does not bind itself (names read inside its functions and classes included)."""
    table = symtable.symtable(source, "<cell>", "exec")
    bound = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
    read = {s.get_name() for s in table.get_symbols() if s.is_referenced()}
    pending = list(table.get_children())
    while pending:  # names that functions and classes look up in the notebook's namespace
        scope = pending.pop()
        read |= {s.get_name() for s in scope.get_symbols() if s.is_global() and s.is_referenced()}
        pending += scope.get_children()
    tree = ast.parse(source)
    mutated = mutated_names(tree)
    # a mutated name is read too (its earlier value is what changes), unless this cell bound it first; a name
    # the cell rebinds is read from an earlier cell when it is read before that (`x = x + 1`)
    return bound | mutated, ((read | mutated) - bound | read_before_bound(tree)) - set(dir(builtins))


def recorded_seconds(cell: dict) -> float | None:
    """How long the cell ran when the notebook was last executed (nbclient records the times), if known."""
    times = cell.get("metadata", {}).get("execution", {})
    if "iopub.execute_input" not in times or "shell.execute_reply" not in times:
        return None
    start, end = (datetime.fromisoformat(times[k].replace("Z", "+00:00"))
                  for k in ("iopub.execute_input", "shell.execute_reply"))
    return (end - start).total_seconds()


def code_cells(cells: list[dict]) -> list[int]:
    """The indices of the code cells."""
    return [i for i, c in enumerate(cells) if c["cell_type"] == "code"]


def calls(tree: ast.AST, names: Iterable[str]) -> bool:
    """Whether tree calls one of names: `f(...)` with f in names, or `a.b.f(...)` where f, b or a is."""
    names = set(names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            while isinstance(func, ast.Attribute):
                if func.attr in names:
                    return True
                func = func.value
            if isinstance(func, ast.Name) and func.id in names:
                return True
    return False


def cells_calling(cells: list[dict], names: Iterable[str]) -> list[int]:
    """The code cells that call one of names (see `calls`), in notebook order."""
    names = set(names)
    return [i for i in code_cells(cells) if calls(ast.parse(python_source(cells[i])), names)]


def needed_cells(cells: list[dict], targets: list[int]) -> list[int]:
    """The cells to run, in notebook order, so that the target cells find every name they read.

    The first code cell (a notebook's set-up), the targets, and, transitively, for every name a needed
    cell reads, the last code cell before it that defines that name (see `defined_and_read`). A name no
    earlier cell defines is left alone (a builtin, or one the cell defines later in itself). Empty when
    targets is empty."""
    if not targets:
        return []
    code = code_cells(cells)
    names = {i: defined_and_read(python_source(cells[i])) for i in code}
    needed, pending = set(code[:1]), list(targets)
    while pending:
        cell = pending.pop()
        if cell in needed:
            continue
        needed.add(cell)
        for name in names[cell][1]:
            earlier = [i for i in code if i < cell and name in names[i][0]]
            if earlier:
                pending.append(earlier[-1])
    return sorted(needed)
