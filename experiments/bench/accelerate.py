"""Peer benchmark: Hugging Face transformers + accelerate disk offload vs moepipe, same checkpoint,
same prompts, same memory. Prints one row per system (tok/s, memory used, ratio to the best peer);
it writes no files (accelerate's offload folder is temporary).

Rows:
- moepipe `planner` (klotski at the n its planner picks) on the real executor: a device pool of
  `gpu_frac` of the model, host RAM `cpu_frac`, the rest read from disk with O_DIRECT;
- accelerate as a user who wants throughput runs it: `from_pretrained(device_map="auto",
  max_memory=..., offload_folder=...)` with `max_memory` of the same sizes (on a CPU-only machine
  its one "cpu" entry is their sum) and every prompt in one greedy `generate` call (the largest
  batch that fits the memory limit: halved until it does);
- accelerate batch by batch (`batch_size` sequences per `generate` call), the second peer row.

Memory: each system runs in a process of its own. Where this process may make a child memory
cgroup (v2, else v1; as root), each runs in one limited to `budget + runtime_mb` (the runtime
allowance measured from a bare process that imports torch and transformers, plus `slack_mb`),
which counts the page cache as well as the process's own memory; its peak is printed beside the
peak RSS. The checkpoint's pages are evicted before each process starts (pages cached earlier
would be charged to another cgroup). Where no cgroup can be made, the limit is not enforced and
the page cache of the weight files is dropped instead (`cold`).

`cold` says how accelerate's memory-mapped, offloaded weights meet the disk (moepipe reads its
disk tier with O_DIRECT every time):
- `pass` (default): their page cache is dropped before each forward pass (the drop not timed):
  the premise of disk offload, a model that does not fit in RAM. On a model smaller than the
  runtime allowance the cgroup alone would let the cache keep the whole model;
- `once`: dropped once before the timed run; accelerate then runs from the page cache (as far as
  the cgroup limit lets it);
- `false`: nothing dropped.

Usage:
    python -m experiments.bench.accelerate checkpoint=DIR [hardware=this-machine] [planner=klotski]
        [gpu_frac=0.6] [cpu_frac=0.15] [batch_size=4] [n_batches=15] [prompt_len=16] [gen_len=4]
        [cold=pass|once|false] [cgroup=true] [slack_mb=256]
The bench runs itself once per system with `role=...` (and `acc_batch=` for accelerate): each
child prints its result as one JSON line.
"""

from __future__ import annotations

import json
import sys

from core.args import as_float, as_int
from core.errors import MoepipeError
from experiments.common.app import command, kv
from experiments.common.cli import run_command
from experiments.common.peers import COLD, RESULT, child, compare, format_rows, peak_rss, run_spec
from experiments.common.schema import BenchAccelerateOptions


def checked(opts: BenchAccelerateOptions) -> dict[str, object]:
    """The options as the peers library reads them (a flat dict), their ranges checked."""
    d = kv(opts)
    d["cold"] = str(d["cold"]).lower()
    if d["cold"] not in COLD:
        raise MoepipeError(f"cold={opts.cold!r} unknown; valid: {', '.join(COLD)}")
    for k in ("gpu_frac", "cpu_frac"):
        as_float(k, d[k], positive=True)
    for k in ("batch_size", "n_batches", "prompt_len", "gen_len"):
        as_int(k, d[k], at_least=1)
    as_int("slack_mb", d["slack_mb"], at_least=0)
    return d


def _main(opts: BenchAccelerateOptions) -> int:
    d = checked(opts)
    if opts.role:  # a child: one system, its result as the last stdout line
        result = child(opts.role, d)
        print(RESULT + json.dumps({**result, "peak_rss_bytes": peak_rss()}), flush=True)
        return 0
    spec, hw = run_spec(d)  # the user's mistakes here, before any child starts
    rows, header = compare(d, spec, hw, opts.cgroup)
    print("\n".join([*header, *format_rows(rows)]))
    return 0


main = command("bench_accelerate", BenchAccelerateOptions, _main, __doc__)

if __name__ == "__main__":
    sys.exit(run_command(main))
