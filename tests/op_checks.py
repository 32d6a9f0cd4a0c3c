"""Generated opcheck tests, in the manner of FBGEMM's use of
torch.testing._internal.optests.generate_opcheck_tests, for our pytest modules.

    generate_opcheck_tests(sys.modules[__name__])   # at the end of a test module (or pass a test class)

adds beside each test `test_x` a twin `test_opcheck__test_x` that runs the same
body while recording every torch.ops.dynamicemb.* call it makes (on copies of
the inputs taken before the call), then runs torch.library.opcheck on those
calls: the schema (declared mutations and aliasing), the fake kernel against
the real one, the autograd registration, and AOT dispatch with dynamic shapes.
So op tests just call ops; none writes opcheck by hand.

A kind of call is the op with its tensors' dtypes, ranks, emptiness and
devices, which optionals are given, and the values of its mode arguments
(strategy, pooling, ...). To stay cheap, a twin runs only the first case of
each parametrize, and the twins of a module check each kind once and at most
MAX_KINDS kinds per op. A test marked @opcheck_every_call (one that calls ops
on chosen samples) keeps every case, and its twin checks every kind of call
that the test file's code makes, past that limit. A call that raises is not
checked (an error test's), nor one made while compiling or on fake tensors.
"""
import functools
import os
import sys
from collections import Counter

import pytest
import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

NAMESPACE = "dynamicemb"
TEST_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# Ops left out of the AOT dispatch check, and why. (None of our ops has an
# autograd formula; the check compares outputs only, and gradients only
# where an input requires grad, which none of our ops' inputs do.)
NO_AOT = {
    "table_clock": "reads a clock: eager and traced runs give different values by design",
    "empty_huge": "returns uninitialised memory (as torch.empty): its values differ from run to run by design",
}
# Integer arguments that pick a code path: a new value is a new kind of call.
MODE_ARGS = {"strategy", "pooling", "optimizer", "weight_decay_mode", "rule", "rules", "output_dtype"}
MAX_KINDS = 4
MAX_NUMEL = 1 << 22  # larger calls are not recorded: opcheck runs an op about eight times
PREFIX = "test_opcheck__"
LOG_ENV = "DYNAMICEMB_OPCHECK_LOG"  # a file that gets the name of each op opchecked (one a line)

# Op name -> how many calls were opchecked in this process (test_op_coverage reads it).
CHECKED = Counter()


def no_opcheck(reason: str):
    """No twin for this test (say why: e.g. its ops run in other processes)."""
    def mark(fn):
        fn._no_opcheck = reason
        return fn
    return mark


def opcheck_every_call(fn):
    """The twin runs every parametrize case and checks each new kind of call
    that the test file's own code makes, past MAX_KINDS (the library's calls
    inside count as in other twins): for tests that call ops on samples."""
    fn._opcheck_every_call = True
    return fn


def _overload(func):
    if isinstance(func, torch._ops.OpOverloadPacket):
        func = getattr(func, "default", None)  # our ops have one overload each
    if isinstance(func, torch._ops.OpOverload) and func.namespace == NAMESPACE:
        return func
    return None


def _shape_kind(x):
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, x.dim(), x.numel() == 0, x.device.type, x.requires_grad)
    if isinstance(x, (list, tuple)):
        return tuple(_shape_kind(v) for v in x)
    return type(x).__name__  # ints, floats: their values are data, not a kind


def _kind(op, args, kwargs):
    named = dict(zip((a.name for a in op._schema.arguments), args), **kwargs)
    return tuple((name, repr(v) if name in MODE_ARGS else _shape_kind(v)) for name, v in named.items())


def _plain(t):
    # Fake, meta and functional tensors belong to a trace, not to the test.
    return type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_meta


def _copy(t):
    c = t.detach().clone(memory_format=torch.preserve_format)
    if t.device.type == "cpu" and torch.cuda.is_available() and t.is_pinned():
        c = c.pin_memory()  # a CUDA store kernel reads a pinned host store in place
    return c.requires_grad_(t.requires_grad)


_SKIP_FILES = (os.path.dirname(torch.__file__) + os.sep, __file__)  # (torchrec is not torch)


def _caller_file():
    """The file of the code that called the op (torch's frames skipped)."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_SKIP_FILES):
        f = f.f_back
    return f.f_code.co_filename if f is not None else ""


class _Recorder(TorchFunctionMode):
    """Records (op, kind, from_test, copied args, copied kwargs) of the
    dynamicemb calls that `wanted(op, kind, from_test)` asks for and that
    return; from_test: called by code of the test's own file."""

    def __init__(self, test_file, wanted):
        super().__init__()
        self.test_file = test_file
        self.wanted = wanted
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _overload(func)
        if op is None or torch.compiler.is_compiling():
            return func(*args, **kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not all(_plain(t) for t in tensors) or sum(t.numel() for t in tensors) > MAX_NUMEL:
            return func(*args, **kwargs)
        key = (_kind(op, args, kwargs), _caller_file() == self.test_file)
        copies = pytree.tree_map_only(torch.Tensor, _copy, (args, kwargs)) if self.wanted(op, *key) else None
        out = func(*args, **kwargs)  # if it raises, nothing is recorded
        if copies is not None:
            self.calls.append((op, *key, *copies))
        return out


def _test_utils(op):
    name = op._schema.name.split("::")[1]
    return tuple(u for u in TEST_UTILS if not (u.startswith("test_aot") and name in NO_AOT))


def _opcheck(op, args, kwargs, test_name):
    try:
        torch.library.opcheck(op, args, kwargs, test_utils=_test_utils(op))
    except Exception as e:
        raise AssertionError(f"opcheck of {op._schema.name} failed on a call made by {test_name}") from e
    name = op._schema.name.split("::")[1]
    CHECKED[name] += 1
    if os.environ.get(LOG_ENV):
        with open(os.environ[LOG_ENV], "a") as f:
            f.write(name + "\n")


def _first_cases(marks):
    """The parametrize marks cut to their first case."""
    out = []
    for m in marks:
        if m.name == "parametrize":
            names, values = m.args[0], list(m.args[1])[:1]
            kw = dict(m.kwargs)
            if isinstance(kw.get("ids"), (list, tuple)):
                kw["ids"] = list(kw["ids"])[:1]
            m = pytest.mark.parametrize(names, values, **kw).mark
        out.append(m)
    return out


def _twin(fn, test_name, seen, max_kinds):
    """seen: op -> kinds the twins of the module checked. A twin checks the
    kinds not seen while the op has fewer than max_kinds; an every-call twin
    checks the unseen kinds that the test file's code calls, beyond that."""
    every = getattr(fn, "_opcheck_every_call", False)

    @functools.wraps(fn)  # the same signature: pytest passes the same fixtures and parameters
    def twin(*args, **kwargs):
        def wanted(op, kind, from_test):
            done = seen.get(op, ())
            return kind not in done and ((every and from_test) or len(done) < max_kinds)

        with _Recorder(fn.__code__.co_filename, wanted) as rec:
            fn(*args, **kwargs)
        for op, kind, from_test, op_args, op_kwargs in rec.calls:
            if wanted(op, kind, from_test):
                seen.setdefault(op, set()).add(kind)
                _opcheck(op, op_args, op_kwargs, test_name)

    marks = list(getattr(fn, "pytestmark", []))
    twin.pytestmark = marks if every else _first_cases(marks)
    twin.__name__ = twin.__qualname__ = PREFIX + fn.__name__
    return twin


def generate_opcheck_tests(target, max_kinds: int = MAX_KINDS):
    """Adds the opcheck twin of each test of `target`, a test module or class.
    Its twins share what they checked: each kind of call is checked once."""
    seen = {}  # op -> kinds checked by the twins of target
    label = getattr(target, "__name__", str(target))
    for name, fn in list(vars(target).items()):
        if not name.startswith("test_") or name.startswith(PREFIX) or not callable(fn):
            continue
        if getattr(fn, "_no_opcheck", None):
            continue
        if hasattr(target, PREFIX + name):
            raise RuntimeError(f"{label} already has {PREFIX + name}")
        setattr(target, PREFIX + name, _twin(fn, f"{label}.{name}", seen, max_kinds))
