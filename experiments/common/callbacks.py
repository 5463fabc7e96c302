"""Hydra callbacks for sweeps: a progress bar, and an end-of-sweep table + report.

Jobs run in launcher worker processes (joblib, SLURM), so progress is counted in the main
process by polling the sweep directory for finished runs (a `summary.json`, written last and
atomically). Wired in `conf/config.yaml` (`hydra.callbacks.progress`) and
`conf/experiment/compare.yaml` (`hydra.callbacks.summary`).
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from core.errors import MoepipeError
from experiments import TERMINAL_SIGNALS
from experiments.common.cli import on_interrupt
from experiments.common.plugin_keys import check_logging_config
from experiments.common.reader_left import bar_stream

FAILED = "failed.txt"  # in a run dir of a sweep: the run's bad input, one line (experiments.run)


def sweep_size(config: DictConfig) -> int | None:
    """Runs in the sweep: the product of the sweep lengths of the command line and
    `hydra.sweeper.params` (the command line wins for a key in both). None if unknown."""
    try:
        args = {}
        params = OmegaConf.select(config, "hydra.sweeper.params") or {}
        for k, v in params.items():
            args[str(k)] = f"{k}={v}"
        for o in OmegaConf.select(config, "hydra.overrides.task") or []:
            key = str(o).split("=", 1)[0]
            args[key] = str(o)
        parsed = OverridesParser.create().parse_overrides(list(args.values()))
        return math.prod(
            len(list(o.sweep_string_iterator())) if o.is_sweep_override() else 1 for o in parsed
        )
    except Exception:  # a custom sweeper's syntax: run without a total
        return None


def finished_runs(sweep_dir: Path, token: str) -> tuple[int, int]:
    """(finished, reused): the runs of the sweep of `token` that hold a summary.json, and how
    many of those an earlier sweep wrote. A run is this sweep's once its job has started in it:
    the job writes the sweep's token into the run dir first (`SweepProgress.on_job_start`), so
    other sweeps' runs in the same fixed sweep dir do not count, even one started within the
    second before (which mtimes, whole seconds on some file systems, could not tell apart). It
    was reused where its summary.json is still the file that was there when its job started.
    One with failed.txt beside its summary.json failed (that summary is an earlier run's, kept),
    as `failed_runs` and `collect` count it."""
    finished = reused = 0
    for summary in _run_files(sweep_dir, "summary.json"):
        sweeps = _sweeps(summary.parent)
        if token not in sweeps or (summary.parent / FAILED).exists():  # its rerun failed
            continue
        try:
            now = _identity(summary)
        except OSError:  # a rerun just removed it
            continue
        reused += sweeps[token] == now
        finished += 1
    return finished, reused


SWEEP_MARK = ".sweep.json"  # in a run dir: the tokens of the sweeps whose jobs ran in it
MARKED_SWEEPS = 32  # the latest sweeps a mark keeps: more at once into one dir is not a use


def mark_run(run_dir: Path, token: str) -> None:
    """Record in `run_dir` that the sweep of `token` runs it now, and which summary.json it
    held then (one of an earlier sweep, if any), beside the other sweeps' marks: two sweeps
    into one sweep dir at once each count the runs their jobs ran in, where the second's mark
    replaced the first's and the first said "0 run(s) finished". Written under the run dir's
    lock (`dir_lock`), so the summary.json it names is not one a run is replacing, and two
    jobs' marks are not written over each other; a job waits there for another run of it."""
    import json

    from experiments.common.dir_lock import dir_locked
    from experiments.common.run_dir import atomic_write_text

    with dir_locked(run_dir):
        try:
            earlier = _identity(run_dir / "summary.json")
        except OSError:
            earlier = None
        sweeps = {k: v for k, v in _sweeps(run_dir).items() if k != token}
        sweeps[token] = earlier
        kept = dict(list(sweeps.items())[-MARKED_SWEEPS:])
        atomic_write_text(run_dir / SWEEP_MARK, json.dumps({"sweeps": kept}))


_JOB_SWEEP: list[str] = []  # the token of the sweep whose job this process runs now


def mark_job_locked(run_dir: Path) -> None:
    """Mark `run_dir` again for the sweep whose job runs in this process (none outside a sweep),
    by the run as it holds the dir's lock (`run.locked`): two sweeps' jobs both marked it at
    their start, before either run took the lock, and the second to run counted the result
    the first had just written as one it ran. Marked under the lock, the summary.json it names
    is the one the run then reuses, or none. A dir it cannot write: the run's own error says."""
    if _JOB_SWEEP:
        with contextlib.suppress(OSError):
            mark_run(run_dir, _JOB_SWEEP[0])


def _identity(path: Path) -> list[int]:
    """What tells one file at `path` from the one that replaces it (a result is moved in whole,
    as a new file): its inode and its mtime in nanoseconds."""
    st = path.stat()
    return [st.st_ino, st.st_mtime_ns]


def _marked(run_dir: Path) -> dict[str, Any] | None:
    """The sweep mark of `run_dir`; None where it has none (a job not started yet) or it is not
    one (written by hand)."""
    import json

    from core.files import read_small

    try:  # unblocked by a FIFO in its place, as a hand-made file it is not a mark
        mark = json.loads(read_small(run_dir / SWEEP_MARK))
    except (OSError, ValueError, RecursionError):  # ConfigError (not a file) is a ValueError
        return None
    return mark if isinstance(mark, dict) else None


def _sweeps(run_dir: Path) -> dict[str, Any]:
    """The sweeps marked in `run_dir`, each token with the summary.json's identity its job
    found there (None: none); none where it has no mark."""
    sweeps = (_marked(run_dir) or {}).get("sweeps")
    return sweeps if isinstance(sweeps, dict) else {}


def failed_runs(sweep_dir: Path, token: str) -> list[str]:
    """The run dirs of the sweep of `token` (relative to `sweep_dir`) whose run failed on bad
    input: a run removes its old failed.txt when it starts again, so one left from an earlier
    sweep of other points is not this sweep's."""
    failed = []
    for path in _run_files(sweep_dir, FAILED):
        if token in _sweeps(path.parent):
            failed.append(str(path.parent.relative_to(sweep_dir)))
    return sorted(failed)


def _run_files(sweep_dir: Path, name: str) -> Iterator[Path]:
    """The files `name` (summary.json, failed.txt) of the run dirs under `sweep_dir`, read
    while runs are writing: a folder renamed or removed mid-walk (a run's `.partial-*` staging
    becoming its result, another sweep's run in the same dir) is skipped, where `Path.rglob`
    raised FileNotFoundError (the progress thread died with the bar frozen; the sweep's end
    line was a traceback). Hidden folders (`.hydra`, that staging) hold no run's."""
    for root, dirs, files in os.walk(sweep_dir):  # scandir errors are skipped (onerror=None)
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        if name in files:
            yield Path(root) / name


def workers_ignore_ctrl_c() -> str | None:
    """Start the sweep's worker processes (joblib's, which loky starts as `sys.executable -m
    ...`, and its resource tracker) with Ctrl-C, SIGTERM, SIGHUP and SIGQUIT ignored, from
    their first instruction: Ctrl-C reaches every process of the terminal's group (a closed
    terminal's SIGHUP too, a scheduler's SIGTERM often), and a worker still importing numpy
    printed its KeyboardInterrupt traceback before the sweep's one line, a tracker killed by
    SIGHUP or SIGQUIT (loky's, which ran the real python) its KeyError tracebacks after it.
    The sweep's process stops the pool itself (joblib kills its workers with SIGKILL).
    Returns the real executable, to be restored when the sweep ends; None where no wrapper
    could be written."""
    import shlex
    import tempfile

    real = sys.executable
    if not real or os.name != "posix" or _wrapped(real):
        return None
    try:
        folder = tempfile.mkdtemp(prefix="moepipe-python-")
        wrapper = Path(folder) / "python"
        # `trap ''` ignores a signal, which stays ignored across exec (a handler would not).
        # The tracker of a pool the sweep stopped finds the workers' memmap folders left and
        # removes them, but warns first, over two lines after the sweep's own: not asked
        quiet = "-W ignore:resource_tracker:UserWarning"
        wrapper.write_text(
            f"#!/bin/sh\ntrap '' INT TERM HUP QUIT\nexec {shlex.quote(real)} {quiet} \"$@\"\n"
        )
        wrapper.chmod(0o755)
    except OSError:
        return None
    sys.executable = str(wrapper)
    _set_tracker_python(str(wrapper))
    os.environ[WRAPPER_ENV] = str(wrapper)  # a worker starts a killed tracker again: with it
    return real


WRAPPER_ENV = "MOEPIPE_POOL_PYTHON"  # the sweep's wrapper, for its pool's workers


def tracker_python_in_worker() -> None:
    """In a pool worker: a resource tracker it starts again (the sweep's was killed) runs
    through the sweep's wrapper too (`workers_ignore_ctrl_c`)."""
    wrapper = os.environ.get(WRAPPER_ENV)
    if wrapper and Path(wrapper).is_file():
        import joblib.externals.loky.backend.spawn  # noqa: F401  (where the worker has it not yet)

        _set_tracker_python(wrapper)


def _set_tracker_python(executable: str) -> None:
    """The python loky starts its resource tracker with (read when loky was imported, not
    sys.executable): the tracker ignores what the workers ignore. Private to loky (joblib 1.6);
    where it is missing the tracker runs the real python, as before."""
    spawn = sys.modules.get("joblib.externals.loky.backend.spawn")
    if spawn is not None and hasattr(spawn, "_python_exe"):
        spawn._python_exe = executable
    # and the signals loky blocks while it starts the tracker (Ctrl-C and SIGTERM) the wrapper's
    # too: SIGHUP or SIGQUIT to the group as it started, before the wrapper's `trap`, killed it
    # (the tracker loky started again then printed a KeyError traceback per name)
    tracker = sys.modules.get("joblib.externals.loky.backend.resource_tracker")
    if tracker is not None and hasattr(tracker, "_IGNORED_SIGNALS"):
        ignored = (signal.SIGINT, signal.SIGTERM)
        tracker._IGNORED_SIGNALS = (
            (*ignored, *TERMINAL_SIGNALS[1:]) if _wrapped(executable) else ignored
        )


def _wrapped(executable: str) -> bool:
    return Path(executable).parent.name.startswith("moepipe-python-")


def workers_heed_signals(real: str) -> None:
    """Undo `workers_ignore_ctrl_c`: the real python back, the wrapper's folder gone."""
    import shutil

    if _wrapped(sys.executable):
        shutil.rmtree(Path(sys.executable).parent, ignore_errors=True)
    sys.executable = real
    _set_tracker_python(real)
    os.environ.pop(WRAPPER_ENV, None)


def remove_if_no_runs(sweep_dir: Path, made: Path | None = None) -> None:
    """A sweep that failed or was stopped leaves no folder that looks like a run: a point's dir
    goes where it holds nothing of one (what hydra put there, the sweep's mark: its job failed
    before it ran, as on a logging config that does not resolve). Where the sweep made its dir
    (`made`: the topmost folder made for it, the sweep dir or one above), that dir goes too
    where it then holds hydra's multirun.yaml alone, with the folders up to `made`, if empty."""
    from experiments.common.dir_lock import LOCK, held_if_free

    for root, dirs, files in os.walk(sweep_dir, topdown=False):
        here = Path(root)
        # a hidden folder is hydra's record or a run's staging (`.partial-*`): not a point's
        hidden = here.name.startswith(".")
        if (
            here == sweep_dir
            or hidden
            or any(not _unfinished(d) for d in dirs if (here / d).exists())
        ):
            continue
        if not all(f in (SWEEP_MARK, LOCK) or f.endswith(".log") for f in files):
            continue
        # a job killed as the sweep stopped left its lock: free now, where no run holds it
        with held_if_free(here) as free:
            if free:
                shutil.rmtree(here, ignore_errors=True)
    if made is None:
        return
    try:
        if all(p.name == "multirun.yaml" for p in sweep_dir.iterdir()):
            (sweep_dir / "multirun.yaml").unlink(missing_ok=True)
            sweep_dir.rmdir()
    except OSError:  # not there, or a point's dir appeared meanwhile: it stays
        return
    for folder in sweep_dir.absolute().parents:
        if made not in (folder, *folder.parents):
            break
        try:
            folder.rmdir()
        except OSError:  # not empty
            break


def _unfinished(folder: str) -> bool:
    """Is `folder`, in a point's dir, hydra's record or a killed run's half-written result
    (`.partial-*`, not the `-earlier` result a replaced one keeps)?"""
    return folder == ".hydra" or (folder.startswith(".partial-") and "-earlier" not in folder)


def name_config_write_errors() -> None:
    """hydra writes a run's .hydra/*.yaml with a bare open and write: the OSError of a write that
    fails (a full disk) names no file, nor then would its one line. Installed once in each process
    that runs jobs (the command's, a launcher's workers), the error names the file."""
    import hydra.core.utils as hydra_utils

    save = hydra_utils._save_config
    if getattr(save, "names_its_file", False):
        return

    def named(cfg: DictConfig, filename: str, output_dir: Path) -> None:
        try:
            save(cfg, filename, output_dir)
        except OSError as e:
            _remove_if_no_run()
            if e.filename:
                raise
            raise OSError(e.errno, e.strerror, str(Path(output_dir) / filename)) from None

    named.names_its_file = True  # type: ignore[attr-defined]
    hydra_utils._save_config = named
    configure = hydra_utils.configure_log

    def log_checked(log_config: DictConfig, verbose: Any = False) -> None:
        _check_log_files(log_config)
        _check_verbose(verbose)
        check_logging_config(log_config)  # a key dictConfig skips, unsaid
        try:
            configure(log_config, verbose)
        except (ValueError, TypeError, AttributeError, ImportError) as e:  # logging's dictConfig
            raise MoepipeError(_logging_refused(log_config, e)) from None

    hydra_utils.configure_log = log_checked
    import hydra._internal.hydra as hydra_internal  # its own name for it: the hydra_logging's

    hydra_internal.configure_log = log_checked  # type: ignore[attr-defined]
    _name_sweep_record_errors()


def _check_verbose(verbose: Any) -> None:
    """hydra.verbose as hydra takes it (true, a logger's name, a list of names): a number or a
    mapping failed hydra's bare assert, an internal error."""
    names = OmegaConf.is_list(verbose) and all(isinstance(v, str) for v in verbose)
    if not (isinstance(verbose, bool | str) or names):
        raise MoepipeError(
            f"hydra.verbose={verbose}: not true, false, a logger's name or a list of names; "
            "pass hydra.verbose=true (every logger) or hydra.verbose=[__main__]"
        )


def _logging_refused(log_config: DictConfig | None, e: BaseException) -> str:
    """One line for a logging config (hydra.job_logging, hydra.hydra_logging) that Python's
    logging refuses (a level it does not know, a handler's class that is not one): its key,
    logging's words and their cause ("Unknown level: 'NOPE'")."""
    key = log_config._get_full_key(None) if isinstance(log_config, DictConfig) else ""
    key = key or "hydra.job_logging"
    said = "; ".join(str(x) for x in (e, e.__cause__) if x is not None and str(x))
    group = key.replace(".", "/", 1)
    return f"{key}: {said}; fix that logging config, or pass {group}=default"


def _check_log_files(log_config: DictConfig | None) -> None:
    """The job's log file(s) where something not a file is in their place: logging's
    FileHandler blocked on a FIFO (a run that hung) and failed on a folder with "Unable to
    configure handler 'file'" (an internal error naming no file)."""
    from core.files import not_regular

    handlers = OmegaConf.select(log_config, "handlers") if log_config is not None else None
    for name in handlers or {}:
        filename = OmegaConf.select(log_config, f"handlers.{name}.filename")
        if filename is None:
            continue
        kind = not_regular(str(filename))
        if kind:
            _remove_if_no_run()
            raise MoepipeError(f"{filename}: {kind}, where the run writes its log; move it away")


def _name_sweep_record_errors() -> None:
    """hydra's basic sweeper writes the sweep's multirun.yaml with `OmegaConf.save`, whose
    OSError on a full disk (the file's close) names no file: its line was "No space left on
    device" alone. `OmegaConf.save` names the file it was given (hydra loads its plugins'
    modules afresh, so the sweeper's module itself cannot be patched beforehand)."""
    from omegaconf import OmegaConf

    save = OmegaConf.save
    if getattr(save, "names_its_file", False):
        return

    def named(config: Any, f: Any, resolve: bool = False) -> None:
        try:
            save(config, f, resolve=resolve)
        except OSError as e:
            if e.filename or not isinstance(f, str | Path):
                raise
            raise OSError(e.errno, e.strerror, str(f)) from None

    named.names_its_file = True  # type: ignore[attr-defined]
    OmegaConf.save = staticmethod(named)  # type: ignore[method-assign,assignment]


def _remove_if_no_run() -> None:
    """The job's run dir, removed where it holds only what hydra put there (.hydra, the log, an
    earlier sweep's mark): a job that failed before it ran leaves no folder that looks like a
    run."""
    import shutil

    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    if not run_dir.is_dir() or any(
        p.name not in (".hydra", SWEEP_MARK) and p.suffix != ".log" for p in run_dir.iterdir()
    ):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    try:
        sweep_dir = Path(str(hc.sweep.dir)).absolute()
    except OmegaConfBaseException:  # a run's (not a sweep's) template may not resolve
        return
    for parent in run_dir.parents:  # a sweep point's folders under the sweep dir, if empty
        if sweep_dir not in parent.parents:
            break
        try:
            parent.rmdir()
        except OSError:
            break


class SweepProgress(Callback):
    """A tqdm bar per sweep counting its run dirs that hold a summary.json; prints the wall time
    and how many runs an earlier sweep had finished."""

    def __init__(self, poll_s: float = 0.5) -> None:
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._token = ""  # this sweep's, in the run dirs its jobs start in (finished_runs)
        self._python: str | None = None  # sys.executable while workers_ignore_ctrl_c's is set

    def __getstate__(self) -> dict[str, Any]:  # launchers pickle callbacks into their workers
        return {"poll_s": self.poll_s, "token": self._token}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(poll_s=state["poll_s"])  # type: ignore[misc]
        self._token = state.get("token", "")
        name_config_write_errors()  # in the launcher's worker, which unpickles this

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """In the job's process (a launcher's worker), before the run: its dir is this
        sweep's from now on. A single run (no sweep, so no token) is not marked."""
        from hydra.core.hydra_config import HydraConfig

        _JOB_SWEEP[:] = [self._token] if self._token else []
        if not self._token:
            return
        # a dir the run cannot write either: its own error says so. The run marks it again
        # under its lock (`mark_job_locked`); this mark names a job that fails before that
        with contextlib.suppress(OSError):
            mark_run(Path(HydraConfig.get().runtime.output_dir), self._token)

    def on_job_end(self, config: DictConfig, **kwargs: Any) -> None:
        _JOB_SWEEP.clear()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # its points are checked and it starts: what their checks warned of prints now, not as
        # the sweep ends (each point's own run holds its own, held_warnings)
        from experiments.common.held_warnings import plan_accepted

        plan_accepted()
        try:
            sweep_dir = Path(str(config.hydra.sweep.dir))
        except OmegaConfBaseException:  # `${nosuch.key}` in it: the launcher fails on it next,
            return  # and that error is the command's one line (hydra would warn of this one)
        total = sweep_size(config)
        # the topmost folder made for the sweep, None where its dir is there: hydra makes them
        # after this callback (a sweep that fails takes them away)
        where = sweep_dir.absolute()
        made = next((p for p in (where, *where.parents) if p.parent.exists()), None)
        made = None if made is None or made.exists() else made
        self._python = workers_ignore_ctrl_c()
        self._t0 = time.perf_counter()
        self._token = secrets.token_hex(8)
        self._stop.clear()
        # a sweep's only: a single run does not import tqdm (and importlib.metadata with it)
        from tqdm import tqdm

        bar = tqdm(
            total=total,
            desc=f"sweep {sweep_dir}",
            unit="run",
            file=bar_stream(),
            dynamic_ncols=True,
            mininterval=1.0,
        )
        # the default sweep folder is timestamped: the same command again would start afresh
        here = sweep_dir.resolve()

        def before_last_line() -> None:
            from experiments.common.local_jobs import stop_local_jobs

            stop_local_jobs()  # submitit_local's jobs ignore the signal; joblib's pool is gone
            # the poll thread first: one that was drawing the bar as the last line went out
            # continued that line after it (seen under load)
            self._stop.set()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(timeout=5)
            bar.close()
            remove_if_no_runs(sweep_dir, made)
            if not sweep_dir.exists():  # no run had started: nothing was kept to resume from
                on_interrupt("no run of the sweep had finished; nothing was kept")

        on_interrupt(
            f"finished runs are kept in {here}; to resume, run the same command with "
            f"hydra.sweep.dir={here}",
            before=before_last_line,
        )

        def poll() -> None:
            while not self._stop.wait(self.poll_s):
                done, _ = finished_runs(sweep_dir, self._token)
                if done != bar.n:
                    bar.update(done - bar.n)
            bar.update(finished_runs(sweep_dir, self._token)[0] - bar.n)
            bar.close()

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self._python is not None:  # the wrapper's folder goes, the real python is back
            workers_heed_signals(self._python)
            self._python = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        wall = time.perf_counter() - self._t0
        sweep_dir = Path(str(config.hydra.sweep.dir))
        done, reused = finished_runs(sweep_dir, self._token)
        earlier = f" ({reused} already finished, reused)" if reused else ""
        print(
            f"sweep {sweep_dir}: {done} run(s) finished{earlier}, wall time {wall:.1f} s",
            file=sys.stderr,
        )
        failed = failed_runs(sweep_dir, self._token)
        if failed:  # the last end-of-sweep callback (hydra calls them in reverse), so reports ran
            print(
                f"error: sweep {sweep_dir}: {len(failed)} run(s) failed "
                f"({', '.join(failed)}; see {FAILED} in each)",
                file=sys.stderr,
            )
            sys.exit(2)


class SweepSummary(Callback):
    """At the end of a sweep: collect it, print a short table, and write the HTML report."""

    def __init__(self, report: bool = True) -> None:
        self.report = report

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from experiments.common.ranking import ok_runs, short_table
        from experiments.common.report_page import write_report
        from experiments.common.tables import collect, write_results

        sweep_dir = Path(str(config.hydra.sweep.dir))
        df, problems = collect(sweep_dir)
        for p in problems:
            print(f"skipped: {p}", file=sys.stderr)
        if df.empty:
            print(f"sweep {sweep_dir}: no finished runs", file=sys.stderr)
            return
        write_results(df, sweep_dir)
        print(short_table(df))
        if self.report and ok_runs(df).empty:
            print(f"no report: every run under {sweep_dir} is infeasible", file=sys.stderr)
        elif self.report:
            page = write_report(sweep_dir, sweep_dir / "report", df=df, problems=problems)
            print(f"report: {page}")
