"""A module imported when first used, not when its user is imported (`lazy_module`): pandas
costs a quarter of a second to import, and a command that stops at its config (most bad input)
never reads a frame. Type checkers see the plain import (`if TYPE_CHECKING`)."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any


class _Lazy(types.ModuleType):
    """Stands for a module until an attribute is read: then imports it and takes its names, so
    later reads find them without this class."""

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self.__name__)
        self.__dict__.update(module.__dict__)
        return getattr(module, attr)


def lazy_module(name: str) -> Any:
    """Module `name` (imported already: the module itself), or a stand-in that imports it when an
    attribute of it is first read."""
    return sys.modules.get(name) or _Lazy(name)
