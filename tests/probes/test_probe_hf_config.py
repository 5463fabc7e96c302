"""Probe class: a malformed Hugging Face config.json (not UTF-8, not an object, a field of the
wrong type or range) is one line naming the file and the field, alone or as one point of a
sweep, which goes on (failed.txt) while the good points finish."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest

from core.hf_config import FIELDS as READ_FIELDS
from core.hf_config import ROPE_FIELDS, hf_config_to_spec, spec_to_hf_config
from core.hf_config.fields import COUNT, FLAG, LAYER_COUNT, NUMBER, POSITIVE, SIZE, TEXT, Rule
from core.spec import MAX_LAYERS, ModelSpec
from real.checkpoint import load_checkpoint, reduced_spec
from real.model import Model
from tests.probes.conftest import TINY, cli, one_line, raises_one_line

BASE = {
    "mixtral": spec_to_hf_config(reduced_spec("mixtral-tiny")),
    "qwen2_moe": spec_to_hf_config(reduced_spec("qwen1.5-moe-a2.7b")),
    "deepseek_v2": spec_to_hf_config(reduced_spec("deepseek-v2-lite")),
    "switch": spec_to_hf_config(reduced_spec("switch-base-128")),
}


class _Drop:
    """A field removed (its repr is stable, so test ids are the same in every process)."""

    def __repr__(self) -> str:
        return "DROP"


DROP = _Drop()

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
    ("deepseek_v2", "kv_lora_rank", 0, "kv_lora_rank"),
    ("deepseek_v2", "qk_rope_head_dim", "64", "qk_rope_head_dim"),
    ("deepseek_v2", "v_head_dim", 0, "v_head_dim"),
    ("deepseek_v2", "n_shared_experts", "2", "n_shared_experts"),
    ("deepseek_v2", "n_shared_experts", -1, "n_shared_experts"),
    ("deepseek_v2", "q_lora_rank", 0, "q_lora_rank"),
    ("deepseek_v2", "routed_scaling_factor", "1.0", "routed_scaling_factor"),
    ("deepseek_v2", "routed_scaling_factor", 0, "routed_scaling_factor"),
    # left out: transformers' default where its class has one (core.hf_config.FAMILY_DEFAULTS);
    # these two it has none for (DeepSeek's own code and transformers' differ on the second)
    ("deepseek_v2", "num_experts_per_tok", DROP, "num_experts_per_tok is missing"),
    ("deepseek_v2", "n_shared_experts", DROP, "n_shared_experts is missing"),
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
    ("an int of 5000 digits", b'{"vocab_size": ' + b"9" * 5000 + b"}", "not valid JSON"),
    ("nested 100000 deep", b'{"rope_scaling": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "JSON"),
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


def test_a_key_given_twice_takes_the_last_in_a_logged_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """transformers reads config.json with json.loads, which keeps the last of two
    num_experts_per_tok; moepipe keeps it too (it refused the file), in one logged line."""
    text = json.dumps(BASE["mixtral"])[:-1] + ', "num_experts_per_tok": 1}'
    (tmp_path / "config.json").write_text(text)
    with caplog.at_level(logging.WARNING):
        assert ModelSpec.from_hf_config(tmp_path).top_k == 1
    lines = [r.getMessage() for r in caplog.records if "appears twice" in r.getMessage()]
    assert len(lines) == 1 and "'num_experts_per_tok'" in lines[0] and "last value" in lines[0]


@pytest.mark.parametrize(
    "family, arch, other",
    [
        ("mixtral", "Qwen2MoeForCausalLM", "qwen2_moe"),
        ("olmoe", "MixtralForCausalLM", "mixtral"),
        ("deepseek_v2", "SwitchTransformersForConditionalGeneration", "switch_transformers"),
    ],
)
def test_architectures_of_another_family_is_refused(
    tmp_path: Path, family: str, arch: str, other: str
) -> None:
    """Qwen2MoeForCausalLM under model_type mixtral ran as Mixtral."""
    d = _write(tmp_path / "ck", family, "architectures", [arch])
    raises_one_line(
        lambda: ModelSpec.from_hf_config(d),
        "config.json",
        f"architectures names {arch}",
        other,
        f"model_type is '{family}'",
    )
    # a class of a family moepipe does not know, or none, says nothing of the weights
    for archs in (["LlamaForCausalLM"], [], None):
        assert ModelSpec.from_hf_config(_write(tmp_path / "ok", family, "architectures", archs))


def test_config_json_missing_or_a_folder(tmp_path: Path) -> None:
    raises_one_line(lambda: ModelSpec.from_hf_config(tmp_path), "config.json", "no such file")
    (tmp_path / "config.json").mkdir()
    raises_one_line(lambda: ModelSpec.from_hf_config(tmp_path), "config.json")


def test_valid_configs_still_load() -> None:
    for family, cfg in BASE.items():
        assert hf_config_to_spec(cfg, family).n_layers > 0
    nulls = {
        **BASE["mixtral"],
        "head_dim": None,
        "num_key_value_heads": None,
        "sliding_window": None,
        "rope_scaling": None,
    }
    assert hf_config_to_spec(nulls, "m").head_dim == BASE["mixtral"]["hidden_size"] // 4


@pytest.mark.slow  # a sweep with its pool: .ci/run's slow suite
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


def test_single_run_of_a_bad_config_is_one_line(tmp_path: Path, cli_here: Any) -> None:
    """In this process: the sweep above runs as a user runs it."""
    d = _write(tmp_path / "ck", "mixtral", "num_attention_heads", 0)
    hf_config = f"+model.hf_config={d}"
    r = cli_here("experiments.run", *TINY, hf_config, f"hydra.run.dir={tmp_path / 'run'}")
    one_line(r, str(d / "config.json"), "num_attention_heads")
    assert not (tmp_path / "run" / "summary.json").exists()


def _bad_values(rule: Rule) -> list[Any]:
    """A value of the wrong type for `rule`, and one out of its range where it has one."""
    wrong_type: Any = 5 if rule.ok("x") else "x"
    out_of_range = {
        COUNT.what: 0,
        LAYER_COUNT.what: MAX_LAYERS + 1,
        SIZE.what: -1,
        POSITIVE.what: 0.0,
        NUMBER.what: math.nan,
        FLAG.what: 1,
        TEXT.what: ["bfloat16"],
    }.get(rule.what.removesuffix(" or null"))
    return [wrong_type] + ([] if out_of_range is None else [out_of_range])


EVERY_FIELD = [
    (key, value)
    for key, rule in READ_FIELDS.items()
    if key != "model_type"
    for value in _bad_values(rule)
] + [
    (f"rope_parameters.{key}", value)
    for key, rule in ROPE_FIELDS.items()
    for value in _bad_values(rule)
]


@pytest.mark.parametrize("key, value", EVERY_FIELD, ids=[f"{k}={v!r}" for k, v in EVERY_FIELD])
def test_every_field_read_is_checked(tmp_path: Path, key: str, value: Any) -> None:
    """Every field of the table moepipe reads (core.hf_config.FIELDS, and the RoPE object's),
    given a value of the wrong type or range, is one line naming the file and the field as
    config.json names it, whichever family reads it, when the file is read."""
    cfg = dict(BASE["mixtral"])
    if key.startswith("rope_parameters."):
        cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 2.0, key.split(".")[1]: value}
    else:
        cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    line = raises_one_line(
        lambda: ModelSpec.from_hf_config(tmp_path), str(tmp_path / "config.json")
    )
    assert f"{key} must be" in line, line


# (family, fields over the family's config, words): fields transformers 5.24's class honours
# whose values moepipe does not run, and settings that make no model (sliding windows that see
# nothing or disagree, a YaRN base its ramp would divide by 0 with)
UNRUN: list[tuple[str, dict[str, Any], str]] = [
    ("mixtral", {"hidden_act": "prelu"}, "hidden_act='prelu'"),
    ("qwen2_moe", {"hidden_act": "xielu"}, "hidden_act='xielu'"),
    ("olmoe", {"hidden_act": "relu3"}, "hidden_act='relu3'"),
    ("deepseek_v2", {"hidden_act": "gelu_99"}, "hidden_act='gelu_99'"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    ("deepseek_v2", {"topk_method": "group_limited_greedy"}, "n_group is missing"),
    (
        "deepseek_v2",
        {"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1},
        "not a multiple of n_group=3",
    ),
    (
        "deepseek_v2",
        {"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 9},
        "topk_group=9 exceeds n_group=8",
    ),
    ("deepseek_v3", {"n_group": 64, "topk_group": 1}, "num_experts_per_tok=8 exceeds"),
    ("deepseek_v2", {"scoring_func": "sigmoid"}, "scoring_func"),
    # run as plain weights: transformers dequantizes (or refuses) them
    ("mixtral", {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "'gptq'"),
    ("switch", {"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
    ("mixtral", {"sliding_window": 0}, "sliding_window must be an integer >= 2"),
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": None}, "sliding_window is null"),
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 0}, "sliding_window must be"),
    ("qwen2_moe", {"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
    ("qwen2_moe", {"layer_types": ["sliding_attention"] * 24}, "use_sliding_window is false"),
    ("qwen2_moe", {"layer_types": ["global"] * 24}, "layer_types must be"),
    (
        "mixtral",
        {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1.0}},
        "yarn needs a RoPE base above 1",
    ),
]
BASE["olmoe"] = spec_to_hf_config(reduced_spec("olmoe-1b-7b"))
BASE["deepseek_v3"] = spec_to_hf_config(reduced_spec("deepseek-v3"))


@pytest.mark.parametrize("family, fields, words", UNRUN, ids=[w for _, _, w in UNRUN])
def test_field_moepipe_does_not_run_is_one_line(
    tmp_path: Path, family: str, fields: dict[str, Any], words: str
) -> None:
    """A config.json field transformers honours at a value moepipe does not implement is refused
    in one line naming the file and the field when the real model is built from it, never run
    as something else."""
    cfg = BASE[family] | fields
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    where = str(tmp_path / "config.json")

    def build() -> Model:
        return Model.from_checkpoint(tmp_path, hf_config_to_spec(cfg, family, where))

    raises_one_line(build, where, words)
