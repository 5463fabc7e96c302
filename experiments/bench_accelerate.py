"""Peer benchmark: Hugging Face transformers + accelerate disk offload vs moepipe, same checkpoint,
same memory budget, one process. Prints tokens/s for both and the ratio.

The peer: `from_pretrained(device_map="auto", max_memory=..., offload_folder=...)`, greedy
`generate` batch by batch. moepipe: the real executor with `planner` (klotski, n = n_batches: 15
as in the paper's Fig. 10, accelerate running the same n batches one after another). Both hold the
same bytes in memory: moepipe a device pool of `gpu_frac` of the model and host RAM `cpu_frac`;
accelerate `max_memory` of the same sizes (on a CPU-only machine its one "cpu" entry is their
sum); the rest of the model is on disk for both. Needs the `bench` extra (pip install -e .[bench]).

`cold` says what the disk tier is:
- `pass` (default): the premise of disk offload, a model that does not fit in RAM. moepipe reads
  its disk tier with O_DIRECT every time; accelerate reads its offloaded weights through
  memory-mapped files, so the page cache of the checkpoint and offload folder is dropped before
  each of its forward passes (the time the drop takes is not counted). Without that, the page
  cache would keep the offloaded weights in RAM beyond the budget after the first pass.
- `once`: the page cache is dropped once before each system's timed run; accelerate then runs
  from RAM after its first forward pass, i.e. with more memory than moepipe.
- `false`: both start warm (on a small model accelerate's disk offload is then an in-RAM run).

Usage:
    python -m experiments.bench_accelerate checkpoint=DIR [hardware=this-machine] [planner=klotski]
        [gpu_frac=0.6] [cpu_frac=0.15] [batch_size=4] [n_batches=15] [prompt_len=16] [gen_len=4]
        [cold=pass|once|false]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.errors import MoepipeError
from core.spec import RoutingConfig, Workload
from core.types import RoutingSource, Tier
from experiments.app import command, kv
from experiments.cli import as_float, as_int
from experiments.pipeline import RunSpec
from experiments.real_run import prompts_for, real_execute
from experiments.validate import load_hardware, read_hardware
from real.checkpoint import load_checkpoint

COLD = ("pass", "once", "false")
@dataclass
class Options:
    checkpoint: str | None = None  # the checkpoint folder both systems read
    hardware: str = "this-machine"  # conf/hardware/<name>.yaml or a FILE.yaml (calibrate's)
    planner: str = "klotski"
    gpu_frac: float = 0.6  # the device pool, as a share of the model's bytes
    cpu_frac: float = 0.15  # host RAM, as a share of the model's bytes
    batch_size: int = 4
    n_batches: int = 15
    prompt_len: int = 16
    gen_len: int = 4
    cold: str = "pass"  # pass | once | false: the page cache emptied before each pass, once, never


_DEFAULTS: dict[str, Any] = kv(Options())


def drop_page_cache(*dirs: str | Path, everything: bool = True) -> None:
    """Evict the files under `dirs` from the page cache, so the next read goes to the disk: with
    `everything`, all clean pages (via /proc/sys/vm/drop_caches, where this process may write
    it), else (or where it may not) those files' pages alone (posix_fadvise DONTNEED)."""
    os.sync()
    if everything:
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
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def placed_mb(model: torch.nn.Module) -> str:
    """MB of parameters per device of accelerate's device map, e.g. "cpu 159 MB, disk 159 MB"."""
    where: dict[str, str] = {k: str(v) for k, v in model.hf_device_map.items()}
    mb: dict[str, float] = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        prefixes = (".".join(parts[:i]) for i in range(len(parts), -1, -1))
        dev = next((where[q] for q in prefixes if q in where), "?")
        mb[dev] = mb.get(dev, 0.0) + p.numel() * p.element_size() / 1e6
    return ", ".join(f"{d} {v:.0f} MB" for d, v in sorted(mb.items()))


def run_accelerate(
    ckpt: str,
    device_bytes: int,
    host_bytes: int,
    prompts: torch.Tensor,
    batch_size: int,
    gen_len: int,
    cold: str,
) -> float:
    """Seconds for greedy generation of every batch with accelerate's disk offload, holding
    `device_bytes` on the device and `host_bytes` in host RAM (their sum in RAM without CUDA);
    `cold` as in the module doc (with "pass", the page-cache drops are not counted)."""
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    max_memory: dict[int | str, int] = (
        {0: device_bytes, "cpu": host_bytes} if cuda else {"cpu": device_bytes + host_bytes}
    )
    with tempfile.TemporaryDirectory(prefix="offload-") as folder:
        model = AutoModelForCausalLM.from_pretrained(
            ckpt, device_map="auto", max_memory=max_memory, offload_folder=folder, dtype="auto"
        )
        model.eval()
        print(f"accelerate placement: {placed_mb(model)}", file=sys.stderr)
        dropping = [0.0]  # seconds spent dropping the page cache inside the timed region

        def drop_before_pass(*_: Any) -> None:
            t = time.perf_counter()
            drop_page_cache(ckpt, folder, everything=False)  # the weights' files alone
            dropping[0] += time.perf_counter() - t

        if cold != "false":
            drop_page_cache(ckpt, folder)
        if cold == "pass":
            model.register_forward_pre_hook(drop_before_pass)
        first = "cuda:0" if cuda else "cpu"
        t0 = time.perf_counter()
        with torch.inference_mode():
            for b in range(0, prompts.shape[0], batch_size):
                ids = prompts[b : b + batch_size].to(first)
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len,
                               min_new_tokens=gen_len, do_sample=False, pad_token_id=0)  # fmt: skip
        total = time.perf_counter() - t0
        print(f"accelerate: {dropping[0]:.2f} s of page-cache drops not counted", file=sys.stderr)
        return total - dropping[0]


def _main(args: Options) -> int:
    opts = kv(args)
    try:
        cold = str(opts["cold"]).lower()
        if cold not in COLD:
            raise MoepipeError(f"cold={cold!r} unknown; valid: {', '.join(COLD)}")
        ckpt = opts["checkpoint"]
        if not ckpt:
            raise MoepipeError("missing checkpoint=DIR")
        gpu_frac = as_float("gpu_frac", opts["gpu_frac"], positive=True)
        cpu_frac = as_float("cpu_frac", opts["cpu_frac"], positive=True)
        sizes = {k: as_int(k, opts[k], at_least=1)
                 for k in ("batch_size", "n_batches", "prompt_len", "gen_len")}  # fmt: skip
        read_hardware(str(opts["hardware"]))  # its problems before the checkpoint's
        model, _ = load_checkpoint(ckpt)
        hw = load_hardware(str(opts["hardware"]), model.total_bytes, gpu_frac, cpu_frac)
        wl = Workload(**sizes, routing=RoutingConfig(source=RoutingSource.SYNTHETIC))
        spec = RunSpec(
            model, hw, wl, str(opts["planner"]), {"n": -1} if opts["planner"] == "klotski" else {}
        )
        if cold != "false":
            drop_page_cache(ckpt)
        t0 = time.perf_counter()
        result, _ = real_execute(ckpt, spec, "replay")
        ours_wall = time.perf_counter() - t0
        wl = wl.with_(n_batches=result.summary["n_batches"])
        budget, host = int(hw.memory_bytes[Tier.GPU]), int(hw.memory_bytes[Tier.CPU])
        theirs_s = run_accelerate(
            ckpt, budget, host, prompts_for(model, wl), wl.batch_size, wl.gen_len, cold
        )
    except MoepipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tokens = wl.tokens_generated
    ours = result.summary["throughput_tok_s"]
    theirs = tokens / theirs_s
    print(
        f"model {model.name} {model.total_bytes / 1e6:.0f} MB, device budget {budget / 1e6:.0f} MB, "
        f"host {host / 1e6:.0f} MB, rest on disk, cold={cold}, {tokens} tokens"
    )
    print(f"accelerate disk offload : {theirs:8.2f} tok/s ({theirs_s:.2f} s)")
    print(
        f"moepipe {spec.planner:16s}: {ours:8.2f} tok/s (makespan {result.summary['makespan_s']:.2f} s, wall incl. setup {ours_wall:.2f} s)"
    )
    print(f"ratio moepipe / accelerate: {ours / theirs:.2f}x")
    return 0


main = command("bench_accelerate", Options, _main, __doc__)

if __name__ == "__main__":
    sys.exit(main())
