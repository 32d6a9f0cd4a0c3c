"""Imports go downward only (ARCHITECTURE.md's layers): no cycle, no module
importing a layer above its own, and other layers use public names only."""
import ast

from import_graph import find_cycle, import_graph, modules

# Bottom-up; a module's layer is that of its longest matching prefix.
LAYERS = [
    # 0: the ops and the rules they state (rules.py reads them from the extension), options, formats
    ["dynamicemb._ops", "dynamicemb.rules", "dynamicemb.types", "dynamicemb.optimizer",
     "dynamicemb.aliases", "dynamicemb.fsync", "dynamicemb.storage_protocol", "dynamicemb.contiguous",
     "dynamicemb.step_warnings",
     "dynamicemb.checkpoint.format",
     "dynamicemb.inference.quantize", "dynamicemb.tiers.prefault", "dynamicemb.shard.train_pipeline"],
    # 1: the hash table and what it is built from; admission (its counters are tables) and the options naming it
    ["dynamicemb.memory", "dynamicemb.positions", "dynamicemb.host_copy", "dynamicemb.routing", "dynamicemb.table",
     "dynamicemb.table_rows", "dynamicemb.admission", "dynamicemb.options"],
    # 2: storages
    ["dynamicemb.storage", "dynamicemb.tiers"],
    # 3: the embedding module
    ["dynamicemb.batched_dynamicemb_tables"],
    # 4: what works on modules: counters, checkpoints, serving, TorchRec sharding
    ["dynamicemb.stats", "dynamicemb.checkpoint", "dynamicemb.incremental_dump", "dynamicemb.inference",
     "dynamicemb.shard"],
    # 5: planning over sharders, and the options it completes from TorchRec's configs
    ["dynamicemb.planner", "dynamicemb.config_init"],
]
ENTRY_POINTS = {"dynamicemb"}  # the package root re-exports every layer; `python -m` entry points too


def layer_of(module: str) -> int:
    best, layer = "", None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best):
                best, layer = p, i
    assert layer is not None, f"{module} is in no layer: add it to LAYERS (and ARCHITECTURE.md)"
    return layer


def _entry(module: str) -> bool:
    return module in ENTRY_POINTS or module.endswith(".__main__")


def test_the_package_has_no_import_cycle():
    assert find_cycle(import_graph()) is None, f"import cycle: {' -> '.join(find_cycle(import_graph()))}"


def test_imports_go_downward_only():
    up = [(m, d) for m, deps in import_graph().items() if not _entry(m)
          for d in deps if not _entry(d) and layer_of(d) > layer_of(m)]
    assert not up, f"imports of a higher layer: {up}"


def test_every_module_has_a_layer():
    for m in modules():
        if not _entry(m):
            layer_of(m)


def test_other_packages_import_public_names_only():
    """`from dynamicemb.x import _name` only inside dynamicemb.x's own package."""
    mods = modules()
    bad = []
    for name, path in mods.items():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dynamicemb"):
                src_pkg = node.module.rsplit(".", 1)[0] if node.module not in {"dynamicemb"} else node.module
                for a in node.names:
                    private = a.name.startswith("_")
                    own = name.startswith(src_pkg + ".") and src_pkg != "dynamicemb"
                    if private and not own:
                        bad.append((name, f"{node.module}.{a.name}"))
    assert not bad, f"private names imported across packages: {bad}"


def test_the_graph_reader_sees_the_known_edges():
    """The reader itself: edges that exist (module level, `from pkg import
    sub`, function level) are found, so a clean result means something."""
    g = import_graph()
    assert "dynamicemb.storage_protocol" in g["dynamicemb.storage"]
    assert "dynamicemb.memory" in g["dynamicemb.table"]  # `from dynamicemb import memory`
    assert "dynamicemb.tiers" in g["dynamicemb.batched_dynamicemb_tables"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
