"""One run: plan a workload with a planner, execute it (simulator or real), write the run dir.

Usage:
    python -m experiments.run model=mixtral-8x7b hardware=rtx3090-env1 workload=paper
        planner=flexgen workload.n_batches=15 executor=sim  # (one line)
    python -m experiments.run -m planner=sequential,layer_prefetch,flexgen   # a sweep

Writes config.yaml, trace.parquet and, last, summary.json, under the run dir's lock
(.run.lock, `common.dir_lock`), replacing an earlier result only once the new one is whole;
trace.json (Chrome/Perfetto) with `trace_json=true`, or later with
`python -m experiments.trace_json runs=RUN_DIR`. Any failure is one line on stderr and exit 2
(cli.run_command); MOEPIPE_TRACEBACK=1 shows a bug's traceback.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

import experiments
from core.args import checkpoint_folder, checkpoint_folder_line
from core.errors import CapacityError, ConfigError, quoted
from core.files import clear_leftovers
from core.routing import resolve_source
from core.spec import ModelSpec
from core.traces import trace_path
from core.types import RoutingSource
from experiments.common import ep_inputs
from experiments.common.app import hydra_main, remove_if_no_run, running
from experiments.common.callbacks import FAILED, mark_job_locked
from experiments.common.cli import (
    any_error_line,
    exit_command,
    exit_on_unwritable_dir,
    exit_with,
    key_given_twice,
    missing_launcher,
    on_interrupt,
    sweep_experiment_misused,
    until_interrupted,
)
from experiments.common.conf_files import as_typed_path, unquoted
from experiments.common.dir_lock import LOCK, dir_locked
from experiments.common.held_warnings import drop_held, plan_accepted, settle
from experiments.common.hydra_errors import with_key
from experiments.common.launch_line import check_split_over_ranks
from experiments.common.path_values import shell_arg
from experiments.common.pipeline import (
    RunSpec,
    gc_paused,
    simulate_run,
    write_run,
)
from experiments.common.reader_left import guard_stdout
from experiments.common.resolve import run_model_name, run_spec
from experiments.common.run_checks import (
    check_no_chdir,
    check_point,
    check_routing_overrides,
    run_model,
)
from experiments.common.run_dir import (
    CODE,  # noqa: F401  (tests and tools read a run dir's code version under this name)
    finished,
    replace_run,
    restore_hydra_record,
    restore_previous,
    stamp,
    write_texts,
)
from experiments.common.schema import RunSchema
from experiments.common.tables import display_name, run_line
from experiments.common.typed_values import with_typed
from experiments.common.unused_n import warn_unused_n_batches

log = logging.getLogger(__name__)


def execute(cfg: DictConfig, out_dir: Path) -> dict:
    check_no_chdir()
    spec = run_spec(cfg)  # bad input fails here, before a finished run's summary is touched
    files = first_read(cfg, spec)
    check_split_over_ranks(spec.executor, bool(OmegaConf.select(cfg, "executor.distributed")))
    check_not_model_folder(cfg, out_dir)  # first: the worst place to write a run
    check_routing_overrides(cfg, spec)
    config_yaml = config_text(cfg, spec)
    if cfg.get("skip_finished", True) and finished(out_dir, config_yaml):
        log.info("%s already finished with this config and code; skipping", out_dir)
        return json.loads((out_dir / "summary.json").read_text())
    # An older run's summary stays until this run's files are whole (write_run replaces it,
    # with its config.yaml, only then): killed or failed, the dir holds the older result whole.
    if spec.executor == "sim":
        # Python's cycle collector stays off until the run's ops and trace are freed (when
        # `simulated` returns): on again while they live, its next collection would walk the
        # million objects of a large run (a tenth of a second), and free none of them.
        with gc_paused():
            s = simulated(cfg, spec, out_dir, config_yaml)
    else:
        from experiments.common.real_run import real_run  # torch is imported only for real runs

        result = real_run(spec, cfg, files, plan_accepted)
        if result is None:  # a torchrun rank other than 0: rank 0 writes the run
            return {}
        write_run(out_dir, result, stamp(config_yaml), chrome=bool(cfg.get("trace_json", False)))
        s = result.summary
    plan_accepted()  # the warnings held back (held_warnings), before the run's own
    warn_unused_n_batches(spec, s["n_batches"])
    choice = HydraConfig.get().runtime.choices.get("planner") if HydraConfig.initialized() else None
    choice = s.get("variant") or choice  # a replication row's label, e.g. eplb[interval=8]
    log.info("%s", run_line(display_name(choice, s["planner"], s["planner_label"]), s, out_dir))
    return s


def simulated(cfg: DictConfig, spec: RunSpec, out_dir: Path, config_yaml: str) -> dict:
    """A simulated run, written to `out_dir`; its summary."""
    kept = _kept()  # where the simulator's streams go, not freed, as its result (kept_to_exit)
    if ep_inputs.block(cfg):  # held-out routing, training tables
        with ep_inputs.named_as_written(cfg, spec.planner):
            spec, routing = ep_inputs.prepare(cfg, spec, out_dir)
            result = simulate_run(spec, routing, on_planned=plan_accepted, keep=kept)
        ep_inputs.annotate(result, cfg, spec, routing)
    else:
        result = simulate_run(spec, on_planned=plan_accepted, keep=kept)
    write_run(out_dir, result, stamp(config_yaml), chrome=bool(cfg.get("trace_json", False)))
    kept_to_exit(result)
    return result.summary


# A single run's result, where the command ends without freeing it (`common.cli.leave`)
_KEPT: list[object] = []


def _kept() -> list[object] | None:
    """`_KEPT` where this process is a single run's command, else None."""
    return _KEPT if experiments.AS_COMMAND and HydraConfig.get().mode == RunMode.RUN else None


def kept_to_exit(result: object) -> None:
    """Keep a single run's result (its schedule's ops, its trace) to the command's end, which
    discards the process's memory whole: freeing the ops one by one took 0.03 s of a 178k-op
    run. The collector walks none of it (frozen, as the imports' objects are). A sweep's
    points, or a run in a process that goes on (a test's), are freed as they end."""
    if (kept := _kept()) is not None:
        gc.freeze()
        kept.append(result)


def first_read(cfg: DictConfig, spec: RunSpec) -> dict | None:
    """A real run's checkpoint files as they are before the run first reads its config.json
    (to check its options and record its model), which the run compares at its end: a rewrite
    between that read and the run's own load was not compared. None for a simulated run."""
    if spec.executor != "real" or not cfg.get("checkpoint"):
        return None
    from experiments.common.real_run import checkpoint_files  # torch: only for real runs

    return checkpoint_files(cfg.checkpoint)


def config_text(cfg: DictConfig, spec: RunSpec | None = None) -> str:
    """What a run dir's config.yaml holds, finished or infeasible: the resolved config and the
    version of the model files and routing trace it reads (`spec`: cfg's, where known)."""
    spec = spec or run_spec(cfg)
    model = run_model(cfg, spec)
    return OmegaConf.to_yaml(cfg, resolve=True) + model_files_line(cfg) + trace_line(spec, model)


def trace_line(spec: RunSpec, model: ModelSpec) -> str:
    """A comment line for config.yaml naming the version (size, mtime) of the routing trace a
    run reads, where its routing is the trace's: a trace rebuilt at the same `trace_dir` makes
    a finished run run again. Empty for synthetic routing, or a trace that is not there (the
    run then fails naming it)."""
    if resolve_source(model, spec.workload.routing.source) != RoutingSource.TRACE:
        return ""
    path = trace_path(spec.workload.routing.trace_dir)
    try:
        st = path.stat()
    except OSError:
        return ""
    return f"# routing trace {path}: {_version(path, st)}\n"


def _version(path: Path, st: os.stat_result | None = None) -> str:
    """A file's version without reading it whole: size, mtime and ctime (which an edit in place
    that puts the mtime back, cp -p or touch -r, still moves; no user tool sets it)."""
    st = st or path.stat()
    return f"size {st.st_size} mtime {st.st_mtime_ns} ctime {st.st_ctime_ns}"


def _readable_version(path: Path) -> str:
    """`_version`, or why a file cannot be stat'ed (a dangling symlink), which the checkpoint's
    reader says or ignores (a generation_config.json, as transformers does)."""
    try:
        return _version(path)
    except OSError as e:
        return f"unreadable ({e.strerror})"


def check_not_model_folder(cfg: DictConfig, out_dir: Path) -> None:
    """A ConfigError where the run dir is the folder the run reads its model from: its files
    went beside the weights, and its tokens.safetensors, a weight file to `model_files_line`,
    changed the model's version at every run (a finished run never counted as finished)."""
    real = cfg.executor.get("name") == "real" and cfg.get("checkpoint")
    key = "checkpoint" if real else "model.hf_config"
    path = cfg.get("checkpoint") if real else cfg.model.get("hf_config")
    if path and _hf_config_file(path).parent.resolve() == out_dir.resolve():
        raise ConfigError(
            f"hydra.run.dir={out_dir}: the folder of {key}={path}, whose files a run's would "
            "mix with; pass hydra.run.dir= another folder"
        )
    if checkpoint_folder(out_dir):  # another model's: the run's files would go among its own
        raise ConfigError(checkpoint_folder_line(out_dir, "hydra.run.dir", "a run's"))


def _hf_config_file(path: object) -> Path:
    """`core.hf_config.hf_config_file` of `path`, imported only for a model read from a folder:
    the Hugging Face config reader's modules (5 ms of start-up) are of no run from conf/model."""
    from core.hf_config import hf_config_file

    return hf_config_file(str(path))


def model_files_line(cfg: DictConfig) -> str:
    """A comment line for config.yaml naming the version of the files a run reads its model
    from (a real run's checkpoint, `model.hf_config`): a checkpoint rebuilt at the same path
    makes a finished run run again. config.json's bytes, and the version (`_version`) of each
    other file a real run reads (`read_files`: generation_config.json too, whose rewrite
    reused a run of the earlier decoding); for `model.hf_config`, config.json's alone (a
    simulation reads no other file). Empty for a model from conf/model."""
    real = cfg.executor.get("name") == "real" and cfg.get("checkpoint")
    path = cfg.checkpoint if real else cfg.model.get("hf_config")
    if not path:
        return ""
    config = _hf_config_file(path)
    h = hashlib.sha256(config.read_bytes() if config.is_file() else b"")
    if real:  # the files it reads: a stray weights file beside them is read by no one
        from experiments.common.real_run import read_files  # (torch: a real run's only)

        for name in read_files(config.parent):  # the index, the weights, generation settings
            if name != config.name:
                h.update(f"{name} {_readable_version(config.parent / name)}\n".encode())
    return f"# model files {config.parent}: {h.hexdigest()[:16]}\n"


@contextmanager
def locked(out_dir: Path) -> Iterator[None]:
    """Hold `out_dir`'s lock (`dir_lock`; a single run took it before hydra made the dir): a
    second run into the same dir waits for the first to end (then finds its result, or
    replaces it), so no run dir holds one run's summary beside another's trace. Hidden folders
    a killed run left half-written go once the lock is held."""
    with dir_locked(out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
        clear_leftovers(out_dir)  # a killed report's outputs set aside come back
        for partial in out_dir.glob(".partial-*"):  # (a dead writer's, as the lock is ours)
            if not partial.name.endswith("-earlier"):
                shutil.rmtree(partial, ignore_errors=True)
        restore_previous(out_dir)
        mark_job_locked(out_dir)  # a sweep's job: the result it finds now is the one it reuses
        yield


def main(argv: list[str] | None = None) -> int:
    """The command: conf/config.yaml with `argv`'s overrides (default sys.argv[1:])."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # joblib's loky replaces a sweep worker whose memory grew past its leak threshold (a worker
    # keeps its last routing: pipeline.last_routing) and warns over two lines, though the
    # worker left cleanly and its queued runs go to the new one
    warnings.filterwarnings(
        "ignore", message="A worker stopped while some jobs were given", category=UserWarning
    )
    from experiments.common.launch_line import launched

    if launched():  # one rank of torchrun's, whose agent stops the others when one fails
        from experiments.common.dist_run import stop_on_sigterm

        stop_on_sigterm(int(os.environ["RANK"]))
    problem = (
        key_given_twice(argv)
        or sweep_experiment_misused(argv)
        or missing_launcher(argv)
        or misplaced_output(argv)
    )
    if problem:
        from experiments.common.launch_line import say_error

        say_error(f"error: {problem}")  # under torchrun: once, not once a rank
        return 2
    exit_on_unwritable_dir(argv, ("hydra.run.dir", "hydra.sweep.dir"))
    running(RunSchema, check_point)
    return int(
        until_interrupted(
            lambda: hydra_main(
                task,
                "config",
                argv,
                __doc__,
                ["hydra.job.name=run"],
                ["hardware", "model", "workload"],
            )
        )
    )


def misplaced_output(argv: Sequence[str]) -> str | None:
    """A hydra key that would put a run's files where the user does not look, taken without a
    word: `hydra.run.dir` in a sweep (-m), which writes under hydra.sweep.dir (the sweep went to
    multirun/<date>/ in the current folder); `hydra.job.name=../x` (its log, <name>.log, went
    beside the run dir); `hydra.output_subdir` (the record a failed rerun puts back is .hydra).
    None otherwise, and where nothing runs (--cfg, --help)."""
    nothing_runs = ("--cfg", "-c", "--help", "-h", "--info", "-i", "--hydra-help")
    if any(a in nothing_runs or a.startswith(("--shell-completion", "-sc")) for a in argv):
        return None
    # each value as hydra reads it (`hydra.run.dir='/a b/é'` is the folder /a b/é), for the line
    given = {k.lstrip("+"): unquoted(v) for k, sep, v in (a.partition("=") for a in argv) if sep}
    multirun = any(a in ("-m", "--multirun") for a in argv)
    sweep = multirun or given.get("hydra.mode") == "MULTIRUN"
    if sweep and "hydra.run.dir" in given and "hydra.sweep.dir" not in given:
        run_dir = given["hydra.run.dir"]
        return (
            f"hydra.run.dir={quoted(run_dir)}: a single run's folder, which a sweep (-m) does not "
            f"use; pass {shell_arg(f'hydra.sweep.dir={as_typed_path(run_dir)}')}"
        )
    if not sweep and "hydra.sweep.dir" in given and "hydra.run.dir" not in given:
        sweep_dir = given["hydra.sweep.dir"]
        return (
            f"hydra.sweep.dir={quoted(sweep_dir)}: a sweep's folder, which a single run (no -m) "
            f"does not use; pass {shell_arg('hydra.run.dir=' + as_typed_path(sweep_dir))}, or "
            "add -m"
        )
    name = given.get("hydra.job.name")
    if name is not None and "$" not in name and not re.fullmatch(r"[\w.+-]+", name):
        return (
            f"hydra.job.name={name}: it names the run's log file (<name>.log in the run's "
            "folder); pass letters, digits, '_', '-', '+' and '.', or leave it out"
        )
    sub = given.get("hydra.output_subdir")
    if sub is not None and sub not in (".hydra", "null"):
        return (
            f"hydra.output_subdir={sub}: a run keeps hydra's record in .hydra (a rerun that fails "
            "puts the finished run's record back from there); leave it out"
        )
    return None


def _in_pool_worker() -> bool:
    """This process is a worker of a launcher's pool (joblib's). multiprocessing, imported here:
    a single run, which never asks, starts without it."""
    import multiprocessing

    return multiprocessing.current_process().name != "MainProcess"


def task(cfg: DictConfig) -> None:
    """One run, or one point of a sweep."""
    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    if hc.mode != RunMode.MULTIRUN:
        on_interrupt(
            f"the run in {out_dir} did not finish (a run is not resumed: the same "
            "command runs it whole)",
            written=f"the run in {out_dir} had finished: its result is whole there",
        )
    elif _in_pool_worker():
        # A launcher's pool worker (joblib's) leaves Ctrl-C to the sweep's process, which stops
        # the pool and says how to resume; the worker's own KeyboardInterrupt traceback would
        # only come before that line. It dies with the sweep's process (a kill -9 of it left
        # the workers running).
        from experiments.common.callbacks import tracker_python_in_worker
        from experiments.common.pool import die_with_parent

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        die_with_parent()
        tracker_python_in_worker()
        guard_stdout()  # its log lines once the sweep's reader has left (`| head -1`)
    # Under torchrun every rank runs this command into the one run dir, which rank 0 alone
    # writes: the other ranks take no lock (waiting on rank 0's, they would never join its
    # process group, and rank 0 would wait for them until the rendezvous timed out).
    lock = nullcontext() if torchrun_rank() > 0 else locked(out_dir)
    with lock:
        try:
            run_point(cfg, out_dir, sweep=hc.mode == RunMode.MULTIRUN)
        except BaseException:  # failed, stopped: the earlier result keeps its hydra record
            if torchrun_rank() == 0:
                restore_hydra_record(out_dir)
            raise
        if (out_dir / FAILED).exists() and torchrun_rank() == 0:  # a sweep's failed point
            restore_hydra_record(out_dir)


def torchrun_rank() -> int:
    """This process's rank in a torchrun launch of G > 1 processes; 0 outside one."""
    from experiments.common.launch_line import launched

    return int(os.environ["RANK"]) if launched() else 0


def run_point(cfg: DictConfig, out_dir: Path, sweep: bool) -> None:
    """One run into `out_dir`. Alone, an expected failure (bad input, an OSError, a config
    that does not resolve) is one line and exit 2; in a sweep it is recorded in failed.txt and
    the sweep goes on."""
    (out_dir / FAILED).unlink(missing_ok=True)  # an earlier try's bad input, retried now
    try:
        execute(cfg, out_dir)
    except CapacityError as e:
        if not sweep:
            remove_if_no_run(out_dir, [FAILED, LOCK])
            exit_with(e)
        # In a sweep an infeasible point (too big a batch for the GPU) is a finished result,
        # recorded so the sweep goes on, a re-run skips it and reports show it as a gap.
        drop_held()  # the point's warnings: its refusal is all it says
        log.warning("infeasible: %s", e)
        infeasible = {"status": "infeasible", "error": str(e), "model": run_model_name(_root_=cfg)}
        replace_run(out_dir, infeasible, lambda tmp: write_texts(tmp, stamp(config_text(cfg))))
    except Exception as e:
        e = with_key(e, cfg)  # a value read without its key (an interpolation that fails)
        if not sweep:
            remove_if_no_run(out_dir, [FAILED, LOCK])
            exit_with(e)
        # In a sweep a bad point must not stop the others (a worker's exit kills the launcher's
        # pool, and with it the runs in flight): it is recorded, the sweep goes on, and the sweep
        # exits 2 at its end (SweepProgress) naming the failed runs. An unexpected error is
        # recorded too, with the file holding its traceback.
        line = with_typed(any_error_line(e))  # a swept value as typed (`1e300`, not 1e+300)
        said = line.removeprefix(f"{out_dir}: ")  # an OSError's line names the dir already
        settle(e)  # the point's warnings, before its line
        print(f"error: run {out_dir}: {said}", file=sys.stderr)
        (out_dir / FAILED).write_text(f"{line}\n")


if __name__ == "__main__":
    exit_command(main)
