"""Expert replication experiment (issue 5): four planners at equal replica budget, simulated.

Usage:
    python -m experiments.replication [replica_slots=1] [out_dir=...]   # conf/experiment/replication.yaml
    python -m experiments.replication split=validation out_dir=...   # choose params without the test split
    python -m experiments.replication split=fold3 out_dir=...        # one fold of a 5-fold cross-validation

Writes one run directory per (case, batch size, planner) with summary.json and balance.csv, then
reads them back to print the table and the targets and to plot balancedness / utilisation per
layer, balancedness per batch, throughput per batch size and, for the target cases, balancedness
against makespan (PNG, in out_dir); out_dir/report.txt keeps the printed lines and
out_dir/index.html shows them with the plots.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml
from omegaconf import DictConfig, OmegaConf

from core.args import as_bool
from core.balance import KEYS
from core.cost import CostModel
from core.errors import MoepipeError
from core.routing import Routing, peek_label
from core.spec import HardwareSpec, ModelSpec, RoutingConfig, Workload
from core.synthetic import fit_to_counts, synthetic_routing
from core.traces import EsftTrace, load_esft
from core.types import OpKind, Resource
from experiments.common.app import check_keys, hydra_main, remove_if_no_run, running
from experiments.common.cli import (
    as_int,
    exit_on_unwritable_dir,
    missing_config,
    output_dir,
    print_or_exit,
    run_command,
    until_interrupted,
)
from experiments.common.pipeline import (
    RunResult,
    RunSpec,
    atomic_write_json,
    atomic_write_text,
    code_version,
    simulate_run,
    write_balance,
    write_run,
)
from experiments.common.schema import HardwareSchema, ReplicationOptions
from planners.expert_parallel import DISPATCH, LANE_SHARING
from planners.predictive_replication import transition_counts
from planners.registry import expert_parallel_names, param_names

log = logging.getLogger(__name__)
CONF = Path(__file__).resolve().parent.parent / "conf"
ROUTINGS = ("esft_heldout", "synthetic_olmoe_top1")  # a case's routing
CASE_KEYS = {  # the keys every case sets
    "model", "routing", "n_devices", "lanes", "batch_sizes", "prompt_len", "n_batches",
}  # fmt: skip
CASE_OPTIONAL = {"lane_sharing", "grouped_gemm", "variants", "planners"}  # and those it may set
# params naming a file a run reads
FILE_PARAMS = ("initial_load", "table", "prior_scenarios", "task_load")


SPLITS = {"test": 0, "validation": 1, "fold1": 1, "fold2": 2, "fold3": 3, "fold4": 4}
# split -> the seq_id % 5 residue of its sequences


def residue(split: str) -> int:
    """The seq_id % 5 residue of `split`'s sequences; a one-line error for an unknown split."""
    if split not in SPLITS:
        raise MoepipeError(f"split={split!r} unknown; valid: {', '.join(SPLITS)}")
    return SPLITS[split]


def split_index(tr: EsftTrace, seed: int, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Token indices into the trace: `split`'s evaluation stream (its sequences in shuffled order,
    each in position order) and its training tokens (see `esft_split`)."""
    r = residue(split)
    held = tr.seq_id % 5 == r
    train = ~held if split.startswith("fold") else (tr.seq_id % 5 != SPLITS["test"]) & ~held
    keys = np.unique(tr.seq_key[held])
    order = np.random.default_rng(seed).permutation(keys)
    rank = {int(k): i for i, k in enumerate(order)}
    idx = np.flatnonzero(held)
    idx = idx[np.lexsort((tr.pos[idx], [rank[int(k)] for k in tr.seq_key[idx]]))]
    return idx, np.flatnonzero(train)


def esft_split(trace_dir: str, seed: int, split: str = "test") -> tuple[np.ndarray, np.ndarray]:
    """The evaluation token stream of `split` (its sequences in shuffled order) and training ids.

    "test": sequences with seq_id % 5 == 0 (the trace README's held-out split), trained on the
    rest. "validation": seq_id % 5 == 1, trained on the sequences in neither, so that params can
    be chosen without ever running the test sequences. "fold1".."fold4": seq_id % 5 == K,
    trained on every other sequence; with "test" as fold 0 they are a 5-fold cross-validation,
    which shows how much the choice of split moves a figure (run them after choosing params).
    Returns eval ids [T_eval, L, k] and train ids [T_train, L, k].
    """
    tr = load_esft(trace_dir, trace_dir_flag="trace_dir")
    idx, train = split_index(tr, seed, split)
    return tr.expert_ids[idx].astype(np.int16), tr.expert_ids[train].astype(np.int16)


def esft_tasks(
    trace_dir: str, seed: int, split: str = "test"
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """Each evaluation token's task [T_eval] (in `esft_split`'s order), the training split's load
    per task [K tasks, L, E] (predictive's `task_load`), and the task names."""
    tr = load_esft(trace_dir, trace_dir_flag="trace_dir")
    idx, train = split_index(tr, seed, split)
    per_task = np.stack(
        [
            load_matrix(tr.expert_ids[train[tr.task[train] == k]], 64)
            for k in range(len(tr.task_names))
        ]
    )
    return tr.task[idx].astype(np.int16), per_task, tr.task_names


def esft_group_loads(trace_dir: str, split: str = "test") -> np.ndarray:
    """[S, L, E] expert loads of each group of `split`'s training sequences that is the size of a
    held-out split (the sequences of one seq_id % 5 residue): how much a split's load differs
    from another's, for predictive's `prior_scenarios` (its gate's hedge before any batch)."""
    held = residue(split)
    tr = load_esft(trace_dir, trace_dir_flag="trace_dir")
    residues = [
        r for r in range(5) if r != held and (split.startswith("fold") or r != SPLITS["test"])
    ]
    n_layers, e = tr.expert_ids.shape[1], 64
    out = np.zeros((len(residues), n_layers, e))
    for i, r in enumerate(residues):
        ids = tr.expert_ids[tr.seq_id % 5 == r]
        for m in range(n_layers):
            out[i, m] = np.bincount(ids[:, m].ravel(), minlength=e)
    return out


def esft_routing(
    eval_ids: np.ndarray,
    wl: Workload,
    split: str = "test",
    tasks: np.ndarray | None = None,
    task_names: tuple[str, ...] = (),
) -> Routing:
    """Consecutive prompt_len windows of the evaluation stream (wrapping) as the workload's
    sequences; with `tasks` [T_eval], each token labelled with its sequence's task."""
    s, p = wl.n_sequences, wl.seq_positions
    take = np.arange(s * p) % len(eval_ids)
    ids = eval_ids[take].reshape(s, p, *eval_ids.shape[1:])
    labels = None if tasks is None else tasks[take].reshape(s, p)
    return Routing(
        ids,
        np.ones(ids.shape, np.float32),
        64,
        f"esft {split} (seq_id % 5 == {SPLITS[split]}), {len(eval_ids)} tokens",
        labels,
        task_names,
    )


def synthetic_split(model: ModelSpec, wl: Workload, out: Path) -> tuple[Routing, Path, Path]:
    """Twice the workload's sequences from one synthetic generator (one popularity and transition
    structure, as one model has): the first half trains the load matrix and transition table that
    eplb / predictive / oracle start from (as ESFT's training split does), the second half is run."""
    both = synthetic_routing(model, replace(wl, n_batches=2 * wl.n_batches))
    n, e = wl.n_sequences, model.n_experts
    out.mkdir(parents=True, exist_ok=True)
    files = save_training(
        both.expert_ids[:n].reshape(-1, *both.expert_ids.shape[2:]), e, out, "train"
    )
    test = Routing(
        both.expert_ids[n:],
        both.gate_weights[n:],
        e,
        both.description + " (second half; first half trains)",
    )
    return test, *files


def load_matrix(ids: np.ndarray, n_experts: int) -> np.ndarray:
    """[L, E] float64 expert selections of routing ids [T, L, k]."""
    return np.stack(
        [np.bincount(ids[:, m].ravel(), minlength=n_experts) for m in range(ids.shape[1])]
    ).astype(np.float64)


def save_training(
    train_ids: np.ndarray, n_experts: int, out: Path, prefix: str
) -> tuple[Path, Path]:
    """From training routing ids [T, L, k]: the load matrix [L, E] (eplb / predictive / oracle's
    initial_load) and the transition table [L, E, E] (predictive's table), as .npy files."""
    paths = out / f"{prefix}_load.npy", out / f"{prefix}_trans.npy"
    np.save(paths[0], load_matrix(train_ids, n_experts))
    np.save(paths[1], transition_counts(train_ids, n_experts))
    return paths


def prepare(cfg: DictConfig, out: Path) -> dict[str, Any]:
    """ESFT evaluation stream of `cfg.split`, training tables for eplb / predictive, and the
    Switch skew fit."""
    test_ids, train_ids = esft_split(cfg.trace_dir, cfg.seed, str(cfg.split))
    save_training(train_ids, 64, out, "esft_train")  # [26, 64] and [26, 64, 64]
    # the evaluated split's own load [26, 64]: what a variant that knows it in advance packs from
    np.save(out / "esft_eval_load.npy", load_matrix(test_ids, 64))
    np.save(out / "esft_train_groups.npy", esft_group_loads(cfg.trace_dir, str(cfg.split)))
    test_tasks, task_load, task_names = esft_tasks(cfg.trace_dir, cfg.seed, str(cfg.split))
    np.save(out / "esft_train_task_load.npy", task_load)  # [4 tasks, 26, 64]
    counts = None
    switch: dict[int, RoutingConfig] = {}  # by expert count: the skew is fitted at each
    for case in cfg.cases.values():
        if case.routing == "synthetic_olmoe_top1":
            e = case_model(case).n_experts
            if e not in switch:
                if counts is None:
                    counts = olmoe_counts(cfg.trace_dir)
                fit = fit_to_counts(counts, top_k=1, layer_corr=0.5, reuse=0.25, n_experts=e)
                log.info(
                    "switch routing, %d experts: skew %.3f fitted to OLMoE top-1 max/mean %.1f "
                    "(reached %.1f)",
                    e,
                    fit.routing.skew,
                    fit.target["max_over_mean_median"],
                    fit.achieved["max_over_mean_median"],
                )
                switch[e] = fit.routing
    return {
        "test_ids": test_ids,
        "test_tasks": test_tasks,
        "task_names": task_names,
        "switch_routing": switch,
        "train_tokens": len(train_ids),
    }


def olmoe_counts(trace_dir: str) -> np.ndarray:
    """OLMoE's top-1 expert counts, which the Switch cases' synthetic skew is fitted to."""
    path = Path(trace_dir) / "olmoe-aggregates" / "olmoe_mixtral_counts.npz"
    try:
        return np.load(path)["olmoe_counts_top1"]
    except (OSError, KeyError, ValueError) as e:
        raise MoepipeError(
            f"trace_dir={trace_dir}: cannot read {path} ({type(e).__name__}), which the "
            "synthetic_olmoe_top1 cases fit their skew to; point trace_dir at ../shared/traces"
        ) from None


def planner_runs(cfg: DictConfig, case: DictConfig) -> list[tuple[str, str, dict[str, Any]]]:
    """A case's rows (label, planner, own params): the expert-parallel planners in the order of
    the config's `planners:`, then the config's and the case's variants; each planner's params
    are the config's, then the case's `planners:`, then a variant's."""
    case_params = case.get("planners") or {}

    def base(p: str) -> dict[str, Any]:
        return {**dict(cfg.planners[p] or {}), **dict(case_params.get(p) or {})}

    variants = {**(cfg.get("variants") or {}), **(case.get("variants") or {})}
    return [(str(p), str(p), base(str(p))) for p in cfg.planners] + [
        (str(v), str(c.planner), {**base(str(c.planner)), **dict(c.get("params") or {})})
        for v, c in variants.items()
    ]


def run_params(
    cfg: DictConfig,
    name: str,
    case: DictConfig,
    planner: str,
    own: dict[str, Any],
    training: tuple[Path, Path],
    out: Path,
) -> dict[str, Any]:
    """One run's planner params: the case's devices and kernels; for every replication planner
    the same replica budget and training load (`training`: load matrix, transition table); on
    held-out ESFT predictive's hedge and, for `task_mix`, the per-task loads; then `own` (the
    config's, the case's and a variant's params of that planner, in that order), which wins."""
    params: dict[str, Any] = {
        "n_devices": int(case.n_devices),
        "lanes": as_bool(f"cases.{name}.lanes", case.lanes),
        "grouped_gemm": as_bool(
            f"cases.{name}.grouped_gemm", case.get("grouped_gemm", cfg.grouped_gemm)
        ),
        "dispatch": str(cfg.dispatch),
    }
    if case.get("lane_sharing"):
        params["lane_sharing"] = str(case.lane_sharing)
    if "initial_load" in param_names(planner):  # the same budget and training load for all
        params["replica_slots"] = int(cfg.replica_slots)
        params["initial_load"] = str(training[0])
    esft = case.routing == "esft_heldout"
    if "table" in param_names(planner):
        params["table"] = str(training[1])
        if esft and own.get("prior_scenarios", True):
            params["prior_scenarios"] = str(out / "esft_train_groups.npy")
    params.update(own)  # a variant's (or the case's, or the config's planner) params win
    if "task_load" in param_names(planner) and params.get("predictor") == "task_mix" and esft:
        params.setdefault("task_load", str(out / "esft_train_task_load.npy"))
    if not params.get("prior_scenarios", True):
        params.pop("prior_scenarios")
    return params


def routing_sha1(routing: Routing) -> str:
    """What a run reads of its routing: the expert ids and, where it has them, the requests'
    labels (`task_mix` plans from them)."""
    h = hashlib.sha1(routing.expert_ids.tobytes())
    if routing.labels is not None:
        h.update(routing.labels.tobytes())
        h.update(",".join(routing.label_names).encode())
    return h.hexdigest()


def case_model(case: DictConfig) -> ModelSpec:
    return ModelSpec.from_dict(yaml.safe_load((CONF / "model" / f"{case.model}.yaml").read_text()))


# the keys that replace the profile's GPU fields of the same name where set (not null)
GPU_KEYS = ("comm_sms", "copy_sms")


def profile_path(name: str) -> Path:
    """`hardware_profile`: a conf/hardware name, or a hardware FILE.yaml (calibrate's)."""
    return Path(name) if name.endswith((".yaml", ".yml")) else CONF / "hardware" / f"{name}.yaml"


def hardware(cfg: DictConfig) -> HardwareSpec:
    """The `hardware_profile`, with the GPU's `GPU_KEYS` replaced where the config sets them."""
    path = profile_path(str(cfg.hardware_profile))
    raw = yaml.safe_load(path.read_text())
    check_keys(HardwareSchema, raw, str(path))
    for key in GPU_KEYS:
        if cfg.get(key) is not None:
            raw["gpu"] = {**raw["gpu"], key: int(cfg[key])}
    return HardwareSpec.from_dict(raw)


def run_case(
    cfg: DictConfig, name: str, case: DictConfig, prep: dict[str, Any], out: Path
) -> list[dict[str, Any]]:
    model = case_model(case)
    hw = hardware(cfg)
    runs = planner_runs(cfg, case)  # the same at every batch size
    rows = []
    for bs in case.batch_sizes:
        rc = (
            prep["switch_routing"][model.n_experts]
            if case.routing == "synthetic_olmoe_top1"
            else RoutingConfig(source="trace")
        )
        wl = Workload(
            batch_size=int(bs),
            n_batches=int(case.n_batches),
            prompt_len=int(case.prompt_len),
            gen_len=1,
            routing=rc,
            seed=int(cfg.seed),
        )
        if case.routing == "esft_heldout":
            routing = esft_routing(
                prep["test_ids"], wl, str(cfg.split), prep["test_tasks"], prep["task_names"]
            )
            load_file, trans_file = out / "esft_train_load.npy", out / "esft_train_trans.npy"
        else:
            routing, load_file, trans_file = synthetic_split(model, wl, out / name / f"bs{bs}")
        routing.check_fits(model, wl)
        for label, planner, own in runs:
            params = run_params(cfg, name, case, planner, own, (load_file, trans_file), out)
            run_dir = out / name / f"bs{bs}" / label
            spec = RunSpec(model, hw, wl, planner, params)
            # what the run reads: the spec, the routing and the files it names (the training
            # tables are rewritten for each split), and the code
            files = {k: file_sha1(params[k]) for k in FILE_PARAMS if params.get(k)}
            key = {
                "spec": repr(spec),
                "routing": routing_sha1(routing),
                "files": files,
                "traces": bool(cfg.write_traces),
                "code": code_version(),
            }
            if reusable(run_dir, key):
                rows.append({"case": name, **json.loads((run_dir / "summary.json").read_text())})
                continue
            # drop what an earlier run left, or a rerun without traces keeps the old ones
            for old in ("summary.json", KEY, "trace.parquet", "trace.json", "balance.csv"):
                (run_dir / old).unlink(missing_ok=True)
            result = simulate_run(spec, routing)
            wc = work_conserving_s(result, hw)
            if wc is not None:
                result.summary["wc_makespan_s"] = wc
            if label != planner:  # a variant: its own row, beside the four the targets compare
                result.summary.update(
                    planner=label,
                    planner_label=label + peek_label(result.schedule.meta),
                    variant_of=planner,
                )
            if cfg.write_traces:
                write_run(run_dir, result)
            else:  # the per-phase balance without the trace files
                run_dir.mkdir(parents=True, exist_ok=True)
                write_balance(run_dir, result)
            (run_dir / KEY).write_text(json.dumps(key))
            atomic_write_json(run_dir / "summary.json", result.summary)  # last: marks it finished
            rows.append({"case": name, **result.summary})
    return rows


def work_conserving_s(result: RunResult, hw: HardwareSpec) -> float | None:
    """Lanes only: the makespan if each expert phase took just what a work-conserving GPU needs,
    where a lane's kernel may use the SMs idle lanes leave (as kernels of plain CUDA streams do)
    instead of its fixed 1/G: the phase's expert work at the whole GPU's roofline plus one op
    overhead, or its busiest lane's ops at the whole GPU, whichever is longer. What the partition
    adds to a phase beyond that is taken off the makespan, the rest left as it ran: an estimate
    that takes the phases to be on the critical path, as lanes run them between whole-GPU dense
    ops. None off lanes, and on lanes that already share the SMs (lane_sharing=shared)."""
    ep = result.schedule.meta.get("ep") or {}
    if not ep.get("lanes") or ep.get("lane_sharing") == "shared":
        return None
    cost, ops, t = CostModel(hw), result.schedule.ops, result.trace
    ex = t[t["kind"].astype(str) == str(OpKind.EXPERT)]
    if ex.empty:
        return None
    full = np.array(
        [
            cost.compute_s(Resource.GPU, OpKind.EXPERT, ops[i].flops, ops[i].touch_bytes)
            for i in ex["op_id"]
        ]
    )
    overhead = cost.compute_s(Resource.GPU, OpKind.EXPERT, 0.0, 0.0)
    ex = ex.assign(full=full, work=full - overhead)
    g = ex.groupby(KEYS, observed=True)
    span = g["end_s"].max() - g["start_s"].min()
    lane = ex.groupby([*KEYS, "stream"], observed=True)["full"].sum().groupby(level=KEYS).max()
    need = np.maximum(g["work"].sum() + overhead, lane)
    return float(t["end_s"].max() - (span - need).clip(lower=0).sum())


def work_conserving_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One note per lanes case, at its largest batch: ep_static's and predictive's makespans
    and replication's gain as run (each lane 1/G of the SMs) and on a work-conserving GPU
    (`work_conserving_s`): an estimate of how much of the gain the partition itself makes."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows if r.get("wc_makespan_s") is not None):
        bs = max(r["batch_size"] for r in rows if r["case"] == case)
        by = {r["planner"]: r for r in rows if r["case"] == case and r["batch_size"] == bs}
        if not {"ep_static", "predictive_replication"} <= by.keys():
            continue
        st, pr = by["ep_static"], by["predictive_replication"]
        ms = {
            k: 1e3 * v
            for k, v in (
                ("st", st["makespan_s"]),
                ("pr", pr["makespan_s"]),
                ("wst", st["wc_makespan_s"]),
                ("wpr", pr["wc_makespan_s"]),
            )
        }
        out.append(
            f"[note] {case} bs={bs} (lanes): each lane's kernels run on 1/{st['n_devices']} of the SMs; "
            f"if they could use the SMs idle lanes leave (work-conserving), ep_static would take "
            f"about {ms['wst']:.2f} ms, not {ms['st']:.2f}, and predictive {ms['wpr']:.2f}, not "
            f"{ms['pr']:.2f}: replication's gain {1 - ms['pr'] / ms['st']:.1%} -> "
            f"{1 - ms['wpr'] / ms['wst']:.1%}"
        )
    return out


def sharing_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One note per batch size of each case whose lanes share the GPU's SMs (plain CUDA streams),
    against the lanes case of the same model and expert kernels that partitions them: ep_static's and
    predictive's makespans and expert-phase utilisation, and replication's gain, in both."""

    def sharing(r: dict[str, Any]) -> str | None:
        ep = r["plan"]["ep"]
        return str(ep.get("lane_sharing") or "partition") if ep.get("lanes") else None

    out = []
    for r in rows:
        if r["planner"] != "ep_static" or sharing(r) != "shared":
            continue
        mine = {
            x["planner"]: x
            for x in rows
            if x["case"] == r["case"] and x["batch_size"] == r["batch_size"]
        }
        theirs = {
            x["planner"]: x
            for x in rows
            if sharing(x) == "partition"
            and x["model"] == r["model"]
            and x["batch_size"] == r["batch_size"]
            and x["n_devices"] == r["n_devices"]
            and x["plan"]["ep"].get("grouped_gemm") == r["plan"]["ep"].get("grouped_gemm")
        }
        both = {"ep_static", "predictive_replication"}
        if not both <= mine.keys() or not both <= theirs.keys():
            continue
        out.append(
            f"[note] {r['case']} bs={r['batch_size']}: lanes sharing the SMs: {_views(mine)}; "
            f"partitioned ({theirs['ep_static']['case']}): {_views(theirs)}"
        )
    return out


def loop_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One note per run of one lane (n_devices 1 on lanes: every expert's kernel one after another
    on one stream, as the Hugging Face loop the replication paper starts from runs them) against
    the same case's G lanes, without and with replicas: whole-run utilisation, GPUtil's load and
    makespan."""
    out = []
    for r in rows:
        ep = r["plan"]["ep"]
        if not ep.get("lanes") or ep.get("n_devices") != 1:
            continue
        by = {
            x["planner"]: x
            for x in rows
            if x["case"] == r["case"] and x["batch_size"] == r["batch_size"] and x is not r
        }
        if not {"ep_static", "predictive_replication"} <= by.keys():
            continue
        st, pr = by["ep_static"], by["predictive_replication"]
        out.append(
            f"[note] {r['case']} bs={r['batch_size']}: one lane ({r['planner_label']}) -> "
            f"{st['n_devices']} lanes (ep_static) -> with replicas (predictive): utilisation "
            f"{r['utilisation']:.3f} -> {st['utilisation']:.3f} -> {pr['utilisation']:.3f}, "
            f"GPU load {r['gpu_load']:.3f} -> {st['gpu_load']:.3f} -> {pr['gpu_load']:.3f}, "
            f"makespan {1e3 * r['makespan_s']:.2f} -> {1e3 * st['makespan_s']:.2f} -> "
            f"{1e3 * pr['makespan_s']:.2f} ms ({r['makespan_s'] / pr['makespan_s']:.2f}x)"
        )
    return out


def eplb_lines(
    rows: list[dict[str, Any]], cases: Sequence[str], fresh: Mapping[str, int | None] | None = None
) -> list[str]:
    """One note per target case at its fresh batch (`fresh_batch`) and at its largest, where eplb
    runs at more than one interval (the `eplb` row and its variants): eplb's balancedness /
    makespan / copies at each (and the share of the ep_static -> oracle gap it closes, where
    both ran), and whether predictive is at least as balanced as the most balanced of them and
    at least as fast as the fastest. Re-placing more often balances better but moves more
    weights over the links the all-to-all uses; placed once from the training load, eplb shows
    what packing alone closes of the gap, without prediction."""
    out, pairs = [], []
    for case in cases:
        sizes = [r["batch_size"] for r in rows if r["case"] == case]
        if sizes:
            shown = ((fresh or {}).get(case), max(sizes))
            pairs += [(case, bs) for bs in dict.fromkeys(b for b in shown if b)]
    for case, bs in pairs:
        at = [r for r in rows if r["case"] == case and r["batch_size"] == bs]
        eplbs = sorted(
            (r for r in at if "eplb" in r["plan"]), key=lambda r: r["plan"]["eplb"]["interval"]
        )
        pr = next((r for r in at if r["planner"] == "predictive_replication"), None)
        if len(eplbs) < 2 or pr is None:
            continue

        by = {r["planner"]: r for r in at}
        st, orc = by.get("ep_static"), by.get("oracle_replication")
        gap = st["makespan_s"] - orc["makespan_s"] if st and orc else 0.0
        # shares of a gap under 1% of ep_static's time only magnify noise (-19000%): say its size
        wide = bool(st) and gap >= NOISE_GAP * st["makespan_s"]

        def view(r: dict[str, Any], st: Any = st, gap: float = gap, wide: bool = wide) -> str:
            closes = (
                f", closes {(st['makespan_s'] - r['makespan_s']) / gap:.0%} of the gap"
                if wide
                else ""
            )
            return (
                f"{r['balancedness']:.4f} / {1e3 * r['makespan_s']:.2f} ms / "
                f"{r['plan']['ep'].get('copies', 0)} copies{closes}"
            )

        most = max(r["balancedness"] for r in eplbs)
        fastest = min(r["makespan_s"] for r in eplbs)
        balanced = "at least as balanced as" if pr["balancedness"] >= most else "less balanced than"
        fast = "at least as fast as" if pr["makespan_s"] <= fastest else "slower than"
        verdict = f"{balanced} eplb's most balanced, {fast} its fastest"

        def when(r: dict[str, Any]) -> str:
            k = r["plan"]["eplb"]["interval"]
            return (
                f"every {k} batches" if k < r["n_batches"] else f"never in {r['n_batches']} batches"
            )

        each = ", ".join(f"{when(r)} {view(r)}" for r in eplbs)
        small = (
            f" (the ep_static -> oracle gap is {1e3 * gap:.2f} ms, under 1%)"
            if st and orc and not wide
            else ""
        )
        out.append(
            f"[note] {case} bs={bs}: eplb re-placing {each}; predictive {view(pr)}: "
            f"{verdict}{small}"
        )
    return out


def prediction_lines(
    rows: list[dict[str, Any]], cases: Sequence[str], fresh: Mapping[str, int | None]
) -> list[str]:
    """One note per target case at its judged batch (`fresh`, else its largest): each planner or
    variant that plans from a predicted load (summary `prediction_tv`: the mean total-variation
    distance of that load from each batch's true one), most distant first, with its balancedness
    and makespan, beside eplb's. With the oracle's `truth_weight` variants it shows how close to
    the truth a prediction must come to reach eplb's balancedness."""
    out = []
    shown = plotted_batches([r for r in rows if r["case"] in cases], fresh)
    for case, bs in ((c, shown[c]) for c in cases if c in shown):  # in the order of `cases`
        at = [r for r in rows if r["case"] == case and r["batch_size"] == bs]
        planned = sorted(
            (r for r in at if r["plan"]["ep"].get("prediction_tv") is not None),
            key=lambda r: -r["plan"]["ep"]["prediction_tv"],
        )
        eplb = next((r for r in at if r["planner"] == "eplb"), None)
        if not planned or eplb is None:
            continue
        each = "; ".join(
            f"{r['planner']} {r['plan']['ep']['prediction_tv']:.3f} -> "
            f"{r['balancedness']:.4f} / {1e3 * r['makespan_s']:.2f} ms"
            for r in planned
        )
        out.append(
            f"[note] {case} bs={bs}: distance of the load planned from to each batch's "
            f"(mean total variation) -> balancedness / makespan: {each}; eplb "
            f"{eplb['balancedness']:.4f} / {1e3 * eplb['makespan_s']:.2f} ms"
        )
    return out


def _views(by: dict[str, dict[str, Any]]) -> str:
    """ep_static's and predictive's makespan and expert-phase utilisation, and the gain."""
    st, pr = by["ep_static"], by["predictive_replication"]
    return (
        f"ep_static {1e3 * st['makespan_s']:.2f} ms (phase {st['expert_phase_util']:.3f}), "
        f"predictive {1e3 * pr['makespan_s']:.2f} ms (phase {pr['expert_phase_util']:.3f}), "
        f"gain {1 - pr['makespan_s'] / st['makespan_s']:.1%}"
    )


KEY = "run_key.json"  # in a run dir: what the run was (spec, routing, code), for resuming
RUNS = "runs.json"  # in out_dir: the run dirs of the last config, which read_runs reads


def file_sha1(path: str) -> str:
    """The sha1 of a file a run reads (a missing one: its name, for the planner to refuse)."""
    try:
        return hashlib.sha1(Path(path).read_bytes()).hexdigest()
    except OSError:
        return f"unreadable: {path}"


def reusable(run_dir: Path, key: dict[str, Any]) -> bool:
    """The run in `run_dir` finished (summary.json is written last) with this spec, routing and
    code: an interrupted experiment, run again, reuses it."""
    try:
        return (run_dir / "summary.json").is_file() and json.loads(
            (run_dir / KEY).read_text()
        ) == key
    except (OSError, ValueError):
        return False


def read_runs(out: Path) -> list[dict[str, Any]]:
    """The rows of the last config run into `out` (its runs.json; run dirs of cases or variants
    dropped since are not read)."""
    listed = out / RUNS
    paths = (
        [out / p / "summary.json" for p in json.loads(listed.read_text())]
        if listed.is_file()
        else sorted(out.glob("*/bs*/*/summary.json"))
    )
    return [dict(json.loads(p.read_text()), case=p.parts[-4]) for p in paths]


def table(rows: list[dict[str, Any]]) -> str:
    """balanced = mean/max device tokens (vLLM); util = mean device compute busy / makespan;
    load = the time a kernel runs on a GPU / makespan (GPUtil's load: the paper's metric; lanes
    are one GPU; on GPUs the all-to-all's kernels count); phase = expert busy / (G x expert-phase spans): the token view and three time
    views. late_ms = the most one device's experts waited for replica copies still in flight
    (`core.balance.copy_waits`): 0 where every copy was prefetched in time."""
    w = max([16, *(len(r["case"]) for r in rows)])
    pw = max([42, *(len(r["planner_label"]) for r in rows)])
    head = (
        f"{'case':{w}} {'bs':>4} {'planner':{pw}} {'makespan_ms':>11} {'tok/s':>9} {'balanced':>8} "
        f"{'util':>6} {'load':>6} {'phase':>6} {'copies':>6} {'late_ms':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['case']:{w}} {r['batch_size']:>4} {r['planner_label']:{pw}} {1e3 * r['makespan_s']:>11.2f} "
            f"{r['batch_size'] * r['n_batches'] * r['prompt_len'] / r['makespan_s']:>9.0f} {r['balancedness']:>8.3f} "
            f"{r['utilisation']:>6.3f} {r.get('gpu_load', float('nan')):>6.3f} {r['expert_phase_util']:>6.3f} "
            f"{r['plan']['ep'].get('copies', 0):>6} {1e3 * r.get('copy_wait_s', 0.0):>7.3f}"
        )
    return "\n".join(lines)


NOISE_GAP = 0.01  # an ep_static -> oracle gap below this share of ep_static's makespan is noise


def gap_line(
    case: str,
    bs: int,
    st: dict[str, Any],
    pr: dict[str, Any],
    orc: dict[str, Any],
    who: str = "predictive",
    seen: str = "",
    verdict: bool = True,
) -> str:
    """Share of the ep_static -> oracle makespan gap `who` closes; in words when there is no gap
    to close (the oracle is not faster than ep_static), never nan. `seen` follows the batch
    size; verdict=False tags the line [note] instead of PASS / FAIL. A gap under NOISE_GAP of
    ep_static's makespan is not judged ([n/a ]): a share of 0.3% says nothing about replication."""

    def tag(ok: bool | None) -> str:
        return ("n/a " if ok is None else "PASS" if ok else "FAIL") if verdict else "note"

    ms = {k: 1e3 * r["makespan_s"] for k, r in (("st", st), ("pr", pr), ("orc", orc))}
    times = f"(ep_static {ms['st']:.2f} ms, oracle {ms['orc']:.2f} ms, {who} {ms['pr']:.2f} ms)"
    gap = st["makespan_s"] - orc["makespan_s"]
    if gap <= 0:
        return (
            f"[{tag(False)}] {case} bs={bs}{seen}: no gap to close: the oracle is not faster than ep_static "
            f"{times}; {who} is {'faster' if ms['pr'] < ms['st'] else 'not faster'} than "
            f"ep_static"
        )
    if gap < NOISE_GAP * st["makespan_s"]:
        return (
            f"[{tag(None)}] {case} bs={bs}{seen}: the oracle is only {gap / st['makespan_s']:.2%} "
            f"faster than ep_static {times}: a gap under {NOISE_GAP:.0%} is noise, not judged; "
            f"{who} is {'faster' if ms['pr'] < ms['st'] else 'not faster'} than ep_static"
        )
    closed = (st["makespan_s"] - pr["makespan_s"]) / gap
    # a share just under half must not print as "50%" beside a FAIL
    shown = f"{closed:.0%}"
    if closed < 0.5 and shown == "50%":
        shown = f"{closed:.2%}" if f"{closed:.2%}" != "50.00%" else "49.99%"  # under 49.995%
    return (
        f"[{tag(closed >= 0.5)}] {case} bs={bs}{seen}: {who} closes {shown} of "
        f"the ep_static -> oracle makespan gap {times}; target >= 50%"
    )


def digits_apart(a: float, b: float) -> int:
    """Decimals that print `a` and `b` apart (at least 4), so a verdict on a < b never stands
    beside equal figures; 4 where they are equal."""
    return next((k for k in range(4, 17) if f"{a:.{k}f}" != f"{b:.{k}f}"), 4)


def fresh_batch(case: Any, split_tokens: int) -> int | None:
    """The largest of a held-out case's batch sizes whose batches together need no more tokens
    than the split holds, so no token runs twice (`esft_routing` wraps the stream beyond): the
    online learners (predictive's window, eplb's) have then seen none of a batch's sequences.
    None if every batch size wraps."""
    per_run = int(case["prompt_len"]) * int(case["n_batches"])
    fits = [int(bs) for bs in case["batch_sizes"] if int(bs) * per_run <= split_tokens]
    return max(fits) if fits else None


def targets(
    rows: list[dict[str, Any]],
    cases: list[str],
    variants: Sequence[str] = (),
    fresh: Mapping[str, int | None] | None = None,
) -> list[str]:
    """The issue's targets: balancedness and makespan gap of predictive (and of each variant) on
    each of `cases` at its `fresh` batch (held-out ESFT cases: `fresh_batch`, no sequence seen
    before, also not online; others: their largest), and utilisation, in each of its three time views, wherever
    ep_static is below 0.6. The case's largest batch, where it is another, is shown beside as a
    note: there the stream revisits the split, so from its second batch on the online learners
    have seen every token they are judged on. A case with no fresh batch is judged at its
    largest, and its lines say it revisits."""
    out, notes = [], []
    fresh = fresh or {}
    for who in ("predictive_replication", *variants):
        name = "predictive" if who == "predictive_replication" else who
        for case in cases:
            largest = max(r["batch_size"] for r in rows if r["case"] == case)
            judged = fresh.get(case) or largest
            for bs in dict.fromkeys((judged, largest)):
                by = {r["planner"]: r for r in rows if r["case"] == case and r["batch_size"] == bs}
                st, ep, orc, pr = by["ep_static"], by["eplb"], by["oracle_replication"], by[who]
                revisits = case in fresh and bs != fresh[case]  # held-out ESFT, wrapped
                seen = " (revisits held-out tokens)" if revisits else ""
                ok = pr["balancedness"] >= ep["balancedness"]
                d = digits_apart(pr["balancedness"], ep["balancedness"])
                bal = (
                    f"{case} bs={bs}{seen}: {name} balancedness {pr['balancedness']:.{d}f} "
                    f"{'>=' if ok else '<'} eplb {ep['balancedness']:.{d}f}"
                )
                gap = gap_line(case, bs, st, pr, orc, name, seen, verdict=bs == judged)
                if bs == judged:
                    out += [f"[{'PASS' if ok else 'FAIL'}] {bal}", gap]
                else:  # the largest batch beside the judged one, not a verdict
                    notes += [f"[note] {bal}", gap]
    out += notes
    for metric, what in (
        ("expert_phase_util", "expert-phase utilisation"),
        ("utilisation", "whole-run utilisation (busy/makespan)"),
        ("gpu_load", "GPU load (GPUtil's, the paper's)"),
    ):
        out += utilisation_lines(rows, metric, what)
    return out


def utilisation_lines(rows: list[dict[str, Any]], metric: str, what: str) -> list[str]:
    """The utilisation target on one metric: every case where ep_static is below 0.6 and the best
    replication planner's figure (target >= 0.9), or why the premise never arises. Where even
    the oracle's replicas stay below 0.9, the line says so: the idle time there is not
    imbalance that replication can remove (e.g. dense work on device 0 at batch 1).
    Runs compare within one layout (`_layout`): a variant run as micro-batches (two-batch
    overlap) against ep_static's variant run so, whose overlap lifts its utilisation too."""
    out = []
    for r in rows:
        base = r["planner"] == "ep_static" or (
            r.get("variant_of") == "ep_static" and _layout(r)[2] > 1
        )
        if not base or r[metric] >= 0.6:
            continue
        same = [
            x
            for x in rows
            if x["case"] == r["case"]
            and x["batch_size"] == r["batch_size"]
            and _layout(x) == _layout(r)
        ]
        # replication planners and their variants (not ep_static's, not the oracle's)
        rep = [
            x
            for x in same
            if x.get("variant_of", x["planner"]) in ("eplb", "predictive_replication")
        ]
        if not rep:
            continue
        best = max(rep, key=lambda x: x[metric])
        bound = [
            x[metric] for x in same if x.get("variant_of", x["planner"]) == "oracle_replication"
        ]
        why = f"; the oracle upper bound reaches {bound[0]:.3f}" if bound and bound[0] < 0.9 else ""
        out.append(
            f"[{'PASS' if best[metric] >= 0.9 else 'FAIL'}] {r['case']} bs={r['batch_size']}{_setting(r)}: {what} "
            f"{r['planner']} {r[metric]:.3f} < 0.6 -> {best['planner']} {best[metric]:.3f} (target >= 0.9{why})"
        )
        if best[metric] < 0.9:
            out.append("       " + idle_text(best))
    if not out:
        low = min((r for r in rows if r["planner"] == "ep_static"), key=lambda r: r[metric])
        out.append(
            f"[n/a ] {what}: no case has ep_static below 0.6 (lowest {low[metric]:.3f}, "
            f"{low['case']} bs={low['batch_size']})"
        )
    return out


def idle_text(r: dict[str, Any], shown: int = 4) -> str:
    """What a run's GPUs waited for while they computed nothing (core.bubbles: its summary's
    gpu_idle_causes_s), as shares of its makespan, the largest first."""
    causes = r.get("gpu_idle_causes_s", {})
    if not causes:
        return f"{r['planner']}: its summary has no gpu_idle_causes_s"
    span = r["makespan_s"]
    top = ", ".join(f"{k} {v / span:.1%}" for k, v in list(causes.items())[:shown])
    rest = sum(list(causes.values())[shown:]) / span
    return (
        f"{r['planner']}'s GPUs computed nothing {sum(causes.values()) / span:.1%} of the run, "
        f"waiting on {top}" + (f", other {rest:.1%}" if rest > 0.0005 else "")
    )


def _layout(r: dict[str, Any]) -> tuple[int, bool, int]:
    """A run's devices as its utilisation depends on them: (G, lanes, micro-batches)."""
    ep = r.get("plan", {}).get("ep", {})
    return (ep.get("n_devices", 0), bool(ep.get("lanes")), ep.get("micro_batches", 1))


def _setting(r: dict[str, Any]) -> str:
    """What the devices of a run are, where it matters to read its utilisation: G GPUs, or G
    lanes of one GPU that partition its SMs or share them."""
    ep = r.get("plan", {}).get("ep", {})
    if not ep:
        return ""
    if not ep.get("lanes"):
        micro = ep.get("micro_batches", 1)
        tbo = f", {micro} micro-batches overlapped" if micro > 1 else ""
        return f" ({ep['n_devices']} GPUs{tbo})"
    how = "sharing its SMs" if ep.get("lane_sharing") == "shared" else "each 1/G of its SMs"
    return f" ({ep['n_devices']} lanes of one GPU, {how})"


def batch_balance(phases: pd.DataFrame) -> pd.Series:
    """Balancedness of each batch (its steps together) from a balance.csv table: its layers'
    mean device tokens over their max, summed as `core.balance` sums a run."""
    g = phases.groupby("batch")
    return g["mean_tokens"].sum() / g["max_tokens"].sum()


def plotted_batches(rows: list[dict[str, Any]], judged: Mapping[str, int | None]) -> dict[str, int]:
    """Case -> the batch size its per-layer and per-batch panels show: the batch its targets are
    judged on (`judged`, where that ran), else its largest."""
    out = {}
    for case in sorted({r["case"] for r in rows}):
        ran = {int(r["batch_size"]) for r in rows if r["case"] == case}
        bs = judged.get(case)
        out[case] = bs if bs in ran else max(ran)
    return out


def target_corner(at: Sequence[dict[str, Any]]) -> tuple[float, float] | None:
    """Where a planner meets both of a case's targets at one batch size, from its rows `at`:
    (eplb's balancedness, the makespan in ms that closes half the ep_static -> oracle gap).
    None where one of the three did not run or the oracle is not faster than ep_static."""
    by = {r["planner"]: r for r in at}
    if not {"ep_static", "eplb", "oracle_replication"} <= by.keys():
        return None
    st, orc = by["ep_static"]["makespan_s"], by["oracle_replication"]["makespan_s"]
    if orc >= st:
        return None
    return float(by["eplb"]["balancedness"]), 1e3 * (st - 0.5 * (st - orc))


def plot_trade_off(
    rows: list[dict[str, Any]], out: Path, judged: Mapping[str, int | None]
) -> Path | None:
    """Balancedness against makespan, one point per planner and variant, one panel per target
    case at its judged batch: the two targets pull apart where copies cost time, and the shaded
    corner (at least eplb's balancedness, at most the makespan that closes half the gap) is
    where a planner meets both. None if no target case ran."""
    import matplotlib.pyplot as plt

    shown = plotted_batches([r for r in rows if r["case"] in judged], judged)
    if not shown:
        return None
    # one colour and marker per planner or variant in every panel, named once in a legend below
    # (labels written beside the points overlapped where several sit near the oracle)
    labels = list(
        dict.fromkeys(
            r["planner_label"]
            for r in rows
            if r["case"] in shown and r["batch_size"] == shown[r["case"]]
        )
    )
    colours = plt.get_cmap("tab20").colors
    style = {lab: (colours[i % len(colours)], "os^Dv<>PX*"[i % 10]) for i, lab in enumerate(labels)}
    ncol = min(len(shown), len(labels))  # about one column of labels per 4.5-inch panel
    legend_in = 0.22 * -(-len(labels) // ncol)  # inches: one legend row per ncol labels
    fig, axes = plt.subplots(
        1, len(shown), figsize=(4.5 * len(shown), 3.6 + legend_in), squeeze=False
    )
    for ax, (case, bs) in zip(axes[0], shown.items(), strict=True):
        at = [r for r in rows if r["case"] == case and r["batch_size"] == bs]
        for r in at:
            colour, marker = style[r["planner_label"]]
            ax.plot(
                1e3 * r["makespan_s"],
                r["balancedness"],
                marker=marker,
                color=colour,
                linestyle="none",
                label=r["planner_label"],
            )
        corner = target_corner(at)
        if corner is not None:
            bal, ms = corner
            ax.axhline(bal, color="grey", linewidth=0.6, linestyle="--")
            ax.axvline(ms, color="grey", linewidth=0.6, linestyle="--")
            ax.fill_between([ax.get_xlim()[0], ms], bal, 1.0, color="green", alpha=0.08)
        fresh = " (fresh)" if judged.get(case) == bs else ""
        ax.set(title=f"{case} bs={bs}{fresh}", xlabel="makespan (ms)", ylabel="balancedness")
    handles = [plt.Line2D([], [], color=c, marker=mk, linestyle="none") for c, mk in style.values()]
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0.0, legend_in / (3.6 + legend_in), 1.0, 1.0))
    path = out / "balance_vs_makespan.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(
    rows: list[dict[str, Any]], out: Path, judged: Mapping[str, int | None] | None = None
) -> list[Path]:
    """Balancedness and expert-phase utilisation per layer, balancedness per batch (each case
    at the batch its targets are judged on, `judged`: a held-out case's fresh batch; else its
    largest), and throughput against batch size; one panel per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    cases = sorted({r["case"] for r in rows})
    judged = judged or {}
    shown = plotted_batches(rows, judged)
    title = {
        c: f"{c} bs={bs}" + (" (fresh)" if judged.get(c) == bs else "") for c, bs in shown.items()
    }
    # one colour per planner or variant in every panel (the default cycle repeats after 10 and
    # restarts per panel: a 12-row case drew two oracle variants in ep_static's and eplb's colours)
    palette = plt.get_cmap("tab20").colors
    colour = {
        lab: palette[i % len(palette)]
        for i, lab in enumerate(dict.fromkeys(r["planner_label"] for r in rows))
    }
    for metric in ("balancedness_per_layer", "expert_phase_util_per_layer"):
        fig, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 3.2), squeeze=False)
        for ax, case in zip(axes[0], cases, strict=True):
            bs = shown[case]
            for r in rows:
                if r["case"] == case and r["batch_size"] == bs:
                    per = r[metric]
                    ax.plot(
                        [int(k) for k in per],
                        list(per.values()),
                        marker=".",
                        color=colour[r["planner_label"]],
                        label=r["planner_label"],
                    )
            ax.set(
                title=title[case],
                xlabel="layer",
                ylabel=metric.removesuffix("_per_layer"),
                ylim=(0, 1.02),
            )
        for ax in axes[0]:
            if ax.get_legend_handles_labels()[0]:  # a panel with no rows draws no legend
                ax.legend(fontsize=6)
        fig.tight_layout()
        paths.append(out / f"{metric}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    fig, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 3.2), squeeze=False)
    for ax, case in zip(axes[0], cases, strict=True):  # per batch, from each run's balance.csv
        bs = shown[case]
        for r in rows:
            path = out / case / f"bs{bs}" / r["planner"] / "balance.csv"
            if r["case"] == case and r["batch_size"] == bs and path.exists():
                per = batch_balance(pd.read_csv(path))
                ax.plot(
                    per.index,
                    per.values,
                    marker=".",
                    label=r["planner_label"],
                    color=colour[r["planner_label"]],
                )
        ax.set(
            title=title[case],
            xlabel="batch (prefill iteration)",
            ylabel="balancedness",
            ylim=(0, 1.02),
        )
    for ax in axes[0]:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    paths.append(out / "balancedness_per_batch.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 3.2), squeeze=False)
    for ax, case in zip(axes[0], cases, strict=True):
        for planner in dict.fromkeys(r["planner"] for r in rows):  # the four, then any variants
            mine = [r for r in rows if r["case"] == case and r["planner"] == planner]
            if not mine:
                continue
            pts = sorted(
                (
                    r["batch_size"],
                    r["batch_size"] * r["n_batches"] * r["prompt_len"] / r["makespan_s"],
                )
                for r in mine
            )
            ax.plot(
                *zip(*pts, strict=True),
                marker="o",
                label=planner,
                color=colour[mine[0]["planner_label"]],
            )
        ax.set(
            title=case,
            xlabel="batch size (sequences)",
            ylabel="tokens / s",
            xscale="log",
            yscale="log",
        )
    for ax in axes[0]:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    paths.append(out / "throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    trade = plot_trade_off(rows, out, judged)
    return paths + ([trade] if trade else [])


def dispatch_lines(dispatch: str) -> list[str]:
    """A report of runs whose replicas split their tokens by load says so above everything else:
    its balancedness and target lines are not the even split the issue states."""
    if dispatch == "even":
        return []
    return [
        f"dispatch={dispatch}: each replicated expert's tokens water-filled over its copies "
        "(the busiest device holding the fewest), not split evenly as the issue states; "
        "every balancedness and target line below is under this dispatch",
        "",
    ]


def hardware_lines(hw: HardwareSpec) -> list[str]:
    """Whether the GPUs' collectives took SMs from their compute in these runs (`comm_sms`): it
    moves every G-GPU makespan that overlaps an all-to-all, two-batch overlap's most."""
    c = hw.gpu
    if c.comm_share:
        cost = (
            f"a running all-to-all or all-reduce holds {c.comm_sms} of each GPU's {c.sms} SMs "
            "from its compute (comm_sms; comm_sms=0 runs them free)"
        )
    else:
        cost = "collectives take no SMs from the GPUs' compute (comm_sms=0)"
    if c.copy_share:
        cost += f"; a replica copy holds {c.copy_sms} on each end (copy_sms: NCCL's p2p kernels)"
    else:
        cost += "; replica copies none (copy_sms=0: the copy engines move them)"
    return [f"[note] hardware {hw.name}: {cost}"]


def reuse_lines(cases: dict[str, Any], split_tokens: int) -> list[str]:
    """One note per held-out ESFT case and batch size whose batches need more tokens than the
    split holds: `esft_routing` wraps the stream, so the run revisits the split's sequences.
    They stay unseen by the training tables, not by what learns online (predictive's EMA,
    eplb's window) after the first batch. Also names the largest batch that does not wrap."""
    out = []
    for name, case in cases.items():
        if case["routing"] != "esft_heldout":
            continue
        per_seq, batches = int(case["prompt_len"]), int(case["n_batches"])
        fits = split_tokens // (per_seq * batches)
        for bs in case["batch_sizes"]:
            per_batch = int(bs) * per_seq
            if per_batch * batches <= split_tokens:
                continue
            out.append(
                f"[note] {name} bs={bs}: {batches} batches of {per_batch} tokens from a "
                f"{split_tokens}-token held-out split: the stream wraps, each token runs "
                f"{per_batch * batches / split_tokens:.1f} times; the split is unseen by the "
                f"training tables, but from the second batch on the online predictor and eplb's "
                f"window have seen its sequences (largest batch without a repeat: bs={fits})"
            )
    return out


def check_inputs(cfg: DictConfig) -> None:
    """The config's names and numbers, before anything runs: one line naming the key."""

    def known(group: str, name: str, key: str) -> None:
        problem = missing_config([CONF / group], group, name, key)
        if problem:
            raise MoepipeError(problem)

    def mapping(key: str, value: Any, optional: bool = False) -> None:
        if not (isinstance(value, DictConfig) or (optional and value is None)):
            raise MoepipeError(
                f"{key}: {value!r} is not a mapping of name: settings; see "
                "conf/experiment/replication.yaml (override one entry as key.name.field=...)"
            )

    mapping("cases", cfg.get("cases"))
    mapping("planners", cfg.get("planners"))
    mapping("variants", cfg.get("variants"), optional=True)
    for group in ("cases", "planners", "variants"):
        for name, value in (cfg.get(group) or {}).items():
            mapping(f"{group}.{name}", value, optional=group == "planners")
    planners = check_planners(cfg)
    for name, case in cfg.cases.items():  # their entries are checked below, with their names
        for group in ("planners", "variants"):
            mapping(f"cases.{name}.{group}", case.get(group), optional=True)
    if not str(cfg.hardware_profile).endswith((".yaml", ".yml")):
        known("hardware", str(cfg.hardware_profile), "hardware_profile")
    elif not profile_path(str(cfg.hardware_profile)).is_file():
        raise MoepipeError(f"hardware_profile={cfg.hardware_profile}: no such file")
    for key in GPU_KEYS:
        if cfg.get(key) is not None:
            as_int(key, cfg[key], at_least=0)
    n_gpus = hardware(cfg).n_gpus  # SMs held past the GPU's: the profile's one line
    as_int("replica_slots", cfg.replica_slots, at_least=0)
    as_int("seed", cfg.seed, at_least=0)
    # a case the command line removed (~cases.X) may stay listed; a misspelt one may not
    shipped = yaml.safe_load((CONF / "experiment" / "replication.yaml").read_text())["cases"]
    unknown_targets = [str(c) for c in cfg.targets_cases if c not in cfg.cases and c not in shipped]
    if unknown_targets:
        raise MoepipeError(
            f"targets_cases: {', '.join(unknown_targets)} is not a case; valid: "
            f"{', '.join(map(str, cfg.cases))}"
        )
    for key in ("grouped_gemm", "write_traces"):
        as_bool(key, cfg[key])
    if cfg.dispatch not in DISPATCH:
        raise MoepipeError(f"dispatch={cfg.dispatch!r} unknown; valid: {', '.join(DISPATCH)}")
    variant_planners(cfg.get("variants") or {}, "variants")
    for name, case in cfg.cases.items():
        missing = sorted(CASE_KEYS - set(case))
        if missing:
            raise MoepipeError(
                f"cases.{name}: missing {', '.join(missing)} (see conf/experiment/replication.yaml)"
            )
        unknown = sorted(set(case) - CASE_KEYS - CASE_OPTIONAL)
        if unknown:
            raise MoepipeError(
                f"cases.{name}.{unknown[0]}: unknown case key; valid: "
                f"{', '.join(sorted(CASE_KEYS | CASE_OPTIONAL))}"
            )
        if case.routing not in ROUTINGS:
            raise MoepipeError(
                f"cases.{name}.routing={case.routing!r} unknown; valid: {', '.join(ROUTINGS)}"
            )
        for key in ("lanes", "grouped_gemm"):
            if key in case:
                as_bool(f"cases.{name}.{key}", case[key])
        known("model", str(case.model), f"cases.{name}.model")
        for key in ("n_devices", "prompt_len", "n_batches"):
            as_int(f"cases.{name}.{key}", case[key], at_least=0 if key == "n_devices" else 1)
        n_experts = case_model(case).n_experts  # checked here, not when the case's turn comes
        g = int(case.n_devices) or n_gpus  # 0: the hardware profile's GPUs
        if g > n_experts:
            raise MoepipeError(
                f"cases.{name}.n_devices={case.n_devices} gives {g} devices, more than "
                f"{case.model}'s {n_experts} experts; set it to at most {n_experts}"
            )
        sharing = case.get("lane_sharing")
        if sharing is not None and sharing not in LANE_SHARING:
            raise MoepipeError(
                f"cases.{name}.lane_sharing={sharing!r} unknown; valid: {', '.join(LANE_SHARING)}"
            )
        if not case.batch_sizes:
            raise MoepipeError(f"cases.{name}.batch_sizes is empty; give at least one, e.g. [8]")
        for bs in case.batch_sizes:
            as_int(f"cases.{name}.batch_sizes", bs, at_least=1)
        variant_planners(case.get("variants") or {}, f"cases.{name}.variants")
        for planner, params in (case.get("planners") or {}).items():
            if str(planner) not in planners:
                raise MoepipeError(
                    f"cases.{name}.planners.{planner}: unknown planner; valid: {', '.join(planners)}"
                )
            if params is not None and not isinstance(params, Mapping):
                raise MoepipeError(
                    f"cases.{name}.planners.{planner}={params!r}: must be a mapping of that "
                    f"planner's params, e.g. {{predictor: window}}"
                )
        for label, _, params in planner_runs(cfg, case):  # one budget for every planner
            if "replica_slots" in params:
                raise MoepipeError(
                    f"cases.{name}: {label} sets replica_slots={params['replica_slots']}, but the "
                    f"planners compare at one budget; set the top-level replica_slots=N instead"
                )
        if case.routing != "esft_heldout":  # synthetic routing: no request tasks
            for label, planner, params in planner_runs(cfg, case):
                if planner == "predictive_replication" and params.get("predictor") == "task_mix":
                    fix = (
                        f"set cases.{name}.planners.predictive_replication.predictor=window"
                        if label == "predictive_replication"
                        else "drop that variant, or move it to the ESFT cases' variants"
                    )
                    raise MoepipeError(
                        f"cases.{name}: {label} has predictor task_mix, which reads each "
                        f"request's task, but {case.routing} routing has none; {fix}"
                    )


def check_planners(cfg: DictConfig) -> list[str]:
    """The registry's expert-parallel planners, each of which `planners:` must set, and nothing
    else."""
    planners = expert_parallel_names()
    for p in planners:
        if p not in cfg.planners:
            raise MoepipeError(
                f"planners.{p} is missing: the experiment compares {', '.join(planners)} at one "
                f"replica budget; restore it (planners.{p}: {{}} runs its defaults)"
            )
    for p in cfg.planners:
        if str(p) not in planners:
            raise MoepipeError(
                f"planners.{p}: not an expert-parallel planner; valid: {', '.join(planners)}"
            )
    return planners


def variant_planners(variants: Any, where: str) -> None:
    """Each variant names one of the expert-parallel planners."""
    planners = expert_parallel_names()
    for label, v in variants.items():
        if str(v.get("planner")) not in planners:
            raise MoepipeError(
                f"{where}.{label}.planner={v.get('planner')!r}; valid: {', '.join(planners)}"
            )


def run(cfg: DictConfig) -> list[str]:
    check_inputs(cfg)
    out = output_dir(cfg.out_dir, "out_dir")
    t0 = time.time()
    prep = prepare(cfg, out)
    rows = []
    for name, case in cfg.cases.items():
        rows += run_case(cfg, str(name), case, prep, out)  # finished runs of this config reused
        log.info("%s done at %.0f s", name, time.time() - t0)
    held_out = [c for c in cfg.targets_cases if c in cfg.cases]  # the target cases that ran
    fresh = {
        c: fresh_batch(cfg.cases[c], len(prep["test_ids"]))
        for c in held_out
        if cfg.cases[c].routing == "esft_heldout"
    }
    listed = [f"{r['case']}/bs{r['batch_size']}/{r['planner']}" for r in rows]
    (out / RUNS).write_text(json.dumps(listed))
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    lines = [
        *dispatch_lines(str(cfg.dispatch)),
        table(rows),
        "",
        *hardware_lines(hardware(cfg)),
        *reuse_lines(dict(cfg.cases), len(prep["test_ids"])),
        *work_conserving_lines(rows),
        *sharing_lines(rows),
        *loop_lines(rows),
        *eplb_lines(rows, held_out, fresh),
        *prediction_lines(rows, held_out, fresh),
        *(
            []
            if held_out
            else [
                f"[n/a ] balancedness and makespan-gap targets: no case of "
                f"targets_cases={list(cfg.targets_cases)} ran"
            ]
        ),
        *targets(rows, held_out, list(cfg.get("variants") or {}), fresh),
    ]
    # every target case gets its trade-off panel: a held-out one at its fresh batch, else its largest
    pngs = plot(rows, out, {c: fresh.get(c) for c in held_out})
    lines.append(f"plots: {', '.join(str(p) for p in pngs)}  ({time.time() - t0:.0f} s)")
    lines.append(f"report: {write_pages(out, lines, pngs)}")
    return lines


CAPTIONS = {  # each plot's caption on the report page
    "balancedness_per_layer.png": "Balancedness (mean / max device tokens) per MoE layer, each "
    "case at the batch its targets are judged on (a held-out case's fresh batch), else its largest.",
    "expert_phase_util_per_layer.png": "Expert-phase utilisation per MoE layer: expert busy time "
    "over the devices' expert-phase spans.",
    "balancedness_per_batch.png": "Balancedness of each batch (prefill iteration).",
    "throughput.png": "Throughput against batch size, every planner and variant.",
    "balance_vs_makespan.png": "Balancedness against makespan for the target cases: the shaded "
    "corner (at least eplb's balancedness, at most the makespan that closes half the "
    "ep_static -> oracle gap) is where a planner meets both targets.",
}


def write_pages(out: Path, lines: list[str], pngs: list[Path]) -> Path:
    """out/report.txt (the printed lines) and out/index.html (those lines and this run's plots,
    each with its caption), both replaced whole; returns the page's path."""
    import html

    body = "\n".join(
        f'<figure><img src="{p.name}" alt="{p.stem}"><figcaption>'
        f"{html.escape(CAPTIONS.get(p.name, p.stem))}</figcaption></figure>"
        for p in pngs
    )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>moepipe replication</title>"
        "<style>body{font-family:sans-serif;margin:2em}pre{font-size:12px}"
        "img{max-width:100%}</style></head><body><h1>Expert replication (issue 5)</h1>"
        f"<pre>{html.escape(chr(10).join(lines))}</pre>\n{body}\n</body></html>\n"
    )
    for name, text in (("report.txt", "\n".join(lines) + "\n"), ("index.html", page)):
        atomic_write_text(out / name, text)
    return out / "index.html"


def main(argv: list[str] | None = None) -> int:
    """The command: conf/experiment/replication.yaml with `argv`'s overrides (sys.argv[1:])."""
    return experiment_main(run, argv, __doc__, Path(__file__).stem)


def experiment_main(
    report: Callable[[DictConfig], list[str]], argv: list[str] | None, doc: str | None, name: str
) -> int:
    """A command over conf/experiment/replication.yaml (this one, replication_cv): `report`'s
    lines; bad input one line, exit 2, and no out_dir left that looks like a run."""
    argv = list(sys.argv[1:] if argv is None else argv)
    exit_on_unwritable_dir(argv, ("out_dir", "hydra.run.dir"))  # before hydra makes it
    running(ReplicationOptions)

    def task(cfg: DictConfig) -> None:
        from hydra.core.hydra_config import HydraConfig

        out = Path(HydraConfig.get().runtime.output_dir)
        try:
            print_or_exit(lambda: report(cfg))
        except SystemExit as e:
            if e.code == 2:
                remove_if_no_run(out)
            raise

    hydra_args = [f"hydra.job.name={name}", "hydra/help=command"]
    return int(
        until_interrupted(lambda: hydra_main(task, "experiment/replication", argv, doc, hydra_args))
    )


if __name__ == "__main__":
    sys.exit(run_command(main))
