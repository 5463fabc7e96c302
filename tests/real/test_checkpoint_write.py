"""write_checkpoint a shard at a time: the weights it wrote when it made the whole checkpoint in
memory first, each shard's weights made just before the shard is written, and make_checkpoint's
RAM check of one shard, not the whole model."""

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import real.checkpoint_write as rc
from real.checkpoint import INDEX_FILE, SINGLE_FILE, reduced_spec
from real.checkpoint_write import peak_ram_bytes, plan_shards, write_checkpoint

QWEN_SMALL = dict(hidden_size=64, n_layers=2, n_experts=4, expert_ffn_size=32, vocab_size=3000)


def weights_digest(ckpt: Path) -> str:
    """sha256 of the index and of every tensor's name, dtype, shape and bytes, file by file (not
    of the files' bytes: safetensors writes its metadata's keys in no fixed order)."""
    h = hashlib.sha256()
    for f in sorted(ckpt.glob("model*")):
        h.update(f.name.encode())
        if f.name == INDEX_FILE:
            h.update(f.read_bytes())
            continue
        with safe_open(str(f), framework="pt") as st:
            for name in sorted(st.keys()):
                t = st.get_tensor(name)
                h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


@pytest.mark.parametrize(
    ("model", "overrides", "kw", "n_files", "digest"),
    [
        # float32, 14 shards of 1 MiB
        ("mixtral-tiny", {}, dict(seed=3, scale=0.5, shard_bytes=2**20), 15, "f267181a"),
        # bf16 with q/k/v biases; its 384 kB embedding and head each alone past 100 kB
        ("qwen1.5-moe-a2.7b", QWEN_SMALL, dict(seed=1, shard_bytes=100_000), 6, "2208970a"),
        ("tiny", {}, dict(seed=0), 1, "54d3ff34"),  # one file, no index
    ],
)
def test_the_weights_are_those_written_when_the_whole_model_was_made_first(
    tmp_path, model, overrides, kw, n_files, digest
):
    """Digests recorded from the writer that made every weight before writing a file (commit
    954a37d): the same seed draws the same weights into the same shards and index."""
    ckpt = write_checkpoint(reduced_spec(model, **overrides), tmp_path / "ck", **kw)
    assert len(list(ckpt.glob("model*"))) == n_files
    assert weights_digest(ckpt).startswith(digest)


def test_each_shard_is_made_just_before_it_is_written(tmp_path, monkeypatch):
    """The weights drawn between two shards' writes are the later shard's, and the writer holds
    no earlier shard's weights when it makes the next (all of them were made before the first
    write)."""
    spec = reduced_spec("mixtral-tiny")
    plan = plan_shards(spec, 2**20)
    events: list[tuple[str, object]] = []
    real_init, real_save = rc._init, rc.save_shard

    def init(key, shape, *args):
        events.append(("made", tuple(shape)))
        return real_init(key, shape, *args)

    def save(tensors, path, meta):
        events.append(("saved", path.name))
        real_save(tensors, path, meta)

    monkeypatch.setattr(rc, "_init", init)
    monkeypatch.setattr(rc, "save_shard", save)
    write_checkpoint(spec, tmp_path / "ck", shard_bytes=2**20)
    expected = []
    for shard in plan:
        expected += [("made", ts.shape) for _, ts in shard.tensors] + [("saved", shard.file)]
    assert len(plan) > 3 and events == expected


def test_a_plan_names_its_shards_as_hugging_face_does():
    """One file model.safetensors; several model-0000i-of-0000n.safetensors, each at most the
    shard size unless a single tensor is larger (it then has a shard of its own)."""
    spec = reduced_spec("qwen1.5-moe-a2.7b", **QWEN_SMALL)
    assert [s.file for s in plan_shards(spec, 2**30)] == [SINGLE_FILE]
    plan = plan_shards(spec, 100_000)
    n = len(plan)
    assert [s.file for s in plan] == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    assert all(s.nbytes <= 100_000 or len(s.tensors) == 1 for s in plan)
    assert sum(s.nbytes for s in plan) == spec.total_bytes


def test_a_checkpoint_larger_than_the_ram_is_written_a_shard_at_a_time(
    tmp_path, monkeypatch, cli_here
):
    """The RAM available set to what a shard of 1 MiB needs, below the 14 MB model: written,
    with a line per shard; a byte less and it is refused before any file is made."""
    spec = reduced_spec("mixtral-tiny")
    plan = plan_shards(spec, 2**20)
    need = peak_ram_bytes(plan)
    assert need < spec.total_bytes
    ram = "experiments.common.pipeline._available_ram_bytes"
    args = ["model=mixtral-tiny", "shard_mb=1"]
    monkeypatch.setattr(ram, lambda: need)
    r = cli_here("experiments.make_checkpoint", *args, f"out={tmp_path / 'a'}")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "a" / INDEX_FILE).is_file()
    written = [line.split(":")[0] for line in r.stdout.splitlines() if "GB written" in line]
    assert written == [shard.file for shard in plan]
    monkeypatch.setattr(ram, lambda: need - 1)
    r = cli_here("experiments.make_checkpoint", *args, f"out={tmp_path / 'b'}")
    assert r.returncode == 2 and "RAM available" in r.stderr and "shard_mb=1" in r.stderr
    assert not (tmp_path / "b").exists()
