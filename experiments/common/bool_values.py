"""A true/false field of a config takes what the command line takes for one (true, false, yes,
no, on, off, 1, 0): omegaconf read any other whole number in a YAML file (`sync: 2`) as true,
unsaid, where `planner.params.sync=2` on the command line is refused. Installed once per
process, before hydra composes the config; the refusal is omegaconf's own "not a valid bool",
which the command prints in one line naming the key and the file.
"""

from __future__ import annotations

from typing import Any


def strict_bools() -> None:
    """omegaconf's bool fields refuse a whole number other than 0 and 1 (`2`, `-1`, `"2"`)."""
    from omegaconf import nodes
    from omegaconf.errors import ValidationError

    convert = nodes.BooleanNode._validate_and_convert_impl
    if getattr(convert, "strict", False):
        return

    def strict(self: nodes.BooleanNode, value: Any) -> bool:
        number = isinstance(value, int) and not isinstance(value, bool)
        if number and value not in (0, 1):
            raise ValidationError("Value '$VALUE' is not a valid bool (type $VALUE_TYPE)")
        return convert(self, value)

    strict.strict = True  # type: ignore[attr-defined]
    nodes.BooleanNode._validate_and_convert_impl = strict  # type: ignore[method-assign]
