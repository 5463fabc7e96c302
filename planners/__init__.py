"""Planners: one file each, registered by name (the stem of conf/planner/<name>.yaml; other
YAMLs there, klotski_at_n, klotski_hot and klotski_multi, are params variants of one planner).

Importing this package imports every module in it, so a new planner file registers itself; one
that fails to import is one line naming it at the registry's first use.
"""

from planners.registry import import_planners, make_planner, planner_names, register

import_planners(__path__, __name__)

__all__ = ["make_planner", "planner_names", "register"]
