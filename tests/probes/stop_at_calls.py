"""A `-m` sweep stopped at chosen calls of its pool's start, in this process: the Nth Python call
after the pool's first `submit` sends SIGTERM, whose handler then raises at that call's first
instruction (as a signal landing there would). Each stop is a line of OUT (JSON): the call's
place, the command's status and last line, and any stop a library dropped or kept on the way
(`stops.Interrupt`, recorded as the command sends it again or raises it as it returns).

    python -m tests.probes.stop_at_calls OUT.jsonl --first 2 --last 1600 --step 7

A stop that hangs the command ends the probe (faulthandler prints every thread's stack).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import json
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from tests.probes.conftest import TINY

SWEEP = ["-m", *TINY[:-1], "planner=sequential", "workload.n_batches=400", "workload.gen_len=128"]


class _Aim:
    """The profile function that sends SIGTERM at the `nth` call after the pool's `submit`."""

    def __init__(self) -> None:
        self.nth, self.calls, self.at = 0, -1, ""

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or self.calls < 0 or self.at:
            return
        self.calls += 1
        if self.calls >= self.nth:
            code = frame.f_code
            self.at = f"{code.co_filename.split('site-packages/')[-1]}:{code.co_name}"
            os.kill(os.getpid(), signal.SIGTERM)


def _record_losses(lost: list[str]) -> None:
    """Each stop a library dropped (freed before its line) or kept, in `lost`."""
    from experiments.common import stops

    freed = stops.Interrupt.__del__
    unsent = stops._raise_unsent

    def recorded_del(self: Any) -> None:
        if self.token in stops._RAISED:
            lost.append("dropped: " + "".join(traceback.format_tb(self.__traceback__))[-600:])
        freed(self)

    def recorded_unsent() -> None:
        lost.extend(f"kept: signal {s}" for s in stops._RAISED.values())
        unsent()

    stops.Interrupt.__del__ = recorded_del  # type: ignore[method-assign]
    stops._raise_unsent = recorded_unsent


def main() -> None:
    parser = argparse.ArgumentParser(
        description="A sweep stopped at chosen calls of its pool start"
    )
    parser.add_argument("out")
    parser.add_argument("--first", type=int, default=2)
    parser.add_argument("--last", type=int, default=1600)
    parser.add_argument("--step", type=int, default=7)
    args = parser.parse_args()
    from joblib.externals.loky import process_executor

    from experiments.common.cli import run_command
    from experiments.run import main as run_main

    aim, lost = _Aim(), []
    _record_losses(lost)
    submit = process_executor.ProcessPoolExecutor.submit

    def aimed_submit(self: Any, *a: Any, **k: Any) -> Any:
        aim.calls = max(aim.calls, 0)
        return submit(self, *a, **k)

    process_executor.ProcessPoolExecutor.submit = aimed_submit  # type: ignore[method-assign]
    with open(args.out, "w") as out, tempfile.TemporaryDirectory() as tmp:
        for nth in range(args.first, args.last + 1, args.step):
            aim.nth, aim.calls, aim.at = nth, -1, ""
            lost.clear()
            err = io.StringIO()
            faulthandler.dump_traceback_later(120, exit=True)
            sys.setprofile(aim)
            try:
                with contextlib.redirect_stderr(err):
                    where = f"hydra.sweep.dir={Path(tmp) / str(nth)}"
                    status = run_command(lambda where=where: run_main([*SWEEP, where]))
            except SystemExit as e:
                status = e.code
            finally:
                sys.setprofile(None)
                faulthandler.cancel_dump_traceback_later()
            said = err.getvalue().strip().splitlines()
            row = {"call": nth, "at": aim.at, "status": status, "line": said[-1] if said else ""}
            out.write(json.dumps({**row, "lost": list(lost)}) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
