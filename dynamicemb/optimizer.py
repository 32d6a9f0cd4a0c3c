"""Optimizer types and their kernel codes, from the rules registry
(dynamicemb.rules: csrc/embedding/optimizer_rules.h).

`EmbOptimType` is FBGEMM's enum when fbgemm_gpu is installed; without it (a
CUDA test machine with only torch and dynamicemb) a stand-in with the
registry's names and values is used.
"""
import enum

from dynamicemb import rules

try:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
except ImportError:  # pragma: no cover - exercised only without fbgemm_gpu
    EmbOptimType = enum.Enum("EmbOptimType", {o.name: o.values[0] for o in rules.OPTIMIZERS})


# Kernel codes by EmbOptimType value and by lower-cased member name.
_CODES = {v: o.code for o in rules.OPTIMIZERS for v in o.values + (o.name.lower(),)}
SUPPORTED = tuple(o.name for o in rules.OPTIMIZERS)


def optimizer_code(optimizer) -> int:
    """Kernel code of an EmbOptimType (or its name / value as a string)."""
    value = getattr(optimizer, "value", optimizer)
    code = _CODES.get(value.lower()) if isinstance(value, str) else None
    if code is None:
        raise ValueError(f"optimizer {optimizer!r} is not supported by dynamicemb; use one of {SUPPORTED}")
    return code


def state_width(code: int, dim: int) -> int:
    """Columns of optimizer state next to a row (optim::state_width)."""
    return rules.optimizer(code).state_width(dim)


def weight_decay_mode_code(mode) -> int:
    """Kernel code of FBGEMM's WeightDecayMode (the enum, its name or its value); None = NONE."""
    if mode is None:
        return 0
    name = getattr(mode, "name", mode)
    if isinstance(name, str) and name.upper() in rules.WeightDecayMode.__members__:
        return int(rules.WeightDecayMode[name.upper()])
    if isinstance(name, int) and not isinstance(name, bool) and name in set(rules.WeightDecayMode):
        return name
    raise ValueError(f"weight_decay_mode {mode!r} is not supported by dynamicemb; use one of "
                     f"{tuple(rules.WeightDecayMode.__members__)}")


def check_weight_decay(code: int, weight_decay: float, decay_mode: int) -> None:
    """FBGEMM's rules, as the registry states which optimizer reads which
    hyper-parameter: ADAM adds weight_decay * w to its update;
    EXACT_ROWWISE_ADAGRAD decays by weight_decay_mode (NONE ignores
    weight_decay); EXACT_SGD and EXACT_ADAGRAD have no weight decay. A weight
    decay that would be ignored is refused rather than dropped silently."""
    rule = rules.optimizer(code)
    reads = set(rule.hyper_parameters)
    if decay_mode and "weight_decay_mode" not in reads:
        takers = ", ".join(o.name for o in rules.OPTIMIZERS if "weight_decay_mode" in o.hyper_parameters)
        raise ValueError(f"weight_decay_mode applies to {takers} only (FBGEMM's rule), not to {rule.name}")
    if weight_decay and "weight_decay" not in reads:
        raise ValueError(f"{rule.name} has no weight decay (FBGEMM's rule); got weight_decay={weight_decay}")
    if weight_decay and "weight_decay_mode" in reads and not decay_mode:
        raise ValueError(f"{rule.name} ignores weight_decay={weight_decay} with weight_decay_mode NONE "
                         f"(FBGEMM's default); set weight_decay_mode to L2 or DECOUPLE")
