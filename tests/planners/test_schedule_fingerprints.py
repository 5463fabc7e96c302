"""Every registered planner plans the schedule it planned when `schedule_fingerprints.json` was
written, op for op (every field of every op: kind, stream, tiers, bytes, tokens, flops, deps)
with the same streams and memory: on the tiny model (the expert-parallel planners on 2 GPUs)
and on Mixtral-8x7B's paper workload at n = 2 (flexgen and klotski also at n = 15, the speed
benchmark's run, in the slow suite). A change to how planners emit ops must keep them.

A change that means to alter a planner's schedule rewrites the file:
    python -m tests.planners.test_schedule_fingerprints
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest

from core.routing import Routing, load_routing
from core.schedule import Schedule
from core.spec import RoutingConfig, Workload
from experiments.common.pipeline import RunSpec, plan_schedule
from planners import planner_names
from tests.conftest import RESIDENT, conf, hardware_from_conf, model_from_conf, random_routing
from tests.planners.ep_common import tiny_spec

STORED = Path(__file__).with_name("schedule_fingerprints.json")
# the paper model's experts do not fit one GPU: expert parallelism runs on the tiny model only
PAPER = [p for p in planner_names() if p not in RESIDENT]
SLOW = ["flexgen", "klotski"]


def fingerprint(schedule: Schedule) -> list[object]:
    """A digest of every op's fields, the streams and the memory; and the op count."""
    h = hashlib.sha256()
    for op in schedule.ops:
        h.update(repr(tuple(op)).encode())
    h.update(repr(sorted((k, repr(v)) for k, v in schedule.streams.items())).encode())
    h.update(repr((schedule.capacity_bytes, schedule.resident_bytes)).encode())
    return [h.hexdigest()[:16], len(schedule.ops)]


def tiny_run(name: str) -> Schedule:
    if name in RESIDENT:
        spec = tiny_spec(name, n_devices=2)
    else:
        wl = Workload(batch_size=2, n_batches=2, prompt_len=8, gen_len=3)
        spec = RunSpec(model_from_conf("tiny"), hardware_from_conf("tiny"), wl, name)
    return plan_schedule(spec, random_routing(spec.model, spec.workload))


@cache
def paper(n: int) -> tuple[RunSpec, Routing]:
    """The paper run's spec (Mixtral-8x7B, rtx3090-env1, the paper workload) at n batches, and
    its routing (the synthetic generator's)."""
    d = {**conf("workload", "paper"), "n_batches": n}
    routing = RoutingConfig(**d.pop("routing"))
    wl = Workload(**d, routing=routing)
    model = model_from_conf("mixtral-8x7b")
    spec = RunSpec(model, hardware_from_conf("rtx3090-env1"), wl, "flexgen")
    return spec, load_routing(model, wl)


def paper_run(name: str, n: int) -> Schedule:
    spec, routing = paper(n)
    return plan_schedule(replace(spec, planner=name), routing)


def computed(key: str) -> list[object]:
    where, name = key.split("/")
    if where == "tiny":
        return fingerprint(tiny_run(name))
    return fingerprint(paper_run(name, int(where.removeprefix("paper-n"))))


def keys() -> list[str]:
    return (
        [f"tiny/{p}" for p in planner_names()]
        + [f"paper-n2/{p}" for p in PAPER]
        + [f"paper-n15/{p}" for p in SLOW]
    )


@pytest.mark.parametrize(
    "key",
    [k if "n15" not in k else pytest.param(k, marks=pytest.mark.slow) for k in keys()],
)
def test_planner_emits_the_schedule_it_emitted(key):
    stored = json.loads(STORED.read_text())
    assert key in stored, f"no stored fingerprint for {key}: rewrite {STORED.name}"
    assert computed(key) == stored[key]


def test_every_planner_has_a_stored_fingerprint():
    assert set(json.loads(STORED.read_text())) == set(keys())


if __name__ == "__main__":
    STORED.write_text(json.dumps({k: computed(k) for k in keys()}, indent=1) + "\n")
