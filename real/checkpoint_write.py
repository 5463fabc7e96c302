"""Writing Hugging Face-layout checkpoints of seeded random weights (`write_checkpoint`), in
the tensor layout `real.checkpoint.unit_layout` lists, with the family's real config.json fields
(core.hf_config), a shard at a time (`plan_shards`): a model larger than the RAM is written.
Tests and benches build their models with it: no model hub is reachable."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.files import staging_dir
from core.hf_config import spec_to_hf_config
from core.spec import ModelSpec
from real.checkpoint import INDEX_FILE, SINGLE_FILE, TensorSpec, torch_dtype, unit_layout
from real.shards import save_shard


def _init(
    key: str, shape: tuple[int, ...], spec: ModelSpec, g: torch.Generator, scale: float
) -> torch.Tensor:
    """Seeded weights that keep activations O(1) (`init_std`). Scaled in place: one float32
    copy of the tensor at a time (a vocabulary's embedding is the largest, 0.4 GB for
    OLMoE's)."""
    std = init_std(key, shape, spec, scale)
    return torch.ones(shape) if std is None else torch.randn(shape, generator=g).mul_(std)


def init_std(key: str, shape: tuple[int, ...], spec: ModelSpec, scale: float) -> float | None:
    """The standard deviation of weight `key` (None: a norm's ones), times `scale`:
    1/sqrt(fan_in); residual-stream outputs (o, w2, wo) shrunk by sqrt(2 * n_layers); the
    embedding's 1, and router logits of std ~1, so routing is spread out; a bias's 0.02."""
    if key.endswith("norm"):
        return None
    if key == "embed":
        return scale
    if key.endswith("_bias"):
        return 0.02 * scale
    std = scale / math.sqrt(shape[-1])
    if key in ("o", "w2", "wo"):
        std /= math.sqrt(2 * spec.n_layers)
    return std


def std_range(spec: ModelSpec) -> tuple[float, float]:
    """The smallest and largest standard deviation of `spec`'s drawn weights at scale 1."""
    stds = [
        init_std(key, ts.shape, spec, 1.0)
        for tensors in unit_layout(spec).values()
        for key, ts in tensors.items()
    ]
    drawn = [s for s in stds if s is not None]
    return min(drawn), max(drawn)


@dataclass(frozen=True)
class Shard:
    """One weight file of a checkpoint, planned from shapes before any of its weights is made."""

    file: str  # its name in the checkpoint's folder
    tensors: tuple[tuple[str, TensorSpec], ...]  # (unit_layout's key, tensor) in draw order
    nbytes: int  # its tensors' bytes


def plan_shards(spec: ModelSpec, shard_bytes: int) -> list[Shard]:
    """The checkpoint's tensors in `unit_layout`'s order, cut into shards of at most
    `shard_bytes` (a larger tensor alone in one), named as Hugging Face names them:
    model.safetensors alone, else model-00001-of-0000N.safetensors. The names need the count,
    so the whole plan comes before the first weight."""
    item_bytes = torch_dtype(spec).itemsize
    groups: list[list[tuple[str, TensorSpec]]] = [[]]
    sizes = [0]
    for tensors in unit_layout(spec).values():
        for key, ts in tensors.items():
            nbytes = math.prod(ts.shape) * item_bytes
            if sizes[-1] and sizes[-1] + nbytes > shard_bytes:
                groups.append([])
                sizes.append(0)
            groups[-1].append((key, ts))
            sizes[-1] += nbytes
    n = len(groups)
    files = (
        [SINGLE_FILE]
        if n == 1
        else [f"model-{j:05d}-of-{n:05d}.safetensors" for j in range(1, n + 1)]
    )
    return [Shard(f, tuple(g), size) for f, g, size in zip(files, groups, sizes, strict=True)]


def peak_ram_bytes(plan: list[Shard]) -> int:
    """About the most RAM `write_checkpoint` takes for weights: twice its largest shard (the
    allocator keeps much of a written shard's memory as it makes the next: 1.3 to 1.8 times a
    shard measured above the interpreter's own) and the float32 draw of its largest tensor
    (`_init`'s, before the cast to the checkpoint's dtype)."""
    largest = max(math.prod(ts.shape) for shard in plan for _, ts in shard.tensors)
    return 2 * max(shard.nbytes for shard in plan) + 4 * largest


def write_checkpoint(
    spec: ModelSpec,
    out_dir: str | Path,
    seed: int = 0,
    scale: float = 1.0,
    shard_bytes: int = 2 * 2**30,
    norm_topk_prob: bool = False,
    rope_scaling: Mapping[str, Any] | None = None,
    progress: Callable[[Shard, int], None] | None = None,
) -> Path:
    """Write `config.json` (with `rope_scaling` if given, written as is) and seeded random weights
    (sharded past `shard_bytes`) to `out_dir`, one shard in memory at a time; `progress` is
    told each shard written and the bytes written so far."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = spec_to_hf_config(spec, norm_topk_prob)
    if rope_scaling:  # e.g. DeepSeek-V2-Lite's {"type": "yarn", "factor": 40, ...}
        cfg["rope_scaling"] = dict(rope_scaling)
    plan = plan_shards(spec, shard_bytes)
    # written into a folder of its own, then moved in, config.json last: a write cut short (a
    # full disk, Ctrl-C) leaves the folder's earlier checkpoint as it was. Where the disk cannot
    # hold both, the earlier one goes first (config.json first: no half checkpoint is read).
    tmp = staging_dir(out)  # a killed writer's staging removed before the disk is counted
    new_bytes = sum(shard.nbytes for shard in plan)
    if shutil.disk_usage(out).free < 1.05 * new_bytes + (64 << 20):
        _remove_checkpoint_files(out)
    tmp.mkdir()
    try:
        weights = _Weights(spec, torch.Generator().manual_seed(seed), scale)
        _save_shards(tmp, plan, weights, cfg, progress)
        _remove_checkpoint_files(out)
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@dataclass(frozen=True)
class _Weights:
    """The draw of a checkpoint's weights: one generator, drawn from in the plan's order, so a
    shard's weights are the same whether the shards before it were kept or written away."""

    spec: ModelSpec
    g: torch.Generator  # seeded once, before the first shard
    scale: float  # the weights' standard deviation, times the default

    def make(self, shard: Shard) -> dict[str, torch.Tensor]:
        dtype = torch_dtype(self.spec)
        return {
            ts.hf_name: _init(key, ts.shape, self.spec, self.g, self.scale).to(dtype).contiguous()
            for key, ts in shard.tensors
        }


def _remove_checkpoint_files(out: Path) -> None:
    """The files of a checkpoint `write_checkpoint` wrote into `out` (by their names only, a
    user's other files stay), config.json first."""
    (out / "config.json").unlink(missing_ok=True)
    for f in out.iterdir():
        if f.name == INDEX_FILE or _SHARD_NAME.fullmatch(f.name):
            f.unlink()


# the weight files write_checkpoint writes: model.safetensors, or model-00001-of-00003.safetensors
_SHARD_NAME = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
# the safetensors metadata key each weight file write_checkpoint writes carries: a folder's
# checkpoint without it is not one it may replace (a real model's, downloaded)
MARK = "moepipe.write_checkpoint"


def foreign_checkpoint(out: Path) -> str | None:
    """The file that makes `out` hold a checkpoint write_checkpoint did not write (config.json
    beside no weights of its own, a weight file without its mark), which writing into `out`
    would delete; None where there is none."""
    if not out.is_dir():
        return None
    names = {f.name for f in out.iterdir()}
    shards = sorted(n for n in names if _SHARD_NAME.fullmatch(n))
    for name in shards:
        if MARK not in _metadata(out / name):
            return name
    rest = sorted(names & {"config.json", INDEX_FILE})
    return rest[0] if rest and not shards else None


def _metadata(path: Path) -> dict[str, str]:
    """A safetensors file's metadata ({} where it has none or is no safetensors file)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception:  # noqa: BLE001 (unreadable: not ours to replace either)
        return {}


def _save_shards(
    out: Path,
    plan: list[Shard],
    weights: _Weights,
    cfg: dict[str, Any],
    progress: Callable[[Shard, int], None] | None,
) -> None:
    """The checkpoint's files in `out`: its shard(s), each made just before it is written and
    let go after, the index where there are several, and config.json last (its mark of a
    whole checkpoint)."""
    meta = {"format": "pt", MARK: "seeded random weights"}
    written = 0
    for shard in plan:
        tensors = weights.make(shard)
        save_shard(tensors, out / shard.file, meta)
        del tensors  # before the next shard's weights are made
        written += shard.nbytes
        if progress is not None:
            progress(shard, written)
    if len(plan) > 1:
        weight_map = {ts.hf_name: shard.file for shard in plan for _, ts in shard.tensors}
        index = {"metadata": {"total_size": written}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
