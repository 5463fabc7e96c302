"""Convert the upstream ESFT routing logs to moepipe's `esft_routing.npz` layout.

SRC is a directory holding `<task>/expert_weights_<layer>.txt` files, or the upstream tarball.

Writes OUT (.npz added when missing); an OUT that is a device, FIFO or folder is refused.

Usage:
    python -m experiments.convert_traces \
        src=../shared/traces/esft-dsv2lite/original/esft_expert_scores_original.tar.gz out=out.npz
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING

from core.args import refuse_theirs
from core.errors import MoepipeError
from core.files import not_regular
from core.trace_convert import convert_esft
from core.traces import N_LAYERS
from experiments.common.app import command
from experiments.common.cli import (
    exit_command,
    output_file,
    until_interrupted,
)
from experiments.common.dir_lock import output_locked
from experiments.common.held_warnings import plan_accepted, say_line


@dataclass
class Options:
    src: str = MISSING  # directory of <task>/expert_weights_<layer>.txt, or a .tar.gz of it
    out: str = MISSING  # output .npz path (.npz is added when missing)


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C: one line and exit 130, the trace already at `out` kept (it is replaced whole)."""
    return int(until_interrupted(lambda: _app(argv)))


def _main(args: Options) -> int:
    try:
        # checked before the conversion (a minute on the full tarball); numpy writes <out>.npz
        if not str(args.out).strip():
            raise MoepipeError("out='': an empty path; pass out=<a file>, e.g. esft_routing.npz")
        if Path(args.out).is_dir():
            raise MoepipeError(
                f"out {args.out}: is a folder; pass a file path, "
                f"e.g. {Path(args.out) / 'esft_routing.npz'}"
            )
        special = not_regular(args.out)  # out=/dev/full wrote /dev/full.npz, unsaid
        if special:
            raise MoepipeError(
                f"out={args.out}: {special}, not a file this command writes; pass out= a "
                "file path, e.g. esft_routing.npz"
            )
        dest = args.out if args.out.endswith(".npz") else f"{args.out}.npz"
        output_file(dest, "out")
        # a file of the user's there (notes, another npz) would be lost: the trace's begins
        # as a zip whose first entry is expert_ids.npy
        with output_locked(dest, "out", "convert_traces"):  # two at once: the last won, unsaid
            refuse_theirs(Path(dest), "out", b"PK\x03\x04", b"expert_ids.npy")
            plan_accepted()  # inputs accepted: its warnings said now, not as it ends
            out = convert_esft(args.src, dest, n_layers=N_LAYERS)  # what load_esft reads
    except MoepipeError as e:
        say_line(e)
        return 2
    print(f"wrote {out}")
    return 0


_app = command("convert_traces", Options, _main, __doc__)

if __name__ == "__main__":
    exit_command(main)
