"""A sweep's launcher options checked before any point runs: joblib's and submitit's take some
values on their own terms (run on a default without a word) and fail on others only once the
sweep is under way, as an internal error, or its temp_folder a folder that cannot be made
or written. Each problem is one line naming the key."""

from __future__ import annotations

import math
from typing import Any

from omegaconf import OmegaConf

from core.errors import MoepipeError, integer_words
from experiments.common.argv_checks import writable_dir

# numpy.memmap's modes, the ones joblib passes on for the arrays it memory-maps
MMAP_MODES = ("r+", "r", "w+", "c")


def check_joblib(cfg: Any) -> None:
    """The joblib launcher's backend, hints and limits, which joblib takes on its own terms: an
    unknown backend ran on its default without a word, an unknown `prefer`, a `batch_size` of
    0, a `pre_dispatch` or `max_nbytes` it cannot parse were internal errors once the sweep
    had started, and `timeout=0` stopped it at its first point."""
    launcher = OmegaConf.select(cfg, "hydra.launcher", default=None)
    target = "" if launcher is None else str(launcher.get("_target_", "")).lower()
    if "submitit" in target:
        check_submitit(launcher)
    if "joblib" not in target:
        return
    _check_worker_locks()  # before joblib's import, which warns over two lines without them
    import joblib.parallel as jp

    for key, valid in (
        ("backend", (*jp.BACKENDS, None)),
        ("prefer", jp.VALID_BACKEND_HINTS),
        ("require", jp.VALID_BACKEND_CONSTRAINTS),
        ("mmap_mode", (*MMAP_MODES, None)),
    ):
        value = launcher.get(key)
        if value not in valid:
            names = ", ".join(str(v) for v in valid if v is not None)
            raise MoepipeError(
                f"hydra.launcher.{key}={value}: not one of joblib's ({names}); pass one, or "
                "leave it out"
            )
    _check_joblib_limits(launcher)
    temp = launcher.get("temp_folder")
    if temp is not None:  # joblib's folder for the arrays it shares with its workers
        writable_dir(str(temp), "hydra.launcher.temp_folder")


LOCKS_PER_POOL = 16  # semaphores a joblib pool holds at once (loky's queues'), with room


def _check_worker_locks() -> None:
    """The semaphores joblib's pool makes, in /dev/shm: a full /dev/shm raised ENOSPC from
    deep inside joblib, said as "No space left on device; free space on that disk" (which
    disk?) and then joblib's warning of serial mode over two more lines."""
    import multiprocessing

    try:
        held = [multiprocessing.Lock() for _ in range(LOCKS_PER_POOL)]
        del held
    except OSError as e:
        raise MoepipeError(
            f"/dev/shm: the sweep's workers cannot get their locks there ({e.strerror or e}); "
            "free space in /dev/shm (df /dev/shm), or pass hydra/launcher=basic to run the "
            "points one after another"
        ) from None


def _check_joblib_limits(launcher: Any) -> None:
    """joblib's numbers: each as joblib reads it, and of a size that lets the sweep run."""
    import joblib.parallel as jp

    def refuse(key: str, what: str) -> None:
        raise MoepipeError(
            f"hydra.launcher.{key}={launcher.get(key)}: {what}; pass one, or leave it out"
        )

    timeout = launcher.get("timeout")
    if timeout is not None and not (_number(timeout) and math.isfinite(timeout) and timeout > 0):
        refuse("timeout", "not a number of seconds > 0 (each point's limit)")
    batch = launcher.get("batch_size")
    if batch != "auto" and not (_whole(batch) and batch >= 1):
        refuse("batch_size", f"must be 'auto' or {integer_words(1)} (points per batch)")
    pre = launcher.get("pre_dispatch")
    if pre != "all" and not _at_least_one(pre, lambda v: jp.eval_expr(v.replace("n_jobs", "1"))):
        refuse("pre_dispatch", f"not 'all', {integer_words(1)} or an expression like 2*n_jobs")
    nbytes = launcher.get("max_nbytes")
    if nbytes is not None and not _at_least_one(nbytes, jp.memstr_to_bytes, zero=True):
        refuse("max_nbytes", "not a size joblib reads (a non-negative integer of bytes, or 1M, 2G)")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _at_least_one(value: Any, parse: Any, zero: bool = False) -> bool:
    """`value` (a whole number, or text `parse` reads as one) is >= 1 (>= 0 with `zero`)."""
    if isinstance(value, str):
        try:
            value = parse(value)
        except (ValueError, TypeError, ZeroDivisionError, SyntaxError):
            return False
    return _number(value) and math.isfinite(value) and value >= (0 if zero else 1)


def check_submitit(launcher: Any) -> None:
    """A submitit launcher's limits that would end every job before it ran (`timeout_min=0`:
    each job killed at once, then an internal error of submitit's)."""
    for key in ("timeout_min", "cpus_per_task", "tasks_per_node", "nodes", "mem_gb"):
        value = launcher.get(key)
        if value is not None and (isinstance(value, bool) or not value >= 1):
            raise MoepipeError(
                f"hydra.launcher.{key}={value}: each job would end before it ran; pass 1 or more"
            )
