"""FP8 checkpoints (DeepSeek-V3's release form) counted as the disk holds them: an expert's
disk reads move its float8 bytes and float32 block scales (`ModelSpec.expert_disk_bytes`),
the host and device tiers hold the dequantized weights (`expert_bytes`), in the planners, the
simulator and the real executor alike; and the FP8 forms and fields moepipe refuses, in one
line. Tiny checkpoints, no transformers.

Usage: python -m pytest -q tests/real/test_fp8_bytes.py
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from core.errors import ConfigError
from core.hf_config import spec_from_hf_config
from core.spec import ModelSpec
from core.types import Resource, Tensor, Tier
from real.checkpoint import load_checkpoint, reduced_spec, unit_layout
from real.checkpoint_write import write_checkpoint
from real.shards import read_header, read_tensor, save_shard
from tests.real.conftest import small_overrides
from tests.real.fp8_ckpt import write_fp8


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """block -> a small DeepSeek-V3 (H 64, F 32, 16 experts, layer 2 MoE) in FP8 blocks."""
    root = tmp_path_factory.mktemp("fp8-bytes")
    spec = reduced_spec("deepseek-v3", **small_overrides("deepseek-v3"))
    plain = write_checkpoint(spec, root / "plain", seed=1)
    made: dict[int, Path] = {}

    def get(block: int = 16) -> Path:
        if block not in made:
            made[block] = write_fp8(plain, root / f"fp8-{block}", block)
        return made[block]

    return get


@pytest.mark.parametrize("block", [16, 24])
def test_spec_counts_the_bytes_an_fp8_expert_holds_on_disk(fp8, block):
    """An expert of H 64, F 32 in blocks of 16: 3 x 2048 float8 bytes and 3 x 8 float32 scales
    = 6240 bytes on disk, which are the bytes of its tensors and scales in the checkpoint;
    in memory its dequantized 12288 (bfloat16). Blocks of 24 (cut short: a grid of 2 x 3)
    add 3 x 6 x 4. config.json alone (a simulation) says the same. Before: 12288 on disk."""
    spec, index = load_checkpoint(fp8(block))
    assert spec.expert_bytes == 3 * 64 * 32 * 2
    assert spec.expert_disk_bytes == 3 * 64 * 32 + 4 * 3 * (8 if block == 16 else 6)
    for unit, tensors in unit_layout(spec).items():
        if unit.kind == Tensor.EXPERT:
            entries = [index[ts.hf_name] for ts in tensors.values()]
            assert all(e.scale is not None for e in entries)
            held = sum(e.nbytes + e.scale.nbytes for e in entries if e.scale is not None)
            assert held == spec.expert_disk_bytes
    sim = spec_from_hf_config(fp8(block))
    assert (sim.disk_dtype_bytes, sim.disk_block) == (1, (block, block))
    assert sim.expert_disk_bytes == spec.expert_disk_bytes


def test_real_run_disk_ops_count_what_the_executor_read(fp8, monkeypatch):
    """klotski streaming the FP8 experts from disk: each disk read is the expert's
    expert_disk_bytes, each host->device copy its dequantized expert_bytes, and the run's
    bytes moved on the disk (what experiments.validate's disk_bytes reports) equal the
    tensors' and scales' bytes the tiered store read. Before: twice the float8 bytes."""
    from experiments.common.pipeline import RunSpec
    from experiments.common.real_run import real_execute
    from real.store import TieredStore
    from tests.real.test_executor import WORKLOAD, hardware

    read = []
    real_read = TieredStore._read_into

    def counted(self, rec, buf):
        if rec.unit.kind == Tensor.EXPERT:  # (the dense units are read once, before the run)
            read.append(sum(torch.Size(s).numel() * d.itemsize for _, d, s, _ in rec.staged))
        return real_read(self, rec, buf)

    monkeypatch.setattr(TieredStore, "_read_into", counted)
    model, _ = load_checkpoint(fp8())
    # the GPU too small for the expert layer (196 kB in bf16) beside the rest (1.6 MB), host
    # RAM for half of it: the experts stream from disk
    disk_bound = hardware(0.0025, 0.0001)
    result, _ = real_execute(fp8(), RunSpec(model, disk_bound, WORKLOAD, "klotski", {}))
    trace = result.trace
    disk = trace[trace["resource"].astype(str) == str(Resource.DISK)]
    h2d = trace[(trace["resource"].astype(str) == str(Resource.H2D)) & (trace["expert"] >= 0)]
    assert len(disk) and set(disk["bytes"]) == {model.expert_disk_bytes}
    assert set(h2d["bytes"]) == {model.expert_bytes}
    assert result.summary["bytes_moved"]["disk"] == sum(read) == len(disk) * 6240


def test_planned_disk_tier_holds_fp8_bytes_host_and_gpu_dequantized():
    """deepseek-v3's conf with +model.disk_dtype_bytes=1 (the release's FP8 experts): the
    plan's disk reads move 1 byte a weight and the scales, its copies to the GPU and the host
    memory they take the bf16 bytes, and the disk tier's footprint is the FP8 layers'. The
    spec without it (every other run) counts as before."""
    from experiments.common.pipeline import RunSpec, simulate_run
    from tests.real.test_executor import WORKLOAD, hardware

    base = reduced_spec("deepseek-v3", **small_overrides("deepseek-v3"))
    spec = replace(base, disk_dtype_bytes=1, disk_block=(16, 16))
    assert base.expert_disk_bytes == base.expert_bytes
    result = simulate_run(RunSpec(spec, hardware(0.0025, 0.0001), WORKLOAD, "klotski", {}))
    ops = result.schedule.ops
    reads = [o for o in ops if o.src == Tier.DISK]
    copies = [o for o in ops if o.src == Tier.CPU and o.dst == Tier.GPU and o.expert >= 0]
    assert reads and {(o.nbytes, o.alloc_bytes) for o in reads} == {(6240, 12288)}
    assert copies and {o.nbytes for o in copies} == {12288}
    on_disk = sum(t == Tier.DISK for t in result.schedule.meta["placement"]["expert_layers"])
    assert result.schedule.resident_bytes[Tier.DISK] == on_disk * 16 * 6240 > 0


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("disk_dtype_bytes", 3, "disk_dtype_bytes=3; set 1 .FP8"),
        ("disk_block", [0, 128], "disk_block=\\[0, 128\\]; pass two"),
    ],
)
def test_spec_refuses_disk_fields_it_cannot_count(field, value, match):
    """Only FP8 (1) or none (0) is a disk form the real executor reads; a block is two
    positive integers. One line naming the field."""
    d = {"name": "m", "family": "mixtral", "n_layers": 1, "hidden_size": 8}
    d |= dict(expert_ffn_size=8, n_experts=2, top_k=1, n_heads=1, n_kv_heads=1, head_dim=8)
    with pytest.raises(ConfigError, match=match) as e:
        ModelSpec.from_dict(d | {"vocab_size": 8, field: value})
    assert "\n" not in str(e.value)


def test_fused_fp8_experts_are_refused_in_one_line(fp8, tmp_path):
    """FP8 experts fused as transformers' modules hold them (save_original_format=False:
    gate_up_proj [E, 2F, H] with its scales): one line saying what is not run and how to save
    it. Before: "is float32 [16, 8, 4]; weight_block_size [16, 16] over ... makes float32 []"."""
    ckpt = tmp_path / "fused"
    shutil.copytree(fp8(), ckpt)
    file = ckpt / "model.safetensors"
    t = {n: read_tensor(e) for n, e in read_header(file).items()}
    pre = "model.layers.2.mlp.experts."
    for m in ("gate_up_proj", "down_proj"):
        parts = [("gate", "up")] if m == "gate_up_proj" else [("down",)]
        for s in ("", "_scale_inv"):
            t[pre + m + s] = torch.stack(
                [
                    torch.cat([t.pop(f"{pre}{x}.{p}_proj.weight{s}") for p in parts[0]])
                    for x in range(16)
                ]
            )
    save_shard(t, file, {"format": "pt"})
    with pytest.raises(ConfigError, match="save_original_format=True") as e:
        load_checkpoint(ckpt)
    assert "\n" not in str(e.value) and "model.layers.2.mlp.experts." in str(e.value)


def test_v3_moe_layer_freq_0_says_no_reference_defines_it(fp8, tmp_path):
    """moe_layer_freq 0: transformers ignores the field, DeepSeek's code takes each layer
    modulo it. One line saying so. Before: only "must be a positive integer, got 0"."""
    ckpt = tmp_path / "freq"
    shutil.copytree(fp8(), ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(cfg | {"moe_layer_freq": 0}))
    with pytest.raises(ConfigError, match="moe_layer_freq must be") as e:
        load_checkpoint(ckpt)
    assert "transformers ignores" in str(e.value) and "cannot run 0" in str(e.value)
    assert "\n" not in str(e.value)
