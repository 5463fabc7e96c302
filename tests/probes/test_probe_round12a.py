"""Probe round 12a (issue 48): other members of the malformed-input classes. A config.json whose
widths are past any model's named the spec's field (n_heads) not config.json's; a model_type of
another family over the first family's fields ran that family's defaults; a RoPE object that
transformers only warns about (a key its type does not take, a factor below 1, betas or llama3's
frequencies the wrong way round, two types) ran; and Switch's decoder sizes were not typed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from core.hf_config import spec_to_hf_config
from core.spec import ModelSpec
from real.checkpoint import reduced_spec
from tests.probes.conftest import raises_one_line

BASE = {
    "mixtral": spec_to_hf_config(reduced_spec("mixtral-tiny")),
    "qwen2_moe": spec_to_hf_config(reduced_spec("qwen1.5-moe-a2.7b")),
    "olmoe": spec_to_hf_config(reduced_spec("olmoe-1b-7b")),
    "deepseek_v2": spec_to_hf_config(reduced_spec("deepseek-v2-lite")),
    "switch_transformers": spec_to_hf_config(reduced_spec("switch-base-128")),
}


def _refused(tmp_path: Path, cfg: dict[str, Any], *words: str) -> str:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    where = str(tmp_path / "config.json")
    return raises_one_line(lambda: ModelSpec.from_hf_config(tmp_path), where, *words)


HUGE = 10**20


@pytest.mark.parametrize(
    ("family", "field"),
    [
        ("mixtral", "num_attention_heads"),
        ("mixtral", "num_local_experts"),
        ("qwen2_moe", "shared_expert_intermediate_size"),
        ("olmoe", "intermediate_size"),
        ("deepseek_v2", "qk_rope_head_dim"),
        ("deepseek_v2", "n_shared_experts"),
        ("switch_transformers", "d_kv"),
        ("switch_transformers", "d_model"),
    ],
)
def test_a_width_past_any_models_names_config_jsons_field(
    tmp_path: Path, family: str, field: str
) -> None:
    """num_attention_heads=1e20 said "n_heads=..., wider than any model", a field config.json
    does not have."""
    line = _refused(tmp_path, BASE[family] | {field: HUGE}, f"{field} must be")
    assert "16777216" in line or "32767" in line, line


def test_a_width_summed_past_any_models_names_the_fields_summed(tmp_path: Path) -> None:
    cfg = BASE["deepseek_v2"] | {"qk_nope_head_dim": 1 << 24, "qk_rope_head_dim": 64}
    _refused(tmp_path, cfg, "qk_head_dim", "qk_nope_head_dim + qk_rope_head_dim")


@pytest.mark.parametrize(
    ("fields_of", "model_type", "field"),
    [
        ("mixtral", "qwen2_moe", "num_local_experts"),
        ("mixtral", "switch_transformers", "num_experts_per_tok"),
        ("qwen2_moe", "olmoe", "moe_intermediate_size"),
        ("olmoe", "mixtral", "norm_topk_prob"),
        ("deepseek_v2", "mixtral", "n_routed_experts"),
        ("switch_transformers", "olmoe", "d_model"),
    ],
)
def test_another_familys_fields_under_a_model_type_are_refused(
    tmp_path: Path, fields_of: str, model_type: str, field: str
) -> None:
    """A Mixtral config.json under model_type qwen2_moe ran Qwen2-MoE's 60 experts of 1408
    (transformers' defaults), the file's num_local_experts unread."""
    cfg = {k: v for k, v in BASE[fields_of].items() if k != "architectures"}
    cfg = cfg | {"model_type": model_type}
    if fields_of == "deepseek_v2":
        cfg = {k: v for k, v in cfg.items() if k not in ("qk_nope_head_dim", "kv_lora_rank")}
        cfg = {k: v for k, v in cfg.items() if k != "q_lora_rank"}  # refused too (round 19a)
        cfg = {k: v for k, v in cfg.items() if k not in ("qk_rope_head_dim", "v_head_dim")}
        cfg = {k: v for k, v in cfg.items() if k != "moe_intermediate_size"}
    line = _refused(tmp_path, cfg, f"{field} is a field of", f"model_type {model_type!r}")
    assert "fix model_type" in line


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize(
    ("rope", "words"),
    [
        ({"rope_type": "linear", "factor": 2.0, "fctor": 3.0}, "fctor is not a key of linear"),
        ({"rope_type": "linear", "factor": 2.0, "beta_fast": 3.0}, "beta_fast is not a key"),
        ({"factor": 2.0}, "has factor but no rope_type"),
        ({"type": "linear", "rope_type": "dynamic", "factor": 2.0}, "give one type"),
        ({"rope_type": "dynamic", "factor": 0.5}, "factor=0.5 must be >= 1"),
        ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 1.0, "beta_slow": 32.0}, "swap"),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "high_freq_factor=4.0 must be above low_freq_factor=4.0",
        ),
        ({"rope_type": "default", "partial_rotary_factor": 2.0}, "partial_rotary_factor must"),
    ],
)
def test_a_rope_object_transformers_warns_about_is_refused(
    tmp_path: Path, key: str, rope: dict[str, Any], words: str
) -> None:
    """Each ran, in the simulator and the real model: transformers logs a warning and runs
    something other than the file meant (the typo's key unread, the other type)."""
    for family in ("mixtral", "deepseek_v2"):
        (tmp_path / family).mkdir()
        _refused(tmp_path / family, BASE[family] | {key: rope}, key, words)


def test_rope_keys_no_family_reads_and_an_empty_object_still_load(tmp_path: Path) -> None:
    for rope in ({}, {"rope_type": "default", "mrope_section": [2, 2, 4]}, {"rope_theta": 1e4}):
        (tmp_path / "config.json").write_text(json.dumps(BASE["mixtral"] | {"rope_scaling": rope}))
        assert ModelSpec.from_hf_config(tmp_path).n_layers > 0


@pytest.mark.parametrize("value", [True, -1, 2.5, "12", [12]])
@pytest.mark.parametrize("field", ["num_decoder_layers", "num_sparse_decoder_layers"])
def test_switchs_decoder_sizes_are_typed(tmp_path: Path, field: str, value: Any) -> None:
    _refused(tmp_path, BASE["switch_transformers"] | {field: value}, f"{field} must be")


def test_an_index_that_lacks_a_tensor_its_shards_hold_is_refused(
    tiny_ckpt: Path, tmp_path: Path
) -> None:
    """A stale index (a tensor in a shard but not in weight_map) loaded the shard's copy
    without a word, the index and the shards disagreeing on what the checkpoint holds."""
    import shutil

    from safetensors.torch import load_file, save_file

    from real.checkpoint import INDEX_FILE, SINGLE_FILE, load_checkpoint

    ckpt = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ckpt)
    tensors = load_file(ckpt / SINGLE_FILE)
    (ckpt / SINGLE_FILE).unlink()
    save_file(tensors, str(ckpt / "a.safetensors"))
    names = sorted(tensors)
    (ckpt / INDEX_FILE).write_text(
        json.dumps({"weight_map": dict.fromkeys(names[1:], "a.safetensors")})
    )
    raises_one_line(
        lambda: load_checkpoint(ckpt), INDEX_FILE, f"lacks tensor {names[0]!r}", "a.safetensors"
    )
    (ckpt / INDEX_FILE).write_text(
        json.dumps({"weight_map": dict.fromkeys(names, "a.safetensors")})
    )
    assert load_checkpoint(ckpt)[0].n_layers == 2


def test_an_npz_member_without_the_npy_suffix_is_one_line(tmp_path: Path) -> None:
    """A zip whose members are raw bytes named `expert_ids` (no `.npy`): npz_names counted
    them, then reading `expert_ids.npy` was a KeyError traceback."""
    import zipfile

    from core.traces import TRACE_FILE, TRACE_NAME, load_esft

    (tmp_path / TRACE_NAME).mkdir()
    with zipfile.ZipFile(tmp_path / TRACE_NAME / TRACE_FILE, "w") as z:
        for name in ("expert_ids", "gate_weights", "task", "seq_id", "pos", "task_names"):
            z.writestr(name, b"\0" * 16)
    raises_one_line(lambda: load_esft(tmp_path), TRACE_FILE, "array expert_ids", "no .npy header")


def test_counts_with_a_fraction_of_a_token_are_refused(tmp_path: Path) -> None:
    """Float counts of 10.5 tokens were fitted; whole floats still load."""
    import numpy as np

    from core.traces import COUNTS_FILE, COUNTS_NAME, load_counts

    (tmp_path / COUNTS_NAME).mkdir()
    counts = np.full((5, 3, 64), 10.0)
    counts[1, 2, 3] = 10.5
    np.savez(tmp_path / COUNTS_NAME / COUNTS_FILE, olmoe_counts_top1=counts)
    raises_one_line(
        lambda: load_counts(tmp_path, "olmoe_counts_top1", 64),
        COUNTS_FILE,
        "olmoe_counts_top1 holds 10.5 at [1, 2, 3]",
        "integer counts",
    )
    np.savez(tmp_path / COUNTS_NAME / COUNTS_FILE, olmoe_counts_top1=np.full((5, 3, 64), 10.0))
    assert load_counts(tmp_path, "olmoe_counts_top1", 64).shape == (5, 3, 64)


# ---- result files read back --------------------------------------------------------------


@pytest.mark.parametrize("what", ["fifo", "folder"])
def test_a_run_log_that_is_no_file_is_one_line(tmp_path: Path, cli_here: Any, what: str) -> None:
    """run.log a FIFO: the run hung in logging's FileHandler (its open waits for a reader); a
    folder: "internal error (ValueError: Unable to configure handler 'file')"."""
    import os

    from tests.probes.conftest import TINY, deadline, one_line

    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "run.log") if what == "fifo" else (run / "run.log").mkdir()
    with deadline(120):
        r = cli_here("experiments.run", *TINY, f"hydra.run.dir={run}")
    one_line(r, str(run / "run.log"), "where the run writes its log", "move it away")
    assert not (run / "summary.json").exists()


@pytest.mark.parametrize(
    "mark",
    ["FIFO", "[" * 100_000 + "]" * 100_000, "[1]", b"\xff\xfe"],
    ids=["fifo", "deep", "list", "binary"],
)
def test_a_sweep_mark_that_is_none_is_no_mark(tmp_path: Path, mark: Any) -> None:
    """A resumed sweep read each point's .sweep.json with read_text: a FIFO there hung the
    sweep's progress thread, and one nested 10^5 deep was a RecursionError traceback."""
    import os
    import signal

    from experiments.common.callbacks import SWEEP_MARK, _marked

    class Blocked(Exception):  # not an OSError, which _marked would take for a missing mark
        pass

    def blocked(signum: int, frame: Any) -> None:
        raise Blocked

    if mark == "FIFO":
        os.mkfifo(tmp_path / SWEEP_MARK)
    else:
        (tmp_path / SWEEP_MARK).write_bytes(mark if isinstance(mark, bytes) else mark.encode())
    old = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(20)
    try:
        assert _marked(tmp_path) is None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    (tmp_path / SWEEP_MARK).unlink()
    (tmp_path / SWEEP_MARK).write_text('{"sweep": "t", "earlier": null}')
    assert _marked(tmp_path) == {"sweep": "t", "earlier": None}


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep folder of one finished tiny run, without files.sha256 (a run dir made by hand:
    what it holds is checked by its own rules)."""
    from tests.probes.conftest import tiny_run

    root = tmp_path_factory.mktemp("sweep")
    tiny_run(root / "good")
    (root / "good" / "files.sha256").unlink()
    return root


def test_a_summary_giving_a_key_twice_takes_the_last_as_json_does(
    finished: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A summary.json giving a key twice was refused; Python's json, which wrote it, keeps
    the last value (json.loads), and so does collect now, saying so in one line (round 14a:
    the format's owner decides). A last value that breaks the summary's own identities is
    refused by those; a rerun reuses no summary edited since the run (files.sha256)."""
    import shutil

    from experiments.common.tables import collect

    mine = tmp_path / "sweep"
    shutil.copytree(finished, mine)
    shutil.copytree(mine / "good", mine / "bad")
    path = mine / "bad" / "summary.json"
    path.write_text(path.read_text().rstrip()[:-1] + ', "planner": "flexgen"}')
    with caplog.at_level("WARNING"):
        df, problems = collect(mine)
    assert len(df) == 2 and not problems, problems
    said = [r.getMessage() for r in caplog.records if "appears twice" in r.getMessage()]
    assert said == [
        f"{path}: key 'planner' appears twice in one JSON object; Python's json, which wrote "
        "it, takes the last value (json.loads), and so does moepipe: keep one of them"
    ]
    path.write_text(path.read_text().rstrip()[:-1] + ', "makespan_s": 1.0}')
    raises_one_line(lambda: collect(mine), str(path), "not tokens_generated / makespan_s")


@pytest.mark.parametrize(
    ("key", "value"), [("n_batches", 2.5), ("ops", 70.5), ("tokens_generated", 1e-3)]
)
def test_a_count_that_is_no_whole_number_is_not_a_runs(
    finished: Path, tmp_path: Path, key: str, value: float
) -> None:
    """n_batches 2.5 went into the table (and report's axis) as a run's."""
    import shutil

    from experiments.common.tables import collect

    mine = tmp_path / "sweep"
    shutil.copytree(finished, mine)
    path = mine / "good" / "summary.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {key: value}))
    raises_one_line(lambda: collect(mine), str(path), f"{key} is {value}", "must be an integer")


# six levels of nine aliases: 59,049 values, under the million check_yaml_size allowed
LAUGHS_6 = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(5)
)


@pytest.mark.parametrize("group", ["hardware", "workload"])
def test_aliases_omegaconf_would_build_for_a_minute_are_refused(
    tmp_path: Path, cli_here: Any, group: str
) -> None:
    """A file of 59,049 aliased values passed the size check and ran for over a minute while
    omegaconf built them, before its unknown keys were refused."""
    from core.yaml_size import check_yaml_size
    from tests.conftest import ROOT
    from tests.probes.conftest import TINY, deadline, one_line

    path = tmp_path / f"{group}.yaml"
    path.write_text((ROOT / "conf" / group / "tiny.yaml").read_text() + LAUGHS_6)
    args = [a for a in TINY if not a.startswith(f"{group}=")]
    with deadline(60):
        r = cli_here("experiments.run", *args, f"{group}={path}", f"hydra.run.dir={tmp_path}/r")
    one_line(r, str(path), "aliases (*name) repeat", "over 10,000")
    check_yaml_size("x: &x [1, 2, 3]\ny: [" + ", ".join(["*x"] * 2000) + "]\n", "f", "fix")


# ---- a user's config folder --------------------------------------------------------------

WORKLOAD = "batch_size: 2\nn_batches: 2\nprompt_len: 8\ngen_len: 3\n"
CONF_FILES: list[tuple[str, dict[str, Any], str]] = [
    ("not UTF-8", {"workload/mine.yaml": b"\xff\xfe\x00"}, "mine.yaml: not UTF-8 text"),
    ("nested deep", {"workload/mine.yaml": WORKLOAD + "x: " + "[" * 5000 + "]" * 5000}, "deeply"),
    ("laughs", {"workload/mine.yaml": WORKLOAD + LAUGHS_6}, "aliases (*name) repeat"),
    ("defaults a number", {"workload/mine.yaml": "defaults: 5\n" + WORKLOAD}, "defaults is int"),
    (
        "defaults naming itself",
        {"workload/mine.yaml": "defaults:\n  - mine\n  - _self_\n" + WORKLOAD},
        "leads back to itself",
    ),
    (
        "defaults loop of two",
        {
            "workload/mine.yaml": "defaults:\n  - other\n  - _self_\n" + WORKLOAD,
            "workload/other.yaml": "defaults:\n  - /workload/mine\n  - _self_\n" + WORKLOAD,
        },
        "leads back to itself",
    ),
    ("a FIFO", {"workload/mine.yaml": "FIFO"}, "mine.yaml: not a regular file (a FIFO)"),
    ("a folder named mine.yaml", {"workload/mine.yaml": "DIR"}, "mine.yaml: a folder"),
    ("the option a folder", {"workload/mine/x.yaml": WORKLOAD}, "workload/mine is a folder"),
]


@pytest.mark.parametrize("case, files, words", CONF_FILES, ids=[c[0] for c in CONF_FILES])
def test_a_bad_file_in_a_users_config_dir_is_one_line(
    tmp_path: Path, cli_here: Any, case: str, files: dict[str, Any], words: str
) -> None:
    """Each was an internal error (UnicodeDecodeError, RecursionError, ValueError), a run of a
    minute, or "no conf/workload/mine.yaml" of a file that is there."""
    import os

    from tests.conftest import overridden
    from tests.probes.conftest import TINY, deadline, one_line

    conf = tmp_path / "conf"
    for rel, text in files.items():
        (conf / rel).parent.mkdir(parents=True, exist_ok=True)
        if text == "FIFO":
            os.mkfifo(conf / rel)
        elif text == "DIR":
            (conf / rel).mkdir()
        else:
            (conf / rel).write_bytes(text if isinstance(text, bytes) else text.encode())
    args = [*overridden(TINY, "workload=mine"), f"--config-dir={conf}"]
    with deadline(60):
        r = cli_here("experiments.run", *args, f"hydra.run.dir={tmp_path / 'run'}")
    one_line(r, str(conf), words)
    assert not (tmp_path / "run").exists()


def test_a_users_config_dir_of_good_files_runs(tmp_path: Path, cli_here: Any) -> None:
    from tests.conftest import overridden
    from tests.probes.conftest import TINY

    (tmp_path / "conf" / "workload").mkdir(parents=True)
    (tmp_path / "conf" / "workload" / "base.yaml").write_text(WORKLOAD)
    text = "defaults:\n  - base\n  - _self_\nbatch_size: 1\n"
    (tmp_path / "conf" / "workload" / "mine.yaml").write_text(text)
    args = [*overridden(TINY, "workload=mine"), f"--config-dir={tmp_path / 'conf'}"]
    r = cli_here("experiments.run", *args, f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["batch_size"] == 1


def test_a_key_added_with_plus_plus_is_checked_as_with_plus(tmp_path: Path, cli_here: Any) -> None:
    """`++workload.foo=1` was "workload: Workload.__init__() got an unexpected keyword argument
    'foo'"; `+workload.foo=1` named the key and the valid ones."""
    from tests.probes.conftest import TINY, one_line

    r = cli_here("experiments.run", *TINY, "++workload.foo=1", f"hydra.run.dir={tmp_path}/r")
    one_line(r, "workload.foo: unknown key", "valid: batch_size")


@pytest.mark.parametrize("what", ["fifo", "folder", "lines"])
def test_a_failed_txt_that_is_no_line_is_skipped_in_one_line(
    finished: Path, tmp_path: Path, what: str
) -> None:
    """A run dir without a summary whose failed.txt is a FIFO hung collect and report
    (read_text waits for a writer); one of three lines printed them all under `skipped`."""
    import os
    import shutil

    from experiments.common.tables import collect
    from tests.probes.conftest import deadline

    mine = tmp_path / "sweep"
    shutil.copytree(finished, mine)
    (mine / "bad" / ".hydra").mkdir(parents=True)
    failed = mine / "bad" / "failed.txt"
    if what == "fifo":
        os.mkfifo(failed)
    elif what == "folder":
        failed.mkdir()
    else:
        failed.write_text("error one\nerror two\nerror three\n")
    with deadline(10):
        df, problems = collect(mine)
    assert len(df) == 1 and len(problems) == 1 and "\n" not in problems[0], problems
    words = {"fifo": "(a FIFO)", "folder": "a folder", "lines": "error one (and 2 more line(s))"}
    assert words[what] in problems[0], problems
