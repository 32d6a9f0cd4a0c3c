"""Optimizer types and their kernel codes, from the rules registry
(dynamicemb.rules: csrc/embedding/optimizer_rules.h).

`EmbOptimType` is FBGEMM's enum when fbgemm_gpu is installed; without it (a
CUDA test machine with only torch and dynamicemb) a stand-in with the
registry's names and values is used.
"""
import enum
import math

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


# FBGEMM's TBE update_hyper_parameters names -> the module's attributes
# (TorchRec's fused optimizers pass them through). FBGEMM's lower_bound
# (global weight decay) has no counterpart here.
_UPDATABLE = {"lr": "learning_rate", "eps": "eps", "beta1": "beta1", "beta2": "beta2", "weight_decay": "weight_decay"}


def hyper_parameter_updates(code: int, decay_mode: int, params) -> dict:
    """FBGEMM's update_hyper_parameters(params) checked whole before any is
    applied: {module attribute: value}. An unknown name, a value that is not
    a finite number, and a weight decay the optimizer would ignore are
    refused (ValueError)."""
    unknown = sorted(set(params) - set(_UPDATABLE))
    if unknown:
        raise ValueError(f"hyper-parameters {unknown} cannot be updated; FBGEMM's names taken: {sorted(_UPDATABLE)}")
    out = {_UPDATABLE[k]: _finite(k, v) for k, v in params.items()}
    if "weight_decay" in out:
        check_weight_decay(code, out["weight_decay"], decay_mode)
    return out


# torch.optim's ranges (a NaN or inf rate would turn every updated row to NaN unsaid).
_RANGES = {"lr": (0.0, math.inf, "a number >= 0"), "eps": (0.0, math.inf, "a number >= 0"),
           "beta1": (0.0, 1.0, "in [0, 1)"), "beta2": (0.0, 1.0, "in [0, 1)"),
           "weight_decay": (0.0, math.inf, "a number >= 0")}


def _finite(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    lo, hi, what = _RANGES.get(name, (-math.inf, math.inf, ""))
    if not lo <= value < hi:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return float(value)


def checked_hyper_parameters(**params) -> dict:
    """The module's hyper-parameters (FBGEMM's names: lr, eps, beta1, beta2,
    weight_decay) checked as update_hyper_parameters checks them."""
    return {k: _finite(k, v) for k, v in params.items()}


def clipping_bound(gradient_clipping: bool, max_gradient: float) -> float:
    """FBGEMM's gradient_clipping / max_gradient as the kernels take it: each
    element of the output gradient is clamped to [-max_gradient,
    max_gradient] before it is summed per key (every optimizer); 0 = no
    clipping."""
    if not gradient_clipping:
        return 0.0
    bound = _finite("max_gradient", max_gradient)
    if bound <= 0:
        raise ValueError(f"max_gradient must be > 0 with gradient_clipping=True, got {max_gradient!r}")
    return bound


def state_start(code: int, initial_accumulator_value: float) -> float:
    """Where a new row's optimizer state starts: initial_accumulator_value
    for an optimizer whose state is an accumulator (the registry's
    `accumulator`: EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD), else 0. A non-zero
    value that the optimizer would ignore is refused rather than dropped."""
    value = _finite("initial_accumulator_value", initial_accumulator_value)
    rule = rules.optimizer(code)
    if value < 0:
        raise ValueError(f"initial_accumulator_value must be >= 0, got {value}")
    if value and not rule.accumulator:
        takers = ", ".join(o.name for o in rules.OPTIMIZERS if o.accumulator)
        raise ValueError(f"initial_accumulator_value applies to {takers} only, not to {rule.name}; "
                         f"got {value}")
    return value if rule.accumulator else 0.0
