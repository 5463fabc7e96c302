"""The ESFT trace's converter: `convert_esft` rebuilds `esft_routing.npz` from the upstream
text files (ESFT's repository, a folder or a tarball), checked line by line with the loader's
rules (`core.traces`), and written whole or not at all."""

from __future__ import annotations

import logging
import os
import posixpath
import re
import tarfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import TraceError, cannot_read
from core.files import not_regular, read_small, staging_file
from core.traces import (
    N_EXPERTS,
    SOFTMAX_RULE,
    TOP_K,
    not_softmax_top_k,
)

log = logging.getLogger(__name__)

_LAYER_FILE = re.compile(r"(?:^|/)(?P<task>[^/]+)/expert_weights_(?P<layer>\d+)\.txt$")


# a layer's dump is read whole: far past upstream's (under 1 MB), short of a gzip bomb's
MAX_DUMP_BYTES = 256 * 2**20
_REPLACE = "replace the file with the upstream dump"
_TAR_FIX = "re-download it, or pass the dump's folder"
_DUMP_FIX = "a routing dump is far smaller: replace it with upstream's expert_weights_<layer>.txt"


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
                raise TraceError(
                    f"{f}: {kind}; a routing dump is a text file: remove it or replace it"
                )
            try:
                data = read_small(f, limit=MAX_DUMP_BYTES, fix=_DUMP_FIX)
            except OSError as e:
                raise TraceError(cannot_read(f, e)) from None
            add(f.relative_to(src).as_posix(), data)
    elif src.is_file():
        try:
            with tarfile.open(src) as tar:
                for mem in tar.getmembers():
                    if mem.isfile() and _LAYER_FILE.search(mem.name):
                        if mem.size > MAX_DUMP_BYTES:  # read whole into memory: a gzip bomb
                            raise TraceError(
                                f"{src}: {mem.name} holds {mem.size} bytes, over "
                                f"{MAX_DUMP_BYTES // 2**20} MiB; {_DUMP_FIX}"
                            )
                        fh = tar.extractfile(mem)
                        assert fh is not None
                        add(mem.name, fh.read())
        except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
            why = " ".join(str(e).split())  # tarfile's message lists methods on several lines
            raise TraceError(f"{src}: not a readable tar archive ({why}); {_TAR_FIX}") from None
    elif src.exists():
        raise TraceError(
            f"{src}: {not_regular(src)}; pass a folder of <task>/expert_weights_<layer>.txt "
            "files or the upstream .tar.gz"
        )
    else:
        raise TraceError(f"{src}: no such file or directory; pass the dump's folder or .tar.gz")
    if not found:
        raise TraceError(
            f"{src}: no <task>/expert_weights_<layer>.txt files found; pass a folder of them"
        )
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


def _numbers(fields: list[str], dtype: Any, where: str, name: str, what: str) -> np.ndarray:
    """`fields` as an array of `dtype`, or a TraceError naming the first field that is not one
    (an id of thousands of digits included: Python's int() limit is no user's business)."""
    try:
        return np.array(fields, dtype=dtype)
    except (ValueError, OverflowError):
        for i, f in enumerate(fields):
            try:
                np.array([f], dtype=dtype)
            except (ValueError, OverflowError):
                shown = f if len(f) <= 20 else f"{f[:12]}... ({len(f)} characters)"
                raise TraceError(
                    f"{where}: {name} {i} is {shown!r}, not {what}; replace the file with the "
                    "upstream dump"
                ) from None
        raise


def _parse_line(text: str, where: str, top_k: int, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """One sequence: ([n, k] ids, [n, k] weights) from `ids... \\t\\t weights...`."""
    parts = text.split("\t\t")
    if len(parts) != 2:
        raise TraceError(
            f"{where}: not an ESFT routing dump line: expected '<ids>\\t\\t<weights>', found "
            f"{len(parts) - 1} separators; {_REPLACE}"
        )
    ids = _numbers(parts[0].split("\t"), np.int64, where, "expert id", "an integer")
    w = _numbers(parts[1].split("\t"), np.float32, where, "gate weight", "a number")
    if len(ids) != len(w) or len(ids) % top_k:
        raise TraceError(
            f"{where}: {len(ids)} ids and {len(w)} weights, not equal multiples of {top_k}; "
            f"{_REPLACE}"
        )
    ids, w = ids.reshape(-1, top_k), w.reshape(-1, top_k)
    outside = np.argwhere((ids < 0) | (ids >= n_experts))  # [n, 2] (token, slot)
    if outside.size:
        t, j = outside[0]
        raise TraceError(
            f"{where}: token {t} has expert id {ids[t, j]}, outside [0, {n_experts}); not a dump "
            f"of a {n_experts}-expert model; {_REPLACE}"
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
            f"dump (ESFT logs 6 distinct experts per token); {_REPLACE}"
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
    odd = [t for t in tasks if not t.isprintable()]
    if odd:  # as load_esft refuses it: the trace written would never load
        raise TraceError(
            f"{src}: task folder {folders[odd[0]]!r} holds a newline, tab or other control "
            "character; rename it (a task's name is its folder's)"
        )
    if len(tasks) > 256:  # the npz's task array is uint8
        raise TraceError(
            f"{src}: {len(tasks)} task folders, the trace holds at most 256; convert at most 256 "
            "tasks at a time (move the others out)"
        )
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
            "<task>/expert_weights_1.txt, expert_weights_2.txt, ...; rename them so"
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
        raise TraceError(f"{what} lacks expert_weights_{missing}.txt; supply every layer's file")
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
                raise TraceError(
                    f"{where}: {len(ids)} tokens, layer 1 has {len(layer_ids[0])}; {_REPLACE}"
                )
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
    tmp = staging_file(out)
    try:
        f = open(tmp, "xb")  # noqa: SIM115 (closed below, once written)
    except OSError as e:
        raise TraceError(
            f"{out}: cannot write in {out.parent} ({e.strerror or e}); pass an output path under "
            "a writable folder"
        ) from None
    try:
        with f:
            np.savez_compressed(f, **arrays)
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise TraceError(
            f"{out}: cannot write it ({e.strerror or e}); free space or pass another output path"
        ) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
