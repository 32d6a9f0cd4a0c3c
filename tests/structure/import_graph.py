"""The package's import graph, read from the sources (ast), not by importing:
module -> the dynamicemb modules it imports, at any depth of the file
(function-level imports included)."""
import ast
import os
from typing import Dict, Set

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "dynamicemb")


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def modules() -> Dict[str, str]:
    """dotted name -> file path of every module of the package."""
    out = {}
    for d, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                out[_module_name(os.path.join(d, f))] = os.path.join(d, f)
    return out


EXTENSIONS: Set[str] = set()  # Python extension modules built from csrc/ (none: the ops library is loaded by path)


def import_graph() -> Dict[str, Set[str]]:
    mods = modules()
    mods.update({e: e for e in EXTENSIONS})
    graph: Dict[str, Set[str]] = {}
    for name, path in mods.items():
        if name in EXTENSIONS:
            graph[name] = set()
            continue
        is_pkg = path.endswith("__init__.py")
        deps: Set[str] = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                # `from pkg import sub` imports the submodule; `from mod import name` the module.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:  # `import dynamicemb.x.y` -> the longest known module
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("dynamicemb"):
                    deps.add(t)
        graph[name] = deps
    return graph


def find_cycle(graph: Dict[str, Set[str]]):
    """One import cycle as a list of modules, or None."""
    state: Dict[str, int] = {}
    stack = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None
