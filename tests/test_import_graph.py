"""The modules of ``workbench`` import one another as a DAG: no import cycle, not even one
hidden in a function body.

The graph is read from the source (``ast``): every ``import`` and ``from ... import`` at module
level *and* inside functions, resolved to the workbench module it names (``from a.b import c``
is the module ``a.b.c`` when that exists, else ``a.b``). A deferred import in a function only
hides a cycle from Python's loader; it is still two modules that need each other, so it counts.
Edges to a parent package (``workbench.x`` needing ``workbench/x/__init__.py``) are not drawn:
a package importing its own submodules is how packages are built. The deprecated module paths
(``workbench/models_gpt.py`` ...: shims of one release) are modules like the others.
"""

import ast
from pathlib import Path

import workbench

ROOT = Path(workbench.__file__).resolve().parent


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path, known) -> set[str]:
    """The workbench modules ``name`` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{up}.{base}" if base else up
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target.startswith("workbench") and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of two or more modules
    (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_function():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_deferred_and_relative_imports(tmp_path):
    known = {"workbench.p": tmp_path / "__init__.py", "workbench.p.x": tmp_path / "x.py",
             "workbench.p.y": tmp_path / "y.py"}
    (tmp_path / "x.py").write_text("def f():\n    from .y import g\n    return g\n")
    assert imported("workbench.p.x", tmp_path / "x.py", known) == {"workbench.p.y"}


def test_workbench_modules_import_each_other_without_cycles():
    edges = graph()
    assert len(edges) > 100 and edges["workbench.dpsgd.engine"]  # the graph was read
    found = cycles(edges)
    assert not found, "import cycles among workbench modules:\n" + "\n".join(
        " <-> ".join(c) for c in found)
