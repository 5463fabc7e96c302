"""Simulator speed: Mixtral-8x7B, Klotski's paper workload (prompt 512, generate 32, batch 16),
`flexgen` at n=15 on rtx3090-env1, against a bare simpy event loop measured in the same process.

Usage:
    python -m experiments.bench_sim [repeat=3] [planner=flexgen]

Prints plan time, simulate time, ops simulated per second, the bare loop's events per second,
and their ratio (target: the whole run simulates in < 2 s, ratio >= 0.3).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import simpy
import yaml

from core.cost import CostModel
from core.errors import MoepipeError
from core.routing import load_routing
from core.spec import HardwareSpec, ModelSpec, RoutingConfig, Workload
from experiments.app import command
from experiments.pipeline import RunSpec, build_schedule
from planners.registry import make_planner
from sim.executor import simulate

CONF = Path(__file__).resolve().parents[1] / "conf"


def bare_simpy_events_per_s(n: int = 200_000) -> float:
    env = simpy.Environment()

    def proc():  # type: ignore[no-untyped-def]
        for _ in range(n):
            yield env.timeout(1)

    env.process(proc())
    t = time.perf_counter()
    env.run()
    return n / (time.perf_counter() - t)


@dataclass
class Options:
    repeat: int = 3  # timed runs; the best is reported
    planner: str = "flexgen"  # a registered planner


def main(argv: list[str] | None = None) -> int:
    return _app(argv)


def _main(args: Options) -> int:
    try:
        make_planner(args.planner, {})  # an unknown planner, before the model is loaded
        if args.repeat < 1:
            raise MoepipeError(f"repeat={args.repeat}: must be >= 1")
        bench(args.planner, args.repeat)
    except MoepipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def bench(planner: str, repeat: int) -> None:
    model = ModelSpec.from_dict(yaml.safe_load((CONF / "model/mixtral-8x7b.yaml").read_text()))
    hw = HardwareSpec.from_dict(yaml.safe_load((CONF / "hardware/rtx3090-env1.yaml").read_text()))
    wl_cfg = yaml.safe_load((CONF / "workload/paper.yaml").read_text())
    routing_cfg = RoutingConfig(**wl_cfg.pop("routing"))
    wl = Workload(**wl_cfg, routing=routing_cfg).with_(n_batches=15)
    routing = load_routing(model, wl)
    spec = RunSpec(model, hw, wl, planner, {})
    cost = CostModel(hw)
    print(
        f"{'run':>3} {'ops':>8} {'plan_s':>7} {'sim_s':>6} {'ops/s':>9} {'bare ev/s':>10} {'ratio':>6}"
    )
    for i in range(repeat):
        t0 = time.perf_counter()
        schedule = build_schedule(spec, routing)
        t1 = time.perf_counter()
        simulate(schedule, cost)
        t2 = time.perf_counter()
        bare = bare_simpy_events_per_s()
        ops_s = len(schedule) / (t2 - t1)
        print(
            f"{i:>3} {len(schedule):>8} {t1 - t0:>7.2f} {t2 - t1:>6.2f} {ops_s:>9.0f} {bare:>10.0f} {ops_s / bare:>6.3f}"
        )


_app = command("bench_sim", Options, _main, __doc__)

if __name__ == "__main__":
    sys.exit(main())
