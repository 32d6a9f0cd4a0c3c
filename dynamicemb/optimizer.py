"""Optimizer types and their kernel codes (csrc/embedding/optimizer_rules.h).

`EmbOptimType` is FBGEMM's enum when fbgemm_gpu is installed; without it (a
CUDA test machine with only torch and dynamicemb) a stand-in with the same
names and values is used.
"""
import enum

try:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
except ImportError:  # pragma: no cover - exercised only without fbgemm_gpu

    class EmbOptimType(enum.Enum):
        EXACT_SGD = "exact_sgd"
        ADAM = "adam"
        EXACT_ADAGRAD = "exact_adagrad"
        EXACT_ROWWISE_ADAGRAD = "exact_row_wise_adagrad"


# Kernel codes: optim::Kind.
_CODES = {"exact_sgd": 0, "sgd": 0, "adam": 1, "exact_adagrad": 2, "exact_row_wise_adagrad": 3}
SUPPORTED = ("EXACT_SGD", "ADAM", "EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD")


def optimizer_code(optimizer) -> int:
    """Kernel code of an EmbOptimType (or its name / value as a string)."""
    value = getattr(optimizer, "value", optimizer)
    if isinstance(value, str):
        value = value.lower()
        if value.upper() in SUPPORTED:
            value = EmbOptimType[value.upper()].value
    if value not in _CODES:
        raise ValueError(f"optimizer {optimizer!r} is not supported by dynamicemb; use one of {SUPPORTED}")
    return _CODES[value]


def state_width(code: int, dim: int) -> int:
    """Columns of optimizer state next to a row (optim::state_width)."""
    return {0: 0, 1: 2 * dim, 2: dim, 3: 1}[code]


# FBGEMM's WeightDecayMode values that EXACT_ROWWISE_ADAGRAD supports here
# (optim::WeightDecayMode); FBGEMM's default is NONE.
_DECAY_MODES = {"NONE": 0, "L2": 1, "DECOUPLE": 2}


def weight_decay_mode_code(mode) -> int:
    """Kernel code of FBGEMM's WeightDecayMode (the enum, its name or its value); None = NONE."""
    if mode is None:
        return 0
    name = getattr(mode, "name", mode)
    if isinstance(name, str) and name.upper() in _DECAY_MODES:
        return _DECAY_MODES[name.upper()]
    if isinstance(name, int) and not isinstance(name, bool) and name in _DECAY_MODES.values():
        return name
    raise ValueError(f"weight_decay_mode {mode!r} is not supported by dynamicemb; use one of {tuple(_DECAY_MODES)}")


def check_weight_decay(code: int, weight_decay: float, decay_mode: int) -> None:
    """FBGEMM's rules: ADAM adds weight_decay * w to its update; EXACT_ROWWISE_ADAGRAD
    decays by weight_decay_mode (NONE ignores weight_decay); EXACT_SGD and
    EXACT_ADAGRAD have no weight decay. A weight decay that would be ignored
    is refused rather than dropped silently."""
    name = {0: "EXACT_SGD", 1: "ADAM", 2: "EXACT_ADAGRAD", 3: "EXACT_ROWWISE_ADAGRAD"}[code]
    if decay_mode and code != 3:
        raise ValueError(f"weight_decay_mode applies to EXACT_ROWWISE_ADAGRAD only (FBGEMM's rule), not to {name}")
    if weight_decay and code in (0, 2):
        raise ValueError(f"{name} has no weight decay (FBGEMM's rule); got weight_decay={weight_decay}")
    if weight_decay and code == 3 and not decay_mode:
        raise ValueError(f"EXACT_ROWWISE_ADAGRAD ignores weight_decay={weight_decay} with weight_decay_mode NONE "
                         f"(FBGEMM's default); set weight_decay_mode to L2 or DECOUPLE")
