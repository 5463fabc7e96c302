"""Peer benchmark: Hugging Face transformers + accelerate disk offload vs moepipe, same checkpoint,
same device-memory budget, one process. Prints tokens/s for both and the ratio.

The peer: `from_pretrained(device_map="auto", max_memory={device: budget}, offload_folder=...)`,
greedy `generate` batch by batch (on a CPU-only machine the "device" is RAM, as moepipe's pool).
moepipe: the real executor with `planner` (klotski, n = n_batches: 15 as in the paper's Fig. 10,
accelerate running the same n batches one after another) at the same device budget, host RAM
`cpu_frac` of the model, the rest on disk. Needs the `bench` extra (pip install -e .[bench]).

Both start cold: before each timed run the page cache of the checkpoint and of accelerate's
offload folder is dropped (posix_fadvise DONTNEED). moepipe then reads with O_DIRECT every time;
accelerate's memory-mapped offload files stay in the page cache after their first read, i.e. it
uses RAM beyond the budget (with `cold=false` both start warm, and on a small model the page
cache makes accelerate's disk offload an in-RAM run).

Usage:
    python -m experiments.bench_accelerate checkpoint=DIR [hardware=this-machine] [planner=klotski]
        [gpu_frac=0.6] [cpu_frac=0.15] [batch_size=4] [n_batches=15] [prompt_len=16] [gen_len=4]
        [cold=true]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from core.errors import MoepipeError
from core.spec import RoutingConfig, Workload
from core.types import RoutingSource, Tier
from experiments.cli import parse_kv
from experiments.pipeline import RunSpec
from experiments.real_run import prompts_for, real_execute
from experiments.validate import load_hardware
from real.checkpoint import load_checkpoint

_DEFAULTS: dict[str, Any] = dict(
    checkpoint=None, hardware="this-machine", planner="klotski", gpu_frac=0.6, cpu_frac=0.15,
    batch_size=4, n_batches=15, prompt_len=16, gen_len=4, cold="true",
)  # fmt: skip


def drop_page_cache(*dirs: str | Path) -> None:
    """Evict the files under `dirs` from the page cache, so the next read goes to the disk
    (all clean pages, via /proc/sys/vm/drop_caches, where this process may write it)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return
    except OSError:
        pass
    for d in dirs:
        for p in Path(d).rglob("*"):
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def run_accelerate(
    ckpt: str, budget_bytes: int, prompts: torch.Tensor, batch_size: int, gen_len: int, cold: bool
) -> float:
    """Seconds for greedy generation of every batch with accelerate's disk offload."""
    from transformers import AutoModelForCausalLM

    device = 0 if torch.cuda.is_available() else "cpu"
    max_memory = (
        {device: budget_bytes, "cpu": budget_bytes} if device == 0 else {"cpu": budget_bytes}
    )
    with tempfile.TemporaryDirectory(prefix="offload-") as folder:
        model = AutoModelForCausalLM.from_pretrained(
            ckpt, device_map="auto", max_memory=max_memory, offload_folder=folder, dtype="auto"
        )
        model.eval()
        if cold:
            drop_page_cache(ckpt, folder)
        first = "cuda:0" if device == 0 else "cpu"
        t0 = time.perf_counter()
        with torch.inference_mode():
            for b in range(0, prompts.shape[0], batch_size):
                ids = prompts[b : b + batch_size].to(first)
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len,
                               min_new_tokens=gen_len, do_sample=False, pad_token_id=0)  # fmt: skip
        return time.perf_counter() - t0


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    opts = dict(_DEFAULTS)
    try:
        opts = parse_kv(argv, opts)
        ckpt = opts["checkpoint"]
        if not ckpt:
            raise MoepipeError("missing checkpoint=DIR")
        model, _ = load_checkpoint(ckpt)
        hw = load_hardware(
            str(opts["hardware"]),
            model.total_bytes,
            float(opts["gpu_frac"]),
            float(opts["cpu_frac"]),
        )
        wl = Workload(
            batch_size=int(opts["batch_size"]), n_batches=int(opts["n_batches"]),
            prompt_len=int(opts["prompt_len"]), gen_len=int(opts["gen_len"]),
            routing=RoutingConfig(source=RoutingSource.SYNTHETIC),
        )  # fmt: skip
        spec = RunSpec(
            model, hw, wl, str(opts["planner"]), {"n": -1} if opts["planner"] == "klotski" else {}
        )
        cold = str(opts["cold"]).lower() in ("1", "true", "yes")
        if cold:
            drop_page_cache(ckpt)
        t0 = time.perf_counter()
        result, _ = real_execute(ckpt, spec, "replay")
        ours_wall = time.perf_counter() - t0
        wl = wl.with_(n_batches=result.summary["n_batches"])
        budget = int(hw.memory_bytes[Tier.GPU])
        theirs_s = run_accelerate(
            ckpt, budget, prompts_for(model, wl), wl.batch_size, wl.gen_len, cold
        )
    except MoepipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tokens = wl.tokens_generated
    ours = result.summary["throughput_tok_s"]
    theirs = tokens / theirs_s
    print(
        f"model {model.name} {model.total_bytes / 1e6:.0f} MB, device budget {budget / 1e6:.0f} MB, {tokens} tokens"
    )
    print(f"accelerate disk offload : {theirs:8.2f} tok/s ({theirs_s:.2f} s)")
    print(
        f"moepipe {spec.planner:16s}: {ours:8.2f} tok/s (makespan {result.summary['makespan_s']:.2f} s, wall incl. setup {ours_wall:.2f} s)"
    )
    print(f"ratio moepipe / accelerate: {ours / theirs:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
