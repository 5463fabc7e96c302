"""Round 21c of issue 48: refusals whose line named what is wrong but not what to do (klotski's
GPU edge also named the activations twice). Each line is made by a real call, in this process,
and must end in its fix.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from core.errors import CapacityError, ConfigError, MoepipeError, TraceError
from core.hf_config.fields import read_hf_config
from core.hf_config.generation import read_generation
from core.spec import RoutingConfig
from core.trace_convert import convert_esft
from core.types import Tensor, Tier
from experiments.common import dist_run
from experiments.common.cli import error_line
from experiments.common.pipeline import RunSpec
from real.checkpoint import Unit, load_checkpoint, reduced_spec
from real.shards import read_header, read_index
from real.store import TieredStore
from tests.conftest import NEEDS_TRACES, overridden
from tests.probes.conftest import TINY, one_line


def test_klotskis_refusal_at_the_gpu_edge_names_the_activations_once(
    tmp_path: Path, cli_here: Any
) -> None:
    """hardware.memory_gb.gpu=0.00001: the placement's line says "activations 6.14e-06 GB", and
    the n-planner's addition said it again."""
    args = overridden(TINY, "planner=klotski", "hardware.memory_gb.gpu=0.00001")
    r = cli_here("experiments.run", *args, f"hydra.run.dir={tmp_path}/r")
    line = one_line(r, "smaller than the working set", "raise hardware.memory_gb.gpu")
    assert line.count("activations") == 1, line


@pytest.mark.parametrize(
    ("args", "fix"),
    [
        (["test=[nosuch]"], "pass tasks the trace has:"),
        (["train=[law]", "test=[law]"], "drop ['law'] from one of them"),
    ],
)
@NEEDS_TRACES
def test_prefetch_evals_task_refusals_end_in_their_fix(
    cli_here: Any, args: list[str], fix: str
) -> None:
    """An unknown task said only "the trace has ..."; an overlap "evaluate on unseen tasks"."""
    one_line(cli_here("experiments.prefetch_eval", *args), fix)


def test_a_process_group_that_did_not_form_says_what_to_do(monkeypatch: Any) -> None:
    """A spawned rank's rendezvous timeout named the causes (a rank never joined, a wrong
    MASTER_ADDR/MASTER_PORT) and torch's line, but no fix."""
    import torch.distributed as dist

    def timed_out(**kw: Any) -> None:
        raise RuntimeError("Timed out initializing process group")

    monkeypatch.setattr(dist, "init_process_group", timed_out)
    init = ("tcp://127.0.0.1:1", 0, 2)
    with pytest.raises(MoepipeError) as e:
        dist_run._rank("ckpt", RunSpec.__new__(RunSpec), "live", None, 1.0, init)
    assert "did not form" in str(e.value) and "raise the timeout" in str(e.value), e.value


def test_validate_with_every_planner_skipped_says_what_to_do(
    tmp_path: Path, tiny_ckpt: Path, cli_here: Any, monkeypatch: Any
) -> None:
    """Each planner's refusal carries its own fix; the line that joined them ended in the last
    one's, as if one planner's fix were the whole story."""
    from experiments import validate

    def refuse(spec: Any) -> Any:
        raise CapacityError("device pool 1 MB cannot hold a layer (9 MB); raise gpu_frac")

    monkeypatch.setattr(validate, "sized_run", refuse)
    args = [f"checkpoint={tiny_ckpt}", "hardware=tiny", "planners=[flexgen]", f"out={tmp_path}/v"]
    line = one_line(cli_here("experiments.validate", *args), "every planner was skipped")
    assert line.endswith("or pass planners=[...] that fit"), line
    assert not (tmp_path / "v").exists()


@pytest.mark.parametrize(
    "misuse",
    [
        lambda s, u: s.to_device(u),
        lambda s, u: s.evict(u, Tier.GPU),
        lambda s, u: s.evict(u, Tier.DISK),
    ],
    ids=["to_device", "evict", "evict_disk"],
)
def test_a_store_misused_by_the_executor_is_an_internal_error(tiny_ckpt: Path, misuse: Any) -> None:
    """The store's own invariants (a unit copied before it was read, one freed twice) were
    MoepipeErrors: the CLI printed them as the user's mistake, with no fix a user could make.
    They are the executor's bugs: the CLI now says so and keeps the traceback."""
    store = TieredStore(str(tiny_ckpt), device_capacity_bytes=1)
    with pytest.raises(AssertionError) as e:
        misuse(store, Unit(Tensor.EXPERT, 0, 0))
    assert not isinstance(e.value, MoepipeError) and error_line(e.value) is None


@pytest.mark.parametrize(
    ("edit", "fix"),
    [
        (
            {"num_hidden_layers": 3},
            "fix config.json to the model its tensors are of, or re-download",
        ),
        ({"intermediate_size": 16}, "fix config.json to the model its tensors are of"),
        ({"torch_dtype": "float16"}, "re-save the tensor in torch.float16"),
    ],
    ids=["missing", "shape", "dtype"],
)
def test_a_checkpoint_at_odds_with_its_config_says_what_to_do(
    tmp_path: Path, tiny_ckpt: Path, edit: dict[str, Any], fix: str
) -> None:
    """A tensor missing, of another shape or another dtype than config.json says was named,
    with no word of what to do about it."""
    ckpt = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(ConfigError) as e:
        load_checkpoint(ckpt)
    assert fix in str(e.value), e.value


def test_a_reduced_model_of_too_many_layers_says_how_many_to_pass() -> None:
    """n_layers=10**9 said "more than any model has (at most ...)", the fix left to infer."""
    with pytest.raises(ConfigError, match=r"pass n_layers <= \d+"):
        reduced_spec("mixtral-tiny", n_layers=10**9)


def _shard(path: Path, header: dict[str, Any], data: int = 8) -> Path:
    """A safetensors file of `header` and `data` zero bytes."""
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(data))
    return path


_ENTRY = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("header", "fix"),
    [
        ({"__metadata__": {"a": 1}, "w": _ENTRY}, "strings; re-copy the checkpoint"),
        ({"w": {**_ENTRY, "dtype": "Q9"}}, "dtype 'Q9'; re-copy the checkpoint"),
        ({"w": {**_ENTRY, "shape": ["2"]}}, "integers; re-copy the checkpoint"),
        ({"w": {**_ENTRY, "data_offsets": [8, 0]}}, "begin <= end; re-copy the checkpoint"),
        ({"w": {**_ENTRY, "dtype": "I32"}}, "re-save it in one of"),
    ],
    ids=["metadata", "unknown_dtype", "shape", "offsets", "unsupported_dtype"],
)
def test_a_malformed_safetensors_header_says_what_to_do(
    tmp_path: Path, header: dict[str, Any], fix: str
) -> None:
    """Each named the breach of the format and stopped there."""
    with pytest.raises(ConfigError) as e:
        read_header(_shard(tmp_path / "model.safetensors", header))
    assert fix in str(e.value), e.value


def test_an_index_whose_weight_map_is_empty_says_what_to_do(tmp_path: Path) -> None:
    """`"weight_map": {}` said what it must be, not what to do."""
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(ConfigError, match="rewrite or re-copy it"):
        read_index(index)


@pytest.mark.parametrize(
    ("fields", "fix"),
    [
        ({"hot_experts": 2}, "set both, or neither"),
        ({"hot_share": 0.5}, "set both, or neither"),
    ],
    ids=["hot_experts_alone", "hot_share_alone"],
)
def test_half_a_hot_set_says_to_set_both(fields: dict[str, Any], fix: str) -> None:
    """hot_experts without hot_share (or the other way round) said what the other is for."""
    with pytest.raises(ConfigError, match=fix):
        RoutingConfig(**fields)


@pytest.mark.parametrize(
    ("text", "fix"),
    [(b"\xff{}", "re-save it with save_pretrained"), (b"[1]", "re-save it with save_pretrained")],
    ids=["not_utf8", "not_an_object"],
)
def test_a_config_json_that_is_no_object_says_what_to_do(
    tmp_path: Path, text: bytes, fix: str
) -> None:
    """A config.json not UTF-8, or a JSON list, said what a config.json is, not what to do."""
    (tmp_path / "config.json").write_bytes(text)
    with pytest.raises(ConfigError, match=fix):
        read_hf_config(tmp_path)


def test_a_generation_config_not_utf8_says_what_to_do(tmp_path: Path) -> None:
    """It said "it is JSON" and stopped."""
    (tmp_path / "config.json").write_bytes(b"\xff{}")
    with pytest.raises(ConfigError, match="re-save it as the JSON"):
        read_generation(tmp_path, 8)


def _dump(root: Path, *layers: str) -> Path:
    """An ESFT routing dump of one task, `layers` the text of expert_weights_1.txt, ..."""
    (root / "dump").mkdir()
    for i, text in enumerate(layers, 1):
        (root / "dump" / "law").mkdir(exist_ok=True)
        (root / "dump" / "law" / f"expert_weights_{i}.txt").write_text(text)
    return root / "dump"


@pytest.mark.parametrize(
    ("layers", "fix"),
    [
        (None, "pass the dump's folder or .tar.gz"),
        ((), "pass a folder of them"),
        (("1\t2\t3\t\t0.3\t0.2\n",), "replace the file with the upstream dump"),
        (("1\t99\t\t0.3\t0.2\n",), "replace the file with the upstream dump"),
        (("1\t1\t\t0.3\t0.2\n",), "replace the file with the upstream dump"),
        (("1\t2\t\t0.3\t0.2\n", "1\t2\t3\t4\t\t0.3\t0.2\t0.3\t0.2\n"), "layer 1 has 1; replace"),
    ],
    ids=["no_such_path", "no_files", "ids_and_weights", "outside", "repeat", "tokens"],
)
def test_an_esft_dump_refusal_says_what_to_do(
    tmp_path: Path, layers: tuple[str, ...] | None, fix: str
) -> None:
    """Each named what is wrong with the dump and stopped there."""
    src = tmp_path / "none" if layers is None else _dump(tmp_path, *layers)
    n = max(len(layers or ()), 1)
    with pytest.raises(TraceError, match=re.escape(fix)):
        convert_esft(src, tmp_path / "out.npz", n_experts=8, top_k=2, n_layers=n)
