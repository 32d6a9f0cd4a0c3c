"""Warnings given once per step, with the step and a count in their text.

Through warnings.warn_explicit with a registry of their own: warnings.warn
keeps every distinct text in the calling module's __warningregistry__ (to
show each once under the default filter), so a long run that failed keys
every step grew it by one entry a step. Filters apply as to warnings.warn
(the "once" filter still keeps each text, in warnings' own registry)."""
import sys
import warnings


def warn_step(message: str, category=RuntimeWarning, stacklevel: int = 2) -> None:
    """warnings.warn(message, category, stacklevel), counting the stack
    from warn_step's caller (1: the caller itself); past the stack's top,
    attributed to sys:1 as warnings.warn does."""
    frame = sys._getframe(1)
    for _ in range(stacklevel - 1):
        if frame is None:
            break
        frame = frame.f_back
    if frame is None:
        filename, lineno, g = "sys", 1, sys.__dict__
    else:
        filename, lineno, g = frame.f_code.co_filename, frame.f_lineno, frame.f_globals
    warnings.warn_explicit(message, category, filename, lineno, module=g.get("__name__"), registry={},
                           module_globals=g if frame is not None else None)
