"""Real routing trace: DeepSeek ESFT-vanilla-lite (26 MoE layers, 64 experts, top-6), 33,279 tokens.

`load_esft` reads `<trace_dir>/esft-dsv2lite/esft_routing.npz`; `esft_routing` cuts a workload's
sequences out of its token stream; `convert_esft` rebuilds the npz from the upstream text files;
`load_counts` reads one array of the OLMoE repository's aggregate counts
(see `../shared/traces/README.md` for provenance and the formats).
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import tarfile
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import TraceError
from core.files import not_regular
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


def trace_path(trace_dir: str | Path = "../shared/traces") -> Path:
    """The npz under `trace_dir`; a relative `trace_dir` is taken relative to the cwd."""
    return (Path.cwd() / Path(trace_dir)).resolve() / TRACE_NAME / TRACE_FILE


def load_esft(
    trace_dir: str | Path = "../shared/traces",
    *,
    trace_dir_flag: str = "workload.routing.trace_dir",
) -> EsftTrace:
    """Read and validate the ESFT trace (cached per file and modification time).

    `trace_dir_flag` is how the calling command takes the trace folder (e.g. `trace_dir`), for
    the fix an error suggests."""
    path = trace_path(trace_dir)
    try:
        st = path.stat()
        kind = not_regular(path)  # np.load would block on a FIFO, read a device without end
        if kind:
            raise TraceError(f"{path}: {kind}; {_FIX}")
        return _load_cached(str(path), st.st_mtime_ns, st.st_size)
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file; {_fix(trace_dir_flag)}") from None
    except OSError as e:  # e.g. trace_dir names the .npz itself: pass the folder holding it
        raise TraceError(f"{path}: {e.strerror}; {_fix(trace_dir_flag)}") from None
    except TraceError as e:
        if trace_dir_flag == "workload.routing.trace_dir":
            raise
        raise TraceError(str(e).replace(_FIX, _fix(trace_dir_flag))) from None


def _fix(flag: str) -> str:
    return _FIX.replace("workload.routing.trace_dir=", f"{flag}=")


@lru_cache(maxsize=2)
def _load_cached(path: str, mtime_ns: int, size: int) -> EsftTrace:
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [a for a in _ARRAYS if a not in z.files]
            if missing:
                raise TraceError(f"{path}: corrupt trace, missing array(s) {missing}; {_FIX}")
            arrs = {a: z[a] for a in _ARRAYS}
            meta = {a: z[a] for a in _META if a in z.files}
    except TraceError:
        raise
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as e:
        raise TraceError(f"{path}: not a readable npz ({type(e).__name__}: {e}); {_FIX}") from None
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
    return Path(trace_dir) / COUNTS_NAME / COUNTS_FILE


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
    path = counts_path(trace_dir)
    fix = f"pass {trace_dir_flag}=<a folder holding the shipped {COUNTS_NAME}/{COUNTS_FILE}>"
    try:
        path.stat()
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file; {fix}") from None
    except OSError as e:
        raise TraceError(f"{path}: {e.strerror}; {fix}") from None
    kind = not_regular(path)  # np.load would block on a FIFO, read a device without end
    if kind:
        raise TraceError(f"{path}: {kind}; {fix}")
    try:
        with np.load(path, allow_pickle=False) as z:
            if key not in z.files:
                raise TraceError(f"{path}: lacks array {key} (it has {sorted(z.files)}); {fix}")
            counts = z[key]
    except TraceError:
        raise
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as e:
        why = f"{type(e).__name__}: {e}"
        raise TraceError(f"{path}: not a readable npz, or {key} is not ({why}); {fix}") from None
    if counts.dtype.kind not in "iuf":  # strings, objects, booleans, complex: not counts
        raise TraceError(f"{path}: {key} has dtype {counts.dtype}, expected integer counts; {fix}")
    if counts.ndim != 3 or counts.shape[-1] != n_experts or 0 in counts.shape:
        raise TraceError(
            f"{path}: {key} has shape {counts.shape}, expected [domains, layers, {n_experts}] "
            f"(its model's {n_experts} experts); {fix}"
        )
    wrong = np.argwhere(~(np.isfinite(counts) & (counts >= 0)))  # [n, 3] (domain, layer, expert)
    if wrong.size:
        d, layer, x = wrong[0]
        raise TraceError(
            f"{path}: {key} holds {counts[d, layer, x]} at domain {d}, layer {layer}, expert {x} "
            f"({len(wrong)} negative or non-finite count(s)); {fix}"
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
            f"trace {TRACE_NAME} has {list(names)}"
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
    tasks = ",".join(sorted(set(cfg.tasks or trace.task_names) - set(cfg.exclude_tasks)))
    cut = f", its first {layers} of {N_LAYERS} MoE layers" if layers < N_LAYERS else ""
    desc = (
        f"trace {TRACE_NAME} [{tasks}] {len(stream)} tokens in {len(starts)} sequences, "
        f"start seq {workload.seed % len(starts)}, wrapped {wraps}x{cut}"
    )
    labels = trace.task[take].astype(np.int16).reshape(s, p)  # each token's task: its request's
    return Routing(ids, w, N_EXPERTS, desc, labels, trace.task_names)


# ---- converter from the upstream text files -----------------------------------------------------

_LAYER_FILE = re.compile(r"(?:^|/)(?P<task>[^/]+)/expert_weights_(?P<layer>\d+)\.txt$")


def _read_sources(src: Path) -> tuple[dict[str, dict[int, str]], dict[str, str]]:
    """(task -> layer (1-based) -> file text, task -> its folder as errors name it), from a
    directory tree or a .tar(.gz). A task in two folders is an error: one would replace the
    other's layer files."""
    found: dict[str, dict[int, str]] = {}
    folders: dict[str, str] = {}  # task -> its folder, relative to src

    def add(name: str, data: bytes) -> None:
        name = posixpath.normpath(name.replace("\\", "/"))
        m = _LAYER_FILE.search(name)
        if m:
            folder = posixpath.dirname(name)
            first = folders.setdefault(m["task"], folder)
            if first != folder:
                raise TraceError(
                    f"{src}: task {m['task']} is in two folders, {first}/ and {folder}/; keep one "
                    "of them (a task's expert_weights_<layer>.txt files belong in one folder)"
                )
            try:
                text = data.decode()
            except UnicodeDecodeError:
                raise TraceError(
                    f"{src}: {name} is not a UTF-8 text file (a compressed or binary file under a "
                    "routing dump's name?); replace it with the upstream expert_weights_<layer>.txt"
                ) from None
            found.setdefault(m["task"], {})[int(m["layer"])] = text

    if src.is_dir():
        for f in sorted(src.rglob("expert_weights_*.txt")):
            kind = not_regular(f)  # a FIFO would block the read, /dev/zero never end
            if kind:
                raise TraceError(f"{f}: {kind}; a routing dump is a text file")
            try:
                data = f.read_bytes()
            except OSError as e:
                raise TraceError(f"{f}: cannot read it ({e.strerror})") from None
            add(f.relative_to(src).as_posix(), data)
    elif src.is_file():
        try:
            with tarfile.open(src) as tar:
                for mem in tar.getmembers():
                    if mem.isfile() and _LAYER_FILE.search(mem.name):
                        fh = tar.extractfile(mem)
                        assert fh is not None
                        add(mem.name, fh.read())
        except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
            why = " ".join(str(e).split())  # tarfile's message lists methods on several lines
            raise TraceError(f"{src}: not a readable tar archive ({why})") from None
    elif src.exists():
        raise TraceError(
            f"{src}: {not_regular(src)}; pass a folder of <task>/expert_weights_<layer>.txt "
            "files or the upstream .tar.gz"
        )
    else:
        raise TraceError(f"{src}: no such file or directory")
    if not found:
        raise TraceError(f"{src}: no <task>/expert_weights_<layer>.txt files found")
    if src.is_dir():
        # beside the tasks' folders, a folder without layer files is a task whose dump is lost
        parents = {posixpath.dirname(f) for f in folders.values()}
        for parent in sorted(parents):
            for d in sorted((src / parent).iterdir()):
                if d.is_dir() and d.name not in found:
                    raise TraceError(
                        f"{d}: a task folder without expert_weights_<layer>.txt files; supply "
                        "its dump, or remove the folder"
                    )
        return found, {t: str(src / f) for t, f in folders.items()}
    return found, {t: f"{src}: {f}" for t, f in folders.items()}


def _parse_line(text: str, where: str, top_k: int, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """One sequence: ([n, k] ids, [n, k] weights) from `ids... \\t\\t weights...`."""
    parts = text.split("\t\t")
    if len(parts) != 2:
        raise TraceError(
            f"{where}: not an ESFT routing dump line: expected '<ids>\\t\\t<weights>', found "
            f"{len(parts) - 1} separators"
        )
    try:
        ids = np.array(parts[0].split("\t"), dtype=np.int64)
        w = np.array(parts[1].split("\t"), dtype=np.float32)
    except ValueError as e:
        raise TraceError(f"{where}: {e}") from None
    if len(ids) != len(w) or len(ids) % top_k:
        raise TraceError(
            f"{where}: {len(ids)} ids and {len(w)} weights; need equal multiples of {top_k}"
        )
    ids, w = ids.reshape(-1, top_k), w.reshape(-1, top_k)
    outside = np.argwhere((ids < 0) | (ids >= n_experts))  # [n, 2] (token, slot)
    if outside.size:
        t, j = outside[0]
        raise TraceError(
            f"{where}: token {t} has expert id {ids[t, j]}, outside [0, {n_experts}); not a dump "
            f"of a {n_experts}-expert model"
        )
    # the loader's rule (not_softmax_top_k): each in [0, 1], then the top-k's sum and largest
    wrong = np.argwhere(~(np.isfinite(w) & (w >= 0) & (w <= 1.0)))
    off = np.flatnonzero(not_softmax_top_k(w, n_experts)) if not wrong.size else wrong[:0, 0]
    if wrong.size or len(off):
        t, j = wrong[0] if wrong.size else (off[0], int(np.argmax(w[off[0]])))
        raise TraceError(
            f"{where}: token {t} has gate weight {w[t, j]} (its top-{top_k} sum "
            f"{w[t].sum():.4f}); {SOFTMAX_RULE.format(k=top_k, e=n_experts)}: replace the file "
            "with the upstream dump"
        )
    srt = np.sort(ids, axis=1)
    rep = np.flatnonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))
    if rep.size:  # a top-k set never repeats an expert: the groups of k are misaligned
        raise TraceError(
            f"{where}: token {rep[0]} repeats an expert within its {top_k} ids; not a top-{top_k} "
            f"dump (ESFT logs 6 distinct experts per token)"
        )
    return ids, w


def convert_esft(
    src: str | Path,
    out_npz: str | Path,
    n_experts: int = N_EXPERTS,
    top_k: int = TOP_K,
    n_layers: int | None = None,
) -> Path:
    """Upstream `<task>/expert_weights_{1..L}.txt` (directory or tarball) -> the npz layout.

    n_layers: the layer count the dump must have (`load_esft` needs N_LAYERS); None takes L
    from the files."""
    src, out = Path(src), Path(out_npz)
    if out.suffix != ".npz":  # numpy adds it; the path returned is the file written
        out = out.with_name(out.name + ".npz")
    found, folders = _read_sources(src)
    tasks = sorted(found)
    if len(tasks) > 256:  # the npz's task array is uint8
        raise TraceError(f"{src}: {len(tasks)} task folders, the trace holds at most 256")
    n_layers = _layer_count(src, found, n_layers)
    parts = [
        _task_tokens(
            found[task], folders[task], ti, n_layers, top_k, n_experts, f"{src}: task {task}"
        )
        for ti, task in enumerate(tasks)
    ]
    # per field, every task's sequences in order: expert ids, gate weights, task, seq_id, pos
    ids_all, w_all, task_all, seq_all, pos_all = (
        [a for part in parts for a in part[i]] for i in range(5)
    )
    expert_ids = np.concatenate(ids_all)
    assert expert_ids.min() >= 0 and expert_ids.max() < n_experts  # checked per line
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TraceError(
            f"{out}: cannot create its folder {out.parent} ({e.strerror or e}); pass an output "
            "path under a writable folder"
        ) from None
    _atomic_savez(
        out,
        expert_ids=expert_ids.astype(np.uint8),
        gate_weights=np.concatenate(w_all),
        task=np.concatenate(task_all),
        seq_id=np.concatenate(seq_all),
        pos=np.concatenate(pos_all),
        task_names=np.array(tasks),
        model_layer=np.arange(1, n_layers + 1, dtype=np.int16),
        num_experts=np.int16(n_experts),
        top_k=np.int16(top_k),
    )
    log.info("wrote %s: %d tokens, %d tasks", out, len(expert_ids), len(tasks))
    return out


def _layer_count(src: Path, found: dict[str, dict[int, str]], n_layers: int | None) -> int:
    """The dump's layer count L (its files expert_weights_1..L.txt), checked against the
    `n_layers` asked for."""
    numbered = sorted({layer for layers in found.values() for layer in layers})
    if numbered[0] < 1:
        raise TraceError(
            f"{src}: not an ESFT routing dump: layer files numbered {numbered}, expected "
            "<task>/expert_weights_1.txt, expert_weights_2.txt, ..."
        )
    have = max(max(layers) for layers in found.values())
    if n_layers is not None and have != n_layers:
        raise TraceError(
            f"{src}: layer files expert_weights_1..{have}.txt, the ESFT trace has {n_layers} MoE "
            f"layers; supply every <task>/expert_weights_<1..{n_layers}>.txt"
        )
    return have


def _task_tokens(
    layers: dict[int, str],
    folder: str,
    ti: int,
    n_layers: int,
    top_k: int,
    n_experts: int,
    what: str,
) -> list[list[np.ndarray]]:
    """One task's layer files (`layers`: layer -> text) as per-sequence arrays: [expert ids
    [n, L, k], gate weights [n, L, k], task [n], seq_id [n], pos [n]], one list of each."""
    missing = sorted(set(range(1, n_layers + 1)) - set(layers))
    if missing:
        raise TraceError(f"{what} lacks expert_weights_{missing}.txt")
    per_layer = [layers[layer].rstrip("\n").split("\n") for layer in range(1, n_layers + 1)]
    n1 = len(per_layer[0])
    for li, lines in enumerate(per_layer):
        if len(lines) != n1:
            raise TraceError(
                f"{folder}/expert_weights_{li + 1}.txt has {len(lines)} lines, "
                f"expert_weights_1.txt has {n1}; a task's layer files hold one line per "
                "sequence each: supply complete files"
            )
    out: list[list[np.ndarray]] = [[], [], [], [], []]
    for line in range(n1):
        layer_ids: list[np.ndarray] = []  # per layer [n, k]
        layer_w: list[np.ndarray] = []
        for li, lines in enumerate(per_layer):
            where = f"{folder}/expert_weights_{li + 1}.txt line {line + 1}"
            ids, w = _parse_line(lines[line], where, top_k, n_experts)
            if layer_ids and len(ids) != len(layer_ids[0]):
                raise TraceError(f"{where}: {len(ids)} tokens, layer 1 has {len(layer_ids[0])}")
            layer_ids.append(ids)
            layer_w.append(w)
        n = len(layer_ids[0])
        out[0].append(np.stack(layer_ids, axis=1))  # [n, L, k]
        out[1].append(np.stack(layer_w, axis=1))
        out[2].append(np.full(n, ti, np.uint8))
        out[3].append(np.full(n, line, np.int32))
        out[4].append(np.arange(n, dtype=np.int32))
    return out


def _atomic_savez(out: Path, **arrays: Any) -> None:
    """`np.savez_compressed` whole or not at all: into a temporary file in `out`'s folder,
    renamed over `out` once complete, so an interrupt or a full disk mid-write keeps the trace
    that was there. (experiments.common.pipeline's atomic_write_text, for core.)"""
    try:
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    except OSError as e:
        raise TraceError(
            f"{out}: cannot write in {out.parent} ({e.strerror or e}); pass an output path under "
            "a writable folder"
        ) from None
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez_compressed(f, **arrays)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp's 0600 would hide a shared trace from others
        os.replace(tmp, out)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise TraceError(
            f"{out}: cannot write it ({e.strerror or e}); free space or pass another output path"
        ) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask, read once at import (setting it to read it is process-wide)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()
