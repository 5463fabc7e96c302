"""What an expert-replication run reads beside its spec: held-out routing and training tables.

`experiments.run` calls `prepare` when the config's `replication.routing` is set
(conf/experiment/replication*.yaml): held-out ESFT windows, or synthetic routing fitted to
OLMoE's skew whose first half trains; the training tables go into the run dir's `inputs/`.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from core import traces
from core.balance import KEYS
from core.cost import CostModel
from core.errors import ConfigError, MoepipeError, did_you_mean, reworded
from core.hardware import HardwareSpec
from core.routing import Routing
from core.spec import ModelSpec, RoutingConfig, Workload
from core.synthetic import fit_to_counts, synthetic_routing
from core.traces import EsftTrace, load_counts, load_esft
from core.types import OpKind, Resource
from experiments.common.pipeline import RunResult, RunSpec
from planners.predictive_replication import transition_counts
from planners.registry import expert_parallel_names, param_names

log = logging.getLogger(__name__)
ROUTINGS = ("esft_heldout", "synthetic_olmoe_top1")  # replication.routing
SPLITS = {"test": 0, "validation": 1, "fold1": 1, "fold2": 2, "fold3": 3, "fold4": 4}
# split -> the seq_id % 5 residue of its sequences
N_EXPERTS = 64  # the ESFT trace's routed experts
INPUTS = "inputs"  # in a run dir: the training tables its planner read
# the params naming a training table a replication run writes into INPUTS as <param>.npy
TABLES = ("initial_load", "table", "prior_scenarios", "task_load")


def residue(split: str) -> int:
    """The seq_id % 5 residue of `split`'s sequences; a one-line error for an unknown split."""
    if split not in SPLITS:
        raise ConfigError(
            f"replication.split={split!r} unknown; {did_you_mean(split, SPLITS)}"
            f"valid: {', '.join(SPLITS)}"
        )
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
    idx = idx[np.lexsort((tr.pos[idx], np.array([rank[int(k)] for k in tr.seq_key[idx]])))]
    return idx, np.flatnonzero(train)


def esft_split(trace_dir: str, seed: int, split: str = "test") -> tuple[np.ndarray, np.ndarray]:
    """The evaluation token stream of `split` (its sequences in shuffled order) and training ids.

    "test": seq_id % 5 == 0 (the trace README's held-out split), trained on the rest;
    "validation": seq_id % 5 == 1, trained on the sequences in neither; "fold1".."fold4":
    seq_id % 5 == K, trained on every other (with "test", a 5-fold cross-validation).
    Returns eval ids [T_eval, L, k] and train ids [T_train, L, k].
    """
    tr = load_esft(trace_dir, trace_dir_flag="workload.routing.trace_dir")
    idx, train = split_index(tr, seed, split)
    return tr.expert_ids[idx].astype(np.int16), tr.expert_ids[train].astype(np.int16)


def esft_tasks(
    trace_dir: str, seed: int, split: str = "test"
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """Each evaluation token's task [T_eval] (in `esft_split`'s order), the training split's load
    per task [K tasks, L, E] (predictive's `task_load`), and the task names."""
    tr = load_esft(trace_dir, trace_dir_flag="workload.routing.trace_dir")
    idx, train = split_index(tr, seed, split)
    per_task = np.stack(
        [
            load_matrix(tr.expert_ids[train[tr.task[train] == k]], N_EXPERTS)
            for k in range(len(tr.task_names))
        ]
    )
    return tr.task[idx].astype(np.int16), per_task, tr.task_names


def esft_group_loads(trace_dir: str, split: str = "test") -> np.ndarray:
    """[S, L, E] expert loads of each group of `split`'s training sequences that is the size of a
    held-out split (one seq_id % 5 residue): how much a split's load differs from another's, for
    predictive's `prior_scenarios` (its gate's hedge before any batch)."""
    held = residue(split)
    tr = load_esft(trace_dir, trace_dir_flag="workload.routing.trace_dir")
    residues = [
        r for r in range(5) if r != held and (split.startswith("fold") or r != SPLITS["test"])
    ]
    n_layers = tr.expert_ids.shape[1]
    out = np.zeros((len(residues), n_layers, N_EXPERTS))
    for i, r in enumerate(residues):
        ids = tr.expert_ids[tr.seq_id % 5 == r]
        for m in range(n_layers):
            out[i, m] = np.bincount(ids[:, m].ravel(), minlength=N_EXPERTS)
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
        N_EXPERTS,
        f"esft {split} (seq_id % 5 == {SPLITS[split]}), {len(eval_ids)} tokens",
        labels,
        task_names,
        {"source": "esft", "split": split, "seq_id_mod_5": SPLITS[split], "tokens": len(eval_ids)},
    )


def load_matrix(ids: np.ndarray, n_experts: int) -> np.ndarray:
    """[L, E] float64 expert selections of routing ids [T, L, k]."""
    return np.stack(
        [np.bincount(ids[:, m].ravel(), minlength=n_experts) for m in range(ids.shape[1])]
    ).astype(np.float64)


@functools.lru_cache(maxsize=4)
def esft_inputs(trace_dir: str, seed: int, split: str) -> dict[str, Any]:
    """One split's evaluation stream and tables, computed once per process (a sweep's worker runs
    many rows of one split): eval ids, tasks, the training load, transition table, the evaluated
    split's own load, the training groups' loads and the per-task loads."""
    eval_ids, train_ids = esft_split(trace_dir, seed, split)
    tasks, task_load, task_names = esft_tasks(trace_dir, seed, split)
    return {
        "eval_ids": eval_ids,
        "tasks": tasks,
        "task_names": task_names,
        "train_load": load_matrix(train_ids, N_EXPERTS),  # [26, 64]
        "train_trans": transition_counts(train_ids, N_EXPERTS),  # [26, 64, 64]
        "eval_load": load_matrix(eval_ids, N_EXPERTS),  # what a variant knowing it packs from
        "train_groups": esft_group_loads(trace_dir, split),  # [S, 26, 64]
        "task_load": task_load,  # [4 tasks, 26, 64]
    }


def olmoe_counts(trace_dir: str) -> np.ndarray:
    """[5 domains, 3 layers, 64] OLMoE top-1 expert counts, which the synthetic_olmoe_top1 skew
    is fitted to; checked at load, so a bad file is named, not blamed on the fit's config."""
    return load_counts(trace_dir, "olmoe_counts_top1", N_EXPERTS)


@functools.lru_cache(maxsize=8)
def olmoe_fit(trace_dir: str, n_experts: int, layer_corr: float, reuse: float) -> RoutingConfig:
    """Synthetic routing whose Zipf skew, at `n_experts`, gives OLMoE's top-1 max/mean."""
    fit = fit_to_counts(
        olmoe_counts(trace_dir), top_k=1, layer_corr=layer_corr, reuse=reuse, n_experts=n_experts
    )
    log.info(
        "switch routing, %d experts: skew %.3f fitted to OLMoE top-1 max/mean %.1f (reached %.1f)",
        n_experts,
        fit.routing.skew,
        fit.target["max_over_mean_median"],
        fit.achieved["max_over_mean_median"],
    )
    return fit.routing


@functools.lru_cache(maxsize=2)
def synthetic_split(model: ModelSpec, wl: Workload) -> tuple[Routing, np.ndarray, np.ndarray]:
    """Twice the workload's sequences from one synthetic generator (one popularity and transition
    structure, as one model has): the first half trains the load matrix and transition table that
    eplb / predictive / oracle start from (as ESFT's training split does), the second is run."""
    both = synthetic_routing(model, replace(wl, n_batches=2 * wl.n_batches))
    n, e = wl.n_sequences, model.n_experts
    train = both.expert_ids[:n].reshape(-1, *both.expert_ids.shape[2:])
    test = Routing(
        both.expert_ids[n:],
        lambda: both.gate_weights[n:],
        e,
        both.description + " (second half; first half trains)",
        fields={**both.fields, "half": "second"},
    )
    return test, load_matrix(train, e), transition_counts(train, e)


def case_set(rep: Any) -> None:
    """ConfigError where a `replication` block (a mapping) names no case: the base experiment,
    run without one of its cases."""
    if not rep.get("case"):
        raise ConfigError(
            "replication.case is not set: run one of the cases, e.g. "
            "python -m experiments.run -m experiment=replication_esft_g8"
        )


def block(cfg: DictConfig) -> dict[str, Any] | None:
    """The config's `replication` block as a dict, or None where it prepares nothing."""
    node = cfg.get("replication")
    if node is None or not node.get("routing"):
        return None
    rep: dict[str, Any] = OmegaConf.to_container(node, resolve=True)  # type: ignore[assignment]
    if rep["routing"] not in ROUTINGS:
        raise ConfigError(
            f"replication.routing={rep['routing']!r} unknown; "
            f"{did_you_mean(rep['routing'], ROUTINGS)}valid: {', '.join(ROUTINGS)}"
        )
    case_set(rep)
    loads = ("train", "eval")  # the tables the replication planners start from
    if rep.get("initial_load") is not None and rep["initial_load"] not in loads:
        raise ConfigError(
            f"replication.initial_load={rep['initial_load']!r} unknown; "
            f"{did_you_mean(rep['initial_load'], loads)}valid: {', '.join(loads)}"
        )
    return rep


def prepare(cfg: DictConfig, spec: RunSpec, out_dir: Path) -> tuple[RunSpec, Routing]:
    """The run's routing, and its spec with the planner params the experiment sets: the same
    replica budget and training tables for every replication planner, written to
    out_dir/inputs/; then `replication.planners` (the experiment's params per planner) and
    `replication.params` (a row's own), which win."""
    rep = block(cfg)
    assert rep is not None
    check_block(rep, spec)
    wl, names = spec.workload, param_names(spec.planner)
    inputs = out_dir / INPUTS
    inputs.mkdir(parents=True, exist_ok=True)
    files: dict[str, np.ndarray] = {}
    if rep["routing"] == "esft_heldout":
        data = esft_inputs(wl.routing.trace_dir, wl.seed, str(rep.get("split", "test")))
        routing = esft_routing(
            data["eval_ids"], wl, str(rep.get("split", "test")), data["tasks"], data["task_names"]
        )
        initial = data["eval_load"] if rep.get("initial_load") == "eval" else data["train_load"]
        files.update(initial_load=initial, table=data["train_trans"])
        files.update(prior_scenarios=data["train_groups"], task_load=data["task_load"])
    else:
        rc = wl.routing
        fit = olmoe_fit(rc.trace_dir, spec.model.n_experts, rc.layer_corr, rc.reuse)
        wl = replace(wl, routing=fit)
        routing, load, trans = synthetic_split(spec.model, wl)
        files.update(initial_load=load, table=trans)
    routing.check_fits(spec.model, wl)
    params = block_params(rep, spec.planner, spec.params)
    for key, array in files.items():
        if key in names and not params.get(key) and wanted(key, params):
            path = inputs / f"{key}.npy"
            np.save(path, array)
            params[key] = str(path)
    return replace(spec, workload=wl, params=params), routing


def _fits_esft(model: ModelSpec) -> None:
    """A ConfigError where `model` is not of the ESFT trace's shape, which an ESFT case replays
    whatever the model: each point of its sweep failed on it after the sweep had started (the
    routing's `check_fits`), one line a point."""
    have = (traces.N_LAYERS, N_EXPERTS, traces.TOP_K)
    want = (len(model.moe_layers), model.n_experts, model.top_k)
    if want != have:
        raise ConfigError(
            f"replication.routing=esft_heldout replays the ESFT trace, whose (moe_layers, "
            f"experts, top_k) = {have}; model {model.name} has {want}: drop model= (the case "
            "runs its own) or pass a model of that shape"
        )


def check_block(rep: dict[str, Any], spec: RunSpec) -> dict[str, Any]:
    """A ConfigError where the block's settings do not fit this run's planner or routing, checked
    before anything is prepared (a sweep checks them before its first point:
    `run_checks.check_point`); else the planner params the block sets for it
    (`replication.planners.<planner>`, then the row's `replication.params`)."""
    if spec.planner not in expert_parallel_names():
        raise ConfigError(
            f"replication.routing is set for planner {spec.planner}, which is not expert-"
            f"parallel; valid: {', '.join(expert_parallel_names())}"
        )
    slots = rep.get("replica_slots", 2)  # every replication planner's budget, ep_static's not
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
        raise ConfigError(
            f"replication.replica_slots={slots}: the replicas each planner may place per device "
            "and MoE layer; pass a non-negative integer"
        )
    if rep["routing"] == "esft_heldout":
        residue(str(rep.get("split", "test")))  # a split of the ESFT sequences it names
        _fits_esft(spec.model)
    elif str(rep.get("split", "test")) != "test":
        raise ConfigError(
            f"replication.split={rep['split']}: a split of the held-out ESFT sequences, but "
            f"this case's routing is {rep['routing']}, which has none; drop it, or run an "
            "ESFT case (experiment=replication_esft_g8)"
        )
    own = own_params(rep, spec.planner)
    if "replica_slots" in own:  # the planners compare at one budget
        raise ConfigError(
            f"replication: {rep.get('label') or spec.planner} sets replica_slots="
            f"{own['replica_slots']}, but the planners compare at one budget; set "
            "replication.replica_slots=N instead"
        )
    predictor = own.get("predictor", spec.params.get("predictor"))
    if rep["routing"] != "esft_heldout" and predictor == "task_mix":
        raise ConfigError(
            f"replication: {rep.get('label') or spec.planner} has predictor task_mix, which reads "
            f"each request's task, but {rep['routing']} routing has none; set "
            f"replication.planners.{spec.planner}.predictor=window"
        )
    return own


def own_params(rep: dict[str, Any], planner: str) -> dict[str, Any]:
    """The planner params the block sets: `replication.planners.<planner>`, then a row's
    `replication.params`, which win (an entry null: none of its own, as `{}`)."""
    return {**((rep.get("planners") or {}).get(planner) or {}), **(rep.get("params") or {})}


def block_params(rep: dict[str, Any], planner: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """The planner params a replication run runs and records in its summary, but its training
    files (`TABLES`, written into its run dir): the config's `params`, the one replica budget
    where the planner takes training loads, then the block's own (`own_params`)."""
    out = dict(params)
    if "initial_load" in param_names(planner):  # the same budget for every planner
        out["replica_slots"] = int(rep.get("replica_slots", 2))
    return out | own_params(rep, planner)


def written_as(rep: dict[str, Any], planner: str) -> dict[str, str]:
    """Each planner param a replication run takes from its block -> the key the user wrote it
    as (a row's `replication.params` win over `replication.planners.<planner>`)."""
    keys = {"replica_slots": "replication.replica_slots"}
    keys.update(
        {
            k: f"replication.planners.{planner}.{k}"
            for k in (rep.get("planners") or {}).get(planner) or {}
        }
    )
    keys.update({k: f"replication.params.{k}" for k in rep.get("params") or {}})
    return keys


@contextmanager
def named_as_written(cfg: DictConfig, planner: str) -> Iterator[None]:
    """Errors of a replication run name each planner param by the key the user wrote
    (`replication.planners.eplb.interval=0`), not as the planner reads it
    (`planner.params.interval=0`), which the user never set."""
    try:
        yield
    except MoepipeError as e:
        rep = block(cfg)
        keys = written_as(rep, planner) if rep else {}
        said = re.sub(r"planner\.params\.(\w+)", lambda m: keys.get(m[1], m[0]), str(e))
        said = re.sub(  # make_params' list of names it does not take
            r"(unknown param\(s\) )([\w, ]+)",
            lambda m: m[1] + ", ".join(keys.get(n, n) for n in m[2].split(", ")),
            said,
        )
        if said == str(e):
            raise
        raise reworded(e, said) from e


def wanted(key: str, params: dict[str, Any]) -> bool:
    """Whether the run's planner reads the training file `key`: `task_load` only under the
    task_mix predictor (which refuses to run without it, and the others with it)."""
    return key != "task_load" or params.get("predictor") == "task_mix"


def annotate(result: RunResult, cfg: DictConfig, spec: RunSpec, routing: Routing) -> None:
    """What the replication report reads beside a run's metrics: its case, its row's label
    where it is a variant, the held-out split's size, and (lanes) the work-conserving makespan."""
    rep = block(cfg)
    assert rep is not None
    s = result.summary
    s["case"] = str(rep["case"])
    if rep["routing"] == "esft_heldout":
        data = esft_inputs(spec.workload.routing.trace_dir, spec.workload.seed, str(rep["split"]))
        s["split"], s["split_tokens"] = str(rep["split"]), len(data["eval_ids"])
    if rep.get("label"):  # a variant: its own row, beside the four the targets compare
        s["variant"], s["variant_of"] = str(rep["label"]), spec.planner
    wc = work_conserving_s(result, spec.hardware)
    if wc is not None:
        s["wc_makespan_s"] = wc


def work_conserving_s(result: RunResult, hw: HardwareSpec) -> float | None:
    """Lanes only: the makespan if each expert phase took just what a work-conserving GPU needs,
    where a lane's kernel may use the SMs idle lanes leave (as kernels of plain CUDA streams do)
    instead of its fixed 1/G: the phase's expert work at the whole GPU's roofline plus one op
    overhead, or its busiest lane's ops at the whole GPU, whichever is longer. What the partition
    adds to a phase beyond that is taken off the makespan, the rest left as it ran: an estimate
    that takes the phases to be on the critical path, as lanes run them between whole-GPU dense
    ops. None off lanes, and on lanes that already share the SMs (lane_sharing=shared)."""
    ep = result.schedule.ep
    if ep is None or not ep.lanes or ep.lane_sharing == "shared":
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
