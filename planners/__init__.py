"""Planners: one file each, registered by name (the stem of conf/planner/<name>.yaml; other
YAMLs there, klotski_at_n, klotski_hot and klotski_multi, are params variants of one planner).

Importing this package imports every module in it, so a new planner file registers itself.
"""

import importlib
import pkgutil

for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")

from planners.registry import make_planner, planner_names, register  # noqa: E402

__all__ = ["make_planner", "planner_names", "register"]
