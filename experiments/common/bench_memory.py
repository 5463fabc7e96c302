"""Memory for the benches that compare moepipe with a peer (experiments.common.peers): a
memory cgroup of this process's own (page cache included), evicting files from the page
cache, and the `Room`, the memory each side of a comparison gets."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CGROUP_ROOT = Path("/sys/fs/cgroup")


# ---- memory: cgroups and the page cache --------------------------------------------------


@dataclass
class MemoryCgroup:
    """A child memory cgroup of this process's own, limited to `limit_bytes` (page cache
    included). `create` returns None where the machine does not let this process make one."""

    path: Path
    version: int  # 2 (unified) or 1 (the v1 memory controller)
    limit_bytes: int

    @classmethod
    def create(cls, name: str, limit_bytes: int) -> MemoryCgroup | None:
        for version, parent in _own_memory_cgroups():
            path = parent / f"{name}-{os.getpid()}"
            try:
                path.mkdir(exist_ok=True)
                knob = "memory.max" if version == 2 else "memory.limit_in_bytes"
                (path / knob).write_text(f"{limit_bytes}\n")
                if version == 1:  # a limit hit without swap: the OOM killer, not a pause
                    (path / "memory.swappiness").write_text("0\n")
                return cls(path, version, limit_bytes)
            except OSError:
                with contextlib.suppress(OSError):
                    path.rmdir()
        return None

    def wrap(self, cmd: Sequence[str]) -> list[str]:
        """`cmd` started inside the cgroup (its shell joins, then execs it)."""
        procs = self.path / "cgroup.procs"
        return ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh", *cmd]

    def peak_bytes(self) -> int | None:
        """The most memory (process + page cache charged to it) the cgroup held."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text().split()[0])
        except (OSError, ValueError):
            return None

    def oom_killed(self) -> bool:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            fields = dict(ln.split() for ln in (self.path / name).read_text().splitlines())
        except (OSError, ValueError):
            return False
        return int(fields.get("oom_kill", 0)) > 0

    def remove(self) -> None:
        for _ in range(50):  # a killed process leaves the cgroup a moment after it is reaped
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _own_memory_cgroups() -> list[tuple[int, Path]]:
    """This process's cgroup directories that can hold a memory-limited child: v2 first."""
    out: list[tuple[int, Path]] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        hid, ctrls, rel = line.split(":", 2)
        if hid == "0" and ctrls == "":
            for mount in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
                d = mount / rel.lstrip("/")
                try:
                    if "memory" in (d / "cgroup.controllers").read_text().split():
                        sub = d / "cgroup.subtree_control"
                        if "memory" not in sub.read_text().split():
                            sub.write_text("+memory\n")
                        out.insert(0, (2, d))
                except OSError:
                    pass
        elif "memory" in ctrls.split(","):
            d = CGROUP_ROOT / "memory" / rel.lstrip("/")
            if (d / "memory.limit_in_bytes").exists():
                out.append((1, d))
    return out


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


# ---- the room: one cgroup limit for every side, and moepipe's tiers within it ------------------


ROOM = ("cgroup", "tiers")


def checked_room(room: str, cold: str) -> str:
    """`room` lower-cased, or a MoepipeError for an unknown one, and for room=cgroup with
    cold=pass: moepipe's host tier would keep in RAM what accelerate's page cache is made to
    drop before each pass, which is not the same memory for both sides."""
    from core.errors import MoepipeError, did_you_mean

    room, cold = room.lower(), cold.lower()
    if room not in ROOM:
        raise MoepipeError(
            f"room={room!r} unknown; {did_you_mean(room, ROOM)}valid: {', '.join(ROOM)}"
        )
    if room == "cgroup" and cold == "pass":
        raise MoepipeError(
            "room=cgroup with cold=pass: moepipe's host tier would hold what accelerate's page "
            "cache is dropped of before each pass; pass cold=once (both keep what the cgroup "
            "lets them) or room=tiers (neither keeps more than the budget)"
        )
    return room


UNLIMITED = 1 << 50  # a cgroup "limit" no run reaches: its peak is measured, nothing enforced


def host_room_bytes(limit_bytes: int, budget_peak_bytes: int, margin_bytes: int) -> int:
    """What moepipe's host tier grows by under room=cgroup: the memory its run at the budget
    tiers left unused under the cgroup limit, less `margin_bytes`, in whole MiB (0 if none).
    More host tier holds more of the weights that run read from disk at every step; its other
    memory (runtime, activations, KV, the device pool) stays as that run measured it, since the
    run with room keeps its n (`Room.options`)."""
    return max(0, (limit_bytes - budget_peak_bytes - margin_bytes) >> 20 << 20)


@dataclass(frozen=True)
class Room:
    """The memory of a comparison. Every side runs in a memory cgroup of `limit_bytes` (the
    budget + a bare child's peak + slack; page cache counted). accelerate gets the budget as
    its `max_memory`, and its page cache fills the rest of the limit by itself. moepipe plans
    exactly its tiers, so with mode "cgroup" its host tier is the budget's plus
    `host_room_bytes`: what its run at the budget tiers left under the limit, less a margin.
    With mode "tiers" (or no cgroup) moepipe's tiers are the budget's alone."""

    mode: str  # "cgroup" | "tiers" (the bench's `room` option)
    device_bytes: int  # the budget's device pool (gpu_frac of the model)
    host_bytes: int  # the budget's host tier (cpu_frac of the model)
    limit_bytes: int | None = None  # every side's cgroup limit; None: no cgroup
    runtime_bytes: int = 0  # the runtime allowance: a bare child's peak (role=probe)
    slack_bytes: int = 0
    margin_bytes: int = 0  # kept free under the limit beyond moepipe's measured peak
    budget_run: dict[str, Any] | None = None  # moepipe's run at the budget tiers (child result)
    budget_peak_bytes: int | None = None  # its cgroup's peak
    host_room_bytes: int = 0  # added to moepipe's host tier

    @property
    def budget_bytes(self) -> int:
        return self.device_bytes + self.host_bytes

    @property
    def n_plan(self) -> dict[str, Any]:
        """How the planner set n where `options` keeps it from the run at the budget tiers
        (that run's schedule meta), else {} (the run's own schedule says)."""
        if not self.host_room_bytes or self.budget_run is None:
            return {}
        return dict(self.budget_run.get("n_plan") or {})

    def options(self, opts: dict[str, Any]) -> dict[str, Any]:
        """The bench's options for the moepipe side (its child and the simulator's prediction
        alike, through run_spec): host_room_mb set and, where there is room, the n of the run
        at the budget tiers kept, so that only the host tier differs between the two runs."""
        out = dict(opts, host_room_mb=self.host_room_bytes >> 20)
        if self.host_room_bytes and self.budget_run is not None:
            n = int(self.budget_run["n_batches"])
            out.update(n_batches=n, klotski_n=n)
        return out

    def lines(self, hw: Any) -> list[str]:
        """The header's memory lines: what each side was allowed, how moepipe's tiers were set;
        `hw`: the moepipe side's hardware, as its child and the simulator plan it."""
        from core.types import Tier

        if self.limit_bytes is None:
            return [
                f"no memory cgroup (not enforced); room={self.mode}: moepipe's tiers are the "
                "budget's"
            ]
        mb = 1e6
        tiers = (
            f"moepipe's tiers: device {hw.memory_bytes[Tier.GPU] / mb:.0f} + host "
            f"{hw.memory_bytes[Tier.CPU] / mb:.0f} MB"
        )
        lines = [
            f"each side in a memory cgroup of {self.limit_bytes / mb:.0f} MB (page cache "
            f"counted) = budget {self.budget_bytes / mb:.0f} + runtime allowance "
            f"{self.runtime_bytes / mb:.0f} (a bare child's peak) + slack "
            f"{self.slack_bytes / mb:.0f}; accelerate's max_memory: the budget"
        ]
        if self.mode == "tiers":
            return [*lines, f"room=tiers: {tiers} (the budget's)"]
        assert self.budget_peak_bytes is not None
        return [
            *lines,
            f"room=cgroup: {tiers} = the budget + {self.host_room_bytes / mb:.0f} MB of host "
            f"room (limit - peak of its run at the budget tiers {self.budget_peak_bytes / mb:.0f}"
            f" - margin {self.margin_bytes / mb:.0f}, whole MiB)",
        ]


def check_trace_routing(routing: str, spec: Any) -> None:
    """routing=trace on a model of another shape than the ESFT trace's: refused before the
    bench starts a child (bench_accelerate, which found it in moepipe's child, after a line
    that it had started) or writes a checkpoint (bench_real)."""
    from core.errors import MoepipeError
    from core.traces import N_EXPERTS, N_LAYERS, TOP_K, replays_esft

    if routing.lower() == "trace" and not replays_esft(spec):
        raise MoepipeError(
            f"routing=trace: the ESFT trace routes {N_LAYERS} MoE layers of {N_EXPERTS} "
            f"experts, top-{TOP_K}; {spec.name} has {len(spec.moe_layers)} of "
            f"{spec.n_experts}, top-{spec.top_k}: use routing=synthetic (or auto)"
        )
