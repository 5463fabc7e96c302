"""Put on PYTHONPATH by tests/real/test_distributed_faults.py: rank 1 of a torchrun launch kills
itself (SIGKILL) at the point MOEPIPE_TEST_DIE_AT names, once the run's modules import (the
points a survivor meets a dead peer at: before, during and after each collective); at "hang"
it stops answering mid-run instead."""

import os
import signal
import sys
import time
from importlib.abc import MetaPathFinder
from typing import Any

AT = os.environ.get("MOEPIPE_TEST_DIE_AT", "")
TRANSFERS = 20  # "transfer": the posts rank 1 makes before it dies, into the run


def _die(*_: Any, **__: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _patch() -> None:
    import torch.distributed as dist

    calls = {
        "init": "init_process_group",  # before the process group forms
        "groups": "new_group",  # the Peers' groups: rank 0 waits in C++ for rank 1's keys
        "barrier": "barrier",  # the run's start
        "gather": "all_gather_object",  # the run's end: every rank's times
        "end": "destroy_process_group",  # after the last collective: rank 0 writes the run
    }
    if AT in calls:
        setattr(dist, calls[AT], _die)
        return
    assert AT in ("transfer", "hang"), AT
    import real.distributed as rd

    post = rd.Peers._post
    n = [0]

    def counted(self: Any, *a: Any, **k: Any) -> Any:
        n[0] += 1
        if n[0] > TRANSFERS:
            if AT == "hang":  # alive, answering nothing
                time.sleep(3600)
            _die()
        return post(self, *a, **k)

    rd.Peers._post = counted  # type: ignore[method-assign]


class _OnImport(MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name == "experiments.common.dist_run":
            sys.meta_path.remove(self)
            _patch()


if AT and os.environ.get("RANK") == "1":
    sys.meta_path.insert(0, _OnImport())
