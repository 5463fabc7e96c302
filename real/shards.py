"""safetensors shards of a checkpoint: each header checked by the format's own rules, tensors
read back, shards written with their I/O errors raised as OSErrors.

`read_header` is the boundary a checkpoint's weights cross: a malformed or truncated file is one
ConfigError naming the file and the tensor, never a traceback or wrong weights.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from core.errors import ConfigError, quoted
from core.files import (
    TRANSFORMERS_JSON,
    loads_json,
    loads_json_as_owner,
    not_regular,
    note_once,
    plain_permissions,
    read_small,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# the fix where a checkpoint's tensors and its config.json disagree
AT_ODDS = "fix config.json to the model its tensors are of, or re-download the checkpoint"

ST_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,  # FP8 weights (real.fp8), read with their scales
}
ST_CODE = {v: k for k, v in ST_DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    file: Path  # safetensors file holding the tensor
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # byte offset of the tensor's data from the start of the file
    nbytes: int
    # an FP8 weight's float32 scales, one per `block` [rows, columns] (real.fp8); None: none
    scale: TensorEntry | None = None
    block: tuple[int, int] = (0, 0)


# bytes per element of every safetensors dtype (the format's own table), to check each tensor's
# byte range against its shape as safetensors' loader does
ST_ITEM_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}
ST_MAX_HEADER = 100_000_000  # safetensors refuses a larger header


def _shard_size(path: Path) -> int:
    """The bytes of shard `path`, a regular file: a FIFO would block the read, /dev/zero feed
    it without end."""
    kind = not_regular(path)
    if kind:
        raise ConfigError(f"{path}: {kind}; a checkpoint shard is a safetensors file")
    if not path.is_file():
        raise ConfigError(f"{path}: missing checkpoint shard; re-copy or rewrite the checkpoint")
    return path.stat().st_size


def read_header(path: Path) -> dict[str, TensorEntry]:
    """A safetensors file's tensors, its header checked by the format's rules (safetensors'
    `Metadata::validate`): an object of {dtype, shape, data_offsets} entries whose byte ranges
    match shape x dtype and tile the data exactly. Any breach is one ConfigError naming the
    file and the tensor; the library's own loader then opens it as a last check."""
    size = _shard_size(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        first = f.read(1)  # a header is a JSON object: "{" (after JSON's whitespace)
        cut = n < 0 or 8 + n > size
        if n > ST_MAX_HEADER or (cut and first and first not in b"{ \t\r\n"):  # JSON, a zip
            # a name no shard has (tokenizer.model) came from the index, not a bad copy
            fix = "re-copy the checkpoint" if path.suffix == ".safetensors" else _NOT_A_SHARD
            raise ConfigError(
                f"{path}: not a safetensors file (it starts {(head + first)!r}, not a header's "
                f"length and then its JSON object); {fix}"
            )
        f.seek(8)
        if cut:
            raise ConfigError(
                f"{path}: truncated safetensors file ({size} bytes, header cut off); "
                "re-copy the checkpoint"
            )
        twice: list[str] = []  # tensors the header names twice: said once the file passes
        try:
            header = loads_json(f.read(n), f"{path}: safetensors header", _twice(path, twice))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConfigError(
                f"{path}: corrupt safetensors header; re-copy the checkpoint"
            ) from None
    if not isinstance(header, dict):
        raise ConfigError(
            f"{path}: safetensors header is a JSON {type(header).__name__}, not an object of "
            "tensors; re-copy the checkpoint"
        )
    out, ranges = {}, []
    for name, meta in header.items():
        if name == "__metadata__":
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise ConfigError(
                    f"{path}: __metadata__ must map strings to strings; re-copy the checkpoint"
                )
            continue
        start, end, shape = _check_entry(path, name, meta)
        if 8 + n + end > size:
            raise ConfigError(
                f"{path}: truncated safetensors file: tensor {quoted(name)} ends at "
                f"byte {8 + n + end} but the file has {size} bytes; re-copy the checkpoint"
            )
        ranges.append((start, end, name))
        if meta["dtype"] not in ST_DTYPES:
            raise ConfigError(
                f"{path}: tensor {quoted(name)} has dtype {meta['dtype']}; re-save it in one "
                f"of {sorted(ST_DTYPES)}"
            )
        out[name] = TensorEntry(path, ST_DTYPES[meta["dtype"]], shape, 8 + n + start, end - start)
    pos = 0
    for start, end, name in sorted(ranges):
        if start != pos:
            raise ConfigError(
                f"{path}: tensor {quoted(name)} starts at data byte {start}, but the tensors "
                f"before it end at {pos} (safetensors' data holds its tensors back to back); "
                "re-copy the checkpoint"
            )
        pos = end
    if 8 + n + pos != size:
        raise ConfigError(
            f"{path}: {size - 8 - n - pos} bytes past the last tensor (safetensors' data ends "
            "with it); re-copy the checkpoint"
        )
    _library_check(path)
    if twice:
        note_once(
            f"{path}: safetensors header names tensor {quoted(twice[0])} twice ({len(twice)} "
            "such); safetensors takes the last entry, and so does moepipe: rewrite the file "
            "with one"
        )
    return out


def _twice(path: Path, twice: list[str]) -> Callable[[str], None]:
    """What safetensors does with a key its header gives twice: a tensor keeps its last entry
    (serde_json's map), its name put in `twice` to be said in one line (the first entry's
    bytes are then a gap, which the tiling check refuses, as safetensors does); `__metadata__`
    twice is refused, as safetensors refuses it ("duplicate field")."""

    def repeated(key: str) -> None:
        if key == "__metadata__":
            raise ConfigError(
                f"{path}: safetensors header gives __metadata__ twice, which safetensors "
                "refuses; re-copy the checkpoint"
            )
        twice.append(key)

    return repeated


def _check_entry(path: Path, name: str, meta: Any) -> tuple[int, int, tuple[int, ...]]:
    """(start, end, shape) of one header entry, or a ConfigError naming the tensor."""
    where = f"{path}: tensor {quoted(name)}"
    if not isinstance(meta, dict) or not {"dtype", "shape", "data_offsets"} <= set(meta):
        raise ConfigError(
            f"{where}: header entry {json.dumps(meta)[:80]} is not "
            "{dtype, shape, data_offsets}; re-copy the checkpoint"
        )
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]

    def whole(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(dtype, str) or dtype not in ST_ITEM_BYTES:
        raise ConfigError(f"{where}: unknown safetensors dtype {dtype!r}; re-copy the checkpoint")
    if not isinstance(shape, list) or not all(whole(d) for d in shape):
        raise ConfigError(
            f"{where}: shape {shape!r} is not a list of integers; re-copy the checkpoint"
        )
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(whole(o) for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise ConfigError(
            f"{where}: data_offsets {offsets!r} is not [begin, end] with begin <= end; re-copy "
            "the checkpoint"
        )
    nbytes = math.prod(shape) * ST_ITEM_BYTES[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise ConfigError(
            f"{where}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, but shape "
            f"{shape} of {dtype} needs {nbytes}; the file is corrupt: re-copy the checkpoint"
        )
    return offsets[0], offsets[1], tuple(shape)


def _library_check(path: Path) -> None:
    """Open `path` with safetensors' own loader (it maps the file, reading only its header):
    anything its rules refuse that `read_header` let pass is refused here, naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except SafetensorError as e:
        raise ConfigError(f"{path}: safetensors refuses it ({e}); re-copy the checkpoint") from None


_NOT_A_SHARD = "the index names a file that is not a shard: rewrite the index"


def index_files(path: Path) -> list[str]:
    """The shard files a `model.safetensors.index.json` names: its weight_map must map tensor
    names to file names in its own folder."""
    return sorted(set(read_index(path).values()))


def read_index(path: Path) -> dict[str, str]:
    """A `model.safetensors.index.json`'s weight_map (tensor name -> file name in its folder),
    checked: a regular file of at most 16 MiB; a key given twice keeps its last value, as
    transformers' json.load reads it, with one line (a tensor named twice loads from the last
    file named)."""
    data = read_small(path, fix="an index is a JSON file")
    try:
        text = data.decode("utf-8")
        weight_map = loads_json_as_owner(text, str(path), TRANSFORMERS_JSON)["weight_map"]
    except (ValueError, KeyError, TypeError):  # not UTF-8 / JSON, a list, no weight_map
        raise ConfigError(
            f"{path}: not a safetensors index (a JSON object with a weight_map of tensor name -> "
            "file); rewrite or re-copy it"
        ) from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(
            f"{path}: weight_map must be an object of tensor name -> file name; rewrite or "
            "re-copy it"
        )
    for name, file in weight_map.items():
        # a NUL byte no file name holds (open() would fail on it unnamed)
        if not isinstance(file, str) or not file or Path(file).name != file or "\0" in file:
            raise ConfigError(
                f"{path}: weight_map[{name!r}] = {file!r} is not a file name in the checkpoint's "
                "folder"
            )
        if file.lower().endswith(".json"):  # config.json, the index itself: read as weights
            raise ConfigError(
                f"{path}: weight_map[{name!r}] = {file!r} names a JSON file of the checkpoint, "
                "not a shard (a safetensors file); rewrite the index to name the shard that "
                "holds the tensor"
            )
    return weight_map


def index_metadata(
    path: Path, weight_map: dict[str, str], index: dict[str, TensorEntry]
) -> list[str]:
    """The tensors `weight_map` (the index at `path`'s, each found in its shard in `index`)
    names, its `metadata` checked as transformers reads it: an object (from_pretrained takes
    index["metadata"] and fails on another type), refused otherwise in one line; absent, or
    a `total_size` other than the bytes of the tensors named (save_pretrained's sum), one
    logged line, as the index is then stale or hand-made (the tensors are checked anyway)."""
    text = read_small(path, fix="an index is a JSON file").decode("utf-8")
    data = loads_json_as_owner(text, str(path), TRANSFORMERS_JSON)
    meta = data.get("metadata")
    if "metadata" in data and not isinstance(meta, dict):
        raise ConfigError(
            f"{path}: metadata is {json.dumps(meta)[:40]}, not an object (transformers' "
            'from_pretrained fails on it); write "metadata": {"total_size": BYTES}'
        )
    held = sum(index[n].nbytes for n in weight_map)
    size = meta.get("total_size") if meta is not None else None
    if meta is None or size is None:
        note_once(
            f"{path}: no metadata.total_size (transformers' save_pretrained writes the bytes of "
            f"its tensors, here {held}); add it, or rewrite the index"
        )
    elif size != held or isinstance(size, bool):
        note_once(
            f"{path}: metadata.total_size is {json.dumps(size)[:40]}, but the tensors its "
            f"weight_map names hold {held} bytes (a stale or hand-edited index); set it to "
            f"{held}, or rewrite the index"
        )
    return list(weight_map)


def read_tensor(entry: TensorEntry) -> torch.Tensor:
    """One tensor's bytes from its file (a plain buffered read)."""
    with open(entry.file, "rb") as f:
        f.seek(entry.offset)
        buf = bytearray(f.read(entry.nbytes))
    if len(buf) != entry.nbytes:
        raise OSError(
            f"{entry.file}: short read at byte {entry.offset} ({len(buf)} of {entry.nbytes})"
        )
    return torch.frombuffer(buf, dtype=torch.uint8).view(entry.dtype).reshape(entry.shape)


def save_shard(tensors: dict[str, torch.Tensor], path: Path, meta: dict[str, str]) -> None:
    """safetensors' save_file, its I/O errors (a full disk) raised as the OSError they are."""
    from safetensors import SafetensorError

    try:
        save_file(tensors, str(path), metadata=meta)
        plain_permissions(path)
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        raise OSError(int(code.group(1)) if code else None, str(e), str(path)) from None


def weight_files(d: Path) -> list[str]:
    """The safetensors files of checkpoint `d`: the ones its index names, or its one file;
    a ConfigError for weights that are not regular files, links to nothing, or both kinds."""
    for name in (INDEX_FILE, SINGLE_FILE):  # is_file() below would call them absent
        kind = not_regular(d / name)
        if kind:
            raise ConfigError(f"{d / name}: {kind}; the checkpoint's weights are files")
        if (d / name).is_symlink() and not (d / name).exists():  # dangling, or a loop
            raise ConfigError(
                f"{d / name}: a symbolic link to nothing (its target is missing, or it links "
                "to itself); point it at the file or re-copy the checkpoint"
            )
    if (d / INDEX_FILE).is_file():
        files = index_files(d / INDEX_FILE)
        if (d / SINGLE_FILE).is_file() and SINGLE_FILE not in files:
            raise ConfigError(
                f"{d}: holds both {SINGLE_FILE} and {INDEX_FILE} (which names other files), two "
                "sets of weights; keep the one config.json was written with"
            )
        stray = sorted({p.name for p in d.glob("*.safetensors")} - set(files))
        if stray:  # an earlier sharding's, or another format's (consolidated.safetensors)
            note_once(
                f"{d / stray[0]}: a safetensors file {INDEX_FILE} does not name ({len(stray)} "
                "such); transformers and moepipe read none of it: remove it, or rewrite the index"
            )
    elif (d / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        pickled = sorted(p.name for p in d.glob("pytorch_model*.bin*"))
        if pickled:  # save_pretrained(safe_serialization=False) of transformers before 5
            raise ConfigError(
                f"{d}: no {SINGLE_FILE} or {INDEX_FILE}, but {pickled[0]}, torch's pickled "
                "weights, which moepipe does not read; re-save the model with transformers' "
                "save_pretrained, whose default writes safetensors"
            )
        variants = sorted(p.name for p in d.glob("model.*") if _VARIANT.match(p.name))
        if variants:  # save_pretrained(variant=...): transformers loads it only when asked
            raise ConfigError(
                f"{d}: no {SINGLE_FILE} or {INDEX_FILE}, but {variants[0]}, a save_pretrained "
                "variant (transformers loads it only given variant=); rename it and its "
                "shards without the variant (model.safetensors, model-00001-of-...)"
            )
        raise ConfigError(f"{d}: no {SINGLE_FILE} or {INDEX_FILE}; the checkpoint has no weights")
    return files


# a save_pretrained variant's weights: model.bf16.safetensors, its index, its shards
_VARIANT = re.compile(r"model\.\w[\w-]*\.safetensors$")
