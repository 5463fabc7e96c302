"""Replica placement and its cost gate: greedy copies, re-homing, polish, home swaps, and the
gate's time model (device_times, copy queues, the SM pool), on hand-worked examples."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from core.hardware import HardwareSpec
from core.spec import ModelSpec
from core.types import OpKind, Resource
from planners.expert_parallel import (
    ExpertTime,
    Layout,
    ReplicaParams,
    Replicator,
    expert_width,
    home_slots,
    polish,
    replicate_onto,
    split_tokens,
    swap_homes,
)
from tests.planners.ep_common import LAY, _timer, tiny_spec


def test_replica_goes_to_lightest_device_without_the_expert():
    """E=4 on G=2 round-robin: dev0 {0, 2}, dev1 {1, 3}. Load [8, 1, 1, 1], one replica: expert 0
    gets 2 copies (4 each); dev0 would hold 4 + 1, dev1 1 + 1, so the copy goes to dev1: 5 vs 6."""
    lay = Layout(n_devices=2, n_experts=4, home_slots=2, replica_slots=1, replicas=1, lanes=True)
    slots = replicate_onto(np.array([8.0, 1, 1, 1]), lay)
    assert slots.tolist() == [[0, 2, -1], [1, 3, 0]]
    assert split_tokens(slots, np.array([8, 1, 1, 1])).sum(1).tolist() == [5, 6]


def test_homes_packed_by_load():
    """Loads [4, 3, 2, 1] on 2 devices, 2 each: 4 -> d0, 3 -> d1, 2 -> d1 (5), 1 -> d0 (5)."""
    lay = Layout(n_devices=2, n_experts=4, home_slots=2, replica_slots=0, replicas=0, lanes=False)
    assert home_slots(lay, np.array([4.0, 3, 2, 1])).tolist() == [[0, 3], [1, 2]]


def test_gate_keeps_the_fastest_prefix_of_greedy_copies():
    """Homes dev0 {0, 2}, dev1 {1, 3}; load [8, 1, 1, 1]: dev0 max(9, 2) = 9 s, dev1 2 s. Copy
    expert 0 to dev1: dev0 4 + 1 = 5 s, dev1 1 + 1 + 4 = 6 s. Expert 0 can go nowhere else, so
    the next copy is expert 1 onto dev0's free slot: 4 + 1 + 0.5 = 5.5 s on both: kept, the
    fastest of the prefixes (9, 6, 5.5 s)."""
    slots = replicate_onto(np.array([8.0, 1, 1, 1]), LAY, gate="time", timer=_timer())
    assert slots.tolist() == [[0, 2, 1], [1, 3, 0]]


def test_rehoming_gate_charges_both_placements_their_copies():
    """Copies take 10 s. Resident: dev0 {0, 1, 3}, dev1 {2, 3, 1}; load [6, 1, 5, 2]. Moving
    the homes to dev0 {0, 3}, dev1 {2, 1} needs no copy: 8 s. Keeping them with re-chosen
    replicas (dev0 + 2, dev1 + 0) takes 7.5 s but a copy on each device, 2.5 s of it late:
    10 s. The move pays; the gate charged only the move's copies and refused it."""
    rep = Replicator(ReplicaParams(gate="time+copy"), LAY, _timer(copy_s=10.0), [])
    old = np.array([[0, 1, 3], [2, 3, 1]])
    keep, new = np.array([[0, 1, 2], [2, 3, 0]]), np.array([[0, 3, -1], [2, 1, -1]])
    load = np.array([6.0, 1, 5, 2])
    assert rep.timer.span(new, load, None) == 8.0 and rep.timer.span(keep, load, None) == 7.5
    assert rep._pays(new, keep, old, load)
    assert not Replicator(ReplicaParams(gate="time"), LAY, _timer(10.0), [])._pays(
        new, keep, old, load
    )


def test_rehoming_takes_a_tie_that_balances_the_tokens():
    """Memory-bound: load [0.9, 0.1, 0.9, 0.1] on homes dev0 {0, 2}, dev1 {1, 3} gives 1.8 and
    0.2 tokens, each device 2 s (its two experts' bytes). Swapping experts 2 and 1 leaves both at
    2 s with 1.0 token each: the same time, balanced, so the re-homing takes it when its copies
    hide (copy_s 0.5 s behind a 2 s layer), and refuses it when they run late (copy_s 10 s)."""
    lay = Layout(n_devices=2, n_experts=4, home_slots=2, replica_slots=0, replicas=0, lanes=False)
    load = np.array([0.9, 0.1, 0.9, 0.1])
    for copy_s, homes in ((0.5, [[0, 1], [2, 3]]), (10.0, [[0, 2], [1, 3]])):
        rep = Replicator(
            ReplicaParams(gate="time+copy"), lay, _timer(copy_s), [np.array([[0, 2], [1, 3]])]
        )
        rep.place(0, load)
        got = rep.place(0, load, home_load=load)
        assert sorted(map(sorted, got.tolist())) == homes, copy_s
        assert rep.homes[0].tolist() == got.tolist()


class _SpanTimer:
    """Stand-in for `ExpertTime` in `Replicator._pays`: set spans and copy queues per placement."""

    def __init__(self, copy_s: float, spans: dict, queues: dict) -> None:
        self.copy_s, self.spans, self.queues = copy_s, spans, queues

    def span(self, slots, load, scenarios):
        return self.spans[slots.tobytes()]

    def queue(self, slots, resident):
        return self.queues[slots.tobytes()]

    def late_copy_s(self, queue, layer_s):
        return max(0.0, queue * self.copy_s - layer_s)


def test_late_copies_do_not_hide_a_slower_span_in_a_tie():
    """Under time+copy a side whose copies run late totals its copy queue (10 copies of 0.2 s
    behind a 1.0 s or 0.9 s layer: 2 s either way). The totals tie, but the move's busiest
    device is slower (1.0 s against 0.9): refused, though it holds fewer peak tokens (5 against
    7). With the spans tied too, the tokens decide; under gate time (no copies charged) the
    slower span loses outright. Before, the tokens decided on the totals' tie alone."""
    keep, new, old = np.array([[0, 1], [2, 3]]), np.array([[0, 2], [1, 3]]), np.zeros((2, 2), int)
    load = np.array([4.0, 3, 1, 0])
    for spans, pays in (((1.0, 0.9), False), ((0.9, 0.9), True)):
        timer = _SpanTimer(
            0.2,
            {new.tobytes(): spans[0], keep.tobytes(): spans[1]},
            {new.tobytes(): 10, keep.tobytes(): 10},
        )
        for gate in ("time+copy", "time"):
            rep = Replicator(ReplicaParams(gate=gate), LAY, timer, [keep])  # type: ignore[arg-type]
            assert rep._pays(new, keep, old, load) is pays, (spans, gate)


def test_polish_moves_a_replica_the_greedy_misplaced():
    """Homes dev0 {0, 1}, dev1 {2, 3}, one replica slot each, budget 1; load [6, 6, 1, 1]. A
    replica of expert 2 on dev0 (a poor greedy choice) leaves dev0 at 12.5; polish moves the slot
    to expert 0 or 1 on dev1: 3 + 6 = 9 on dev0 and 3 + 1 + 1 = 5 on dev1."""
    lay = Layout(n_devices=2, n_experts=4, home_slots=2, replica_slots=1, replicas=1, lanes=True)
    bad = np.array([[0, 1, 2], [2, 3, -1]])
    out = polish(bad, np.array([6.0, 6, 1, 1]), lay)
    assert out[:, :2].tolist() == [[0, 1], [2, 3]]  # homes stay
    assert out[1, 2] in (0, 1) and out[0, 2] == -1 and (out[:, 2] >= 0).sum() == 1


def test_gate_declines_a_replica_in_a_memory_bound_layer():
    """Load [2, 1, 1, 1]: dev0 max(3, 2) = 3 s, dev1 2 s. Copying expert 0 to dev1 gives dev0
    max(2, 2) = 2 s but dev1 max(3, 3) = 3 s (one more expert's bytes): not sooner, declined;
    the ungated greedy would have placed it."""
    load = np.array([2.0, 1, 1, 1])
    assert replicate_onto(load, LAY, gate="time", timer=_timer()).tolist() == [
        [0, 2, -1],
        [1, 3, -1],
    ]
    assert replicate_onto(load, LAY)[1].tolist() == [1, 3, 0]


def test_gate_charges_only_copies_not_already_resident():
    """As the first gate test, with a 10 s copy, of which one layer's time (6 s) hides behind the
    other layers: 6 + (10 - 6) >= 9, declined unless dev1 already holds expert 0 (no copy
    needed), or when no residency is known (the first placement is preloaded)."""
    load, t = np.array([8.0, 1, 1, 1]), _timer(copy_s=10.0)
    empty = np.array([[0, 2, -1], [1, 3, -1]])
    held = np.array([[0, 2, -1], [1, 3, 0]])
    assert replicate_onto(load, LAY, gate="time+copy", timer=t, resident=empty)[1, 2] == -1
    assert replicate_onto(load, LAY, gate="time+copy", timer=t, resident=held)[1, 2] == 0
    assert replicate_onto(load, LAY, gate="time+copy", timer=t)[1, 2] == 0


def test_copy_hidden_within_one_layer_is_free():
    """A 4 s copy against a 6 s layer runs behind the other layers: no charge; the excess of a
    longer queue is charged."""
    t = _timer(copy_s=4.0)
    assert t.late_copy_s(1, 6.0) == 0.0
    assert t.late_copy_s(2, 6.0) == 2.0
    load = np.array([8.0, 1, 1, 1])
    empty = np.array([[0, 2, -1], [1, 3, -1]])
    assert replicate_onto(load, LAY, gate="time+copy", timer=t, resident=empty)[1, 2] == 0


def test_copies_that_hold_sms_are_charged_even_when_hidden():
    """Copies by NCCL's p2p kernels (`copy_sm_share` of the SMs) slow the compute beside them:
    at a quarter, a hidden 4 s copy costs 1 s, two of them 2 s plus the 2 s they run late. In the
    first gate test's layer (9 s; two copies, one a device, make it 5.5 s) the copies are taken
    at a quarter (5.5 + 1) and declined at 0.9 (5.5 + 3.6, and one copy alone 6 + 3.6: past 9)."""
    t = replace(_timer(copy_s=4.0), copy_sm_share=0.25)
    assert t.late_copy_s(1, 6.0) == 1.0
    assert t.late_copy_s(2, 6.0) == 2.0 + 2.0
    load = np.array([8.0, 1, 1, 1])
    empty = np.array([[0, 2, -1], [1, 3, -1]])
    assert replicate_onto(load, LAY, gate="time+copy", timer=t, resident=empty)[1, 2] == 0
    t = replace(t, copy_sm_share=0.9)
    assert replicate_onto(load, LAY, gate="time+copy", timer=t, resident=empty)[1, 2] == -1


def test_the_gate_weighs_shared_lanes_as_the_pool_runs_them():
    """On lanes that share the SMs the gate's span is the pool's makespan: two lanes each with
    one narrow kernel (3 tokens: one row tile, far from filling the GPU) run side by side, each
    its launch plus its work at its cap; two wide ones (4096 tokens each) share the GPU and
    take their work together plus one launch."""
    from core.cost import CostModel

    spec = tiny_spec("ep_static", lanes=True)
    m = spec.model
    raw = yaml.safe_load(Path("conf/hardware/tiny.yaml").read_text())
    raw["gpu"].update(sms=16, overhead_us=1)
    cost = CostModel(HardwareSpec.from_dict(raw))
    timer = ExpertTime(cost, m.expert_flops(1), m.expert_bytes, True, 0.0, 1.0, m)
    slots = np.array([[0, 2], [1, 3]])
    over = cost.overhead_s(Resource.GPU, OpKind.EXPERT)
    for n, side_by_side in ((3, True), (4096, False)):
        load = np.array([n, n, 0.0, 0.0])
        work = cost.compute_s(Resource.GPU, OpKind.EXPERT, m.expert_flops(n), m.expert_bytes) - over
        cap = cost.cap(Resource.GPU, m.expert_flops(n), m.expert_bytes, expert_width(m, [n]))
        want = over + work / cap if side_by_side else over + 2 * work
        assert cap < 0.5 if side_by_side else cap == 1.0
        assert timer.span(slots, load, None) == pytest.approx(want)


def test_gate_on_scenarios_keeps_a_copy_the_prediction_alone_declines():
    """Load [2, 1, 1, 1] alone: copying expert 0 leaves the busiest device at 3 s, declined (as
    above). Judged also on a scenario where expert 0 takes 6: no copy 3 and 7 s (mean 5); expert 0
    onto dev1 3 and 5 s (dev0 3 + 1, dev1 1 + 1 + 3), mean 4; then expert 1 onto dev0 3 and
    4.5 s, mean 3.75: both kept. A scenario equal to the prediction changes nothing."""
    load = np.array([2.0, 1, 1, 1])
    hedged = replicate_onto(
        load, LAY, gate="time", timer=_timer(), scenarios=np.array([load, [6.0, 1, 1, 1]])
    )
    assert hedged.tolist() == [[0, 2, 1], [1, 3, 0]]
    same = replicate_onto(load, LAY, gate="time", timer=_timer(), scenarios=np.array([load, load]))
    assert same.tolist() == [[0, 2, -1], [1, 3, -1]]


def test_first_placement_fills_the_slots_when_that_is_no_slower():
    """The first placement is preloaded (no copy to pay for). Load [2, 1, 1, 1]: the gate alone
    places no replica (3 s either way, as above), EPLB's greedy fills both slots for the same
    3 s: taken. Load [0.5] x 4 is memory-bound: 2 distinct experts a device = 2 s, a third copy
    makes it 3 s: the gate's empty slots stay. Later placements are the gate's alone."""
    from planners.expert_parallel import ReplicaParams, Replicator

    def fresh() -> Replicator:
        return Replicator(ReplicaParams(gate="time"), LAY, _timer(), [LAY.round_robin()])

    rep = fresh()
    assert rep.place(0, np.array([2.0, 1, 1, 1])).tolist() == [[0, 2, 1], [1, 3, 0]]
    assert rep.place(0, np.array([2.0, 1, 1, 1])).tolist() == [[0, 2, -1], [1, 3, -1]]
    assert fresh().place(0, np.full(4, 0.5)).tolist() == [[0, 2, -1], [1, 3, -1]]


def test_swap_homes_by_hand():
    """G = 4, two homes each; experts 0 and 4 (load 10 each) share device 0 (home load 20, the
    others 2). The busiest device takes the first of its equally good swaps, expert 0 <-> expert 1
    of device 1 (delta 9: 11 and 11); the two left (2 and 2) have no swap that lowers their pair.
    Replica slots come back empty; every expert keeps exactly one home."""
    lay = Layout(n_devices=4, n_experts=8, home_slots=2, replica_slots=1, replicas=4, lanes=False)
    homes = np.array([[0, 4, 5], [1, 5, -1], [2, 6, -1], [3, 7, -1]])
    load = np.array([10.0, 1, 1, 1, 10, 1, 1, 1])
    out = swap_homes(homes, load, lay)
    assert out.tolist() == [[1, 4, -1], [0, 5, -1], [2, 6, -1], [3, 7, -1]]
    assert sorted(out[:, :2].ravel()) == list(range(8))


def test_swap_homes_swaps_each_device_once():
    """Every device receives at most one home copy per re-homing: with all the load on device 0,
    only one swap happens, though a second would lower device 0 further."""
    lay = Layout(n_devices=2, n_experts=6, home_slots=3, replica_slots=0, replicas=0, lanes=False)
    homes = np.array([[0, 1, 2], [3, 4, 5]])
    out = swap_homes(homes, np.array([5.0, 5, 5, 0, 0, 0]), lay)
    moved = [set(homes[d]) - set(out[d]) for d in range(2)]
    assert [len(m) for m in moved] == [1, 1]
    assert sorted(out.ravel()) == list(range(6))


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("share", [1.0, 0.125])
@pytest.mark.parametrize("table", [False, True])
def test_device_times_are_each_devices_own_time(grouped, share, table):
    """The gate's `device_times` (all devices at once) equals `device_s` row by row to the last
    bit (the gate breaks ties of modelled time by device), and both are the device's ops
    costed one by one: random slots (empty ones and an expert twice on one device included)
    and fractional loads with zeros, one grouped op per device or one op per expert, a lane's
    share, a measured time table or the roofline."""
    from core.cost import CostModel
    from planners.expert_parallel import predicted_tokens

    m = ModelSpec.from_dict(yaml.safe_load(Path("conf/model/deepseek-v2-lite.yaml").read_text()))
    raw = yaml.safe_load(Path("conf/hardware/h200-hgx8.yaml").read_text())
    if table:
        raw["gpu"]["time_tables"] = {"compute-expert": [[1e9, 2e-5], [1e12, 3e-3]]}
    timer = ExpertTime(
        CostModel(HardwareSpec.from_dict(raw)),
        m.expert_flops(1),
        m.expert_bytes,
        grouped,
        0.0,
        share,
    )
    rng = np.random.default_rng(0)
    for _ in range(20):
        slots = rng.integers(-1, 64, size=(8, 10))
        slots[0, :2] = [5, 5]
        load = rng.gamma(0.5, 40.0, size=64) * (rng.random(64) > 0.3)
        rows = predicted_tokens(slots, load)
        got = timer.device_times(slots, load)
        assert got.tolist() == [timer.device_s(row) for row in rows]  # bit for bit: gate ties
        # and each is the device's ops (`_ops`) costed one by one, up to the order of the sums
        ops = [
            sum(
                timer.cost.compute_s(Resource.GPU, OpKind.EXPERT, f, b, share)
                for f, b, _ in timer._ops(row)
            )
            for row in rows
        ]
        assert got == pytest.approx(ops, rel=1e-12, abs=0)


def test_new_copies_count_each_devices_added_holdings():
    """Per device, the experts held and not held before (a second slot of one held already
    shares its weights, as the real run's `copy_moves`; empty slots not counted); the longest such
    queue. Checked against a count by hand on random slots."""
    from planners.expert_parallel import new_copies

    rng = np.random.default_rng(1)
    for _ in range(200):
        old, new = rng.integers(-1, 6, size=(2, 4, 3))
        want = max(
            len({x for x in n if x >= 0} - {x for x in o if x >= 0})
            for n, o in zip(new.tolist(), old.tolist(), strict=True)
        )
        assert new_copies(new, old) == want
        total = sum(
            len({x for x in n if x >= 0} - {x for x in o if x >= 0})
            for n, o in zip(new.tolist(), old.tolist(), strict=True)
        )
        assert new_copies(new, old, one_queue=True) == total  # lanes: one GPU's copy queue
    assert new_copies(np.array([[3, 3, -1]]), np.array([[3, -1, -1]])) == 0
    assert new_copies(np.array([[3, 4, 4]]), np.array([[3, -1, -1]])) == 1
    assert new_copies(np.array([[-1, -1]]), np.array([[0, 1]])) == 0


def test_gate_queues_copies_on_both_ends_of_the_link():
    """On G GPUs the gate's copy queue is the longer of each GPU's copies in and out: expert 0,
    held only by GPU 0, copied to GPUs 1-3 is one copy into each but three out of GPU 0 (the
    source the real run sends from, `copy_moves`); on lanes the same copies are one queue."""
    from core.cost import CostModel
    from planners.expert_parallel import ExpertTime, copy_moves

    old = np.array([[0, -1], [1, -1], [2, -1], [3, -1]])
    new = np.array([[0, -1], [1, 0], [2, 0], [3, 0]])
    assert copy_moves(old.tolist(), new.tolist()) == [(0, 0, 1), (0, 0, 2), (0, 0, 3)]
    timer = ExpertTime(CostModel(tiny_spec("ep_static").hardware), 1.0, 1, True, 1.0)
    assert timer.queue(new, old) == 3
    assert replace(timer, one_link=True).queue(new, old) == 3
    spread = np.array([[0, 1], [1, 0], [2, -1], [3, -1]])  # one copy each way
    assert timer.queue(spread, old) == 1 and replace(timer, one_link=True).queue(spread, old) == 2


def test_pool_ops_of_one_expert_each_equal_the_scalar_cost():
    """On lanes sharing the SMs, one op per expert: `pool_ops` (all at once) gives each busy
    expert exactly the launch, work and cap that `CostModel.compute_s`, `cap` and `expert_width`
    give it alone, from a few tokens (narrow kernels) to thousands (wide ones), with widths
    that fall on a half."""
    from core.cost import CostModel

    m = ModelSpec.from_dict(yaml.safe_load(Path("conf/model/switch-base-128.yaml").read_text()))
    m = replace(m, expert_ffn_size=1100)  # 9 + 6 tiles per row tile: widths round half to even
    cost = CostModel(
        HardwareSpec.from_dict(yaml.safe_load(Path("conf/hardware/h200-hgx8.yaml").read_text()))
    )
    timer = ExpertTime(cost, m.expert_flops(1), m.expert_bytes, False, 0.0, 1.0, m)
    over = cost.overhead_s(Resource.GPU, OpKind.EXPERT)
    rng = np.random.default_rng(2)
    tokens = rng.gamma(0.3, 300.0, size=128) * (rng.random(128) > 0.4)
    tokens[:4] = [1.0, 300.5, 4000.25, 60000.0]
    want = []
    for n in tokens[tokens > 0]:
        f = m.expert_flops(1) * n
        width = expert_width(m, [np.ceil(n)])
        want.append(
            (
                over,
                cost.compute_s(Resource.GPU, OpKind.EXPERT, f, m.expert_bytes) - over,
                cost.cap(Resource.GPU, f, m.expert_bytes, width),
            )
        )
    assert min(c for *_, c in want) < 0.5 < max(c for *_, c in want)
    assert timer.pool_ops(tokens) == want
