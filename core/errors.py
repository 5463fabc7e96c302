"""Errors a user can fix. CLIs catch `MoepipeError` and print its one-line message, exit non-zero.

Each message names the field, file or op at fault and what would fix it.
"""


class MoepipeError(Exception):
    """Base class: a mistake in the user's input, reported as one line."""


class ConfigError(MoepipeError, ValueError):
    """A config field has a bad value (names the field and the valid range)."""


class TraceError(MoepipeError):
    """A routing trace file is missing, corrupt, or disagrees with the model's shape."""


class ScheduleError(MoepipeError):
    """A schedule is malformed, or can never finish (names the stuck ops)."""


class CapacityError(MoepipeError):
    """Something does not fit in memory (says what it needs and what there is)."""
