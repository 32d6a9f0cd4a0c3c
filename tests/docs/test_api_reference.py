"""DynamicEmb_APIs.md is the complete API reference: every public name (each
`__all__` of the package and its modules) has a reference entry, every entry
names something that exists where the doc says, signatures and defaults
written in entries are the code's, every field of a documented dataclass is in
its table with its real default, every member of a documented enum is named,
and every `dynamicemb.x.y` the docs mention resolves. See markdown_doc.py for
the conventions."""
import ast
import dataclasses
import enum
import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

import pytest
import torch

import dynamicemb
from markdown_doc import dotted_references, heading_anchors, local_links, reference_entries

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "DynamicEmb_APIs.md"
README = ROOT / "README.md"
# Public modules whose __all__ must exist and be documented; any other module
# of the package that defines __all__ is held to it too.
PUBLIC_MODULES = ("dynamicemb", "dynamicemb.planner", "dynamicemb.shard", "dynamicemb.checkpoint",
                  "dynamicemb.incremental_dump", "dynamicemb.inference", "dynamicemb.tiers", "dynamicemb.routing")


def _modules_with_all():
    names = set(PUBLIC_MODULES)
    for info in pkgutil.walk_packages(dynamicemb.__path__, "dynamicemb."):
        parts = info.name.split(".")
        if any(p.startswith("_") for p in parts[1:]):  # private modules, __main__
            continue
        if getattr(importlib.import_module(info.name), "__all__", None) is not None:
            names.add(info.name)
    return sorted(names)


ENTRIES = reference_entries(API.read_text())


def _entry_objects():
    return {(e.module, e.name): getattr(importlib.import_module(e.module), e.name, None) for e in ENTRIES}


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_public_module_declares_all(module):
    assert isinstance(getattr(importlib.import_module(module), "__all__", None), list), \
        f"{module} has no __all__ list"


@pytest.mark.parametrize("module", _modules_with_all())
def test_every_public_name_is_documented(module):
    """A name counts as documented when an entry documents the same object
    (a re-export, e.g. dynamicemb.DynamicEmbDump, may be documented once, in
    the module that defines it)."""
    mod = importlib.import_module(module)
    documented = {id(obj) for obj in _entry_objects().values() if obj is not None}
    documented_here = {e.name for e in ENTRIES if e.module == module}
    missing = [n for n in mod.__all__
               if n not in documented_here and id(getattr(mod, n)) not in documented]
    assert not missing, f"{module}.__all__ names without an entry in {API.name}: {missing}"


def test_entries_exist_and_are_unique():
    seen, problems = set(), []
    for e in ENTRIES:
        if (e.module, e.name) in seen:
            problems.append(f"line {e.line}: {e.module}.{e.name} has two entries")
        seen.add((e.module, e.name))
        mod = importlib.import_module(e.module)
        if not hasattr(mod, e.name):
            problems.append(f"line {e.line}: {e.module} has no {e.name!r}")
        elif e.name not in getattr(mod, "__all__", [e.name]):
            problems.append(f"line {e.line}: {e.module}.{e.name} is documented but not in {e.module}.__all__")
    assert len(ENTRIES) > 30, f"only {len(ENTRIES)} entries found: is the convention still followed?"
    assert not problems, "\n".join(problems)


def _namespace(obj) -> dict:
    """Where a documented default is evaluated: the defining module's globals,
    the package's public names and torch."""
    ns = {"torch": torch}
    ns.update({n: getattr(dynamicemb, n) for n in dynamicemb.__all__})
    ns.update(vars(sys.modules[obj.__module__]))
    return ns


def _same(actual, documented) -> bool:
    """Equal and of one type (an enum member is not its int, 0.0 is not 0)."""
    return type(actual) is type(documented) and actual == documented


_KINDS = {"posonlyargs": inspect.Parameter.POSITIONAL_ONLY, "args": inspect.Parameter.POSITIONAL_OR_KEYWORD,
          "kwonlyargs": inspect.Parameter.KEYWORD_ONLY}


def _documented_parameters(params: str):
    """[(name, kind, default expression or None)] of a written signature."""
    fn = ast.parse(f"def _f({params}): pass").body[0].args
    out = []
    positional = fn.posonlyargs + fn.args
    defaults = [None] * (len(positional) - len(fn.defaults)) + list(fn.defaults)
    for a, d in zip(positional, defaults):
        kind = _KINDS["posonlyargs"] if a in fn.posonlyargs else _KINDS["args"]
        out.append((a.arg, kind, d))
    if fn.vararg:
        out.append((fn.vararg.arg, inspect.Parameter.VAR_POSITIONAL, None))
    for a, d in zip(fn.kwonlyargs, fn.kw_defaults):
        out.append((a.arg, _KINDS["kwonlyargs"], d))
    if fn.kwarg:
        out.append((fn.kwarg.arg, inspect.Parameter.VAR_KEYWORD, None))
    return out


def _signature_problems(obj, params: str) -> list:
    try:
        documented = _documented_parameters(params)
    except SyntaxError as e:
        return [f"the written signature ({params}) does not parse: {e}"]
    actual = list(inspect.signature(obj).parameters.values())
    names = [p.name for p in actual]
    if [n for n, _, _ in documented] != names:
        return [f"parameters {[n for n, _, _ in documented]}, the code's are {names}"]
    problems = []
    ns = _namespace(obj)
    for (name, kind, default), p in zip(documented, actual):
        if kind != p.kind:
            problems.append(f"{name}: written as {kind.description}, is {p.kind.description}")
        if (default is None) != (p.default is inspect.Parameter.empty):
            problems.append(f"{name}: the default is {'missing' if default is None else 'written but there is none'}")
        elif default is not None:
            value = eval(compile(ast.Expression(default), "<doc>", "eval"), ns)  # noqa: S307 - our own doc
            if not _same(p.default, value):
                problems.append(f"{name}: written default {ast.unparse(default)} = {value!r}, "
                                f"the code's is {p.default!r}")
    return problems


def _field_rows(body: str):
    """{field: default cell} of the entry's table whose first header cell is 'field'."""
    rows, in_table = {}, False
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else None
        if cells is None:
            if in_table:
                break
            continue
        if cells[0] == "field":
            in_table = True
            header = cells
            continue
        if in_table and not set(cells[0]) <= set("-: "):
            name = cells[0].strip("`")
            rows[name] = cells[header.index("default")] if "default" in header else None
    return rows


_REQUIRED = "—"  # a default cell for a field without a default


def _field_problems(cls, body: str) -> list:
    """The table lists every field the class declares itself (inherited ones
    may be listed too) and nothing else, each with its default: one code
    span that evaluates to it, or "—" for a required field."""
    rows = _field_rows(body)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    own = set(cls.__dict__.get("__annotations__", {})) & set(fields)
    problems = []
    if not own <= set(rows) or not set(rows) <= set(fields):
        problems.append(f"field table has {sorted(set(rows) - set(fields))} that the class has not, lacks "
                        f"{sorted(own - set(rows))}")
    ns = _namespace(cls)
    for name in set(rows) & set(fields):
        cell, f = rows[name], fields[name]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if cell == _REQUIRED or required:
            if (cell == _REQUIRED) != required:
                problems.append(f"{name}: written {'required' if cell == _REQUIRED else cell}, "
                                f"the code's is {'required' if required else 'a default'}")
            continue
        if cell is None or not (cell.startswith("`") and cell.endswith("`") and cell.count("`") == 2):
            problems.append(f"{name}: the default must be one code span (or {_REQUIRED}), got {cell!r}")
            continue
        value = eval(cell.strip("`"), ns)  # noqa: S307 - our own doc
        actual = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if not _same(actual, value):
            problems.append(f"{name}: written default {cell} = {value!r}, the code's is {actual!r}")
    return problems


def test_signatures_fields_and_members_match_the_code():
    problems = []
    for e in ENTRIES:
        obj = getattr(importlib.import_module(e.module), e.name, None)
        if obj is None:
            continue  # reported by test_entries_exist_and_are_unique
        where = f"line {e.line} ({e.module}.{e.name})"
        if e.params is not None:
            problems += [f"{where}: {p}" for p in _signature_problems(obj, e.params)]
        elif inspect.isclass(obj) and dataclasses.is_dataclass(obj):
            problems += [f"{where}: {p}" for p in _field_problems(obj, e.body)]
        if inspect.isclass(obj) and issubclass(obj, enum.Enum) and obj.__module__.startswith("dynamicemb"):
            unnamed = [m for m in obj.__members__ if f"`{m}`" not in e.body]
            if unnamed:
                problems.append(f"{where}: members not named in the entry: {unnamed}")
    assert not problems, "\n".join(problems)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("doc", [API, README], ids=lambda p: p.name)
def test_dotted_references_resolve(doc):
    refs = dotted_references(doc.read_text())
    bad = sorted({r for r in refs if not _resolves(r)})
    assert not bad, f"{doc.name} names what does not exist: {bad}"


@pytest.mark.parametrize("doc", [API, README], ids=lambda p: p.name)
def test_links_within_the_doc_resolve(doc):
    text = doc.read_text()
    bad = sorted(set(local_links(text)) - heading_anchors(text))
    assert not bad, f"{doc.name} links to headings it does not have: {bad}"
