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
