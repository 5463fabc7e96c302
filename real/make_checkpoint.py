"""Write a seeded random checkpoint (HF config.json + safetensors) for a conf/model, optionally
reduced in size, for the real executor's tests and benchmarks.

Usage: python -m real.make_checkpoint model=mixtral-tiny out=ckpt/ [seed=0] [scale=1.0]
           [shard_mb=2048] [norm_topk_prob=false] [hidden_size=256 n_layers=8 expert_ffn_size=1024 ...]
           [rope_scaling='{type: yarn, factor: 4, original_max_position_embeddings: 1024}']
Any other key=value overrides a ModelSpec field (see real.checkpoint.reduced_spec); rope_scaling
is written into config.json as given (types default, linear, dynamic, yarn and llama3 run).
"""

from __future__ import annotations

import enum
import sys
import typing
from dataclasses import fields
from typing import Any

import yaml

from core.args import as_bool, as_float, as_int, output_dir
from core.errors import MoepipeError
from core.spec import ModelSpec
from real.attention import Rope
from real.checkpoint import reduced_spec, spec_to_hf_config, write_checkpoint

_OPTIONS = {"model", "out", "seed", "scale", "shard_mb", "norm_topk_prob", "rope_scaling"}


def parse_args(argv: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """key=value arguments -> (our options, ModelSpec overrides); values parsed as YAML scalars."""
    opts: dict[str, Any] = {}
    overrides: dict[str, Any] = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise MoepipeError(
                f"argument {arg!r} is not key=value; see python -m real.make_checkpoint --help"
            )
        try:
            parsed = value if key in ("model", "out") else yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = value  # not a YAML scalar: kept as the string, and checked below
        (opts if key in _OPTIONS else overrides)[key] = parsed
    for key in ("model", "out"):
        if key not in opts:
            raise MoepipeError(
                f"missing {key}=...; usage: python -m real.make_checkpoint model=mixtral-tiny out=ckpt/"
            )
    return opts, overrides


def check_overrides(overrides: dict[str, Any]) -> None:
    """Each ModelSpec override has its field's type (a whole number for sizes, a number for
    floats, a list of whole numbers for moe_layers); unknown fields are left to reduced_spec,
    which lists the valid ones."""
    hints = typing.get_type_hints(ModelSpec)
    names = {f.name for f in fields(ModelSpec)}
    for key, value in overrides.items():
        if key not in names:
            continue
        hint = hints[key]
        if hint is int:
            as_int(key, value)
        elif hint is float:
            as_float(key, value)
        elif isinstance(hint, type) and issubclass(hint, enum.Enum):
            valid = [str(m.value) for m in hint]
            if str(value) not in valid:
                raise MoepipeError(f"{key}={value}: unknown; valid: {', '.join(valid)}")
        elif key == "moe_layers" and not (
            isinstance(value, list)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
        ):
            raise MoepipeError(f"moe_layers={value}: pass a list of layer indices, e.g. [0,1,2]")


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    try:
        opts, overrides = parse_args(argv)
        seed = as_int("seed", opts.get("seed", 0), at_least=0)
        scale = as_float("scale", opts.get("scale", 1.0), positive=True)
        shard_mb = as_float("shard_mb", opts.get("shard_mb", 2048), positive=True)
        norm_topk_prob = as_bool("norm_topk_prob", opts.get("norm_topk_prob", False))
        check_overrides(overrides)
        spec = reduced_spec(opts["model"], **overrides)
        rope_scaling = opts.get("rope_scaling")
        if rope_scaling is not None:
            if not isinstance(rope_scaling, dict):
                raise MoepipeError(
                    f"rope_scaling={rope_scaling}: pass a mapping, e.g. '{{type: linear, factor: 2}}'"
                )
            cfg = spec_to_hf_config(spec) | {"rope_scaling": rope_scaling}
            Rope.from_config(cfg, spec, where="command line")  # raises on malformed fields
        out = output_dir(opts["out"], "out")  # before the weights are made
        try:
            out = write_checkpoint(
                spec,
                out,
                seed=seed,
                scale=scale,
                shard_bytes=max(int(shard_mb * 2**20), 1),
                norm_topk_prob=norm_topk_prob,
                rope_scaling=rope_scaling,
            )
        except OSError as e:
            raise MoepipeError(
                f"out={out}: cannot write the checkpoint ({e.strerror or e})"
            ) from None
    except MoepipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {out}: {spec.name} ({spec.family}), {spec.total_bytes / 2**20:.1f} MiB by the spec's count"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
