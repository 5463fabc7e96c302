"""Writing Hugging Face-layout checkpoints of seeded random weights (`write_checkpoint`), in
the tensor layout `real.checkpoint.unit_layout` lists, with the family's real config.json fields
(core.hf_config). Tests and benches build their models with it: no model hub is reachable."""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from core.hf_config import spec_to_hf_config
from core.spec import ModelSpec
from real.checkpoint import INDEX_FILE, SINGLE_FILE, torch_dtype, unit_layout
from real.shards import save_shard


def _init(
    key: str, shape: tuple[int, ...], spec: ModelSpec, g: torch.Generator, scale: float
) -> torch.Tensor:
    """Seeded weights that keep activations O(1): std 1/sqrt(fan_in); residual-stream outputs
    (o, w2, wo) shrunk by sqrt(2 * n_layers); router logits of std ~1 so routing is spread out."""
    if key.endswith("norm"):
        return torch.ones(shape)
    x = torch.randn(shape, generator=g)
    if key == "embed":
        return x * scale
    if key.endswith("_bias"):
        return x * 0.02 * scale
    std = scale / math.sqrt(shape[-1])
    if key in ("o", "w2", "wo"):
        std /= math.sqrt(2 * spec.n_layers)
    return x * std


def write_checkpoint(
    spec: ModelSpec,
    out_dir: str | Path,
    seed: int = 0,
    scale: float = 1.0,
    shard_bytes: int = 2 * 2**30,
    norm_topk_prob: bool = False,
    rope_scaling: Mapping[str, Any] | None = None,
) -> Path:
    """Write `config.json` (with `rope_scaling` if given, written as is) and seeded random weights
    (sharded past `shard_bytes`) to `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = spec_to_hf_config(spec, norm_topk_prob)
    if rope_scaling:  # e.g. DeepSeek-V2-Lite's {"type": "yarn", "factor": 40, ...}
        cfg["rope_scaling"] = dict(rope_scaling)
    dtype = torch_dtype(spec)
    g = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for tensors in unit_layout(spec).values():
        for key, ts in tensors.items():
            t = _init(key, ts.shape, spec, g, scale).to(dtype).contiguous()
            if size and size + t.nbytes > shard_bytes:
                shards.append({})
                size = 0
            shards[-1][ts.hf_name] = t
            size += t.nbytes
    # written into a folder of its own, then moved in, config.json last: a write cut short (a
    # full disk, Ctrl-C) leaves the folder's earlier checkpoint as it was. Where the disk cannot
    # hold both, the earlier one goes first (config.json first: no half checkpoint is read).
    new_bytes = sum(t.nbytes for shard in shards for t in shard.values())
    if shutil.disk_usage(out).free < 1.05 * new_bytes + (64 << 20):
        _remove_checkpoint_files(out)
    tmp = out / f".partial-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        _save_shards(tmp, shards, cfg)
        _remove_checkpoint_files(out)
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


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


def _save_shards(out: Path, shards: list[dict[str, torch.Tensor]], cfg: dict[str, Any]) -> None:
    """The checkpoint's files in `out`: its shard(s), the index where there are several, and
    config.json."""
    meta = {"format": "pt", MARK: "seeded random weights"}
    if len(shards) == 1:
        save_shard(shards[0], out / SINGLE_FILE, meta)
    else:
        weight_map, total = {}, 0
        for j, shard in enumerate(shards):
            name = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
            save_shard(shard, out / name, meta)
            weight_map |= dict.fromkeys(shard, name)
            total += sum(t.nbytes for t in shard.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
