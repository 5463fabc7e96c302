"""Write a seeded random checkpoint (Hugging Face config.json + safetensors) of a conf/model,
optionally reduced in size, for the real executor's tests and benchmarks.

Usage: python -m experiments.make_checkpoint model=mixtral-tiny out=ckpt/ [seed=0] [scale=1.0]
           [hidden_size=256 n_layers=8 expert_ffn_size=1024 ...]
           [rope_scaling='{type: yarn, factor: 4, original_max_position_embeddings: 1024}']
Every ModelSpec field (hidden_size, n_layers, ...) is an override, its derived fields kept
consistent (real.checkpoint.reduced_spec); rope_scaling goes into config.json as given (types
default, linear, dynamic, yarn and llama3 run).
"""

from __future__ import annotations

import enum
import math
import shutil
import typing
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING

from core.args import as_float, as_int, as_size_mb, not_a_run_folder, output_dir
from core.errors import MoepipeError, did_you_mean
from core.hf_config import HFConfig, hf_config_to_spec, hf_runtime, spec_to_hf_config
from core.spec import ModelSpec
from experiments.common.app import command
from experiments.common.cli import exit_command, os_error_fix, until_interrupted
from experiments.common.dir_lock import dir_locked
from experiments.common.held_warnings import plan_accepted
from experiments.common.option_names import named_as
from real.attention import Rope
from real.checkpoint import reduced_spec
from real.checkpoint_write import (
    Shard,
    foreign_checkpoint,
    peak_ram_bytes,
    plan_shards,
    std_range,
    write_checkpoint,
)


@dataclass
class Options:
    model: str = MISSING  # conf/model/<model>.yaml, or a model YAML file (FILE.yaml)
    out: str = MISSING  # the checkpoint folder to write
    seed: int = 0  # of the random weights
    scale: float = 1.0  # the weights' standard deviation, times the default
    shard_mb: float = 2048  # safetensors shard size: one is made in RAM at a time
    norm_topk_prob: bool = False  # config.json's norm_topk_prob (renormalise top-k gate weights)
    rope_scaling: Any = None  # a mapping written into config.json, e.g. {type: linear, factor: 2}


def _override_type(hint: Any) -> Any:
    """A ModelSpec field's type as an optional override's: enums as their value (checked in
    `check_enums`), tuples as lists."""
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return Optional[str]  # noqa: UP045  make_dataclass needs a typing object
    if typing.get_origin(hint) is tuple:
        return Optional[list[typing.get_args(hint)[0]]]  # noqa: UP045
    return Optional[hint]  # noqa: UP045


_SPEC_HINTS = typing.get_type_hints(ModelSpec)
# the fields a written checkpoint can take: it writes no FP8 (the disk_* fields' form)
_SPEC_FIELDS = [f.name for f in fields(ModelSpec) if not f.name.startswith("disk_")]
Schema = make_dataclass(
    "MakeCheckpointOptions",
    [(name, _override_type(_SPEC_HINTS[name]), field(default=None)) for name in _SPEC_FIELDS],
    bases=(Options,),
)


def check_enums(overrides: dict[str, Any]) -> None:
    """An enum field's override is one of its values (the schema types it as a string)."""
    for key, value in overrides.items():
        hint = _SPEC_HINTS[key]
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            valid = [str(m.value) for m in hint]
            if str(value) not in valid:
                raise MoepipeError(
                    f"{key}={value}: unknown; {did_you_mean(value, valid)}valid: {', '.join(valid)}"
                )


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C: one line and exit 130; a cut checkpoint has no config.json, so it is not read."""
    return int(until_interrupted(lambda: _app(argv)))


# A shard under a megabyte holds a tensor or two: a model's checkpoint would be thousands of
# files (1e-30 made one file per tensor), each a file a loader opens
MIN_SHARD_MB = 1.0
SHARD_WHY = "a smaller shard holds a tensor or two, and the checkpoint thousands of files"
# torch.Generator's seed: a 64-bit integer
MAX_SEED = 2**63 - 1
# No draw of a normal past this many standard deviations turns up in any checkpoint (the odds
# are 1e-23 a weight): a scale whose weights stay finite this far out stays finite
MAX_SIGMAS = 10.0
# A normal draw falls within this many standard deviations of 0 one time in 10: at most that
# share of the narrowest-drawn tensor's weights may be subnormal (a float16 model's real
# weights are so near it at scale 1; bfloat16 and float32 are far from it)
MIN_SIGMAS = 0.125


def check_runs(spec: ModelSpec, norm_topk_prob: bool, rope_scaling: Any) -> None:
    """Refuse a checkpoint the real model would refuse to run (hf_runtime: an odd rotary dim,
    ...): written, it took its time and disk only for every run on it to fail."""
    cfg = spec_to_hf_config(spec, norm_topk_prob)
    if rope_scaling is not None:
        cfg |= {"rope_scaling": rope_scaling}
    hf_runtime(HFConfig(cfg, "the config.json it would write"), hf_config_to_spec(cfg, spec.name))


def check_kept(spec: Any, overrides: dict[str, Any], out: Path, norm_topk_prob: bool) -> None:
    """Each field the user set is one the checkpoint keeps: read back from its config.json (and
    its folder's name), as a run reads it; a field config.json cannot hold was dropped unread."""
    back = hf_config_to_spec(spec_to_hf_config(spec, norm_topk_prob), out.absolute().name)
    for key in overrides:
        if getattr(back, key) != getattr(spec, key):
            where = "its folder's name (out=)" if key == "name" else "config.json"
            raise MoepipeError(
                f"{key}={overrides[key]}: the checkpoint cannot keep it (a run reads {key}="
                f"{getattr(back, key)} from {where}); leave {key} out"
            )


# the model's keys its checks name, as this command's own options that set them
OWN_NAMES = {f"model.{k}": k for k in _SPEC_FIELDS}


def _main(opts: Any) -> int:
    """Hold `out`'s lock (`dir_lock`) throughout: a second make_checkpoint into the same folder
    waits for the first to end, then replaces its checkpoint whole; two at once each reported
    success over a folder holding one's config.json and the other's shards."""
    out = Path(opts.out).absolute()
    # the topmost folder of `out` that is not there yet (output_dir makes out's parents too)
    made = next((p for p in (out, *out.parents) if p.parent.exists()), None)
    fresh = made is not None and not made.exists()
    try:
        busy = "another make_checkpoint is writing this folder"
        with dir_locked(output_dir(opts.out, "out"), busy), named_as(OWN_NAMES):
            return _write(opts)
    except BaseException:  # a failed or stopped run leaves no folder it made, nor another's
        if fresh and made is not None and not (out.is_dir() and any(out.iterdir())):
            shutil.rmtree(made, ignore_errors=True)
        raise


def _write(opts: Any) -> int:
    seed = as_int("seed", opts.seed, at_least=0, at_most=MAX_SEED, why="a 64-bit seed")
    scale = as_float("scale", opts.scale, positive=True)
    shard_mb = as_size_mb(
        "shard_mb", opts.shard_mb, at_least=MIN_SHARD_MB, whole=False, low_why=SHARD_WHY
    )
    overrides = {k: getattr(opts, k) for k in _SPEC_FIELDS if getattr(opts, k) is not None}
    check_enums(overrides)
    spec = reduced_spec(opts.model, **overrides)
    rope_scaling = opts.rope_scaling
    if rope_scaling is not None:
        if not isinstance(rope_scaling, dict):
            raise MoepipeError(
                f"rope_scaling={rope_scaling}: pass a mapping, e.g. '{{type: linear, factor: 2}}'"
            )
        cfg = spec_to_hf_config(spec) | {"rope_scaling": rope_scaling}
        Rope.from_config(cfg, spec, where="command line")  # raises on malformed fields
    check_kept(spec, overrides, Path(opts.out), opts.norm_topk_prob)
    check_runs(spec, opts.norm_topk_prob, rope_scaling)
    check_usable(spec)
    # before check_scale, whose pass over every tensor's shape took a minute for a model of
    # 100,000 layers that the disk cannot hold
    check_room(spec, Path(opts.out))
    check_scale(spec, scale)
    shard_bytes = max(int(shard_mb * 2**20), 1)
    plan = plan_shards(spec, shard_bytes)
    check_ram(plan, shard_mb, spec.name)
    theirs = foreign_checkpoint(Path(opts.out))
    if theirs is not None:  # a real model's, downloaded: writing here deletes its weights
        raise MoepipeError(
            f"out={opts.out}: holds a checkpoint without make_checkpoint's mark ({theirs}), "
            "whose files this would replace; pass out= another folder, or delete them first"
        )
    not_a_run_folder(opts.out, "out", checkpoint=True)  # as a run refuses a checkpoint's
    out = output_dir(opts.out, "out")  # before the weights are made
    plan_accepted()  # inputs accepted: its warnings said now, not as it ends
    try:
        out = write_checkpoint(
            spec,
            out,
            seed=seed,
            scale=scale,
            shard_bytes=shard_bytes,
            norm_topk_prob=opts.norm_topk_prob,
            rope_scaling=rope_scaling,
            progress=lambda shard, written: _progress(shard, written, plan),
        )
    except OSError as e:
        raise MoepipeError(
            f"out={out}: cannot write the checkpoint ({e.strerror or e}); {os_error_fix(e)}"
        ) from None
    print(
        f"wrote {out}: {spec.name} ({spec.family}), "
        f"{spec.total_bytes / 2**20:.1f} MiB by the spec's count"
    )
    kept = Path(out) / "generation_config.json"  # a user's file: kept, but said
    if kept.exists() or kept.is_symlink():
        print(
            f"kept {kept}, which runs of this checkpoint read (make_checkpoint writes none): "
            "remove it if it was the earlier model's"
        )
    return 0


def check_scale(spec: ModelSpec, scale: float) -> None:
    """Refuse a scale whose weights would overflow the checkpoint's dtype (inf weights, written
    with exit 0), or whose smallest weights would fall below its smallest normal number
    (subnormal, with fewer bits of precision, or 0: a model of zeros was also written with
    exit 0), naming the range that works. The largest weight is about MAX_SIGMAS standard
    deviations of the widest-drawn tensor (the embedding's); the tensor of the narrowest
    draw keeps all but those within MIN_SIGMAS of 0 (1 in 10) normal."""
    import torch

    from real.checkpoint import torch_dtype

    dtype = torch_dtype(spec)
    narrowest, widest = std_range(spec)
    largest = min(torch.finfo(dtype).max, torch.finfo(torch.float32).max)
    smallest = max(torch.finfo(dtype).tiny, torch.finfo(torch.float32).tiny)
    low, high = smallest / (MIN_SIGMAS * narrowest), largest / (MAX_SIGMAS * widest)
    span = f"pass scale in [{_digits(low, up=True)}, {_digits(high, up=False)}]"
    if scale > high:
        raise MoepipeError(
            f"scale={scale:g}: the weights would overflow {dtype} (largest {largest:.3g}) and be "
            f"written as inf; {span}"
        )
    if scale < low:
        raise MoepipeError(
            f"scale={scale:g}: the smallest weights (std {scale * narrowest:.3g}) would be near or "
            f"below {dtype}'s smallest normal number ({smallest:.3g}), subnormal (fewer bits of "
            f"precision) or 0; {span}"
        )


def _digits(x: float, *, up: bool) -> str:
    """`x` to 3 significant digits, rounded up (`up`) or down: a bound shown within its range."""
    shown = f"{x:.3g}"
    while (float(shown) < x) if up else (float(shown) > x):
        x = x * (1 + 1e-3) if up else x * (1 - 1e-3)
        shown = f"{x:.3g}"
    return shown


def check_usable(spec: ModelSpec) -> None:
    """Refuse a value transformers accepts but moepipe's run cannot use: RMSNorm runs in
    float32, where an rms_norm_eps below its smallest normal number is not the value given (0
    or subnormal; the spec takes it below 1, and a rope_theta only inside float32's range); a
    vocabulary of one token generates only it."""
    import torch

    low = f"{torch.finfo(torch.float32).tiny:.3g}"  # rounded inwards: a float32
    ranges = {  # field: (the range's words, whether a value is in it, why not)
        "rms_norm_eps": (
            f"in [{low}, 1)",
            lambda v: float(low) <= v,
            "RMSNorm runs in float32, where it is 0 or subnormal (not the value given)",
        ),
        "vocab_size": ("at least 2", lambda v: v >= 2, "a model of one token generates only it"),
    }
    for key, (span, usable, why) in ranges.items():
        value = getattr(spec, key)
        if not usable(value):
            raise MoepipeError(f"{key}={value:g}: {why}; pass {key} {span}")


def check_room(spec: ModelSpec, out: Path) -> None:
    """Refuse a checkpoint larger than the free space of the disk `out` is on (a checkpoint
    there already counts as free: it is replaced), naming both; 393 GB was started on a 60 GB
    disk."""
    import shutil

    from real.checkpoint import INDEX_FILE

    where = next((p for p in (out, *out.absolute().parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(where).free
    if out.is_dir():
        names = ("config.json", INDEX_FILE)
        free += sum(
            f.stat().st_size
            for f in out.iterdir()
            if f.is_file() and (f.name in names or f.suffix == ".safetensors")
        )
    if spec.total_bytes > free:
        raise MoepipeError(
            f"out={out}: the checkpoint is {spec.total_bytes / 1e9:.3g} GB and the disk there has "
            f"{free / 1e9:.3g} GB free; make the model smaller (n_layers, n_experts, hidden_size) "
            "or write elsewhere"
        )


def check_ram(plan: list[Shard], shard_mb: float, name: str) -> None:
    """Refuse a checkpoint whose largest shard (with the draws of its largest tensor) does not fit
    in the RAM available, naming what would fit: each shard's weights are made just before it
    is written and let go after, so a model larger than the RAM is written a shard at a time."""
    from experiments.common.pipeline import check_ram as check

    largest = max(plan, key=lambda shard: shard.nbytes)
    tensor = max(
        (ts for shard in plan for _, ts in shard.tensors), key=lambda ts: math.prod(ts.shape)
    )
    check(
        peak_ram_bytes(plan),
        f"model={name}: making its largest shard ({largest.nbytes / 1e9:.3g} GB of weights at "
        f"shard_mb={shard_mb:g})",
        f"pass a smaller shard_mb, or make its largest tensor ({tensor.hf_name}) smaller "
        "(hidden_size, expert_ffn_size, vocab_size)",
    )


def _progress(shard: Shard, written: int, plan: list[Shard]) -> None:
    """One line per shard written where there are several (a full-size model's take minutes)."""
    if len(plan) > 1:
        total = sum(s.nbytes for s in plan)
        print(f"{shard.file}: {written / 1e9:.2f} of {total / 1e9:.2f} GB written", flush=True)


_app = command("make_checkpoint", Schema, _main, __doc__)

if __name__ == "__main__":
    exit_command(main)
