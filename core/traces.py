"""Real routing trace: DeepSeek ESFT-vanilla-lite (26 MoE layers, 64 experts, top-6), 33,279 tokens.

`load_esft` reads `<trace_dir>/esft-dsv2lite/esft_routing.npz`; `esft_routing` cuts a workload's
sequences out of its token stream; `core.trace_convert.convert_esft` rebuilds the npz from the
upstream text files;
`load_counts` reads one array of the OLMoE repository's aggregate counts
(see `../shared/traces/README.md` for provenance and the formats).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import TraceError
from core.files import no_folder_there, not_regular
from core.npy import NpyError, npz_arrays, npz_names
from core.routing import Routing
from core.spec import ModelSpec, Workload

log = logging.getLogger(__name__)

TRACE_NAME = "esft-dsv2lite"
TRACE_FILE = "esft_routing.npz"
N_LAYERS = 26  # MoE layers (model layers 1..26; layer 0 is dense)
N_EXPERTS = 64  # routed experts per layer
TOP_K = 6
_ARRAYS = ("expert_ids", "gate_weights", "task", "seq_id", "pos", "task_names")
_META = ("num_experts", "top_k", "model_layer")  # what convert_esft records of the model
_FIX = "pass workload.routing.trace_dir=... or rebuild it with python -m experiments.convert_traces"
COUNTS_NAME = "olmoe-aggregates"
COUNTS_FILE = "olmoe_mixtral_counts.npz"


@dataclass(frozen=True)
class EsftTrace:
    expert_ids: np.ndarray  # [T, L, k] uint8: T tokens in (task, seq_id, pos) order, L=26, k=6
    gate_weights: np.ndarray  # [T, L, k] float32: softmax probability of each chosen expert
    task: np.ndarray  # [T] uint8: index into task_names
    seq_id: np.ndarray  # [T] int32: sequence number within its task
    pos: np.ndarray  # [T] int32: token position within its sequence
    task_names: tuple[str, ...]  # intent, law, summary, translation
    path: str = ""  # file it was read from

    @property
    def n_tokens(self) -> int:
        return int(self.expert_ids.shape[0])

    @property
    def seq_key(self) -> np.ndarray:
        """[T] int64 label unique per (task, sequence): equal labels = same sequence."""
        return self.task.astype(np.int64) * (1 << 32) + self.seq_id.astype(np.int64)


DEFAULT_TRACE_DIR = "../shared/traces"  # every command's default: the checkout's sibling
CHECKOUT = Path(__file__).resolve().parents[1]  # the checkout the package is imported from


def trace_dirs(trace_dir: str | Path) -> list[Path]:
    """Where a trace folder is looked for, in order: `trace_dir` from the current folder (a
    path the user gives stays relative to where they run), then, for the default, from the
    checkout (`DEFAULT_TRACE_DIR` beside it), so a command run from another folder reads it."""
    here = (Path.cwd() / Path(trace_dir)).resolve()
    if str(trace_dir) != DEFAULT_TRACE_DIR:
        return [here]
    there = (CHECKOUT / DEFAULT_TRACE_DIR).resolve()
    return [here] if there == here else [here, there]


def found_under(trace_dir: str | Path, holding: str) -> tuple[Path, str]:
    """`holding` under the first of `trace_dirs` that has it (else under the first), and what
    a line of it not found says of the places looked: "" where there was one."""
    places = [d / holding for d in trace_dirs(trace_dir)]
    path = next((p for p in places if os.path.lexists(p)), places[0])
    if len(places) == 1:
        return path, ""
    return path, f" (looked for {trace_dir} from the current folder and from the checkout: " + (
        ", ".join(str(p) for p in places) + ")"
    )


def trace_path(trace_dir: str | Path = DEFAULT_TRACE_DIR) -> Path:
    """The npz under `trace_dir` (`found_under`: relative to the current folder, or for the
    default, to the checkout where the current folder has none)."""
    return found_under(trace_dir, f"{TRACE_NAME}/{TRACE_FILE}")[0]


def load_esft(
    trace_dir: str | Path = "../shared/traces",
    *,
    trace_dir_flag: str = "workload.routing.trace_dir",
) -> EsftTrace:
    """Read and validate the ESFT trace (cached per file and modification time).

    `trace_dir_flag` is how the calling command takes the trace folder (e.g. `trace_dir`), for
    the fix an error suggests."""
    _a_folder(trace_dir, trace_dir_flag, f"{TRACE_NAME}/{TRACE_FILE}")
    path, looked = found_under(trace_dir, f"{TRACE_NAME}/{TRACE_FILE}")
    try:
        st = path.stat()
        kind = not_regular(path)  # np.load would block on a FIFO, read a device without end
        if kind:
            raise TraceError(f"{path}: {kind}; {_FIX}")
        return _load_cached(str(path), st.st_mtime_ns, st.st_size)
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file{looked}; {_fix(trace_dir_flag)}") from None
    except OSError as e:  # e.g. trace_dir names the .npz itself: pass the folder holding it
        raise TraceError(f"{path}: {e.strerror}; {_fix(trace_dir_flag)}") from None
    except TraceError as e:
        if trace_dir_flag == "workload.routing.trace_dir":
            raise
        raise TraceError(str(e).replace(_FIX, _fix(trace_dir_flag))) from None


def _a_folder(trace_dir: str | Path, flag: str, holding: str) -> None:
    """A TraceError where `trace_dir` is there but no folder (a file, the .npz itself, a FIFO):
    its file's line said "Not a directory" of a path under it."""
    if os.path.lexists(trace_dir) and not os.path.isdir(trace_dir):
        raise TraceError(
            f"{flag}={trace_dir}: {no_folder_there(trace_dir)}; pass the folder holding {holding}"
        )


def _fix(flag: str) -> str:
    return _FIX.replace("workload.routing.trace_dir=", f"{flag}=")


@lru_cache(maxsize=2)
def _load_cached(path: str, mtime_ns: int, size: int) -> EsftTrace:
    try:
        files = npz_names(path)
        missing = [a for a in _ARRAYS if a not in files]
        if missing:
            raise TraceError(f"{path}: corrupt trace, missing array(s) {missing}; {_FIX}")
        unknown = [a for a in files if a not in (*_ARRAYS, *_META)]
        if unknown:  # a misspelled model record (num_expert) went unchecked, unsaid
            raise TraceError(
                f"{path}: holds array(s) {unknown} that no routing trace has (it has "
                f"{', '.join((*_ARRAYS, *_META))}); {_FIX}"
            )
        arrs = npz_arrays(path, _ARRAYS)
        meta = npz_arrays(path, [a for a in _META if a in files])
    except (OSError, NpyError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise TraceError(f"{path}: not a readable npz ({why}); {_FIX}") from None
    trace = EsftTrace(
        expert_ids=arrs["expert_ids"],
        gate_weights=arrs["gate_weights"],
        task=arrs["task"],
        seq_id=arrs["seq_id"],
        pos=arrs["pos"],
        task_names=_task_names(path, arrs["task_names"]),
        path=path,
    )
    _validate(trace)
    _validate_meta(trace, meta)
    for a in (trace.expert_ids, trace.gate_weights, trace.task, trace.seq_id, trace.pos):
        a.flags.writeable = False  # shared by every caller through the cache
    log.info("loaded %s: %d tokens", path, trace.n_tokens)
    return trace


def _validate(tr: EsftTrace) -> None:
    def bad(what: str) -> TraceError:
        return TraceError(f"{tr.path}: corrupt trace, {what}; {_FIX}")

    ids, w = tr.expert_ids, tr.gate_weights
    if ids.ndim != 3 or ids.shape[1:] != (N_LAYERS, TOP_K):
        raise bad(f"expert_ids has shape {ids.shape}, expected [T, {N_LAYERS}, {TOP_K}]")
    if w.shape != ids.shape:
        raise bad(f"gate_weights has shape {w.shape}, expert_ids {ids.shape}")
    t = ids.shape[0]
    if t == 0:
        raise bad("it holds no tokens")
    for name, what in (
        ("task", "indices into task_names"),
        ("seq_id", "sequence numbers"),
        ("pos", "token positions"),
    ):
        a = getattr(tr, name)
        if a.shape != (t,):
            raise bad(f"{name} has shape {a.shape}, expected ({t},)")
        if a.dtype.kind not in "iu":  # a float's fraction, a string: no token's index
            raise bad(f"{name} has dtype {a.dtype}, expected integers ({what})")
        if int(a.min()) < 0:  # a token of task -1 was dropped from every selection
            i = int(np.argmin(a))
            raise bad(f"{name} must be {what} >= 0 (token {i} has {a[i]})")
    if int(tr.task.max()) >= len(tr.task_names):
        raise bad(f"task index {int(tr.task.max())} but only {len(tr.task_names)} task_names")
    _validate_order(tr, bad)
    if not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= N_EXPERTS:
        raise bad(f"expert_ids must be integers in [0, {N_EXPERTS})")
    if w.dtype.kind != "f":  # complex weights were cast to their real part with a warning
        raise bad(f"gate_weights has dtype {w.dtype}, expected float32")
    wrong = np.argwhere(~(np.isfinite(w) & (w >= 0) & (w <= 1)))  # [n, 3] (token, layer, slot)
    if wrong.size:
        t0, layer, j = wrong[0]
        raise bad(
            f"gate_weights holds {w[t0, layer, j]} at token {t0}, MoE layer {layer + 1} "
            f"({len(wrong)} value(s) NaN, infinite or outside [0, 1]; gate weights are "
            "probabilities)"
        )
    off = np.argwhere(not_softmax_top_k(w, N_EXPERTS))  # [n, 2] (token, layer)
    if off.size:
        t0, layer = off[0]
        raise bad(
            f"gate_weights of token {t0} at MoE layer {layer + 1} sum to {w[t0, layer].sum():.4f}"
            f", the largest {w[t0, layer].max():.4f} ({len(off)} such token-layers); "
            f"{SOFTMAX_RULE.format(k=TOP_K, e=N_EXPERTS)}"
        )
    srt = np.sort(ids, axis=2)  # [T, L, k]
    rep = np.argwhere((srt[:, :, 1:] == srt[:, :, :-1]).any(axis=2))  # [n, 2] (token, layer)
    if rep.size:  # a top-k set never repeats an expert (convert_esft refuses the same)
        t0, layer = rep[0]
        raise bad(
            f"token {t0} repeats an expert within its top-{TOP_K} ids at MoE layer {layer + 1} "
            f"({len(rep)} such token-layers; a top-k set names {TOP_K} distinct experts)"
        )


# the rule the converter and the loader both apply to a token's top-k gate weights
SOFTMAX_RULE = (
    "gate weights are a softmax's top-{k} over {e} experts: each in [0, 1], summing to at most "
    "1, the largest at least 1/{e}"
)


def not_softmax_top_k(w: np.ndarray, n_experts: int) -> np.ndarray:
    """[...] mask of the top-k weight groups (`w` [..., k], each weight already in [0, 1]) that
    no softmax over `n_experts` gives: summing past 1, or all below 1/E (the largest of E
    probabilities summing to 1 is at least 1/E; an all-zero token is a lost dump). The dump
    rounds each weight to 4 decimals, which the bounds allow."""
    k = w.shape[-1]
    return (w.sum(axis=-1) > 1.0 + k * 1e-4) | (w.max(axis=-1) < 1.0 / n_experts - 1e-4)


def _task_names(path: str, names: np.ndarray) -> tuple[str, ...]:
    """The npz's task_names, checked: distinct non-empty strings (task indexes them, the
    workload's tasks= names them; convert_esft writes its sorted task folders)."""
    got = np.atleast_1d(names)
    if got.dtype.kind != "U" or got.ndim != 1 or got.size == 0:
        raise TraceError(
            f"{path}: corrupt trace, task_names is {got.dtype} of shape {got.shape}, expected "
            f"a list of task names (strings); {_FIX}"
        )
    out = tuple(str(n) for n in got)
    odd = [n for n in out if not n.isprintable()]
    if odd:  # a newline or a tab in a name split the one line that names the tasks
        raise TraceError(
            f"{path}: corrupt trace, task name {odd[0]!r} holds a newline, tab or other control "
            f"character; rename that task (its folder, for convert_traces); {_FIX}"
        )
    twice = sorted({n for n in out if out.count(n) > 1})
    if twice or not all(n.strip() for n in out):
        raise TraceError(
            f"{path}: corrupt trace, task_names {list(out)} "
            + (f"repeats {twice}" if twice else "has an empty name")
            + f"; each task needs its own non-empty name; {_FIX}"
        )
    return out


def _validate_order(tr: EsftTrace, bad: Any) -> None:
    """Tokens in (task, seq_id, pos) order, each sequence's positions 0, 1, 2, ... as
    convert_esft writes them: where they are not, a sequence cut from the stream mixes tokens
    of others, or repeats one."""
    key = tr.seq_key  # [T]
    new = np.r_[True, key[1:] != key[:-1]]  # [T] first token of a sequence run
    pos = tr.pos.astype(np.int64)
    want = np.arange(len(pos)) - np.maximum.accumulate(np.where(new, np.arange(len(pos)), 0))
    back = np.flatnonzero(key[1:] < key[:-1])
    if back.size:
        i = int(back[0]) + 1
        raise bad(
            f"token {i} (task {tr.task[i]}, seq_id {tr.seq_id[i]}) comes after token {i - 1} "
            f"(task {tr.task[i - 1]}, seq_id {tr.seq_id[i - 1]}); tokens are in (task, seq_id, "
            "pos) order"
        )
    wrong = np.flatnonzero(pos != want)  # keys ascend: a sequence's tokens are one run
    if wrong.size:
        i = int(wrong[0])
        raise bad(
            f"token {i} (task {tr.task[i]}, seq_id {tr.seq_id[i]}) has pos {pos[i]}, expected "
            f"{want[i]}; a sequence's tokens have positions 0, 1, 2, ... in order"
        )


def _validate_meta(tr: EsftTrace, meta: dict[str, np.ndarray]) -> None:
    """The model the file says it routes (`convert_esft` writes these): what the loader assumes
    of the ESFT model, or a file of another model read as this one."""

    def bad(what: str) -> TraceError:
        return TraceError(f"{tr.path}: corrupt trace, {what}; {_FIX}")

    for key, want in (("num_experts", N_EXPERTS), ("top_k", TOP_K)):
        got = meta.get(key)
        if got is not None and (got.shape != () or got.dtype.kind not in "iu" or int(got) != want):
            value = got.tolist() if got.dtype.kind in "iu" else f"{got.tolist()!r} ({got.dtype})"
            raise bad(f"{key} is {value}, the ESFT model's is {want} (an integer)")
    layers = meta.get("model_layer")
    if layers is not None and not np.array_equal(layers, np.arange(1, N_LAYERS + 1)):
        raise bad(
            f"model_layer is {layers.tolist()[:8]}{'...' if layers.size > 8 else ''}, "
            f"the ESFT model's MoE layers are 1..{N_LAYERS}"
        )


# ---- aggregate counts (OLMoE repository) -----------------------------------------------------


def counts_path(trace_dir: str | Path) -> Path:
    """The counts file under `trace_dir` (`found_under`, as `trace_path`)."""
    return found_under(trace_dir, f"{COUNTS_NAME}/{COUNTS_FILE}")[0]


MAX_COUNT = 10**15  # tokens one expert of one (domain, layer) counts: past any trace's


def load_counts(
    trace_dir: str | Path,
    key: str,
    n_experts: int,
    *,
    trace_dir_flag: str = "workload.routing.trace_dir",
) -> np.ndarray:
    """[domains, layers, E] expert counts `key` of the aggregate counts file, E = `n_experts`
    (64 for the `olmoe_*` arrays, 8 for the `mixtral_*` ones), checked: one line naming the file
    and the array for one that is missing, unreadable, of another dtype or shape, negative,
    non-finite, or a (domain, layer) that counts no tokens."""
    _a_folder(trace_dir, trace_dir_flag, f"{COUNTS_NAME}/{COUNTS_FILE}")
    path, looked = found_under(trace_dir, f"{COUNTS_NAME}/{COUNTS_FILE}")
    fix = f"pass {trace_dir_flag}=<a folder holding the shipped {COUNTS_NAME}/{COUNTS_FILE}>"
    try:
        path.stat()
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file{looked}; {fix}") from None
    except OSError as e:
        raise TraceError(f"{path}: {e.strerror}; {fix}") from None
    kind = not_regular(path)  # np.load would block on a FIFO, read a device without end
    if kind:
        raise TraceError(f"{path}: {kind}; {fix}")
    try:
        files = npz_names(path)
        if key not in files:
            raise TraceError(f"{path}: lacks array {key} (it has {sorted(files)}); {fix}")
        counts = npz_arrays(path, [key])[key]
    except (OSError, NpyError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise TraceError(f"{path}: not a readable npz, or {key} is not ({why}); {fix}") from None
    if counts.dtype.kind not in "iuf":  # strings, objects, booleans, complex: not counts
        raise TraceError(f"{path}: {key} has dtype {counts.dtype}, expected integer counts; {fix}")
    if counts.dtype.kind == "f" and (np.isfinite(counts) & (counts % 1 != 0)).any():
        at = tuple(int(i) for i in np.argwhere(np.isfinite(counts) & (counts % 1 != 0))[0])
        raise TraceError(
            f"{path}: {key} holds {counts[at]} at {list(at)}, a fraction of a token; expected "
            f"integer counts; {fix}"
        )
    if counts.ndim != 3 or counts.shape[-1] != n_experts or 0 in counts.shape:
        raise TraceError(
            f"{path}: {key} has shape {counts.shape}, expected [domains, layers, {n_experts}] "
            f"(its model's {n_experts} experts); {fix}"
        )
    # [n, 3] (domain, layer, expert); past MAX_COUNT an int64 row's sum wrapped (2**62 x 8 = 0,
    # "counts no tokens") and a float's lost its units
    ok = np.isfinite(counts) & (counts >= 0) & (counts <= MAX_COUNT)
    wrong = np.argwhere(~ok)
    if wrong.size:
        d, layer, x = wrong[0]
        raise TraceError(
            f"{path}: {key} holds {counts[d, layer, x]} at domain {d}, layer {layer}, expert {x} "
            f"({len(wrong)} negative, non-finite or above {MAX_COUNT:.0e} count(s)); {fix}"
        )
    empty = np.argwhere(counts.sum(axis=-1) == 0)  # [n, 2] (domain, layer)
    if empty.size:
        d, layer = empty[0]
        raise TraceError(
            f"{path}: {key} counts no tokens at domain {d}, layer {layer} ({len(empty)} of "
            f"{counts.shape[0] * counts.shape[1]} (domain, layer) rows are all zero); {fix}"
        )
    return counts


# ---- workload routing -------------------------------------------------------------------------


def select_tokens(trace: EsftTrace, tasks: tuple[str, ...], exclude: tuple[str, ...]) -> np.ndarray:
    """[T'] token indices of the chosen tasks, in (task, seq_id, pos) order."""
    names = trace.task_names
    unknown = [t for t in (*tasks, *exclude) if t not in names]
    if unknown:
        raise TraceError(
            f"workload.routing.tasks/exclude_tasks name unknown task(s) {unknown}; "
            f"trace {TRACE_NAME} has {list(names)}: pass names from those"
        )
    keep = set(tasks or names) - set(exclude)
    mask = np.isin(trace.task, [names.index(t) for t in sorted(keep)])
    if not mask.any():
        raise TraceError(
            f"workload.routing selects no tokens (tasks={list(tasks)}, "
            f"exclude_tasks={list(exclude)}); keep at least one of {list(names)}"
        )
    idx = np.flatnonzero(mask)
    order = np.lexsort((trace.pos[idx], trace.seq_id[idx], trace.task[idx]))
    return idx[order]


def replays_esft(model: ModelSpec) -> bool:
    """Whether the ESFT trace can route `model`: its experts and top-k, and at most the trace's
    MoE layers (a `num_hidden_layers` cut of DeepSeek-V2-Lite replays the first ones)."""
    return (model.n_experts, model.top_k) == (N_EXPERTS, TOP_K) and (
        1 <= len(model.moe_layers) <= N_LAYERS
    )


def esft_routing(model: ModelSpec, workload: Workload) -> Routing:
    """Workload sequences cut as consecutive windows of the selected tokens' stream.

    Real sequences are taken in turn (starting at sequence `seed % n`) and concatenated, so a
    window that outgrows one sequence continues with the next; the stream wraps when exhausted.
    """
    have = (N_LAYERS, N_EXPERTS, TOP_K)
    want = (len(model.moe_layers), model.n_experts, model.top_k)
    if not replays_esft(model):
        raise TraceError(
            f"trace {TRACE_NAME} has ({have[0]} layers, {have[1]} experts, top-{have[2]}); "
            f"model {model.name} has {want}; use workload.routing.source=synthetic for this model"
        )
    layers = want[0]  # a cut to the first layers replays the trace's first MoE layers
    cfg = workload.routing
    trace = load_esft(cfg.trace_dir)
    idx = select_tokens(trace, cfg.tasks, cfg.exclude_tasks)  # [T']
    key = trace.seq_key[idx]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])  # first token of each sequence
    first = int(starts[workload.seed % len(starts)])
    stream = np.roll(idx, -first)  # [T'] rotated to start at a sequence boundary
    s, p = workload.n_sequences, workload.seq_positions
    need = s * p
    wraps = (need - 1) // len(stream)
    take = stream[np.arange(need) % len(stream)]  # [S*P]
    ids = trace.expert_ids[take, :layers].astype(np.int16).reshape(s, p, layers, TOP_K)
    w = trace.gate_weights[take, :layers].astype(np.float32).reshape(s, p, layers, TOP_K)
    drawn = sorted(set(cfg.tasks or trace.task_names) - set(cfg.exclude_tasks))
    tasks = ",".join(drawn)
    cut = f", its first {layers} of {N_LAYERS} MoE layers" if layers < N_LAYERS else ""
    desc = (
        f"trace {TRACE_NAME} [{tasks}] {len(stream)} tokens in {len(starts)} sequences, "
        f"start seq {workload.seed % len(starts)}, wrapped {wraps}x{cut}"
    )
    fields = {
        "source": "trace",
        "trace": TRACE_NAME,
        "tasks": drawn,
        "exclude_tasks": sorted(cfg.exclude_tasks),
        "tokens": len(stream),
        "sequences": len(starts),
        "start_seq": workload.seed % len(starts),
        "seed": workload.seed,
        "wrapped": wraps,
        "moe_layers": layers,
        "trace_moe_layers": N_LAYERS,
    }
    labels = trace.task[take].astype(np.int16).reshape(s, p)  # each token's task: its request's
    return Routing(ids, w, N_EXPERTS, desc, labels, trace.task_names, fields)
