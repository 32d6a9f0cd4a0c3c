"""What the sharded EBC and EC with dynamic tables share."""
import contextlib
import functools
from typing import Iterable, List

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb.checkpoint.state_dict import add_entry_paths, add_tables, load_tables
from dynamicemb.shard.parameter_sharding import CUSTOMIZED

# Kernels whose weights TorchRec does not initialise itself.
_NO_INIT = {
    CUSTOMIZED,
    EmbeddingComputeKernel.KEY_VALUE.value,
    EmbeddingComputeKernel.SSD_VIRTUAL_TABLE.value,
    EmbeddingComputeKernel.DRAM_VIRTUAL_TABLE.value,
}


def is_dynamic(info) -> bool:
    return info.param_sharding.compute_kernel == CUSTOMIZED


def check_row_wise(sharding_infos) -> bool:
    """True if this sharding holds dynamic tables; refuses a dynamic table
    under any sharding type but ROW_WISE."""
    dynamic = [i for i in sharding_infos if is_dynamic(i)]
    st = sharding_infos[0].param_sharding.sharding_type
    if dynamic and st != ShardingType.ROW_WISE.value:
        names = [i.embedding_config.name for i in dynamic]
        raise ValueError(f"dynamic tables {names} are planned {st}; dynamic tables are sharded ROW_WISE only")
    return bool(dynamic)


@contextlib.contextmanager
def building(module):
    """While TorchRec builds a sharded collection (_initialize_torch_state,
    which calls reset_parameters): its dynamic tables are not a user's to
    reset then (one reopened on its FileStore holds the rows it resumes)."""
    module._dynamicemb_building = True
    try:
        yield
    finally:
        module._dynamicemb_building = False


def reset_tables(module, configs: Iterable, weights) -> None:
    """TorchRec's reset_parameters: each native table's init_fn again; each
    dynamic table emptied, since it initialises keys as they arrive (a key's
    initial row is a function of the seed, table and key: every key reads
    it again when it next comes). Left as they were, a user's reset of a
    trained model kept every dynamic row, silently."""
    from dynamicemb.stats import dynamic_modules
    if not getattr(module, "_dynamicemb_building", False):
        for m in dynamic_modules(module):
            for t in range(m.num_tables):
                if m.storage.stats(t)["size"] > 0:
                    m.storage.clear_table(t)
    if module._device and module._device.type == "meta":
        return
    for config in configs:
        ps = module.module_sharding_plan[config.name]
        if ps.compute_kernel in _NO_INIT:
            continue
        param = weights[config.name].weight
        config.init_fn(param)
        if ps.sharding_type == ShardingType.DATA_PARALLEL.value:
            with torch.no_grad():
                torch.distributed.broadcast(param.data, src=0, group=module._env.process_group)


def check_feature_order(module, features) -> None:
    """TorchRec's sharded collections fix the order of a KJT's features at
    the first batch and read later batches by position: a batch with its
    features in another order would feed each feature's ids to another
    table, unsaid (native tables too). Refused by name; features appended
    after the first batch's (which TorchRec ignores) pass."""
    if not isinstance(features, KeyedJaggedTensor):  # (a TensorDict is reordered by name)
        return
    keys = features.keys()
    first = module.__dict__.get("_dynamicemb_first_keys")
    if first is None:
        module.__dict__["_dynamicemb_first_keys"] = list(keys)
    elif list(keys[:len(first)]) != first:
        missing = [f for f in first if f not in keys]
        what = (f"lacks the features {missing} of the first batch" if missing else
                f"has the first batch's features in another order")
        raise ValueError(f"dynamicemb (input dist): the batch {what}: its features are {list(keys)}, the first "
                         f"batch's {first}; TorchRec reads a KJT's features by position from the first batch on, "
                         f"so its ids would feed other tables or none: build every batch's KeyedJaggedTensor "
                         f"with the same keys in the same order (an empty feature: lengths of 0)")


def lookups_train(lookups: List, mode: bool) -> None:
    """ShardedEBC/EC keep lookups in a plain list: propagate train/eval."""
    for lookup in lookups:
        lookup.train(mode)


def _add_tables(collection, module, destination, prefix, local_metadata):
    add_tables(module, destination, prefix, collection)


def _load_tables(collection, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                 error_msgs):
    load_tables(module, state_dict, prefix, collection, missing_keys)


def register_dynamic_state(module, collection: str) -> None:
    """Puts the collection's dynamic tables in its state_dict() and takes
    them back in load_state_dict() (dynamicemb.checkpoint.state_dict), after
    TorchRec's own hooks. `collection`: "embedding_bags" (EBC) or "embeddings" (EC)."""
    module._register_state_dict_hook(functools.partial(_add_tables, collection))
    module._register_load_state_dict_pre_hook(functools.partial(_load_tables, collection), with_module=True)
    tables = getattr(module, collection)
    add_entry_paths(tables[name] for name, ps in module.module_sharding_plan.items()
                    if ps.compute_kernel == CUSTOMIZED and name in tables)
