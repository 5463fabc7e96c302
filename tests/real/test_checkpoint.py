"""Checkpoints: config.json round-trips to the same ModelSpec for every conf/model, HF tensor
names, sharding, the make_checkpoint CLI, and one-line errors naming the bad file or tensor."""

import dataclasses
import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.errors import ConfigError
from core.hf_config import hf_config_to_spec, spec_to_hf_config
from core.spec import ModelSpec
from core.types import Tensor
from experiments import make_checkpoint
from real.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    Unit,
    hf_config,
    load_checkpoint,
    load_units,
    reduced_spec,
    unit_layout,
)
from real.checkpoint_write import write_checkpoint
from tests.real.conftest import ALL_MODELS, small_overrides


@pytest.mark.parametrize("name", ALL_MODELS)
def test_hf_config_round_trip_full_size(name):
    spec = reduced_spec(name)
    assert hf_config_to_spec(spec_to_hf_config(spec), spec.name) == spec


@pytest.mark.parametrize("name", ALL_MODELS)
def test_checkpoint_round_trip_reduced(name, small_ckpt):
    """The written directory reads back (config.json and every tensor's shape) to the same spec."""
    spec = reduced_spec(name, **small_overrides(name))
    loaded, index = load_checkpoint(small_ckpt(name))
    assert loaded == ModelSpec(**{**vars(spec), "name": name})
    n_tensors = sum(len(t) for t in unit_layout(spec).values())
    assert len(index) == n_tensors


def test_qwen_dense_layers_round_trip(tmp_path):
    spec = reduced_spec(
        "qwen1.5-moe-a2.7b",
        **small_overrides("qwen1.5-moe-a2.7b"),
        moe_layers=[0, 2],
        dense_ffn_size=48,
    )
    write_checkpoint(spec, tmp_path / "q")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["mlp_only_layers"] == [1] and cfg["intermediate_size"] == 48
    assert load_checkpoint(tmp_path / "q")[0].moe_layers == (0, 2)


def test_mixtral_hf_names(mixtral_tiny):
    cfg = json.loads((mixtral_tiny / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["num_local_experts"] == 8
    assert cfg["num_experts_per_tok"] == 2 and cfg["intermediate_size"] == 256
    _, index = load_checkpoint(mixtral_tiny)
    for name in [
        "model.embed_tokens.weight",
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.block_sparse_moe.gate.weight",
        "model.layers.2.block_sparse_moe.experts.7.w3.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]:
        assert name in index, name
    assert index["model.layers.1.block_sparse_moe.experts.0.w2.weight"].shape == (128, 256)
    assert index["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 128)


@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "qwen1.5-moe-a2.7b",
            [
                "model.layers.0.mlp.shared_expert_gate.weight",
                "model.layers.0.mlp.shared_expert.up_proj.weight",
                "model.layers.0.self_attn.q_proj.bias",
                "model.layers.0.mlp.experts.3.gate_proj.weight",
            ],
        ),
        (
            "deepseek-v2-lite",
            [
                "model.layers.0.mlp.down_proj.weight",
                "model.layers.1.mlp.shared_experts.gate_proj.weight",
                "model.layers.2.mlp.gate.weight",
                "model.layers.0.self_attn.q_proj.weight",
                "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
                "model.layers.1.self_attn.kv_a_layernorm.weight",
                "model.layers.2.self_attn.kv_b_proj.weight",
                "model.layers.2.self_attn.o_proj.weight",
            ],
        ),
        (
            "olmoe-1b-7b",
            ["model.layers.2.mlp.experts.15.down_proj.weight", "model.layers.0.mlp.gate.weight"],
        ),
        (
            "switch-base-128",
            [
                "shared.weight",
                "encoder.block.0.layer.1.mlp.wi.weight",
                "encoder.block.1.layer.1.mlp.router.classifier.weight",
                "encoder.block.3.layer.1.mlp.experts.expert_7.wo.weight",
                "encoder.final_layer_norm.weight",
            ],
        ),
    ],
)
def test_family_hf_names(name, expected, small_ckpt):
    _, index = load_checkpoint(small_ckpt(name))
    for hf in expected:
        assert hf in index, hf


def test_sharded_checkpoint_and_missing_shard(tmp_path):
    spec = reduced_spec("mixtral-tiny")
    d = write_checkpoint(spec, tmp_path / "sh", shard_bytes=2**20)
    weight_map = json.loads((d / INDEX_FILE).read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) > 3 and not (d / SINGLE_FILE).exists()
    _, index = load_checkpoint(d)
    assert {e.file.name for e in index.values()} == set(shards)
    (d / shards[1]).unlink()
    with pytest.raises(ConfigError, match=shards[1]):
        load_checkpoint(d)


def test_a_rewrite_cut_short_keeps_the_earlier_checkpoint(tmp_path, monkeypatch):
    """A checkpoint written again into its folder: its files are made apart and moved in once
    whole, so one cut short (a full disk, Ctrl-C: here the third shard's write fails) leaves the
    earlier checkpoint as it was (before, its files were deleted first); a finished rewrite
    replaces them, a single file by shards too, and a user's other files in the folder stay."""
    import real.checkpoint_write as rc

    d = write_checkpoint(reduced_spec("mixtral-tiny"), tmp_path / "ck")
    (d / "model_backup.safetensors").write_bytes(b"mine")
    before = {f.name: f.read_bytes() for f in d.iterdir()}
    real_save, calls = rc.save_shard, []

    def fail_third(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real_save(*args, **kw)

    monkeypatch.setattr(rc, "save_shard", fail_third)
    with pytest.raises(OSError):
        write_checkpoint(reduced_spec("mixtral-tiny"), d, seed=1, shard_bytes=2**20)
    assert {f.name: f.read_bytes() for f in d.iterdir()} == before
    monkeypatch.setattr(rc, "save_shard", real_save)
    write_checkpoint(reduced_spec("mixtral-tiny"), d, seed=1, shard_bytes=2**20)
    assert not (d / SINGLE_FILE).exists() and (d / INDEX_FILE).exists()
    assert (d / "model_backup.safetensors").read_bytes() == b"mine"
    assert not [f for f in d.iterdir() if f.name.startswith(".partial")]
    load_checkpoint(d)


def test_missing_dir_and_config(tmp_path, mixtral_tiny):
    with pytest.raises(ConfigError, match="no such checkpoint directory"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="config.json"):
        load_checkpoint(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text((mixtral_tiny / "config.json").read_text())
    with pytest.raises(ConfigError, match=SINGLE_FILE):
        load_checkpoint(tmp_path / "empty")


def test_truncated_file_names_the_file(tmp_path):
    d = write_checkpoint(reduced_spec("tiny"), tmp_path / "t")
    f = d / SINGLE_FILE
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ConfigError, match=rf"{f}: truncated.*lm_head|{f}: truncated"):
        load_checkpoint(d)
    f.write_bytes(b"\x10\x00")
    with pytest.raises(ConfigError, match=rf"{f}: truncated"):
        load_checkpoint(d)


def test_wrong_shape_names_tensor_and_shapes(tmp_path):
    d = write_checkpoint(reduced_spec("tiny"), tmp_path / "w")
    tensors = load_file(d / SINGLE_FILE)
    name = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    tensors[name] = torch.zeros(64, 64, dtype=torch.bfloat16)
    save_file(tensors, d / SINGLE_FILE)
    with pytest.raises(
        ConfigError, match=rf"tensor {name} has shape \[64, 64\], config.json expects \[128, 64\]"
    ):
        load_checkpoint(d)


def test_cli_writes_reduced_checkpoint(tmp_path, capsys):
    rc = make_checkpoint.main(
        [
            "model=olmoe-1b-7b",
            f"out={tmp_path / 'o'}",
            "seed=3",
            "hidden_size=64",
            "n_layers=2",
            "expert_ffn_size=32",
            "n_experts=8",
            "top_k=2",
            "vocab_size=100",
        ]
    )
    assert rc == 0 and "wrote" in capsys.readouterr().out
    spec, _ = load_checkpoint(tmp_path / "o")
    assert (spec.family, spec.hidden_size, spec.n_layers, spec.n_experts, spec.head_dim) == (
        "olmoe",
        64,
        2,
        8,
        4,
    )  # 64 // 16 heads
    assert spec.moe_layers == (0, 1)
    assert (Unit(Tensor.EXPERT, 1, 7) in unit_layout(spec)) and (
        Unit(Tensor.EXPERT, 1, 8) not in unit_layout(spec)
    )


def test_cli_takes_a_list_as_key_a_b(tmp_path, capsys):
    """moe_layers=1 and moe_layers=0,2 are [1] and [0, 2], as every command takes a list (a
    Qwen2-MoE config.json can say which layers are dense; a Mixtral one cannot)."""
    small = "hidden_size=64 n_layers=3 expert_ffn_size=32 n_experts=4 top_k=2 vocab_size=100"
    args = ["model=qwen1.5-moe-a2.7b", *small.split(), "dense_ffn_size=64"]
    assert make_checkpoint.main([*args, f"out={tmp_path / 'a'}", "moe_layers=1"]) == 0
    assert make_checkpoint.main([*args, f"out={tmp_path / 'b'}", "moe_layers=0,2"]) == 0
    assert load_checkpoint(tmp_path / "a")[0].moe_layers == (1,)
    assert load_checkpoint(tmp_path / "b")[0].moe_layers == (0, 2)


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert make_checkpoint.main(["model=nope", f"out={tmp_path}"]) == 2
    assert make_checkpoint.main(["model=tiny", f"out={tmp_path}", "bogus_field=1"]) == 2
    assert make_checkpoint.main(["model=tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
    assert "bogus_field" in err[1] and "out=" in err[2]


def test_cli_rope_scaling(tmp_path, capsys):
    """rope_scaling=... lands in config.json as given; a malformed one is a one-line error and
    writes nothing."""
    args = ["model=mixtral-tiny", "hidden_size=64", "n_layers=1"]
    linear = "rope_scaling={type: linear, factor: 2}"
    assert make_checkpoint.main([*args, f"out={tmp_path / 'a'}", linear]) == 0
    assert hf_config(tmp_path / "a").fields["rope_scaling"] == {"type": "linear", "factor": 2}
    assert make_checkpoint.main([*args, f"out={tmp_path / 'b'}", "rope_scaling=yarn"]) == 2
    assert make_checkpoint.main([*args, f"out={tmp_path / 'b'}", "rope_scaling={type: yarn}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: rope_scaling=yarn: pass a mapping, e.g. '{type: linear, factor: 2}'",
        "error: command line: rope_scaling.factor is missing; yarn needs a positive number",
    ]
    assert not (tmp_path / "b").exists()


ROUTER = ("router", "router_bias")  # DeepSeek's: float32 at any compute dtype


@pytest.mark.parametrize("small", [True, False], ids=["small", "full-size"])
@pytest.mark.parametrize("name", ALL_MODELS)
def test_unit_bytes_equal_what_planners_stream(name, small):
    """Every unit's tensors in the checkpoint (biases, QK-norms, kv_a_layernorm, Qwen's shared
    gate included) add up to the bytes the spec gives the planners, so the simulator moves exactly
    what the real executor reads. Full-size shapes are only counted, never allocated."""
    spec = reduced_spec(name, **small_overrides(name)) if small else reduced_spec(name)

    def planned(unit: Unit) -> int:
        by_kind = {
            Tensor.ATTENTION: spec.attn_bytes,
            Tensor.GATE: spec.gate_bytes,
            Tensor.EXPERT: spec.expert_bytes,
            Tensor.EMBED: spec.embed_bytes,
            Tensor.HEAD: spec.head_bytes,
        }
        if unit.kind == Tensor.FFN:
            return spec.shared_ffn_bytes if spec.is_moe(unit.layer) else spec.dense_ffn_bytes
        return by_kind[unit.kind]

    layout = unit_layout(spec)
    for unit, tensors in layout.items():
        got = sum(
            math.prod(t.shape) * (spec.router_dtype_bytes if k in ROUTER else spec.dtype_bytes)
            for k, t in tensors.items()
        )
        assert got == planned(unit), f"{name} {unit}: checkpoint {got} B, spec {planned(unit)} B"
    assert sum(map(planned, layout)) == spec.total_bytes


def test_float16_is_named_and_tied_head_is_the_embedding(tmp_path):
    """A config.json's float16 that its float32 weights are not gets a line naming the tensor
    and what config.json says (float16 weights run: test_hf_parity_round7.py); an LM head tied
    to the embedding (tie_word_embeddings) reads the embedding's bytes where it is not saved,
    and its own where it is, as transformers' from_pretrained ties them (only where their
    values are equal)."""
    d = write_checkpoint(reduced_spec("mixtral-tiny"), tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"torch_dtype": "float16"}))
    with pytest.raises(ConfigError, match=r"is torch.float32, config.json says torch.float16"):
        load_checkpoint(d)
    (d / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": True}))
    _, index = load_checkpoint(d)  # tied in config.json, lm_head.weight saved: its own
    assert index["lm_head.weight"] != index["model.embed_tokens.weight"]
    weights = load_file(d / SINGLE_FILE)
    del weights["lm_head.weight"]
    save_file(weights, d / SINGLE_FILE)
    _, units = load_units(d)
    assert torch.equal(units[Unit(Tensor.HEAD)]["lm_head"], units[Unit(Tensor.EMBED)]["embed"])
    (d / "config.json").write_text(json.dumps(cfg))  # untied: the head is missing
    with pytest.raises(ConfigError, match=r"lm_head.weight is not in"):
        load_checkpoint(d)


@pytest.mark.parametrize("step", [1, 2, 4])
def test_switch_sparse_blocks_round_trip_through_config_json(step):
    """The writer follows transformers' rule as the reader does (block i sparse if
    i % step == 1): at step 4 blocks 1, 5, 9 were refused, and 3, 7, 11 written as step 4 came
    back as 1, 5, 9."""
    base = reduced_spec("switch-base-128")
    moe = tuple(i for i in range(12) if step == 1 or i % step == 1)
    spec = dataclasses.replace(base, n_layers=12, moe_layers=moe)
    assert hf_config_to_spec(spec_to_hf_config(spec), "s").moe_layers == moe
    with pytest.raises(ConfigError, match="cannot express moe_layers"):
        spec_to_hf_config(dataclasses.replace(spec, moe_layers=(3, 7, 11)))
    one = dataclasses.replace(spec, moe_layers=(1,))  # step 11 says it (step 2 was refused)
    assert hf_config_to_spec(spec_to_hf_config(one), "s").moe_layers == (1,)


def test_an_index_and_its_shards_must_agree(tmp_path, caplog):
    """An index naming a tensor its shard does not hold, or a folder with both a single file and
    an index, was read without a word; a config.json cut to fewer layers than the weights (as
    transformers allows) runs the first ones, and says so."""
    spec = reduced_spec("mixtral-tiny")
    d = write_checkpoint(spec, tmp_path / "sh", shard_bytes=2**20)
    meta = json.loads((d / INDEX_FILE).read_text())
    first = sorted(set(meta["weight_map"].values()))[0]
    bogus = dict(meta, weight_map={**meta["weight_map"], "model.bogus.weight": first})
    (d / INDEX_FILE).write_text(json.dumps(bogus))
    with pytest.raises(ConfigError, match=r"weight_map names 'model.bogus.weight' .* not hold"):
        load_checkpoint(d)
    (d / INDEX_FILE).write_text(json.dumps(meta))
    write_checkpoint(spec, tmp_path / "single")
    shutil.copyfile(tmp_path / "single" / SINGLE_FILE, d / SINGLE_FILE)
    with pytest.raises(
        ConfigError, match=r"holds both model.safetensors and .* \(which names other"
    ):
        load_checkpoint(d)
    (d / SINGLE_FILE).unlink()
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=2)))
    with caplog.at_level("WARNING", logger="real.checkpoint"):
        assert load_checkpoint(d)[0].n_layers == 2
    assert "num_hidden_layers=2 of the weights' 4 layers: the model runs its first 2" in caplog.text
