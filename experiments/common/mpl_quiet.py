"""matplotlib imported without its warnings of a config or cache folder it cannot write (a
read-only or missing HOME): it then works in a temporary folder of its own, as it says over two
lines on stderr of a command that succeeds.

Usage:
    agg()   # before `import matplotlib.pyplot`
"""

from __future__ import annotations

import logging


def agg() -> None:
    """Import matplotlib with the Agg backend, its folder lookups (cached by matplotlib, so
    done once) made with its warnings held back."""
    log = logging.getLogger("matplotlib")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import matplotlib

        matplotlib.get_configdir()
        matplotlib.get_cachedir()
        matplotlib.use("Agg")
    finally:
        log.setLevel(level)
