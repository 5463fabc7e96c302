"""What a command whose options are not a run's keys (the benches, validate, validate_lanes)
calls them: a line from shared code (the planner, the simulator, a child process's relayed
error, warning or info line) names the command's own options, not a run's config keys nor
another command's options.

Usage:
    with named_as(BENCH_OPTIONS):  # around a command's body
        ...
    line = own_names_now(line)  # a child's line, relayed inside that body
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

from core.errors import MoepipeError, reworded

# the workload's keys and the memory tiers, as the benches and validate name their options
_WORKLOAD = {f"workload.{k}": k for k in ("batch_size", "n_batches", "prompt_len", "gen_len")}
_MEMORY = {
    "hardware.memory_gb.gpu": "gpu_frac",  # its device pool is gpu_frac of the model
    "hardware.memory_gb.cpu": "cpu_frac",  # and its host tier cpu_frac
}

# a run's config keys a child's error names, as the bench's own options the user gave
BENCH_OPTIONS = {
    "planner.params.attn_batches": "klotski_attn",
    "planner.params.n": "klotski_n",
    **_WORKLOAD,
    "workload.routing.source": "routing",
    **_MEMORY,
}

# experiments.validate's: its workload options and planner_params, every planner's
VALIDATE_OPTIONS = {**_WORKLOAD, "planner.params": "planner_params", **_MEMORY}

# experiments.validate_lanes's: the lanes are the expert-parallel planners' devices
VALIDATE_LANES_OPTIONS = {
    **{k: v for k, v in VALIDATE_OPTIONS.items() if k.startswith("workload.")},
    "planner.params.n_devices": "lanes",
    "planner.params.replica_slots": "replica_slots",
    "n_devices": "lanes",
}


def own_names(text: str, names: dict[str, str]) -> str:
    """`text` with each key of `names` (a run's config key, another command's option) named as
    the command's own option that sets it: bench.real's user, who passes n=, was told to change
    klotski_n."""
    for key, option in names.items():  # not inside a dotted key: `workload.n_batches`'s tail
        text = re.sub(rf"(?<![\w.]){re.escape(key)}\b", option, text)
    return text


# the names of the `named_as` blocks this process is inside, innermost last
_ACTIVE: list[dict[str, str]] = []


# per `named_as` block, the lines said in it: its log records' messages and the lines relayed
_SAID: list[set[str]] = []


def own_names_now(text: str) -> str:
    """`text` (a child's line the command relays) with the names of the `named_as` block this
    process is inside; unchanged outside one."""
    return own_names(text, _ACTIVE[-1]) if _ACTIVE else text


def said_before(line: str) -> bool:
    """Has the `named_as` block this process is inside said `line` already (logged it, or
    relayed it from a child)? A bench's children each choose the n its parent chose, and each
    warned as the parent had. A blank line, or one outside a block, is never said before."""
    text = line.strip()
    if not _SAID or not text:
        return False
    if text in _SAID[-1]:
        return True
    _SAID[-1].add(text)
    return False


@contextlib.contextmanager
def named_as(names: dict[str, str]) -> Iterator[None]:
    """Inside, a MoepipeError's line and every log record's message (the n-planner's warning,
    an info line) name the command's own options (`own_names`), whichever shared code (the
    planner, the simulator, a child's relayed line) raised or logged it."""
    previous = logging.getLogRecordFactory()

    def renamed(*args: object, **kwargs: object) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            text = record.getMessage()
        except Exception:  # a malformed record: logging reports it as it would have
            return record
        record.msg, record.args = own_names(text, names), ()
        said.add(record.msg.strip())
        return record

    said: set[str] = set()
    logging.setLogRecordFactory(renamed)
    _ACTIVE.append(names)
    _SAID.append(said)
    try:
        yield
    except MoepipeError as e:  # a refusal stays one (held_warnings says it alone), a bug one
        raise reworded(e, own_names(str(e), names)) from e
    finally:
        _ACTIVE.pop()
        _SAID.pop()
        logging.setLogRecordFactory(previous)
