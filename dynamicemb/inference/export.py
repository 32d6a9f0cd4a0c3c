"""Exporting an InferenceEmbeddingTable (or a model holding them) for
serving: torch.export with dynamic batch size and id count, and an
AOTInductor package for CPU serving.

A program exported from TBE-layout inputs (values, offsets) loads and runs
in a process that imports only torch and dynamicemb (which registers the
lookup op); one exported from KeyedJaggedTensor inputs needs torchrec too
(its pytree types)."""
from typing import Dict, Optional, Tuple

import torch

from dynamicemb._ops import LIBRARY
from dynamicemb.inference.table import InferenceEmbeddingTable


def ops_library() -> str:
    """The path of dynamicemb's ops library (libdynamicemb_ops.so): the ops'
    registrations and kernels with no Python dependency, which a C++ server
    loads (dlopen) before a package (examples/serve_cpp)."""
    return LIBRARY


def example_inputs(module: InferenceEmbeddingTable, batch_size: int = 2, ids_per_bag: int = 2,
                   weighted: Optional[bool] = None) -> Tuple[torch.Tensor, ...]:
    """(values, offsets[, per_sample_weights]) in TBE layout: batch_size bags
    per feature of ids_per_bag ids each (2 bags at least: a size-1 dimension
    would be specialised by export)."""
    F = len(module.feature_names)
    n = F * batch_size * ids_per_bag
    device = module.slot_keys.device
    values = torch.arange(n, dtype=torch.int64, device=device)
    offsets = torch.arange(0, n + 1, ids_per_bag, dtype=torch.int64, device=device)
    if module.is_weighted if weighted is None else weighted:
        return values, offsets, torch.ones(n, dtype=torch.float32, device=device)
    return values, offsets


def dynamic_shapes(module: InferenceEmbeddingTable, weighted: bool):
    """Any id count and any batch size: offsets hold F * batch + 1 entries
    (the lookup op checks that), given as a free dim; AOTInductor would
    derive a batch dim from F * batch + 1 in floating point, off by one for
    some sizes."""
    ids = torch.export.Dim("ids", min=0)
    bags = torch.export.Dim("bags", min=2)
    shapes = ({0: ids}, {0: bags})
    return shapes + ({0: ids},) if weighted else shapes


def kjt_dynamic_shapes(kjt, name: str = "kjt"):
    """The dynamic shapes of a KeyedJaggedTensor argument (its pytree fields:
    values, weights, lengths, offsets, ...): any id count, any batch size."""
    F = len(kjt.keys())
    ids = torch.export.Dim(f"{name}_ids", min=0)
    batch = torch.export.Dim(f"{name}_batch", min=1)
    return [{0: ids}, {0: ids} if kjt._weights is not None else None, {0: F * batch},
            {0: F * batch + 1} if kjt._offsets is not None else None, None, None]


def _is_kjt(a) -> bool:
    return type(a).__name__ == "KeyedJaggedTensor"


def request_form(args: tuple) -> tuple:
    """`args` with each KeyedJaggedTensor as a request builds it: its keys,
    values, weights and lengths, nothing cached. A program's input structure
    records which of a KJT's fields are set, so an example that went through
    a model (its offsets cached) would refuse every KJT built from lengths
    (from_lengths_sync, or the constructor) with an error that names nothing."""
    return tuple(type(a)(keys=a.keys(), values=a.values(), weights=a.weights_or_none(), lengths=a.lengths())
                 if _is_kjt(a) and not a.variable_stride_per_key() else a for a in args)


def model_dynamic_shapes(args: tuple):
    """Per argument: a KeyedJaggedTensor's dynamic shapes, None (static) for anything else."""
    return tuple(kjt_dynamic_shapes(a, f"arg{i}") if _is_kjt(a) else None for i, a in enumerate(args))


def export_model(model: torch.nn.Module, args: tuple, dynamic_shapes=None) -> torch.export.ExportedProgram:
    """torch.export of a whole model (e.g. to_inference's) on example `args`,
    by default dynamic in the id count and batch size of its KeyedJaggedTensor
    inputs (exported programs with KJT inputs need torchrec imported to
    load); `dynamic_shapes` (torch.export's) for other inputs. Shapes are
    size-oblivious, so a dynamic batch of one runs too."""
    if dynamic_shapes is None:
        args = request_form(args)
        dynamic_shapes = model_dynamic_shapes(args)
    return _export(model, args, dynamic_shapes)


def _export(model, inputs, shapes) -> torch.export.ExportedProgram:
    # Size-oblivious reasoning: an output [batch, dim] would otherwise add a
    # guard batch != 1 (its stride check), and a batch of one would not run.
    from torch.fx.experimental import _config
    with _config.patch(backed_size_oblivious=True):
        return torch.export.export(model.eval(), inputs, dynamic_shapes=shapes)


def export(module: InferenceEmbeddingTable, inputs: Optional[tuple] = None) -> torch.export.ExportedProgram:
    """torch.export of the module's TBE-layout lookup, dynamic in the batch
    size (1 included) and the number of ids (example inputs by default)."""
    inputs = example_inputs(module) if inputs is None else inputs
    return _export(module, inputs, dynamic_shapes(module, len(inputs) > 2))


def package(model: torch.nn.Module, example: tuple, path: str, dynamic_shapes=None,
            metadata: Optional[Dict[str, str]] = None) -> str:
    """Exports `model` on `example` inputs and compiles it with AOTInductor
    into the package `path`: load it with torch._inductor.aoti_load_package
    after importing dynamicemb, or from C++ with libtorch's
    AOTIModelPackageLoader after loading dynamicemb's ops library
    (examples/serve_cpp). For an InferenceEmbeddingTable the dynamic shapes
    default to dynamic_shapes(), for another model to model_dynamic_shapes().
    `metadata` (str -> str) goes into the package (the loader's
    get_metadata()). Returns the package's path."""
    if dynamic_shapes is None and isinstance(model, InferenceEmbeddingTable) and not any(map(_is_kjt, example)):
        dynamic_shapes = globals()["dynamic_shapes"](model, len(example) > 2)
    elif dynamic_shapes is None:
        example = request_form(example)
        dynamic_shapes = model_dynamic_shapes(example)
    program = _export(model, example, dynamic_shapes)
    configs = {"aot_inductor.metadata": dict(metadata)} if metadata else None
    return torch._inductor.aoti_compile_and_package(program, package_path=path, inductor_configs=configs)
