"""FP8 checkpoints for the tests, as DeepSeek-V3's release stores them: each linear weight of
the layers in float8_e4m3fn with a float32 `weight_scale_inv` per block, and config.json's
quantization_config. No transformers needed (tests/real/test_fp8_bytes.py runs without it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

FP8_BLOCK = 8  # DeepSeek's release: 128; 8 divides every size of the tests' models


def fp8_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] as DeepSeek's release stores it: float8_e4m3fn of w / scale, scale (float32,
    [ceil(R / block), ceil(C / block)]) the block's largest magnitude over float8's largest
    value, the last block of a dimension the block does not divide cut short."""
    f8, (r, c) = torch.float8_e4m3fn, w.shape
    g = torch.zeros(-(-r // block) * block, -(-c // block) * block)
    g[:r, :c] = w.float()
    g = g.reshape(g.shape[0] // block, block, g.shape[1] // block, block)
    scale = g.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(f8).max
    q = (g / scale[:, None, :, None]).to(f8).flatten(0, 1).flatten(1, 2)
    return q[:r, :c].contiguous(), scale


def write_fp8(ckpt: Path, to: Path, block: int = FP8_BLOCK) -> Path:
    """A copy of a DeepSeek-V3 checkpoint quantized as DeepSeek's release is: every linear
    weight of the layers in float8 blocks with its weight_scale_inv; the embedding, the head,
    the norms and the router (its weight and correction bias) as saved; quantization_config as
    the release's config.json has it."""
    from real.shards import read_header, read_tensor, save_shard

    shutil.copytree(ckpt, to)
    file = to / "model.safetensors"
    out = {}
    for name, e in read_header(file).items():
        x = read_tensor(e)
        linear = name.startswith("model.layers.") and x.dim() == 2 and "norm" not in name
        if linear and not name.endswith("mlp.gate.weight"):
            out[name], out[name + "_scale_inv"] = fp8_blocks(x, block)
        else:
            out[name] = x
    save_shard(out, file, {"format": "pt"})
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    cfg = json.loads((to / "config.json").read_text())
    cfg["quantization_config"] = fp8 | {"weight_block_size": [block, block]}
    (to / "config.json").write_text(json.dumps(cfg))
    return to
