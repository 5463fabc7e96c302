"""Environment variables that torch reads as it loads and refuses (TORCH_LOGS,
TORCH_DISTRIBUTED_DEBUG): a command that imported torch with one set badly failed with an
"internal error" and a traceback file, though the fix is the user's (`env_line`)."""

from __future__ import annotations

import os
import re
import traceback


def env_line(e: BaseException) -> str | None:
    """One line naming the variable where `e` is torch's refusal of one set in the environment
    (its message names it, and torch's own code raised it), else None."""
    if not isinstance(e, ValueError | RuntimeError):
        return None
    text = str(e)
    names = [n for n in re.findall(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]+\b", text) if n in os.environ]
    if not names:
        return None
    frames = traceback.extract_tb(e.__traceback__)
    if not frames or f"{os.sep}torch{os.sep}" not in frames[-1].filename:
        return None
    name = names[0]
    first = " ".join(text.split())[:200]
    return (
        f"environment variable {name}={os.environ[name]!r}: torch refuses it as it loads "
        f"({first}); set it to a value torch takes, or unset it"
    )
