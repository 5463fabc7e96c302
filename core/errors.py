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


def quoted(name: object) -> str:
    """A name from a user's file or command line (a tensor, key, field or file) as a line shows
    it: as is where it reads back unambiguously, else in Python's quotes with its escapes, so
    that an empty name, a space or a control character in one shows (`tensor '' (1 such)`,
    where `tensor  (1 such)` hid it)."""
    text = str(name)
    plain = text and text.isprintable() and not any(c.isspace() or c in "'\"" for c in text)
    return text if plain else repr(text)
