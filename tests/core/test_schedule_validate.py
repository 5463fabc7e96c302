"""`core.schedule.validate` rejects each malformed schedule with the right error class and a
message that names the op at fault (its `Op.label()`) and says what would make it valid.

Each case starts from one valid base: a 1 GB gpu / 4 GB cpu / 100 GB disk machine, streams
`weights` (h2d), `kv_store` (d2h), `compute` (gpu), and a gate op 0 (step 0, layer 0,
batch 0) on `compute`; the case appends the one bad op (or memory) that breaks it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from core.ep_layout import EPLayout
from core.errors import CapacityError, MoepipeError, ScheduleError
from core.schedule import Op, ScheduleBuilder, validate
from core.types import OpKind, Resource, Tier

GB = 10**9
CAPACITY = {Tier.GPU: GB, Tier.CPU: 4 * GB, Tier.DISK: 100 * GB}


def base() -> tuple[ScheduleBuilder, int]:
    b = ScheduleBuilder(CAPACITY)
    b.stream("weights", Resource.H2D)
    b.stream("kv_store", Resource.D2H)
    b.stream("compute", Resource.GPU)
    gate = b.add(OpKind.GATE, "compute", step=0, layer=0, batch=0)
    return b, gate


def test_base_is_valid():
    """The base, plus a correct expert (after its gate) and a correct load, passes."""
    b, gate = base()
    b.add(OpKind.EXPERT, "compute", (gate,), layer=0, batch=0, expert=1)
    b.add(
        OpKind.LOAD,
        "weights",
        src=Tier.CPU,
        dst=Tier.GPU,
        nbytes=GB,
        alloc_tier=Tier.GPU,
        alloc_bytes=GB,
    )
    validate(b.build())


# Each builder appends its bad op and returns its id (or None when no op is at fault).
def _dep_on_later(b: ScheduleBuilder, gate: int) -> int:
    return b.add(OpKind.FFN, "compute", (gate, 2), layer=0)  # op 1 names op 2, after it


def _dep_on_itself(b: ScheduleBuilder, gate: int) -> int:
    return b.add(OpKind.FFN, "compute", (1,), layer=0)  # op 1 names op 1


def _dep_negative(b: ScheduleBuilder, gate: int) -> int:
    return b.add(OpKind.FFN, "compute", (-1,), layer=0)


def _undeclared_stream(b: ScheduleBuilder, gate: int) -> int:
    return b.add(OpKind.FFN, "ghost", (gate,), layer=0)


def _compute_on_link(b: ScheduleBuilder, gate: int) -> int:
    return b.add(OpKind.FFN, "weights", (gate,), layer=0)


def _transfer_on_wrong_link(b: ScheduleBuilder, gate: int) -> int:
    # cpu -> gpu runs on h2d; `kv_store` is the d2h stream
    return b.add(OpKind.LOAD, "kv_store", src=Tier.CPU, dst=Tier.GPU, nbytes=GB, layer=0)


def _kv_store_on_wrong_link(b: ScheduleBuilder, gate: int) -> int:
    # gpu -> cpu runs on d2h; `weights` is the h2d stream
    return b.add(OpKind.KV_STORE, "weights", src=Tier.GPU, dst=Tier.CPU, nbytes=GB, layer=0)


def _transfer_without_tiers(b: ScheduleBuilder, gate: int) -> int:
    return b.add(OpKind.LOAD, "weights", nbytes=GB, layer=0)


def _negative_alloc(b: ScheduleBuilder, gate: int) -> int:
    return b.add(OpKind.FFN, "compute", (gate,), alloc_tier=Tier.GPU, alloc_bytes=-1)


def _alloc_without_tier(b: ScheduleBuilder, gate: int) -> int:
    return b.add(OpKind.FFN, "compute", (gate,), alloc_bytes=1000)


def _expert_without_gate(b: ScheduleBuilder, gate: int) -> int:
    return b.add(OpKind.EXPERT, "compute", (), step=0, layer=0, batch=0, expert=2)


def _expert_with_other_batch_gate(b: ScheduleBuilder, gate: int) -> int:
    # the layer's gate of batch 0 exists, the expert serves batch 1 (no gate of its own)
    return b.add(OpKind.EXPERT, "compute", (gate,), step=0, layer=0, batch=1, expert=2)


def _all_batches_expert_missing_one_gate(b: ScheduleBuilder, gate: int) -> int:
    # batch -1 = every batch of the group: needs the gates of batches 0 and 1
    g1 = b.add(OpKind.GATE, "compute", step=0, layer=0, batch=1)
    assert g1 == 1
    return b.add(OpKind.EXPERT, "compute", (gate,), step=0, layer=0, expert=3)


def _expert_missing_a_device_gate(b: ScheduleBuilder, gate: int) -> int:
    # batch 0 gated in two parts (one per device's sequences): the routing needs both
    b.stream("compute1", Resource.GPU, 1)
    g1 = b.add(OpKind.GATE, "compute1", step=0, layer=0, batch=0)
    assert g1 == 1
    return b.add(OpKind.EXPERT, "compute1", (g1,), step=0, layer=0, batch=0, expert=2)


def _expert_of_layer_without_gate(b: ScheduleBuilder, gate: int) -> int:
    # depends on layer 0's gate, but it computes layer 1
    return b.add(OpKind.EXPERT, "compute", (gate,), step=0, layer=1, batch=0, expert=0)


def _alloc_over_tier(b: ScheduleBuilder, gate: int) -> int:
    # 2 GB of a 1 GB gpu
    return b.add(
        OpKind.LOAD,
        "weights",
        src=Tier.CPU,
        dst=Tier.GPU,
        nbytes=2 * GB,
        alloc_tier=Tier.GPU,
        alloc_bytes=2 * GB,
        layer=0,
    )


def _alloc_over_room_left_by_resident(b: ScheduleBuilder, gate: int) -> int:
    # 0.75 GB resident leaves 0.25 GB of the 1 GB gpu; the load takes 0.5 GB
    b.reserve(Tier.GPU, 3 * GB // 4)
    return b.add(
        OpKind.LOAD,
        "weights",
        src=Tier.CPU,
        dst=Tier.GPU,
        nbytes=GB // 2,
        alloc_tier=Tier.GPU,
        alloc_bytes=GB // 2,
        layer=0,
    )


def _waits_for_memory_freed_later(b: ScheduleBuilder, gate: int) -> int:
    # two 0.75 GB loads on one stream; the first is freed only after the second: never finishes
    a = b.add(
        OpKind.LOAD,
        "weights",
        src=Tier.CPU,
        dst=Tier.GPU,
        nbytes=1,
        layer=0,
        alloc_tier=Tier.GPU,
        alloc_bytes=3 * GB // 4,
    )
    c = b.add(
        OpKind.LOAD,
        "weights",
        src=Tier.CPU,
        dst=Tier.GPU,
        nbytes=1,
        layer=1,
        alloc_tier=Tier.GPU,
        alloc_bytes=3 * GB // 4,
    )
    b.add(OpKind.FREE, "compute", (c,), free_tier=Tier.GPU, free_bytes=3 * GB // 4)
    assert a == 1
    return c


def _freed_twice(b: ScheduleBuilder, gate: int) -> int:
    # a 0.5 GB load freed twice: after the second free the gpu would seem to hold less than nothing
    a = b.add(
        OpKind.LOAD,
        "weights",
        src=Tier.CPU,
        dst=Tier.GPU,
        nbytes=1,
        layer=0,
        alloc_tier=Tier.GPU,
        alloc_bytes=GB // 2,
    )
    b.add(OpKind.FREE, "compute", (a,), free_tier=Tier.GPU, free_bytes=GB // 2)
    return b.add(OpKind.FREE, "compute", (a,), free_tier=Tier.GPU, free_bytes=GB // 2)


def _expert_over_a_span(b: ScheduleBuilder, gate: int) -> int:
    return b.add(OpKind.EXPERT, "compute", (gate,), layer=0, batch=0, expert=1, batches=2)


def _attention_over_no_batch(b: ScheduleBuilder, gate: int) -> int:
    return b.add(OpKind.ATTENTION, "compute", layer=0, batch=0, batches=0)


CASES: list[tuple[str, Callable[[ScheduleBuilder, int], int], type[MoepipeError], list[str]]] = [
    ("dep on a later op", _dep_on_later, ScheduleError, ["must name earlier ops"]),
    ("dep on itself", _dep_on_itself, ScheduleError, ["must name earlier ops"]),
    ("negative dep", _dep_negative, ScheduleError, ["must name earlier ops"]),
    ("undeclared stream", _undeclared_stream, ScheduleError, ["'ghost'", "not declared"]),
    ("compute on a link", _compute_on_link, ScheduleError, ["compute op on h2d", "gpu or cpu"]),
    (
        "load on the wrong link",
        _transfer_on_wrong_link,
        ScheduleError,
        ["cpu->gpu runs on h2d", "stream is on d2h"],
    ),
    (
        "kv-store on the wrong link",
        _kv_store_on_wrong_link,
        ScheduleError,
        ["gpu->cpu runs on d2h", "stream is on h2d"],
    ),
    ("transfer without tiers", _transfer_without_tiers, ScheduleError, ["needs src and dst"]),
    ("negative allocation", _negative_alloc, ScheduleError, ["needs a tier and bytes >= 0"]),
    ("allocation without tier", _alloc_without_tier, ScheduleError, ["needs a tier"]),
    (
        "expert without gate dep",
        _expert_without_gate,
        ScheduleError,
        ["must depend on the gate", "causal"],
    ),
    (
        "expert of a batch without gate",
        _expert_with_other_batch_gate,
        ScheduleError,
        ["must depend on the gate", "causal"],
    ),
    (
        "all-batch expert missing a gate",
        _all_batches_expert_missing_one_gate,
        ScheduleError,
        ["must depend on the gate", "missing [1]"],
    ),
    (
        "expert missing one device's gate part",
        _expert_missing_a_device_gate,
        ScheduleError,
        ["must depend on the gate", "missing [0]"],
    ),
    (
        "expert of a layer without gate",
        _expert_of_layer_without_gate,
        ScheduleError,
        ["must depend on the gate"],
    ),
    (
        "allocation over the tier",
        _alloc_over_tier,
        CapacityError,
        ["allocates 2 GB of gpu", "only 1 GB"],
    ),
    (
        "allocation over what resident leaves",
        _alloc_over_room_left_by_resident,
        CapacityError,
        ["allocates 0.5 GB of gpu", "only 0.25 GB"],
    ),
    (
        "waits for memory freed later",
        _waits_for_memory_freed_later,
        ScheduleError,
        ["can never finish", "waits for", "750000000 B of gpu (250000000 B free)"],
    ),
    (
        "memory freed twice",
        _freed_twice,
        ScheduleError,
        ["frees 500000000 B of gpu that no earlier op allocated"],
    ),
    (
        "an expert over a span of batches",
        _expert_over_a_span,
        ScheduleError,
        ["batch=0..1", "only an attention or a gate over whole batches"],
    ),
    (
        "an attention over no batch",
        _attention_over_no_batch,
        ScheduleError,
        ["covers 0 batches", ">= 1"],
    ),
]


@pytest.mark.parametrize(
    ("make_bad", "error", "says"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_validate_rejects_naming_the_op_and_the_fix(make_bad, error, says):
    """Expected error class and phrases per case in CASES; the message starts from or contains
    the bad op's label (e.g. 'op 1 compute-ffn step=0 layer=0 on ghost')."""
    b, gate = base()
    bad = make_bad(b, gate)
    s = b.build()
    with pytest.raises(error) as info:
        validate(s)
    msg = str(info.value)
    assert s.ops[bad].label() in msg
    for phrase in says:
        assert phrase in msg


def test_resident_over_capacity_names_the_tier():
    """1.5 GB reserved resident on the 1 GB gpu: CapacityError naming the tier and both sizes
    ('resident gpu memory 1.5 GB exceeds the gpu capacity 1 GB'); there is no op to name."""
    b, _ = base()
    b.reserve(Tier.GPU, 3 * GB // 2)
    with pytest.raises(
        CapacityError,
        match=r"resident gpu memory 1\.5 GB exceeds the gpu "
        r"capacity 1 GB",
    ):
        validate(b.build())


def test_id_not_its_position():
    """An op whose id is not its position (the builder never makes one; a hand-edited list may):
    op 1 given id 5 -> 'op 5 ...: id must equal its position 1'."""
    b, _ = base()
    s = b.build()
    s.ops.append(Op(5, OpKind.FFN, "compute", layer=0))
    with pytest.raises(ScheduleError, match=r"op 5 compute-ffn .*id must equal its position 1"):
        validate(s)


def test_stuck_schedule_skipped_without_check_finishes():
    """check_finishes=False skips the zero-time run: the never-finishing case passes validate
    (the simulator reports it instead), the static checks still run."""
    b, gate = base()
    _waits_for_memory_freed_later(b, gate)
    validate(b.build(), check_finishes=False)
    b2, gate2 = base()
    _dep_on_later(b2, gate2)
    with pytest.raises(ScheduleError):
        validate(b2.build(), check_finishes=False)


def test_bad_memory_names_the_bad_op_not_its_good_twin():
    """Op 1 is a good load cpu->gpu allocating 1 KB; op 2 is the same load with alloc_bytes=-1.
    The message must name op 2, not op 1."""
    b, _ = base()
    b.add(
        OpKind.LOAD,
        "weights",
        src=Tier.CPU,
        dst=Tier.GPU,
        nbytes=1000,
        layer=0,
        alloc_tier=Tier.GPU,
        alloc_bytes=1000,
    )
    bad = b.add(
        OpKind.LOAD,
        "weights",
        src=Tier.CPU,
        dst=Tier.GPU,
        nbytes=1000,
        layer=1,
        alloc_tier=Tier.GPU,
        alloc_bytes=-1,
    )
    s = b.build()
    with pytest.raises(ScheduleError, match="memory effect") as info:
        validate(s)
    assert s.ops[bad].label() in str(info.value)


def test_two_bad_ops_name_the_first():
    """Ops 1 and 2 are each on an undeclared stream; the message must name op 1. Tried with 40
    different pairs of stream names: with set order, about half of the pairs name op 2, so all
    40 naming op 1 by chance is below 1e-9."""
    for i in range(40):
        b, _ = base()
        first = b.add(OpKind.FFN, f"ghost_{i}_a", layer=0)
        b.add(OpKind.FFN, f"ghost_{i}_b", layer=0)
        s = b.build()
        with pytest.raises(ScheduleError) as info:
            validate(s)
        assert s.ops[first].label() in str(info.value), f"pair {i}: {info.value}"


def test_transfer_without_a_link_says_so():
    """disk -> gpu has no entry in LINK_OF (it goes disk -> cpu -> gpu): the message should not
    say it 'runs on None'."""
    b, _ = base()
    bad = b.add(OpKind.LOAD, "weights", src=Tier.DISK, dst=Tier.GPU, nbytes=GB, layer=0)
    s = b.build()
    with pytest.raises(ScheduleError) as info:
        validate(s)
    msg = str(info.value)
    assert s.ops[bad].label() in msg
    assert "None" not in msg and "no disk->gpu link" in msg


@pytest.mark.parametrize("kind", [OpKind.DISPATCH, OpKind.COMBINE])
def test_all_to_all_must_be_on_a_p2p_stream(kind):
    """A dispatch on a compute stream used to pass validate() and crash the simulator."""
    b, _ = base()
    bad = b.add(kind, "compute", tokens=4, nbytes=1000, layer=0)
    s = b.build()
    with pytest.raises(ScheduleError, match="must be on p2p") as info:
        validate(s)
    assert s.ops[bad].label() in str(info.value)


@pytest.mark.parametrize("order", [("c", "s1", "s2"), ("c", "s2", "s1")])
def test_the_finishing_check_does_not_depend_on_stream_order(order):
    """A (after compute X) and B (no deps) each take 0.6 GB of 1 GB; B frees its own and A's
    stream frees A after C, which follows B. With any durations B goes first and all finish.
    The zero-time run took A first when its stream was declared first, and refused the
    schedule ("can never finish"); it now runs in rounds, B before A."""
    b = ScheduleBuilder(CAPACITY)
    for name, res in zip(
        order,
        [{"c": Resource.GPU, "s1": Resource.H2D, "s2": Resource.D2H}[n] for n in order],
        strict=True,
    ):
        b.stream(name, res)
    x = b.add(OpKind.FFN, "c", (), flops=1e9)
    a = b.add(
        OpKind.LOAD,
        "s1",
        (x,),
        src=Tier.CPU,
        dst=Tier.GPU,
        nbytes=GB // 10,
        alloc_tier=Tier.GPU,
        alloc_bytes=6 * GB // 10,
    )
    bb = b.add(
        OpKind.LOAD,
        "s2",
        (),
        src=Tier.GPU,
        dst=Tier.CPU,
        nbytes=GB // 10,
        alloc_tier=Tier.GPU,
        alloc_bytes=6 * GB // 10,
        free_tier=Tier.GPU,
        free_bytes=6 * GB // 10,
    )
    c = b.add(OpKind.LOAD, "s2", (bb,), src=Tier.GPU, dst=Tier.CPU, nbytes=GB // 10)
    b.add(OpKind.FREE, "s1", (a, c), free_tier=Tier.GPU, free_bytes=6 * GB // 10)
    validate(b.build())


@pytest.mark.parametrize(
    ("lanes", "res", "ok"),
    [
        (True, Resource.D2D, True),
        (True, Resource.P2P, False),
        (True, Resource.P2P_OUT, False),
        (False, Resource.P2P, True),
        (False, Resource.P2P_OUT, True),
        (False, Resource.D2D, False),
    ],
)
def test_an_expert_parallel_layout_uses_only_its_own_links(lanes, res, ok):
    """A gpu -> gpu replica copy may run on p2p, p2p_out or d2d, and the IR names lanes and
    GPUs alike (`gpu:d`): the layout (`Schedule.ep`) says which links there are. Lanes share one
    GPU's memory (d2d only); G GPUs have none in common (no d2d). A copy on a link its layout
    lacks is named; without the layout every one of them passes, as before."""
    b, _ = base()
    b.stream("copy", res)
    b.add(OpKind.EXPERT, "compute", (0,), layer=0, batch=0, expert=1)
    bad = b.add(OpKind.LOAD, "copy", src=Tier.GPU, dst=Tier.GPU, nbytes=1000, layer=0)
    validate(b.build())  # no layout
    b.ep = EPLayout(n_devices=2, lanes=lanes)
    s = b.build()
    if ok:
        validate(s)
        return
    with pytest.raises(ScheduleError, match="lanes of one GPU" if lanes else "G GPUs") as info:
        validate(s)
    assert s.ops[bad].label() in str(info.value)
