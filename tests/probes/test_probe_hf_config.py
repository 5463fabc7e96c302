"""Probe class: a malformed Hugging Face config.json (not UTF-8, not an object, a field of the
wrong type or range) is one line naming the file and the field, alone or as one point of a
sweep, which goes on (failed.txt) while the good points finish."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from core.spec import ModelSpec
from real.checkpoint import load_checkpoint, reduced_spec, spec_to_hf_config
from tests.probes.conftest import TINY, cli, one_line, raises_one_line

BASE = {
    "mixtral": spec_to_hf_config(reduced_spec("mixtral-tiny")),
    "qwen2_moe": spec_to_hf_config(reduced_spec("qwen1.5-moe-a2.7b")),
    "deepseek_v2": spec_to_hf_config(reduced_spec("deepseek-v2-lite")),
    "switch": spec_to_hf_config(reduced_spec("switch-base-128")),
}
DROP = object()  # a field removed

# (family, field, value, words the line must hold besides the file)
FIELDS: list[tuple[str, str, Any, str]] = [
    ("mixtral", "num_attention_heads", 0, "num_attention_heads"),
    ("mixtral", "num_attention_heads", "4", "num_attention_heads"),
    ("mixtral", "num_attention_heads", 4.0, "num_attention_heads"),
    ("mixtral", "num_attention_heads", -1, "num_attention_heads"),
    ("mixtral", "num_attention_heads", None, "num_attention_heads"),
    ("mixtral", "num_attention_heads", True, "num_attention_heads"),
    ("mixtral", "num_hidden_layers", "2", "num_hidden_layers"),
    ("mixtral", "num_hidden_layers", 0, "num_hidden_layers"),
    ("mixtral", "num_hidden_layers", 2.5, "num_hidden_layers"),
    ("mixtral", "num_hidden_layers", [2], "num_hidden_layers"),
    ("mixtral", "num_hidden_layers", DROP, "num_hidden_layers"),
    ("mixtral", "hidden_size", "64", "hidden_size"),
    ("mixtral", "hidden_size", 0, "hidden_size"),
    ("mixtral", "intermediate_size", 0, "intermediate_size"),
    ("mixtral", "num_local_experts", 0, "num_local_experts"),
    ("mixtral", "num_local_experts", "8", "num_local_experts"),
    ("mixtral", "num_experts_per_tok", 0, "num_experts_per_tok"),
    ("mixtral", "num_experts_per_tok", "2", "num_experts_per_tok"),
    ("mixtral", "num_experts_per_tok", 99, "num_experts_per_tok=99 exceeds num_local_experts"),
    ("mixtral", "vocab_size", 0, "vocab_size"),
    ("mixtral", "vocab_size", {"n": 1}, "vocab_size"),
    ("mixtral", "num_key_value_heads", 0, "num_key_value_heads"),
    ("mixtral", "num_key_value_heads", 3, "num_key_value_heads=3"),
    ("mixtral", "head_dim", "16", "head_dim"),
    ("mixtral", "head_dim", 0, "head_dim"),
    ("mixtral", "rope_theta", "1e6", "rope_theta"),
    ("mixtral", "rope_theta", 0, "rope_theta"),
    ("mixtral", "rope_theta", -1.0, "rope_theta"),
    ("mixtral", "rope_theta", True, "rope_theta"),
    ("mixtral", "rope_theta", math.nan, "rope_theta"),
    ("mixtral", "rope_theta", math.inf, "rope_theta"),
    ("mixtral", "rms_norm_eps", "1e-5", "rms_norm_eps"),
    ("mixtral", "rms_norm_eps", 0, "rms_norm_eps"),
    ("mixtral", "dtype", 5, "dtype"),
    ("mixtral", "dtype", "int8", "dtype"),
    ("mixtral", "torch_dtype", ["bfloat16"], "torch_dtype"),
    ("mixtral", "model_type", 5, "model_type"),
    ("mixtral", "model_type", "llama", "model_type"),
    ("mixtral", "model_type", DROP, "model_type"),
    ("mixtral", "rope_scaling", "yarn", "rope_scaling"),
    ("mixtral", "rope_scaling", {"type": "linear", "rope_theta": "x"}, "rope_scaling.rope_theta"),
    ("mixtral", "rope_parameters", [1], "rope_parameters"),
    ("mixtral", "norm_topk_prob", "yes", "norm_topk_prob"),
    ("mixtral", "tie_word_embeddings", "no", "tie_word_embeddings"),
    ("qwen2_moe", "decoder_sparse_step", 0, "decoder_sparse_step"),
    ("qwen2_moe", "decoder_sparse_step", "1", "decoder_sparse_step"),
    ("qwen2_moe", "mlp_only_layers", "0", "mlp_only_layers"),
    ("qwen2_moe", "mlp_only_layers", [0.5], "mlp_only_layers"),
    ("qwen2_moe", "mlp_only_layers", [-1], "mlp_only_layers"),
    ("qwen2_moe", "shared_expert_intermediate_size", -1, "shared_expert_intermediate_size"),
    ("qwen2_moe", "shared_expert_intermediate_size", "x", "shared_expert_intermediate_size"),
    ("qwen2_moe", "moe_intermediate_size", 0, "moe_intermediate_size"),
    ("qwen2_moe", "num_experts", 1.5, "num_experts"),
    ("deepseek_v2", "moe_layer_freq", 0, "moe_layer_freq"),
    ("deepseek_v2", "first_k_dense_replace", -1, "first_k_dense_replace"),
    ("deepseek_v2", "first_k_dense_replace", "1", "first_k_dense_replace"),
    ("deepseek_v2", "first_k_dense_replace", 10_000, "first_k_dense_replace=10000"),
    ("deepseek_v2", "kv_lora_rank", 0, "kv_lora_rank"),
    ("deepseek_v2", "qk_rope_head_dim", "64", "qk_rope_head_dim"),
    ("deepseek_v2", "v_head_dim", 0, "v_head_dim"),
    ("deepseek_v2", "n_shared_experts", "2", "n_shared_experts"),
    ("deepseek_v2", "n_shared_experts", -1, "n_shared_experts"),
    ("deepseek_v2", "q_lora_rank", 0, "q_lora_rank"),
    ("deepseek_v2", "routed_scaling_factor", "1.0", "routed_scaling_factor"),
    ("deepseek_v2", "routed_scaling_factor", 0, "routed_scaling_factor"),
    ("deepseek_v2", "n_routed_experts", DROP, "n_routed_experts"),
    ("switch", "num_layers", 0, "num_layers"),
    ("switch", "d_model", "x", "d_model"),
    ("switch", "d_kv", 0, "d_kv"),
    ("switch", "num_heads", 0, "num_heads"),
    ("switch", "encoder_sparse_step", 0, "encoder_sparse_step"),
    ("switch", "layer_norm_epsilon", "x", "layer_norm_epsilon"),
]

# (what the whole file is, its bytes, words the line must hold)
FILES: list[tuple[str, bytes, str]] = [
    ("not UTF-8", b'\xff\xfe{"model_type": "mixtral"}', "not UTF-8"),
    ("latin-1", '{"model_type": "mixtral\xe9"}'.encode("latin-1"), "not UTF-8"),
    ("a JSON list", b"[1, 2]", "JSON list"),
    ("a JSON string", b'"mixtral"', "JSON str"),
    ("a JSON number", b"7", "JSON int"),
    ("JSON null", b"null", "not an object"),
    ("empty", b"", "not valid JSON"),
    ("cut short", b'{"model_type": "mix', "not valid JSON"),
    ("not JSON", b"model_type: mixtral\n", "not valid JSON"),
]


def _write(folder: Path, family: str, field: str, value: Any) -> Path:
    cfg = dict(BASE[family])
    if value is DROP:
        cfg.pop(field, None)
    else:
        cfg[field] = value
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize(
    "family, field, value, words", FIELDS, ids=[f"{f}-{k}={v!r}"[:60] for f, k, v, _ in FIELDS]
)
def test_field_of_wrong_type_is_one_line(
    tmp_path: Path, family: str, field: str, value: Any, words: str
) -> None:
    d = _write(tmp_path / "ck", family, field, value)
    raises_one_line(lambda: ModelSpec.from_hf_config(d), str(d / "config.json"), words)


@pytest.mark.parametrize("what, data, words", FILES, ids=[w for w, _, _ in FILES])
def test_file_that_is_no_config_is_one_line(
    tmp_path: Path, what: str, data: bytes, words: str
) -> None:
    (tmp_path / "config.json").write_bytes(data)
    raises_one_line(
        lambda: ModelSpec.from_hf_config(tmp_path), str(tmp_path / "config.json"), words
    )
    # the real executor's loader reads it through the same boundary
    raises_one_line(lambda: load_checkpoint(tmp_path), "config.json", words)


def test_config_json_missing_or_a_folder(tmp_path: Path) -> None:
    raises_one_line(lambda: ModelSpec.from_hf_config(tmp_path), "config.json", "no such file")
    (tmp_path / "config.json").mkdir()
    raises_one_line(lambda: ModelSpec.from_hf_config(tmp_path), "config.json")


def test_valid_configs_still_load() -> None:
    for family, cfg in BASE.items():
        from core.hf_config import hf_config_to_spec

        assert hf_config_to_spec(cfg, family).n_layers > 0
    nulls = {
        **BASE["mixtral"],
        "head_dim": None,
        "num_key_value_heads": None,
        "sliding_window": None,
        "rope_scaling": None,
    }
    assert hf_config_to_spec(nulls, "m").head_dim == BASE["mixtral"]["hidden_size"] // 4


def test_one_bad_point_does_not_stop_a_sweep(tmp_path: Path) -> None:
    """One command, as a user runs it: a joblib sweep over a good and bad config.json files.
    Each bad point leaves one line in its failed.txt, naming the file and field, and no
    summary; the good point finishes; the sweep exits non-zero without a traceback."""
    bad = {
        "heads0": ("mixtral", "num_attention_heads", 0),
        "layers_str": ("mixtral", "num_hidden_layers", "2"),
        "theta_str": ("mixtral", "rope_theta", "1e6"),
        "step0": ("qwen2_moe", "decoder_sparse_step", 0),
    }
    dirs = {name: _write(tmp_path / name, *case) for name, case in bad.items()}
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "config.json").write_text("[1]")
    (tmp_path / "latin").mkdir()
    (tmp_path / "latin" / "config.json").write_bytes(b"\xff{}")
    good = tmp_path / "good"
    good.mkdir()
    (good / "config.json").write_text(json.dumps(spec_to_hf_config(reduced_spec("tiny"))))
    points = [*dirs.values(), tmp_path / "list", tmp_path / "latin", good]
    sweep = tmp_path / "sweep"
    r = cli(
        "experiments.run",
        "-m",
        *TINY,
        "+model.hf_config=" + ",".join(map(str, points)),
        f"hydra.sweep.dir={sweep}",
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr + r.stdout, r.stderr
    failed = {p.read_text(): p.parent for p in sweep.rglob("failed.txt")}
    assert len(failed) == len(points) - 1, (failed, r.stderr)
    for text, run in failed.items():
        assert text.count("\n") == 1 and "config.json" in text, text
        assert not (run / "summary.json").exists()
    words = [
        "num_attention_heads",
        "num_hidden_layers",
        "rope_theta",
        "decoder_sparse_step",
        "JSON list",
        "not UTF-8",
    ]
    for w in words:
        assert any(w in t for t in failed), (w, list(failed))
    summaries = list(sweep.rglob("summary.json"))
    assert len(summaries) == 1 and json.loads(summaries[0].read_text())["model"] == "good"


def test_single_run_of_a_bad_config_is_one_line(tmp_path: Path) -> None:
    d = _write(tmp_path / "ck", "mixtral", "num_attention_heads", 0)
    r = cli("experiments.run", *TINY, f"+model.hf_config={d}", f"hydra.run.dir={tmp_path / 'run'}")
    one_line(r, str(d / "config.json"), "num_attention_heads")
    assert not (tmp_path / "run" / "summary.json").exists()
