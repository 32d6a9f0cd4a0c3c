"""Warnings given once per step, with the step and a count in their text.

Through warnings.warn_explicit with a registry of their own: warnings.warn
keeps every distinct text in the calling module's __warningregistry__ (to
show each once under the default filter), so a long run that failed keys
every step grew it by one entry a step. Filters apply as to warnings.warn."""
import sys
import warnings


def warn_step(message: str, category=RuntimeWarning, stacklevel: int = 2) -> None:
    """warnings.warn(message, category, stacklevel), counting the stack
    from warn_step's caller (1: the caller itself), with no registry kept."""
    frame = sys._getframe(stacklevel)
    g = frame.f_globals
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno, module=g.get("__name__"),
                           registry={}, module_globals=g)
