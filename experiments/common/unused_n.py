"""The warning for a `workload.n_batches` the user typed that the run did not use: a planner
that sizes its own group (Klotski's `planner.params.n: 0`) chose another n.

Usage:
    warn_unused_n_batches(spec, summary["n_batches"])   # in experiments.run, once per run
"""

from __future__ import annotations

import logging

from experiments.common.pipeline import RunSpec, sizes_its_group

log = logging.getLogger(__name__)


def given_n_batches() -> bool:
    """Whether the command line (hydra's overrides as typed) sets workload.n_batches: an
    experiment file's or the workload conf's own value is not the user's to be warned of."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return False
    keys = {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task}
    return "workload.n_batches" in keys


def warn_unused_n_batches(spec: RunSpec, ran_n: int) -> None:
    """One warning where the user's workload.n_batches (`spec`'s) gave way to the n the
    run's planner chose itself (`ran_n`): the run went on as if it had not been typed."""
    typed = spec.workload.n_batches
    if ran_n == typed or not given_n_batches():
        return
    if not sizes_its_group(spec):
        return  # the planner keeps the workload's n: nothing of the user's went unused
    n = spec.params.get("n")
    log.warning(
        "workload.n_batches=%d was not used: planner %s sizes its own group "
        "(planner.params.n=%s) and ran n=%d; pass planner.params.n=-1 (or =%d) to run "
        "n=%d, or drop workload.n_batches",
        typed,
        spec.planner,
        n,
        ran_n,
        typed,
        typed,
    )
