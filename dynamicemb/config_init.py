"""The initial rows a TorchRec table config asks for, as a dynamic table's
initializer.

A TorchRec config initialises a native table with its `init_fn` (by default
`torch.nn.init.uniform_` between `weight_init_min` and `weight_init_max`,
themselves defaulting to +-sqrt(1 / num_embeddings)). A dynamic table creates
rows per key as keys arrive, with an initializer that is a pure function of
(seed, table, key), so it can follow an `init_fn` only when that names one of
torch's initializers it implements. The config's initializer applies when the
table's `initializer_args` are left at their default; a config and options
asking for different initial rows are refused by table name.
"""
import functools
import inspect
import math
from typing import Optional

import torch

from dynamicemb.options import DynamicEmbInitializerArgs, DynamicEmbInitializerMode

Mode = DynamicEmbInitializerMode


def _uniform(a, b, **_):
    return DynamicEmbInitializerArgs(mode=Mode.UNIFORM, lower=float(a), upper=float(b))


def _normal(mean, std, **_):
    return DynamicEmbInitializerArgs(mode=Mode.NORMAL, mean=float(mean), std_dev=float(std))


def _trunc_normal(mean, std, a, b, **_):
    return DynamicEmbInitializerArgs(mode=Mode.TRUNCATED_NORMAL, mean=float(mean), std_dev=float(std),
                                     lower=float(a), upper=float(b))


def _constant(val, **_):
    return DynamicEmbInitializerArgs(mode=Mode.CONSTANT, value=float(val))


# torch's initializers a dynamic table implements: their arguments (bound
# with torch's defaults) to initializer args.
_TORCH_INITS = {
    torch.nn.init.uniform_: _uniform,
    torch.nn.init.normal_: _normal,
    torch.nn.init.trunc_normal_: _trunc_normal,
    torch.nn.init.constant_: _constant,
    torch.nn.init.zeros_: lambda **_: _constant(0.0),
    torch.nn.init.ones_: lambda **_: _constant(1.0),
}


def config_initializer(config) -> Optional[DynamicEmbInitializerArgs]:
    """The initializer args of a config's init_fn (TorchRec fills it in from
    weight_init_min / _max when not given), or None when it is not one of
    torch's initializers above (as a function or a functools.partial of one)."""
    fn = config.init_fn
    if fn is None:  # (TorchRec fills it in at construction; one cleared since reads as that)
        return _uniform(config.get_weight_init_min(), config.get_weight_init_max())
    args, kwargs = (), {}
    if isinstance(fn, functools.partial):
        fn, args, kwargs = fn.func, fn.args, dict(fn.keywords)
    to_args = _TORCH_INITS.get(fn)
    if to_args is None:
        return None
    try:
        bound = inspect.signature(fn).bind(None, *args, **kwargs)  # None: the tensor
    except TypeError:
        return None
    bound.apply_defaults()
    params = dict(bound.arguments)
    params.pop(next(iter(params)))  # the tensor
    try:
        return to_args(**params)
    except TypeError:  # an argument that is not a number
        return None
    except ValueError as e:  # numbers DynamicEmbInitializerArgs refuses (bounds crossed, say)
        raise ValueError(f"table {config.name!r}: its config's init_fn: {e}") from None


def describe(args: DynamicEmbInitializerArgs) -> str:
    """Initializer args in a few words, for messages."""
    m = Mode(args.mode)
    if m == Mode.UNIFORM:
        return ("UNIFORM in +-sqrt(1 / num_embeddings)" if args.lower is None and args.upper is None
                else f"UNIFORM in [{args.lower}, {args.upper}]")
    if m == Mode.NORMAL:
        return f"NORMAL(mean={args.mean}, std_dev={args.std_dev})"
    if m == Mode.TRUNCATED_NORMAL:
        return f"TRUNCATED_NORMAL(mean={args.mean}, std_dev={args.std_dev}) in [{args.lower}, {args.upper}]"
    if m == Mode.CONSTANT:
        return f"CONSTANT {args.value}"
    return m.name


def _torchrec_default(config) -> DynamicEmbInitializerArgs:
    bound = math.sqrt(1 / config.num_embeddings)
    return _uniform(-bound, bound)


def table_initializer(config, args: DynamicEmbInitializerArgs) -> DynamicEmbInitializerArgs:
    """A dynamic table's initializer args: `args` (its options'), or the
    config's initializer when `args` are the default and the config asks
    for other rows than TorchRec's default. Refuses an init_fn it cannot
    follow, and a config and args that ask for different rows."""
    wanted = config_initializer(config)
    if wanted == _torchrec_default(config):
        return args  # also dynamicemb's default
    if wanted is None:
        raise ValueError(f"table {config.name!r}: its config's init_fn {config.init_fn!r} cannot initialise a "
                         f"dynamic table, whose rows are created per key as keys arrive; give "
                         f"torch.nn.init.uniform_, normal_, trunc_normal_, constant_, zeros_ or ones_ (or a "
                         f"functools.partial of one), or set dynamicemb_options.initializer_args")
    if args == DynamicEmbInitializerArgs():
        return wanted
    if args != wanted:
        raise ValueError(f"table {config.name!r}: dynamicemb_options.initializer_args ({describe(args)}) "
                         f"contradict the initial rows its config asks for with weight_init_min / "
                         f"weight_init_max or init_fn ({describe(wanted)}); set one of them")
    return args
