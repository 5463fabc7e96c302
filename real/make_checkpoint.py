"""Write a seeded random checkpoint (HF config.json + safetensors) for a conf/model, optionally
reduced in size, for the real executor's tests and benchmarks.

Usage: python -m real.make_checkpoint model=mixtral-tiny out=ckpt/ [seed=0] [scale=1.0]
           [shard_mb=2048] [norm_topk_prob=false] [hidden_size=256 n_layers=8 expert_ffn_size=1024 ...]
Any other key=value overrides a ModelSpec field (see real.checkpoint.reduced_spec).
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from core.errors import MoepipeError
from real.checkpoint import reduced_spec, write_checkpoint

_OPTIONS = {"model", "out", "seed", "scale", "shard_mb", "norm_topk_prob"}


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
        parsed = value if key in ("model", "out") else yaml.safe_load(value)
        (opts if key in _OPTIONS else overrides)[key] = parsed
    for key in ("model", "out"):
        if key not in opts:
            raise MoepipeError(
                f"missing {key}=...; usage: python -m real.make_checkpoint model=mixtral-tiny out=ckpt/"
            )
    return opts, overrides


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    try:
        opts, overrides = parse_args(argv)
        spec = reduced_spec(opts["model"], **overrides)
        out = write_checkpoint(
            spec,
            opts["out"],
            seed=int(opts.get("seed", 0)),
            scale=float(opts.get("scale", 1.0)),
            shard_bytes=int(float(opts.get("shard_mb", 2048)) * 2**20),
            norm_topk_prob=bool(opts.get("norm_topk_prob", False)),
        )
    except MoepipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {out}: {spec.name} ({spec.family}), {spec.total_bytes / 2**20:.1f} MiB by the spec's count"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
