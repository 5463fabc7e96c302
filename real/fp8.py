"""FP8 checkpoints as DeepSeek-V3's release stores them: a float8_e4m3fn `<name>.weight` with
a float32 `<name>.weight_scale_inv` of one scale per [rows, columns] block (quantization_config's
weight_block_size), dequantized at load into the run's dtype as transformers' Fp8Dequantize
does where no GPU runs FP8: the weight in float32 times its block's scale, then cast.

The disk holds the FP8 bytes and scales; the host and device tiers hold the dequantized weights.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from core.errors import ConfigError, quoted
from real.shards import TensorEntry, read_tensor

SCALE_SUFFIX = "_scale_inv"  # `<name>.weight` + this: its blocks' scales
FP8 = torch.float8_e4m3fn


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """[rows, columns] of a [R, C] weight's scales: a block per block_rows x block_columns,
    the last of each dimension cut short where the block does not divide it."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def attach_scales(
    index: dict[str, TensorEntry], listed: list[str], block: tuple[int, int] | None
) -> list[str]:
    """Each float8 weight of `index` given its scales (`TensorEntry.scale`) and `block`
    (quantization_config's; None: no FP8, `listed` as it is); the scales' own names taken out
    of `index` and `listed` (what the model reads is the weight). One line naming the tensor
    for a float8 weight without scales, scales without their weight, a scale grid of
    another shape than the block makes, or quantization_config over no float8 weight."""
    if block is None:
        return listed
    for name in [n for n in index if n.endswith(SCALE_SUFFIX)]:
        weight, scale = name.removesuffix(SCALE_SUFFIX), index.pop(name)
        e = index.get(weight)
        if e is None or e.dtype != FP8:
            raise ConfigError(
                f"{scale.file}: tensor {quoted(name)} scales no float8_e4m3fn weight "
                f"{quoted(weight)}; re-copy the checkpoint"
            )
        _check_matrix(weight, e)
        grid = scale_grid(e.shape, block)
        if scale.dtype != torch.float32 or scale.shape != grid:
            raise ConfigError(
                f"{scale.file}: tensor {quoted(name)} is {scale.dtype} {list(scale.shape)}; "
                f"weight_block_size {list(block)} over {quoted(weight)} {list(e.shape)} makes "
                f"float32 {list(grid)}: fix quantization_config or re-copy the checkpoint"
            )
        _check_scales(name, scale)
        index[weight] = replace(e, scale=scale, block=block)
    bare = sorted(n for n, e in index.items() if e.dtype == FP8 and e.scale is None)
    if bare:
        _check_matrix(bare[0], index[bare[0]])
        raise ConfigError(
            f"{index[bare[0]].file}: float8_e4m3fn tensor {quoted(bare[0])} has no "
            f"{quoted(bare[0] + SCALE_SUFFIX)} ({len(bare)} such); re-copy the checkpoint"
        )
    if index and not any(e.scale is not None for e in index.values()):
        raise ConfigError(
            f"{next(iter(index.values())).file.parent / 'config.json'}: quantization_config "
            "says fp8, but no tensor is float8_e4m3fn with its scales (the weights are not "
            "quantized, and transformers would load them into FP8 layers with no scales); "
            "remove quantization_config, or re-copy the checkpoint"
        )
    return [n for n in listed if not n.endswith(SCALE_SUFFIX)]


def _check_scales(name: str, scale: TensorEntry) -> None:
    """One line for a block scale that is 0, negative, NaN or infinite: transformers would
    multiply the block by it; no quantizer writes one (a block's scale is its largest magnitude
    over FP8's, > 0 and finite). Read once, as the checkpoint is opened: a grid is 1/16384th
    of its weight's values."""
    values = read_tensor(scale)  # [rows/br, columns/bc] float32
    bad = ~(torch.isfinite(values) & (values > 0))
    if bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0]]
        raise ConfigError(
            f"{scale.file}: tensor {quoted(name)} holds {float(values[tuple(at)])} at block {at} "
            f"({int(bad.sum())} such), where a scale is a finite number > 0; re-copy or "
            "re-quantize the checkpoint"
        )


def _check_matrix(name: str, e: TensorEntry) -> None:
    """One line for a float8 tensor that is not one matrix: transformers' fused experts
    (save_original_format=False: [E, 2F, H] and [E, H, F]), whose scales moepipe does not split
    by expert."""
    if len(e.shape) != 2:
        raise ConfigError(
            f"{e.file}: float8_e4m3fn tensor {quoted(name)} is {list(e.shape)}, experts fused "
            "into one tensor: FP8 runs with one tensor per expert matrix only; save the "
            "checkpoint with save_original_format=True (DeepSeek's release's form)"
        )


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """q [R, C] float8 times scale [ceil(R/br), ceil(C/bc)] float32 per block -> float32 [R, C]
    (transformers' product; the caller casts it to the run's dtype)."""
    rows, cols = q.shape
    s = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return q.to(torch.float32) * s


def read_weight(entry: TensorEntry) -> torch.Tensor:
    """`read_tensor`, an FP8 weight dequantized to float32 with its scales."""
    if entry.scale is None:
        return read_tensor(entry)
    return dequantize(read_tensor(entry), read_tensor(entry.scale), entry.block)
