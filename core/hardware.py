"""The machine as the simulator and the planners see it: `HardwareSpec` (memory tiers, links,
compute rates, overheads), built from a resolved hydra YAML dict (`HardwareSpec.from_dict`).
Every validation error names the field as the YAML names it and what would fix it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from core.errors import ConfigError, integer_field
from core.spec import GB, check_finite
from core.types import OpKind, Resource, Tier

# what to do with a hardware number out of its range: the line's fix
_MEASURED = "set the measured value (python -m experiments.calibrate measures it)"


@dataclass(frozen=True)
class LinkSpec:
    bandwidth_bytes_per_s: float  # sustained bandwidth
    latency_s: float = 0.0  # fixed cost per transfer

    def time_s(self, nbytes: float) -> float:
        return nbytes / self.bandwidth_bytes_per_s + self.latency_s


@dataclass(frozen=True)
class ComputeSpec:
    peak_flops_per_s: float  # dense bf16 peak the kernels reach
    mem_bw_bytes_per_s: float  # memory bandwidth for weight/KV reads
    kernel_overhead_s: float = 0.0  # fixed launch cost per op
    # Per op kind overhead replacing kernel_overhead_s (an eager attention launches dozens of
    # kernels; one expert GEMM a handful).
    kind_overhead_s: Mapping[str, float] = field(default_factory=dict)
    # Calibrated tables: op kind -> ((flops, seconds), ...) sorted by flops. They replace the
    # roofline for that kind (see core.cost).
    time_tables: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    # Streaming multiprocessors (0 = unknown: every kernel can fill the device) and the memory
    # bandwidth one SM's thread blocks can draw (0 = mem_bw / sms, an even split): how much of
    # the device a kernel of few thread blocks can use (core.cost.CostModel.cap).
    sms: int = 0
    sm_mem_bw_bytes_per_s: float = 0.0
    # SMs a collective's kernels (the all-to-all's dispatch and combine, tensor-parallel
    # all-reduces) hold on each GPU it runs on, for as long as it runs: compute beside it gets the
    # other sms - comm_sms (sim/executor.py). 0: collectives cost no compute (or sms unknown).
    comm_sms: int = 0
    # SMs a replica copy between GPUs holds on each end while it runs: 0 where the copy engines
    # move it (cudaMemcpyPeerAsync), some where NCCL's p2p kernels do (the real executor's)
    copy_sms: int = 0

    @property
    def comm_share(self) -> float:
        """The share of the device a running collective holds (`comm_sms` / `sms`), 0 unknown."""
        return self.comm_sms / self.sms if self.sms and self.comm_sms else 0.0

    @property
    def copy_share(self) -> float:
        """The share of the device a running replica copy holds (`copy_sms` / `sms`)."""
        return self.copy_sms / self.sms if self.sms and self.copy_sms else 0.0


@dataclass(frozen=True)
class ProcessesSpec:
    """What the ops of a G-device expert-parallel schedule cost when its devices run as processes
    of this machine at once (`executor.distributed=true`), beyond their cost alone; measured by
    `experiments.calibrate` in such a run. The defaults add nothing: a one-process profile's
    costs are unchanged."""

    # a batch's routing, from its gates to every rank (the gate parts' exchange): every dispatch
    # of the batch waits for it before its tokens move
    gate_exchange_s: float = 0.0
    # per compute kind: an op's time with the G processes computing at once over the cost
    # model's time for it alone (the cores they share, their transfer threads)
    compute_scale: Mapping[str, float] = field(default_factory=dict)
    # per op kind: how long an op starts after it is ready (its deps and the op before it on
    # its stream done), the process's host work between ops (core.bubbles' `late`)
    start_delay_s: Mapping[str, float] = field(default_factory=dict)
    # the share of a process's compute a replica copy it sends or receives holds while it runs:
    # on a CPU-only machine the copy is a memcpy on the cores that compute (on a GPU the copy
    # engines move it: 0). The simulator slows that device's compute meanwhile (sim/executor.py)
    copy_share: float = 0.0

    def check(self, where: str) -> None:
        """A ConfigError naming `where`.<field> for a value no machine has: NaN or inf first
        (they pass the range checks), then each field's range."""
        check_finite(where, gate_exchange_us=self.gate_exchange_s * 1e6)
        check_finite(where, copy_share=self.copy_share)
        check_finite(f"{where}.compute_scale_by_kind", **dict(self.compute_scale))
        check_finite(
            f"{where}.start_delay_us_by_kind",
            **{k: v * 1e6 for k, v in self.start_delay_s.items()},
        )
        if self.gate_exchange_s < 0:
            raise ConfigError(f"{where}.gate_exchange_us must be >= 0; {_MEASURED}")
        if not 0 <= self.copy_share < 1:
            raise ConfigError(
                f"{where}.copy_share must be in [0, 1), got {self.copy_share!r}; {_MEASURED}"
            )
        for kind, x in self.compute_scale.items():
            if not x > 0:
                raise ConfigError(
                    f"{where}.compute_scale_by_kind.{kind} must be positive, got {x!r}; {_MEASURED}"
                )
        for kind, x in self.start_delay_s.items():
            if x < 0:
                raise ConfigError(
                    f"{where}.start_delay_us_by_kind.{kind} must be >= 0, got {x * 1e6:g}; "
                    f"{_MEASURED}"
                )

    def scale(self, kind: OpKind | str) -> float:
        return self.compute_scale.get(str(kind), 1.0)

    def delay_s(self, kind: OpKind | str) -> float:
        return self.start_delay_s.get(str(kind), 0.0)


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    memory_bytes: Mapping[Tier, int]  # capacity per tier (GPU: usable by the model)
    gpu: ComputeSpec
    cpu: ComputeSpec
    links: Mapping[Resource, LinkSpec]  # h2d, d2h, disk, disk_write (+ p2p)
    n_gpus: int = 1  # GPUs (or concurrent GPU lanes) for expert parallelism
    sources: Mapping[str, str] = field(default_factory=dict)  # where each number comes from
    processes: ProcessesSpec = field(default_factory=ProcessesSpec)  # G processes' extra cost

    def __post_init__(self) -> None:
        where = f"hardware {self.name}: "
        for res, link in self.links.items():
            check_finite(
                f"{where}links.{res}",
                gbps=link.bandwidth_bytes_per_s / GB,
                latency_us=link.latency_s * 1e6,
            )
        for dev in ("gpu", "cpu"):
            c: ComputeSpec = getattr(self, dev)
            check_finite(
                f"{where}{dev}",
                tflops=c.peak_flops_per_s / 1e12,
                mem_bw_gbps=c.mem_bw_bytes_per_s / GB,
                overhead_us=c.kernel_overhead_s * 1e6,
                sm_mem_bw_gbps=c.sm_mem_bw_bytes_per_s / GB,
            )
            check_finite(
                f"{where}{dev}.overhead_us_by_kind",
                **{str(k): v * 1e6 for k, v in c.kind_overhead_s.items()},
            )
            for kind, pts in c.time_tables.items():
                for i, (x, y) in enumerate(pts):
                    check_finite(f"{where}{dev}.time_tables.{kind}[{i}]", flops=x, seconds=y)
        for tier in Tier:
            cap = self.memory_bytes.get(tier)
            if tier == Tier.DISK and cap == 0:
                continue  # no disk tier (memory_gb.disk: null)
            if cap is None or not cap > 0:
                got = "nothing" if cap is None else f"{cap} bytes"
                raise ConfigError(
                    f"hardware {self.name}: memory_gb.{tier} must be a positive capacity, got "
                    f"{got}; set its size in GB"
                )
        for res in (Resource.H2D, Resource.D2H, Resource.DISK)[: 3 if self.has_disk else 2]:
            if res not in self.links:
                raise ConfigError(
                    f"hardware {self.name}: links.{res} is missing; add {res}: {{gbps: ..., "
                    "latency_us: ...} under links (as conf/hardware/'s files have it)"
                )
        for res, link in self.links.items():
            if not link.bandwidth_bytes_per_s > 0:
                raise ConfigError(
                    f"hardware {self.name}: links.{res}.gbps must be positive, got "
                    f"{link.bandwidth_bytes_per_s / GB:g}; {_MEASURED}"
                )
            if link.latency_s < 0:
                raise ConfigError(
                    f"hardware {self.name}: links.{res}.latency_us must be >= 0; {_MEASURED}"
                )
        for dev in ("gpu", "cpu"):
            c = getattr(self, dev)
            for f_, key in (("peak_flops_per_s", "tflops"), ("mem_bw_bytes_per_s", "mem_bw_gbps")):
                if not getattr(c, f_) > 0:  # named as the YAML names it
                    raise ConfigError(
                        f"hardware {self.name}: {dev}.{key} must be positive; {_MEASURED}"
                    )
            if c.kernel_overhead_s < 0:
                raise ConfigError(
                    f"hardware {self.name}: {dev}.overhead_us must be >= 0; {_MEASURED}"
                )
            for kind, v in c.kind_overhead_s.items():
                if v < 0:
                    raise ConfigError(
                        f"hardware {self.name}: {dev}.overhead_us_by_kind.{kind} must be >= 0; "
                        f"{_MEASURED}"
                    )
        integer_field(f"hardware {self.name}: n_gpus", self.n_gpus, 1, "set it to the GPUs it has")
        self.processes.check(f"hardware {self.name}: processes")

    @property
    def has_disk(self) -> bool:
        """Whether the machine has a disk tier (`memory_gb.disk: null` says it has none)."""
        return self.memory_bytes.get(Tier.DISK, 0) > 0

    def link(self, res: Resource) -> LinkSpec:
        if res == Resource.DISK_WRITE and res not in self.links:
            return self.links[Resource.DISK]
        if res == Resource.P2P_OUT and res not in self.links:  # the same link's other direction
            return self.link(Resource.P2P)
        if res == Resource.P2P and res not in self.links:
            return self.links[Resource.H2D]
        if res == Resource.D2D and res not in self.links:
            # a device-to-device copy reads and writes each byte in HBM once: half its bandwidth,
            # at a transfer's launch cost (the GPU link's latency)
            return LinkSpec(self.gpu.mem_bw_bytes_per_s / 2, self.link(Resource.P2P).latency_s)
        return self.links[res]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HardwareSpec:
        """From the YAML layout: memory_gb, gpu/cpu {tflops, mem_bw_gbps, overhead_us},
        links {gbps, latency_us}."""
        name = str(d.get("name", "hardware"))
        at = "memory_gb"  # the field being read, for an error's line
        try:
            given = dict(d["memory_gb"])
            if "disk" in given and given["disk"] is None:  # no disk tier: a capacity of none
                given["disk"] = 0.0
            elif given.get("disk") == 0:  # 0 would read as null: said so, as a size is wanted
                raise ConfigError(
                    f"hardware {name}: memory_gb.disk=0: set its size in GB, or null for a "
                    "machine without a disk tier"
                )
            mem_gb = {Tier(k): float(v) for k, v in given.items()}
            check_finite(f"hardware {name}: memory_gb", **{str(k): v for k, v in mem_gb.items()})
            for tier, gb in mem_gb.items():  # before the bytes: 1e308 GB overflows an int
                if gb > 0:  # 0: "must be a positive capacity" (__post_init__)
                    _in_range(f"hardware {name}: memory_gb.{tier}", _memory_key(tier), gb)
                elif gb < 0:  # -1e308 GB overflows an int too
                    raise ConfigError(
                        f"hardware {name}: memory_gb.{tier}={gb:g} must be a positive capacity; "
                        "set its size in GB"
                    )
            mem = {k: int(v * GB) for k, v in mem_gb.items()}
            links = {}
            at = "links"
            for k, v in dict(d["links"]).items():
                at = f"links.{k}"
                links[Resource(k)] = LinkSpec(
                    _scaled(v["gbps"], GB, f"hardware {name}: {at}.gbps"),
                    float(v.get("latency_us", 0)) * 1e-6,
                )
            at = "gpu"
            gpu = _compute_from_dict(d["gpu"], name)
            at = "cpu"
            cpu = _compute_from_dict(d["cpu"], name, "cpu")
            at = "n_gpus"
            n_gpus = integer_field(
                f"hardware {name}: n_gpus", d.get("n_gpus", 1), 1, "set it to the GPUs it has"
            )
            at = "sources"
            sources = {str(k): str(v) for k, v in dict(d.get("sources") or {}).items()}
            at = "processes"
            proc = dict(d.get("processes") or {})
            processes = ProcessesSpec(
                float(proc.get("gate_exchange_us", 0)) * 1e-6,
                {
                    op_kind(k, f"hardware {name}: processes.compute_scale_by_kind"): float(v)
                    for k, v in dict(proc.get("compute_scale_by_kind") or {}).items()
                },
                {
                    op_kind(k, f"hardware {name}: processes.start_delay_us_by_kind"): float(v)
                    * 1e-6
                    for k, v in dict(proc.get("start_delay_us_by_kind") or {}).items()
                },
                float(proc.get("copy_share", 0)),
            )
            spec = cls(name, mem, gpu, cpu, links, n_gpus, sources, processes)
            check_physical(spec)
            return spec
        except KeyError as e:
            raise ConfigError(
                f"hardware {name}: {at}: missing field {e.args[0]!r}; add it (conf/hardware/'s "
                "files have every field)"
            ) from None
        except (ValueError, TypeError, AttributeError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(
                f"hardware {name}: {at}: {e} (the layout: memory_gb {{gpu, cpu, disk}}, gpu and "
                "cpu {tflops, mem_bw_gbps, overhead_us}, links {<link>: {gbps, latency_us}}); "
                "write it as conf/hardware/'s files have it"
            ) from None


# What a machine's numbers can be, as a YAML writes them: wide enough for any device from a
# failing USB disk to a future rack, narrow enough that a slip of units (1e-300, 1e9 s) is named
# instead of simulated into a makespan of 1e290 s. Checked where a user's YAML comes in
# (`from_dict`), not in the dataclass, so tests may still build a deliberately extreme machine.
PHYSICAL: dict[str, tuple[float, float, str]] = {
    "gbps": (1e-4, 1e6, "GB/s"),
    "latency_us": (0.0, 1e7, "us"),
    "tflops": (1e-6, 1e6, "TFLOP/s"),
    "mem_bw_gbps": (1e-3, 1e6, "GB/s"),
    "overhead_us": (0.0, 1e7, "us"),
    "memory_gb": (1e-6, 1e9, "GB"),
    # one GPU's memory and one host's RAM: far past any made (hundreds of GB, tens of TB), so
    # a size written in bytes or MB (80e9, 81920) is named, not simulated as a larger machine
    "memory_gb.gpu": (1e-6, 1e4, "GB"),
    "memory_gb.cpu": (1e-6, 1e5, "GB"),
    "gate_exchange_us": (0.0, 1e7, "us"),
    "start_delay_us": (0.0, 1e7, "us"),
    "compute_scale": (1e-3, 1e3, "x"),
    "sms": (0, 1e6, "SMs"),  # 0: unknown
    "n_gpus": (1, 1e5, "GPUs"),  # past the largest training clusters
    "sm_mem_bw_gbps": (0, 1e6, "GB/s"),  # 0: unknown
    "time_table_tflops": (1e-9, 1e6, "TFLOP/s"),  # a point's flops over its seconds
}


def _memory_key(tier: object) -> str:
    """`PHYSICAL`'s key for memory tier `tier`: its own bound where it has one."""
    own = f"memory_gb.{tier}"
    return own if own in PHYSICAL else "memory_gb"


def _in_range(where: str, key: str, value: float) -> None:
    lo, hi, unit = PHYSICAL[key]
    if not lo <= value <= hi:
        raise ConfigError(
            f"{where}={value:g} is outside what a machine can be ({lo:g} to {hi:g} {unit}); "
            "check its unit"
        )


def check_physical(hw: HardwareSpec) -> None:
    """Every number of a hardware YAML within `PHYSICAL`, else a ConfigError naming the field
    as the YAML names it."""
    at = f"hardware {hw.name}: "
    _in_range(f"{at}n_gpus", "n_gpus", hw.n_gpus)
    for tier, cap in hw.memory_bytes.items():
        if cap or tier != Tier.DISK:  # no disk tier: nothing to range
            _in_range(f"{at}memory_gb.{tier}", _memory_key(tier), cap / GB)
    for res, link in hw.links.items():
        _in_range(f"{at}links.{res}.gbps", "gbps", link.bandwidth_bytes_per_s / GB)
        _in_range(f"{at}links.{res}.latency_us", "latency_us", link.latency_s * 1e6)
    for dev in ("gpu", "cpu"):
        c: ComputeSpec = getattr(hw, dev)
        _in_range(f"{at}{dev}.tflops", "tflops", c.peak_flops_per_s / 1e12)
        _in_range(f"{at}{dev}.mem_bw_gbps", "mem_bw_gbps", c.mem_bw_bytes_per_s / GB)
        _in_range(f"{at}{dev}.overhead_us", "overhead_us", c.kernel_overhead_s * 1e6)
        for kind, v in c.kind_overhead_s.items():
            _in_range(f"{at}{dev}.overhead_us_by_kind.{kind}", "overhead_us", v * 1e6)
        _in_range(f"{at}{dev}.sms", "sms", c.sms)
        _in_range(f"{at}{dev}.sm_mem_bw_gbps", "sm_mem_bw_gbps", c.sm_mem_bw_bytes_per_s / GB)
        for kind, pts in c.time_tables.items():
            for i, (flops, secs) in enumerate(pts):
                if flops > 0:  # a point's rate; (0, t) is a launch's floor
                    rate = flops / secs / 1e12 if secs > 0 else math.inf
                    _in_range(f"{at}{dev}.time_tables.{kind}[{i}] rate", "time_table_tflops", rate)
    p = hw.processes
    _in_range(f"{at}processes.gate_exchange_us", "gate_exchange_us", p.gate_exchange_s * 1e6)
    for kind, x in p.compute_scale.items():
        _in_range(f"{at}processes.compute_scale_by_kind.{kind}", "compute_scale", x)
    for kind, x in p.start_delay_s.items():
        _in_range(f"{at}processes.start_delay_us_by_kind.{kind}", "start_delay_us", x * 1e6)


def op_kind(kind: Any, where: str) -> str:
    """`kind` as an op kind's name, or a ConfigError naming `where` and the valid kinds."""
    try:
        return str(OpKind(kind))
    except ValueError:
        valid = ", ".join(str(k) for k in OpKind)
        raise ConfigError(f"{where}: {kind!r} is not an op kind; valid: {valid}") from None


def _points(pts: Any, where: str) -> tuple[tuple[float, float], ...]:
    """A time table's [[flops, seconds], ...], or a ConfigError naming `where` and the first
    point that is no pair of numbers (the whole table in the line hid which)."""
    fix = "[flops, seconds] pairs (experiments.calibrate writes them)"
    if not isinstance(pts, list | tuple):
        raise ConfigError(f"{where}: {_short(pts)} is not a list of {fix}")
    out = []
    for i, p in enumerate(pts):
        try:
            x, y = p
            out.append((float(x), float(y)))
        except (TypeError, ValueError):
            why = f"{_short(p)} is not a pair of numbers; give {fix}"
            raise ConfigError(f"{where}[{i}]: {why}") from None
    return tuple(out)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _scaled(value: Any, unit: float, where: str) -> float:
    """A YAML number in base units (`value` x `unit`); a finite value the unit takes past a
    float's range (gbps=1e308) is named as given, not as the inf it becomes."""
    x = float(value)
    if math.isfinite(x) and not math.isfinite(x * unit):
        raise ConfigError(f"{where}={x:g} is outside what a machine can be; check its unit")
    return x * unit


def _compute_from_dict(c: Mapping[str, Any], name: str, dev: str = "gpu") -> ComputeSpec:
    """One compute device of a hardware YAML (`HardwareSpec.from_dict`)."""
    at = f"hardware {name}: time_tables"
    tables = {
        op_kind(kind, at): _points(pts, f"{at}.{kind}")
        for kind, pts in dict(c.get("time_tables") or {}).items()
    }
    for kind, pts in tables.items():
        bad = next(
            (i for i, (x, y) in enumerate(pts) if x < 0 or y < 0 or (i and x < pts[i - 1][0])),
            None,
        )
        if not pts or bad is not None:
            point = "it has none" if bad is None else f"[{bad}] is {list(pts[bad])}"
            raise ConfigError(
                f"hardware {name}: time_tables.{kind} must be [flops, seconds] points "
                f"with flops ascending and both >= 0 ({point}; experiments.calibrate writes them)"
            )
    kind_overhead = {
        op_kind(k, f"hardware {name}: overhead_us_by_kind"): float(v) * 1e-6
        for k, v in dict(c.get("overhead_us_by_kind") or {}).items()
    }
    at = f"hardware {name}: {dev}."
    sms = integer_field(f"{at}sms", c.get("sms", 0), 0, "set the device's SM count", "0 = unknown")
    sm_bw = _scaled(c.get("sm_mem_bw_gbps", 0), GB, f"hardware {name}: {dev}.sm_mem_bw_gbps")
    if sm_bw < 0:
        raise ConfigError(f"{at}sm_mem_bw_gbps must be >= 0 (0 = unknown); set 0 or a bandwidth")
    comm_sms, copy_sms = (
        integer_field(f"{at}{k}", c.get(k, 0), 0, "set the SMs it holds (0: none)")
        for k in ("comm_sms", "copy_sms")
    )
    held = comm_sms + copy_sms
    if min(comm_sms, copy_sms) < 0 or (held > 0 and held >= sms):
        raise ConfigError(
            f"hardware {name}: comm_sms={comm_sms} and copy_sms={copy_sms} must be 0 "
            f"(they cost no compute) or together below sms={sms} (set sms, the "
            "device's SM count)"
        )
    return ComputeSpec(
        _scaled(c["tflops"], 1e12, f"hardware {name}: {dev}.tflops"),
        _scaled(c["mem_bw_gbps"], GB, f"hardware {name}: {dev}.mem_bw_gbps"),
        float(c.get("overhead_us", 0)) * 1e-6,
        kind_overhead,
        tables,
        sms,
        sm_bw,
        comm_sms,
        copy_sms,
    )
