"""Probe class: a malformed safetensors file or index is refused by the format's own rules
(the ones safetensors' loader applies), as one line naming the file and the tensor; nothing
runs on wrong weights."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from real.checkpoint import INDEX_FILE, SINGLE_FILE, load_checkpoint
from tests.probes.conftest import one_line, raises_one_line, real_args

Header = dict[str, Any]


def _split(path: Path) -> tuple[Header, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(header: Any, data: bytes) -> bytes:
    b = json.dumps(header).encode()
    return len(b).to_bytes(8, "little") + b + data


def _first(h: Header) -> str:
    return min(k for k in h if k != "__metadata__")


def _edit(h: Header, **meta: Any) -> Header:
    k = _first(h)
    return {**h, k: {**h[k], **meta}}


def _drop(h: Header, key: str) -> Header:
    k = _first(h)
    return {**h, k: {x: v for x, v in h[k].items() if x != key}}


def _end(h: Header) -> int:
    return int(h[_first(h)]["data_offsets"][1])


# (case, header -> new header, data -> new data, words the line must hold)
Edit = Callable[[Header], Any]
CASES: list[tuple[str, Edit, Callable[[bytes], bytes], str]] = [
    ("header a list", lambda h: [h], lambda d: d, "JSON list"),
    ("header a string", lambda h: "x", lambda d: d, "JSON str"),
    ("entry a string", lambda h: {**h, _first(h): "F32"}, lambda d: d, "is not {dtype"),
    ("entry a list", lambda h: {**h, _first(h): [1]}, lambda d: d, "is not {dtype"),
    ("no data_offsets", lambda h: _drop(h, "data_offsets"), lambda d: d, "is not {dtype"),
    ("no shape", lambda h: _drop(h, "shape"), lambda d: d, "is not {dtype"),
    ("no dtype", lambda h: _drop(h, "dtype"), lambda d: d, "is not {dtype"),
    ("offsets short", lambda h: _edit(h, data_offsets=[0, _end(h) - 4]), lambda d: d, "needs"),
    ("offsets long", lambda h: _edit(h, data_offsets=[0, _end(h) + 4]), lambda d: d, "needs"),
    (
        "shape too big",
        lambda h: _edit(h, shape=[2 * x for x in h[_first(h)]["shape"]]),
        lambda d: d,
        "needs",
    ),
    ("shape too small", lambda h: _edit(h, shape=[1]), lambda d: d, "needs"),
    (
        "offsets reversed",
        lambda h: _edit(h, data_offsets=[_end(h), 0]),
        lambda d: d,
        "data_offsets",
    ),
    ("offsets not ints", lambda h: _edit(h, data_offsets=["0", "8"]), lambda d: d, "data_offsets"),
    ("offsets three", lambda h: _edit(h, data_offsets=[0, 4, 8]), lambda d: d, "data_offsets"),
    ("shape negative", lambda h: _edit(h, shape=[-1, 4]), lambda d: d, "shape"),
    ("shape a string", lambda h: _edit(h, shape="4x4"), lambda d: d, "shape"),
    ("dtype unknown", lambda h: _edit(h, dtype="F13"), lambda d: d, "dtype"),
    ("dtype unsupported", lambda h: _edit(h, dtype="I32"), lambda d: d, "dtype"),
    (
        "gap before data",
        lambda h: {
            k: (
                {**v, "data_offsets": [o + 4 for o in v["data_offsets"]]}
                if k != "__metadata__"
                else v
            )
            for k, v in h.items()
        },
        lambda d: b"\0" * 4 + d,
        "starts at data byte",
    ),
    ("bytes after data", lambda h: h, lambda d: d + b"\0" * 8, "past the last tensor"),
    ("data cut short", lambda h: h, lambda d: d[:-4], "truncated"),
    (
        "metadata not strings",
        lambda h: {**h, "__metadata__": {"format": 1}},
        lambda d: d,
        "__metadata__",
    ),
]


@pytest.fixture
def ckpt(tiny_ckpt: Path, tmp_path: Path) -> Path:
    d = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, d)
    return d


@pytest.mark.parametrize("case, header, data, words", CASES, ids=[c[0] for c in CASES])
def test_malformed_header_is_one_line(
    ckpt: Path, case: str, header: Edit, data: Callable[[bytes], bytes], words: str
) -> None:
    f = ckpt / SINGLE_FILE
    h, d = _split(f)
    f.write_bytes(_join(header(h), data(d)))
    line = raises_one_line(lambda: load_checkpoint(ckpt), str(f), words)
    if case.startswith(("entry", "no ", "offsets", "shape", "dtype")):
        assert f"tensor {_first(h)}" in line  # names the tensor it edited


def test_header_cut_off_or_not_json(ckpt: Path) -> None:
    f = ckpt / SINGLE_FILE
    raw = f.read_bytes()
    f.write_bytes(raw[:5])
    raises_one_line(lambda: load_checkpoint(ckpt), str(f), "truncated")
    f.write_bytes((10).to_bytes(8, "little") + b"\xff" * 10)
    raises_one_line(lambda: load_checkpoint(ckpt), str(f), "corrupt")
    f.write_bytes((2**62).to_bytes(8, "little") + b"{}")
    raises_one_line(lambda: load_checkpoint(ckpt), str(f))


def _sharded(ckpt: Path, index: Any) -> None:
    (ckpt / SINGLE_FILE).rename(ckpt / "model-00001-of-00001.safetensors")
    text = index if isinstance(index, str) else json.dumps(index)
    (ckpt / INDEX_FILE).write_text(text)


@pytest.mark.parametrize(
    "index, words",
    [
        ([{"weight_map": {}}], "not a safetensors index"),
        ({"metadata": {}}, "not a safetensors index"),
        ({"weight_map": ["a"]}, "weight_map"),
        ({"weight_map": {}}, "weight_map"),
        ({"weight_map": {"lm_head.weight": 3}}, "weight_map"),
        ({"weight_map": {"lm_head.weight": "../../etc/passwd"}}, "not a file name"),
        ({"weight_map": {"lm_head.weight": "missing.safetensors"}}, "missing checkpoint shard"),
        ({"weight_map": {"lm_head.weight": "a\0.safetensors"}}, "not a file name"),
        ("{not json", "not a safetensors index"),
    ],
    ids=[
        "list",
        "no weight_map",
        "map a list",
        "map empty",
        "file a number",
        "file a path",
        "file missing",
        "file name with a NUL",  # was open()'s ValueError, an internal error
        "not json",
    ],
)
def test_malformed_index_is_one_line(ckpt: Path, index: Any, words: str) -> None:
    _sharded(ckpt, index)
    raises_one_line(lambda: load_checkpoint(ckpt), words)


def test_a_real_run_on_a_malformed_file_is_one_line(
    ckpt: Path, tmp_path: Path, cli_here: Any
) -> None:
    """As a user runs it: a real run whose shard's data_offsets disagree with its shape."""
    f = ckpt / SINGLE_FILE
    h, d = _split(f)
    f.write_bytes(_join(_edit(h, data_offsets=[0, _end(h) - 4]), d))
    r = cli_here("experiments.run", *real_args(ckpt, tmp_path / "run"))
    one_line(r, str(f), _first(h))
    assert not (tmp_path / "run" / "summary.json").exists()


def test_an_index_mapping_a_tensor_twice_keeps_the_last_as_transformers(
    ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """JSON lets a key repeat and keeps the last: the index's reader is transformers, whose
    json.load keeps the last entry, and so does moepipe, with one line naming the file and the
    tensor (it was refused). A last entry naming a file that lacks the tensor is named as
    such. (A safetensors header naming a tensor twice is safetensors' to rule on:
    tests/probes/test_probe_round14a.py.)"""
    h, _ = _split(ckpt / SINGLE_FILE)
    name = _first(h)
    shard = "model-00001-of-00001.safetensors"
    pairs = ", ".join(f'"{n}": "{shard}"' for n in [*h, name] if n != "__metadata__")
    _sharded(ckpt, '{"weight_map": {' + pairs + "}}")
    with caplog.at_level(logging.WARNING):
        load_checkpoint(ckpt)
    said = [r.getMessage() for r in caplog.records if "appears twice" in r.getMessage()]
    assert said and all(repr(name) in line and INDEX_FILE in line for line in said)
    assert "transformers takes the last value" in said[0]
    (ckpt / INDEX_FILE).write_text('{"weight_map": {' + pairs + f', "{name}": "gone"}}}}')
    raises_one_line(lambda: load_checkpoint(ckpt), "gone")


@pytest.mark.parametrize("target", ["self", "missing"])
@pytest.mark.parametrize("name", [INDEX_FILE, SINGLE_FILE])
def test_a_weights_file_that_links_to_nothing_is_named(ckpt: Path, name: str, target: str) -> None:
    """An index that is a symbolic link to itself or to a missing file was reported as no
    weights at all ("no model.safetensors or model.safetensors.index.json")."""
    (ckpt / SINGLE_FILE).unlink()
    (ckpt / name).symlink_to(name if target == "self" else ckpt / "gone.json")
    raises_one_line(lambda: load_checkpoint(ckpt), str(ckpt / name), "symbolic link")


def test_a_tensor_in_two_shards_is_refused(ckpt: Path) -> None:
    """Two shards holding one tensor (the index naming the later one) ran on the index's copy
    without a word; transformers loads every shard whole, and which copy it keeps is load
    order."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(ckpt / SINGLE_FILE)
    (ckpt / SINGLE_FILE).unlink()
    names = sorted(tensors)
    shards = {"a.safetensors": names[:3], "b.safetensors": names[3:]}
    twice = names[0]
    for shard, held in shards.items():
        save_file({n: tensors[n] for n in held}, str(ckpt / shard))
    extra = load_file(ckpt / "b.safetensors") | {twice: torch.zeros_like(tensors[twice])}
    save_file(extra, str(ckpt / "b.safetensors"))
    weight_map = {n: s for s, held in shards.items() for n in held} | {twice: "b.safetensors"}
    (ckpt / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    raises_one_line(lambda: load_checkpoint(ckpt), repr(twice)[1:-1], "a.safetensors and b")


def test_weights_of_another_dtype_than_a_config_without_one_say_so(ckpt: Path) -> None:
    """Under a config.json without torch_dtype the weights' own dtype is read (transformers'
    rule); a tensor of another dtype than the rest was 'config.json says torch.bfloat16', which
    it does not."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(ckpt)[0].dtype_bytes == 4  # float32 weights, run as float32
    tensors = load_file(ckpt / SINGLE_FILE)
    name = next(n for n in tensors if "embed" not in n)
    tensors[name] = tensors[name].bfloat16()
    save_file(tensors, ckpt / SINGLE_FILE, metadata={"format": "pt"})
    raises_one_line(lambda: load_checkpoint(ckpt), name, "names no dtype", '"torch_dtype"')


def test_a_header_or_index_nested_too_deep_for_json_is_one_line(ckpt: Path) -> None:
    """json's parser recurses per bracket: 10^5 of them in a shard's header or in the index
    was an internal RecursionError."""
    deep = "[" * 100_000 + "]" * 100_000
    f = ckpt / SINGLE_FILE
    good = f.read_bytes()
    body = ('{"__metadata__": {"a": ' + deep + "}}").encode()
    f.write_bytes(len(body).to_bytes(8, "little") + body)
    raises_one_line(lambda: load_checkpoint(ckpt), str(f), "corrupt safetensors header")
    f.write_bytes(good)
    _sharded(ckpt, '{"weight_map": {}, "more": ' + deep + "}")
    raises_one_line(lambda: load_checkpoint(ckpt), INDEX_FILE, "not a safetensors index")


def test_a_checkpoint_given_as_one_of_its_files_says_so(ckpt: Path) -> None:
    """checkpoint=DIR/config.json was 'no such checkpoint directory', though it exists."""
    for f in (ckpt / "config.json", ckpt / SINGLE_FILE):
        raises_one_line(lambda f=f: load_checkpoint(f), str(f), "a file, not a checkpoint")
