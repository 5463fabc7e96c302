"""Tables the commands share: a sweep's run dirs flattened into one results table (what `collect`
writes and `report` reads), planner display names, and markdown tables."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from core.args import naming, output_dir, refuse_theirs
from core.bubbles import top_cause
from core.errors import MoepipeError, cannot_read
from core.files import broken_link, cannot_write, clear_leftovers, read_small, read_summary_json
from core.lazy import lazy_module
from core.routing import peek_suffix
from core.shown import fixed, short_of
from core.yaml_size import UniqueKeyLoader, check_yaml_size, yaml_problem
from experiments.common.deferred import written_together
from experiments.common.dir_lock import dir_locked
from experiments.common.run_config import REPEATED, config_disagrees, flatten
from experiments.common.run_config import short as _short
from experiments.common.run_dir import OUTPUTS_BUSY, edited_since_run
from experiments.common.summary_keys import plan_problem

if TYPE_CHECKING:
    import pandas as pd
else:
    pd = lazy_module("pandas")


def markdown(df: pd.DataFrame, index: bool = False) -> str:
    """A DataFrame as a GitHub markdown table (without the optional `tabulate` dependency)."""
    d = df.reset_index() if index else df
    fmt = lambda v: fixed(v, 3) if isinstance(v, float) else str(v)  # noqa: E731
    head = [" / ".join(map(str, c)) if isinstance(c, tuple) else str(c) for c in d.columns]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in d.itertuples(index=False)]
    return "\n".join(rows)


RESULTS = "results"
RESULTS_START = b"run_dir,"  # how every results.csv write_results writes begins
PARQUET_START = b"PAR1"  # how every parquet file begins


def refuse_their_results(folder: Path, key: str) -> None:
    """A MoepipeError naming `key` where `folder`'s results.csv or results.parquet, which a
    command is to replace, is not one that write_results wrote: the user's, which it would lose."""
    refuse_theirs(folder / f"{RESULTS}.csv", key, RESULTS_START)
    refuse_theirs(folder / f"{RESULTS}.parquet", key, PARQUET_START)


SYSTEM = "system"  # a run's planner as every table, figure and log names it (display_name)


CONF = Path(__file__).resolve().parents[2] / "conf"  # conf/planner/<choice>.yaml


def run_dirs(sweep_dir: Path) -> list[Path]:
    """Directories that are (or were about to be) runs: hydra's .hydra/, a config or a summary,
    found in one walk of the sweep. A run dir linked into it (ln -s) is one too (the walk does
    not follow links: a loop would never end), and a link leading nowhere (named). A hidden folder
    is no run, nor is anything under one: hydra's record (.hydra/, with the kept record of a
    run's result inside), a run's staging (`.partial-*`) or its earlier result set aside while
    the new one moves in (`.previous`), which a killed run leaves until the next run there puts
    it back."""
    marks = ("summary.json", "config.yaml", ".hydra")
    found = []
    for top, dirs, files in os.walk(sweep_dir):
        here = Path(top)
        if any(m in dirs or m in files for m in marks):
            found.append(here)
        linked = [here / n for n in dirs if not n.startswith(".") and (here / n).is_symlink()]
        found += [d for d in linked if any((d / m).exists() for m in marks)]
        gone = (here / n for n in files if not n.startswith(".") and n not in marks)
        # a run dir's own dead link (its trace.parquet) is no run dir linked in: read_run's
        found += [p for p in gone if here not in found and p.is_symlink() and not p.exists()]
        dirs[:] = [n for n in dirs if not n.startswith(".")]
    for d in found:  # what killed writers left half done goes (as the next writer would)
        clear_leftovers(d)
    return sorted(set(found))


def read_run(run: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(row, None) for a finished run, (None, what is missing) otherwise. A run dir with
    failed.txt beside summary.json is a finished run's folder whose later run (another config,
    in a sweep) failed: that run kept the earlier result, and the point is failed, as the
    sweep's end line said."""
    if broken_link(run):
        return None, f"not a run dir{broken_link(run)}; point the link at one, or remove it"
    summary_path = run / "summary.json"
    failed = _failed(run)
    if failed and summary_path.exists():
        return None, (
            f"{failed}; summary.json beside failed.txt is an earlier run's, kept: delete "
            "failed.txt to collect that one"
        )
    if failed:
        return None, failed
    if broken_link(summary_path):  # a link there, to nowhere: no unfinished run's doing
        return None, f"summary.json unreadable{broken_link(summary_path)}; point it at the file"
    if not summary_path.exists():
        return None, "no summary.json (unfinished or interrupted; run the sweep again to finish)"
    rerun = "delete it and run the sweep again (finished points are reused)"
    try:
        summary = read_summary_json(summary_path, fix=rerun)
    except MoepipeError as e:  # a folder, FIFO or device in its place: refused, not read
        return None, f"summary.json unreadable ({str(e).removeprefix(f'{summary_path}: ')})"
    except json.JSONDecodeError as e:  # a run killed while it wrote the file
        return None, f"summary.json unreadable (not JSON: {e.msg}, line {e.lineno}); {rerun}"
    except UnicodeDecodeError:
        return None, f"summary.json unreadable (not UTF-8 text); {rerun}"
    except RecursionError:  # json's parser recurses per bracket
        return None, f"summary.json unreadable (nested too deeply for JSON); {rerun}"
    except OSError as e:  # a folder of that name, no permission
        return None, f"summary.json unreadable ({_why(e)}); check that file"
    if not isinstance(summary, dict):
        what = f"a JSON {type(summary).__name__}, not an object"
        return None, f"summary.json unreadable ({what}); {rerun}"
    config, why = _run_config(run, rerun)
    if config is None:
        return None, why
    if "status" not in summary and "throughput_tok_s" not in summary:
        return None, "summary.json has no metrics"
    lacking = summary_lacks(summary)
    if lacking:  # a summary of another version, or cut by hand: no row the table can show
        return None, f"summary.json {lacking}; {rerun}"
    ok = summary.get("status", "ok") == "ok"
    if ok:
        check_metrics(summary, summary_path, identities=False)
    label = str(summary.get("planner_label", ""))
    # (routing_fields: read back against config.yaml; its text, `routing`, is the column)
    left = (*REPEATED, "planner_label", "routing_fields")
    metrics = {k: v for k, v in summary.items() if k not in left}
    # a repeated key under its config column's name, kept where the config lacks that column
    repeated = flatten({REPEATED[k]: v for k, v in summary.items() if k in REPEATED})
    cfg = flatten(config)
    disagree = config_disagrees(config, summary)
    if disagree:  # an edited config, or a run dir put together by hand
        return None, f"{disagree}: not the config it ran; {rerun}"
    edited = edited_since_run(run, ("summary.json", "config.yaml"))
    if edited:  # a hand-edited metric would be tabulated as the run's (its trace: figures')
        return None, f"{edited}; {rerun}"
    if ok:  # a run dir made by hand (no files.sha256): its metrics must still agree
        check_metrics(summary, summary_path)
    row = {**cfg, **{k: v for k, v in repeated.items() if k not in cfg}, **flatten(metrics)}
    if "model" in summary:  # the model it ran: a real run's or hf_config's, not model='s group
        row["model.name"] = summary["model"]
    row.setdefault("status", "ok")
    row[SYSTEM] = system_of(run, {**row, "planner_label": label})
    row["has_trace"] = (run / "trace.parquet").is_file()  # a folder in its place is none
    return {column_name(k): v for k, v in row.items()}, None


def _run_config(run: Path, rerun: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the run's resolved config.yaml, None), or (None, why it is no run's config). Hydra's
    .hydra/config.yaml, its record from before resolving, stood in for one deleted, unsaid:
    a run dir's config is its config.yaml (the run-dir contract, docs/commands.md)."""
    cfg_path = run / "config.yaml"
    if not (cfg_path.exists() or cfg_path.is_symlink()) and run.name in ("sim", "real"):
        return None, (  # a run again would not write one: `dir=runs` over validate's output
            "no config.yaml: experiments.validate's run of one planner (its sim/ and real/ "
            "keep none); this reads experiments.run's runs: point dir= at a sweep of them"
        )
    if not (cfg_path.exists() or cfg_path.is_symlink()):
        return None, (
            "no config.yaml (the run's resolved config; hydra's .hydra/config.yaml, from "
            "before resolving, is not read in its place); run it again, which writes one"
        )
    try:
        text = read_small(cfg_path, fix=rerun).decode("utf-8")
        check_yaml_size(text, str(cfg_path), rerun)  # a billion laughs: a hang
        config = yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a safe loader)
    except MoepipeError as e:
        return None, f"config.yaml unreadable ({str(e).removeprefix(f'{cfg_path}: ')})"
    except yaml.YAMLError as e:  # a key twice in a mapping too: the later won, unsaid
        problem, line = yaml_problem(e, text)
        at = f"line {line}: " if line else ""
        return None, f"config.yaml unreadable ({at}{problem}); {rerun}"
    except (OSError, UnicodeDecodeError) as e:
        return None, f"config.yaml unreadable ({_why(e)})"
    if not isinstance(config, dict) or not config:  # a run writes a mapping of its keys
        return None, "config.yaml is empty or not a mapping of config keys"
    return config, None


def column_name(key: str) -> str:
    """A results column's name: the dotted key with no spaces (an idle cause such as
    `load expert@h2d` becomes `gpu_idle_causes_s.load_expert@h2d`)."""
    return key.replace(" ", "_")


# summary.json's metrics (core.trace.summarize): finite numbers, each, in a finished run
METRICS = (
    "makespan_s",
    "prefill_s",
    "decode_s",
    "throughput_tok_s",
    "gpu_bubble_s",
    "gpu_bubble_frac",
    "lower_bound_s",
    "efficiency",
    "dag_lower_bound_s",
    "dag_efficiency",
    "tokens_generated",
    "ops",
    "batch_size",
    "n_batches",
    "prompt_len",
    "gen_len",
)


# the metrics that count (tokens, ops, batches, lengths): whole numbers in every run's summary
COUNTS = ("tokens_generated", "ops", "batch_size", "n_batches", "prompt_len", "gen_len")
METRIC_GROUPS = ("busy_s", "bytes_moved", "peak_bytes", "gpu_idle_causes_s")  # {name: number}
# past any run's metric (bytes, ops, tokens, seconds); a figure's axis over 1e308 overflows
MAX_METRIC = 1e30
# summary.json's names, strings where present
TEXTS = ("planner", "model", "planner_label", "executor", "hardware", "routing", "dag_bound_binds")
MAPPINGS = ("plan", "params")  # summary.json's mappings of the planner's own keys
# what every finished run's summary holds: the table's and the report's columns
REQUIRED = ("planner", "model", "makespan_s", "throughput_tok_s")
STATUSES = ("ok", "infeasible")  # a finished run's, and a point too big for its hardware's


def summary_lacks(summary: dict[str, Any]) -> str | None:
    """What a summary.json lacks that every run writes (a key the table needs, a known
    status), in words; None where it lacks nothing."""
    status = summary.get("status", "ok")
    if status not in STATUSES:
        return f"has status {_short(status)}, not one of {', '.join(STATUSES)}"
    if status == "ok":
        missing = [k for k in REQUIRED if k not in summary]
        if missing:
            return f"has no {', '.join(missing)}"
        if "routing" not in summary and "routing_fields" not in summary:  # a hand-made file's
            return (
                "has no routing_fields (the routing it ran, as data, which config.yaml's "
                "workload.routing is checked against)"
            )
    return routing_lacks(summary)


def routing_lacks(summary: dict[str, Any]) -> str | None:
    """Where a summary.json has its routing's text but not its `routing_fields` mapping, which
    config.yaml is checked by (`run_config.routing_disagrees`): an older moepipe's, not to be
    read as agreeing with its config unchecked (collect skips it, a resumed run runs again)."""
    fields = summary.get("routing_fields", _NONE)
    if "routing" not in summary or isinstance(fields, dict):
        return None
    if fields is _NONE:
        return "has routing but no routing_fields (the routing as data; an older moepipe's)"
    return f"has routing_fields {_short(fields)}, not a mapping of the routing's fields"


_NONE = object()  # a key a summary does not hold


def metric_problem(summary: dict[str, Any]) -> tuple[str, str] | None:
    """(key, what it is) of the first entry of a summary that no run writes: a name that is not
    a string, a metric that is not a finite number in [0, MAX_METRIC]; None where there is
    none."""

    def number(v: Any) -> bool:  # an int past a float's range (10**400) is not one either
        if not isinstance(v, int | float) or isinstance(v, bool):
            return False
        try:
            return math.isfinite(v) and v <= MAX_METRIC
        except OverflowError:
            return False

    for key in TEXTS:
        if key in summary and not isinstance(summary[key], str):
            return key, f"{_short(summary[key])}, not a name"
    for key in MAPPINGS:
        if key in summary and not isinstance(summary[key], dict):
            return key, f"{_short(summary[key])}, not a mapping of the planner's keys"
    items = [(k, summary[k]) for k in METRICS if k in summary]
    for group in METRIC_GROUPS:
        values = summary.get(group, {})
        if not isinstance(values, dict):
            return group, f"{_short(values)}, not a mapping of name -> number"
        items += [(f"{group}.{k}", v) for k, v in values.items()]
    for key, value in items:
        if not number(value) or value < 0:
            return key, f"{_short(value)}, not a finite number in [0, {MAX_METRIC:g}]"
        if key in COUNTS and value != int(value):  # a run counts whole batches, tokens, ops
            return key, f"{_short(value)}, must be an integer"
    return _per_layer_problem(summary, number) or plan_problem(summary)


# per-layer metrics the report draws: {MoE layer: number} (JSON keys are strings), or a list
# with null for a layer without one (`plan.` ones are inside the summary's plan)
PER_LAYER_MAPS = ("balancedness_per_layer", "expert_phase_util_per_layer")
PER_LAYER_LISTS = ("plan.prefetch_accuracy_per_layer",)


def _per_layer_problem(summary: dict[str, Any], number: Any) -> tuple[str, str] | None:
    """(key, what it is) of a per-layer metric that is not one: a layer that is no whole
    number, a value that is no finite number >= 0."""
    for key in PER_LAYER_MAPS:
        values = summary.get(key, {})
        if not isinstance(values, dict) or not all(
            str(k).isdigit() and number(v) and v >= 0 for k, v in values.items()
        ):
            return key, f"{_short(values)}, not a mapping of MoE layer -> number >= 0"
    for key in PER_LAYER_LISTS:
        group, _, name = key.partition(".")
        plan = summary.get(group, {})
        values = plan.get(name, []) if isinstance(plan, dict) else []
        if not isinstance(values, list) or not all(
            v is None or (number(v) and v >= 0) for v in values
        ):
            return key, f"{_short(values)}, not a list of numbers >= 0 (null: none) per MoE layer"
    return None


def check_metrics(summary: dict[str, Any], path: Path, identities: bool = True) -> None:
    """A MoepipeError naming `path` and the key when a metric of a finished run's summary is not
    a finite number >= 0 (a string, NaN, infinity, a list, a negative time, rate or count), or,
    with `identities`, disagrees with the metrics it is computed from: such a file was not
    written by a run, and would go into a table or a figure as if it were a result."""
    problem = metric_problem(summary) or (_identity_problem(summary) if identities else None)
    if problem:
        raise MoepipeError(
            f"{path}: {problem[0]} is {problem[1]}; the file is not a run's: delete it and run "
            "that point again"
        )


# summary.json's ratios, as core.trace.summarize computes them: key -> (numerator, denominator)
RATIOS = {
    "throughput_tok_s": ("tokens_generated", "makespan_s"),
    "efficiency": ("lower_bound_s", "makespan_s"),
    "dag_efficiency": ("dag_lower_bound_s", "makespan_s"),
    "gpu_bubble_frac": ("gpu_bubble_s", "makespan_s"),
}


def _identity_problem(summary: dict[str, Any]) -> tuple[str, str] | None:
    """(key, what it is) of a metric that disagrees with the ones it is computed from (a ratio
    not its numerator over the makespan, decode_s not the makespan less prefill_s, no makespan
    for a run of ops), as no run writes them; None where they agree or are absent. The
    metrics' types are checked first (`metric_problem`). A summary with `ops` must hold
    summarize's mappings (busy_s, ...): a table or figure would show them blank."""
    if "ops" in summary:  # written by summarize, with each of these
        for group in METRIC_GROUPS:
            if group not in summary:
                return group, "missing, which every run's summary holds"
    makespan = summary.get("makespan_s")
    if makespan is None:
        return None
    if makespan == 0 and summary.get("ops", 0) > 0:
        return "makespan_s", f"0 for a run of {summary['ops']} ops"
    for key, (num, den) in RATIOS.items():
        if key in summary and num in summary:
            want = summary[num] / summary[den] if summary[den] > 0 else 0.0
            if not math.isclose(summary[key], want, rel_tol=1e-9, abs_tol=1e-12):
                return key, f"{summary[key]!r}, not {num} / {den} ({want!r})"
    if "decode_s" in summary and "prefill_s" in summary:
        want = makespan - summary["prefill_s"]
        if not math.isclose(summary["decode_s"], want, rel_tol=1e-9, abs_tol=1e-12):
            return "decode_s", f"{summary['decode_s']!r}, not makespan_s - prefill_s ({want!r})"
    return None


def check_result(summary: dict[str, Any]) -> None:
    """Before a run writes its summary: a MoepipeError where a metric came out beyond what a
    result can hold (a makespan of 1e297 s from a machine of 1e-300 GB/s), which collect and
    report would refuse afterwards, instead of a result nothing can read."""
    problem = metric_problem(summary)
    if problem:
        raise MoepipeError(
            f"the run's {problem[0]} came out as {problem[1]}: its hardware, model or workload "
            "holds a value beyond what the simulator models; check them"
        )


def _why(e: Exception) -> str:
    if isinstance(e, UnicodeDecodeError):
        return "not UTF-8 text"
    return str(getattr(e, "strerror", None) or e)


def display_name(choice: str | None, planner: str, planner_label: str = "") -> str:
    """The one name a run's planner goes by in run logs, run dirs, tables and figures: its
    config's name (conf/planner/<choice>.yaml: the registry key, or a variant of it such as
    klotski_at_n, whose planner is `klotski`), else the planner's registry key; a run that
    peeked at the routing says so (an upper bound, or not: `peek_suffix` of its label)."""
    return (choice or planner) + peek_suffix(planner_label)


def system_of(run: Path, row: dict[str, Any]) -> str:
    """A collected run's `display_name`, from the planner choice hydra recorded in its
    .hydra/hydra.yaml (none for a run written without hydra)."""
    planner = str(row.get("planner.name", row.get("planner", "?")))
    if row.get("variant"):  # a replication row's label, e.g. eplb[interval=8]
        return display_name(str(row["variant"]), planner, str(row.get("planner_label", "")))
    try:
        hydra = yaml.safe_load((run / ".hydra" / "hydra.yaml").read_text()) or {}
        choice = str(hydra["hydra"]["runtime"]["choices"]["planner"])
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError):
        choice = None
    if choice is not None and _planner_of_choice(choice) != planner:
        # hydra rewrites .hydra when a run starts: one that failed or was stopped in a finished
        # run's folder left its own choice beside the earlier run's result
        choice = None
    return display_name(choice, planner, str(row.get("planner_label", "")))


def run_line(name: str, s: dict[str, Any], out_dir: Path | str) -> str:
    """A finished run's line (summary `s` of the run in `out_dir`), each number as it is: a
    10 us makespan 1.04e-05 s, a 99.96% bubble not 100.0% (`core.shown`)."""
    return (
        f"{name} {s['model']} n={s['n_batches']}: {fixed(s['throughput_tok_s'])} tok/s, "
        f"makespan {fixed(s['makespan_s'])} s, "
        f"GPU bubble {short_of(100 * s['gpu_bubble_frac'], '.1f', 0, 100)}% "
        f"(waits on {top_cause(s['gpu_idle_causes_s'])}), "
        f"efficiency {short_of(s['efficiency'], '.3f', 0, 1)} -> {out_dir}"
    )


@functools.lru_cache(maxsize=64)
def _planner_of_choice(choice: str) -> str | None:
    """The registered planner conf/planner/<choice>.yaml runs (None where there is none)."""
    try:
        conf = yaml.safe_load((CONF / "planner" / f"{choice}.yaml").read_text())
        return str(conf["name"])
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError):
        return None


def _failed(run: Path) -> str | None:
    """`failed: LINE`, experiments.run's one line in `run`'s failed.txt for a point's bad
    input (or why it cannot be read); None where there is no failed.txt."""
    failed = run / "failed.txt"
    if not failed.exists():
        return None
    try:  # a FIFO there blocked read_text: collect and report hung
        lines = read_small(failed).decode("utf-8").strip().splitlines() or [""]
    except MoepipeError as e:  # a folder, FIFO or device in its place
        return f"failed (failed.txt unreadable: {str(e).removeprefix(f'{failed}: ')})"
    except (OSError, UnicodeDecodeError) as e:
        return f"failed (failed.txt unreadable: {_why(e)})"
    more = f" (and {len(lines) - 1} more line(s))" if len(lines) > 1 else ""
    return f"failed: {lines[0]}{more}"  # one line, as run writes it


def collect(sweep_dir: str | Path) -> tuple[pd.DataFrame, list[str]]:
    """The sweep's table (one row per finished run, `run_dir` relative to the sweep) and the
    problems found ('<run dir>: <what is missing>')."""
    sweep = Path(sweep_dir)
    rows, problems = [], []
    for run in run_dirs(sweep):
        row, problem = read_run(run)
        rel = str(run.relative_to(sweep))
        if problem:  # a newline in a folder's name split the line that names it
            problems.append(f"{shown(rel)}: {problem}")
            continue
        assert row is not None
        rows.append({"run_dir": rel, **row})
    df = pd.DataFrame(rows)
    if not df.empty:
        df = df.sort_values("run_dir", kind="stable").reset_index(drop=True)
    return df, problems


def csv_of_ours(path: Path, column: str, command: str) -> None:
    """A MoepipeError where the CSV at `path`, which `command` is to replace, has no `column`
    in its header: a collect's or a user's, which it would lose (reproduce_klotski replaced
    one once its runs ended)."""
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            header = f.readline(65536).rstrip("\n").split(",")
    except (FileNotFoundError, IsADirectoryError):
        return
    except OSError as e:
        raise MoepipeError(cannot_read(f"out={path}", e)) from None
    if column not in header:
        raise MoepipeError(
            f"out={path}: a file {command} did not write (it would be lost); pass out= another "
            "folder, or move that file away first"
        )


def write_results(df: pd.DataFrame, out_dir: str | Path) -> tuple[Path, Path]:
    out = output_dir(out_dir, "out")  # one line for a folder that cannot be made
    clean = df.copy()
    for c in clean.columns:  # parquet needs one type per column
        if clean[c].dtype == object and clean[c].map(type).nunique() > 1:
            clean[c] = one_type(clean[c])
    pq, csv = out / f"{RESULTS}.parquet", out / f"{RESULTS}.csv"
    refuse_their_results(out, "out")  # a results file of the user's own, in out=
    for path in (pq, csv):  # checked before either is written
        if path.is_dir():
            raise MoepipeError(
                f"{path}: is a folder, where the results file goes; remove it or pass out= "
                "another folder"
            )
    # each file whole or not there (a full disk left a results.parquet cut short), and the two
    # of one collect: two at once (one while a sweep still ran) left one's beside the other's
    try:
        with dir_locked(out, OUTPUTS_BUSY), written_together(pq, csv) as (pq_tmp, csv_tmp):
            with naming(pq):  # the file that failed, not the last one of the pair
                clean.to_parquet(pq_tmp, index=False)
            with naming(csv):
                clean.to_csv(csv_tmp, index=False)
    except OSError as e:
        raise MoepipeError(cannot_write(str(e.filename or out), e)) from None
    return pq, csv


def one_type(col: pd.Series) -> pd.Series:
    """A column of mixed types as parquet can hold it: true/false where some runs lack the key
    as pandas' nullable boolean (it became the strings 'true' and 'NaN'); otherwise a missing
    value as None and anything but a string as JSON."""

    def missing(v: Any) -> bool:
        return v is None or (isinstance(v, float) and math.isnan(v))

    present = [v for v in col if not missing(v)]
    if present and all(isinstance(v, bool) for v in present):
        return col.map(lambda v: None if missing(v) else v).astype("boolean")
    return col.map(lambda v: None if missing(v) else v if isinstance(v, str) else json.dumps(v))


def skipped_note(sweep: Path, problems: list[str]) -> str:
    """`: FIRST (and N more run dir(s) skipped)`: what a line saying that no run of `sweep` was
    read adds, so that it stays one line; "" when none was skipped."""
    if not problems:
        return ""
    more = f" (and {len(problems) - 1} more run dir(s) skipped)" if len(problems) > 1 else ""
    return f": {sweep / problems[0]}{more}"


def shown(name: str) -> str:
    """A run dir's name as a line shows it: quoted where it holds a newline or another
    character that does not print (one split the line that names it), else as it is."""
    return name if name.isprintable() else repr(name)


def counted(df: pd.DataFrame, problems: list[str]) -> str:
    """`N run(s), M skipped`, and the finished runs whose summary.json lacks a metric every run
    writes now (one of an older moepipe, written before the key was added): kept, a result,
    with the runs and the keys named, as their columns in the table are empty."""
    said = f"{len(df)} run(s), {len(problems)} skipped"
    ok = df[df["status"] == "ok"] if "status" in df.columns else df.iloc[:0]
    kept = [k for k in METRICS if k not in REPEATED]  # those go under their config column
    lacking = [k for k in kept if k not in ok.columns or ok[k].isna().any()]
    if ok.empty or not lacking:
        return said
    older = ok[ok.reindex(columns=lacking).isna().any(axis=1)]
    first = str(older["run_dir"].iloc[0])
    return (
        f"{said}, {len(older)} with an older summary.json "
        f"({shown(first)}/"
        f"summary.json ...) without {', '.join(lacking)}: kept, those columns empty there"
    )


def load_sweep(given: str | Path) -> tuple[pd.DataFrame, list[str]] | None:
    """`collect` for the CLIs: one line on stderr per skipped run, naming its folder; None after
    one `error: ` line if `given` is empty (Path("") is the current folder) or no folder, holds
    no finished run (the line names the first skipped one), or holds a summary.json with a
    metric that is not a number."""
    from experiments.common.held_warnings import say_line

    if not str(given).strip():
        say_line(f"dir={str(given)!r}: an empty path; pass dir=<the sweep folder>")
        return None
    sweep_dir = Path(given)
    if not sweep_dir.is_dir():
        say_line(f"dir={sweep_dir}: not a folder{broken_link(sweep_dir)}; pass a sweep's folder")
        return None
    try:
        df, problems = collect(sweep_dir)
    except MoepipeError as e:  # a summary.json that no run wrote
        say_line(e)
        return None
    if df.empty:
        first = skipped_note(sweep_dir, problems) or "; run a sweep into it first"
        say_line(f"no finished run under {sweep_dir}{first}")
        return None
    say_skipped(sweep_dir, problems)
    return df, problems


def say_skipped(sweep: Path, problems: list[str]) -> None:
    """One line on stderr per run dir of `sweep` that `collect` skipped, naming its folder:
    the words collect, report, replication and replication_cv print."""
    for p in problems:
        print(f"skipped {sweep / p}", file=sys.stderr)
