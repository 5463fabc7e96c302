"""Where each device's expert copies go: homes (`home_slots`, `swap_homes`), replicas
(`replicate_onto`, under the replica cost gate `_gated`, then `polish`), and a policy's
layer-by-layer `Replicator`; load files (`read_npy`) and `PredictionError`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from core.errors import ConfigError
from core.files import not_regular
from core.npy import NpyError, npy_file
from core.planner import PlanContext
from core.types import ReplicaGate
from planners.ep.cost import ExpertTime, predicted_tokens
from planners.ep.params import Layout, ReplicaParams

# a load file's largest count: far past any run's tokens (a count near 1e308 overflowed the
# placement's sums into inf with numpy warnings)
MAX_LOAD = 1e15


# what to do with a load file that is no load matrix: the line's fix
_REMAKE = "write it again with np.save of the counts (a replication run writes its own)"


def read_npy(path: str, label: str, shape: tuple[int | None, ...], need: str) -> np.ndarray:
    """A .npy array of loads or counts whose shape matches `shape` (None: any length >= 1 on that
    axis), finite and >= 0 (all 0 is a table with no pairs yet: a one-MoE-layer model's
    transitions), or one ConfigError naming `label` (the param), the file
    and what is wrong (`need`: the shape the model needs)."""
    kind = not_regular(path)  # a FIFO would block the read, /dev/zero feed it without end
    if kind:
        raise ConfigError(f"{label} {path}: {kind}; pass a .npy file")
    try:
        arr = npy_file(path)
    except OSError as e:
        raise ConfigError(
            f"{label} {path}: cannot read it ({e.strerror or e}); check the path, or pass "
            "another .npy file"
        ) from None
    except NpyError as e:  # another format, cut short, or pickled objects (never unpickled)
        raise ConfigError(
            f"{label} {path}: not a .npy array of numbers ({e}; np.save of a numeric array "
            "writes one)"
        ) from None
    fits = arr.ndim == len(shape) and all(
        n == want if want is not None else n >= 1 for n, want in zip(arr.shape, shape, strict=True)
    )
    if not fits:
        raise ConfigError(f"{label} {path}: shape {arr.shape}, the model needs {need}; {_REMAKE}")
    # real numbers only: a complex array would lose its imaginary part with a warning
    if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise ConfigError(
            f"{label} {path}: dtype {arr.dtype}, not numbers (loads are real counts); {_REMAKE}"
        )
    out = arr.astype(np.float64)
    if not np.isfinite(out).all() or (out < 0).any() or (out > MAX_LOAD).any():
        some = not np.isnan(out).all()
        raise ConfigError(
            f"{label} {path}: loads must be finite counts in [0, {MAX_LOAD:g}] "
            f"(min {np.nanmin(out) if some else 'nan'}, max {np.nanmax(out) if some else 'nan'}, "
            f"{int(np.isnan(out).sum())} NaN); {_REMAKE}"
        )
    return out


def read_load(path: str, n_layers: int, n_experts: int, who: str) -> np.ndarray:
    """A .npy [MoE layers, experts] load matrix (e.g. token counts of a training split)."""
    return read_npy(
        path,
        f"{who} initial_load",
        (n_layers, n_experts),
        f"[{n_layers} MoE layers, {n_experts} experts]",
    )


def swap_homes(homes: np.ndarray, load: np.ndarray, layout: Layout) -> np.ndarray:
    """Homes [G, K] (replica slots emptied) re-balanced under load [E] by swapping two homes
    between devices, each device in at most one swap (so each receives at most one copy): the
    busiest device not yet swapped takes the swap that lowers the larger of the pair's loads the
    most, until no swap lowers it."""
    h = layout.home_slots
    out = homes.copy()
    out[:, h:] = -1
    dev = np.array([load[row[row >= 0]].sum() for row in out])  # [G] home load
    free = [int(d) for d in np.argsort(-dev, kind="stable")]  # devices not yet swapped
    while len(free) >= 2:
        b = free.pop(0)
        best: tuple[float, int, int, int, float] | None = None
        for i in np.flatnonzero(out[b, :h] >= 0):
            for d in free:
                for j in np.flatnonzero(out[d, :h] >= 0):
                    delta = load[out[b, i]] - load[out[d, j]]
                    pair = max(dev[b] - delta, dev[d] + delta)
                    if delta > 0 and pair < dev[b] and (best is None or pair < best[0]):
                        best = (pair, int(i), d, int(j), delta)
        if best is None:
            continue
        _, si, sd, sj, delta = best
        out[b, si], out[sd, sj] = out[sd, sj], out[b, si]
        dev[b], dev[sd] = dev[b] - delta, dev[sd] + delta
        free.remove(sd)
        free.sort(key=lambda x: -dev[x])
    return out


def home_slots(layout: Layout, load: np.ndarray | None) -> np.ndarray:
    """[G, K] homes: round-robin, or with a load [E] EPLB's balanced packing of one copy per
    expert (needs G | E); replica slots empty."""
    from planners.eplb_algo import balanced_packing

    if load is None or layout.n_experts % layout.n_devices:
        return layout.round_robin()
    pack, rank = balanced_packing(np.asarray(load, dtype=np.float64)[None], layout.n_devices)
    slots = np.full((layout.n_devices, layout.slots_per_device), -1, dtype=np.int64)
    slots[pack[0], rank[0]] = np.arange(layout.n_experts)
    return slots


def replicate_onto(
    load: np.ndarray,
    layout: Layout,
    homes: np.ndarray | None = None,
    *,
    gate: str = ReplicaGate.NONE,
    timer: ExpertTime | None = None,
    resident: np.ndarray | None = None,
    scenarios: np.ndarray | None = None,
) -> np.ndarray:
    """[G, K] slots: homes (default round-robin) plus replica copies. load [E] predicted tokens.

    gate "none": `layout.replicas` copies given to the largest per-copy load (EPLB's greedy), each
    on the lightest device with a free slot (preferring one without that expert).
    gate "time" / "time+copy" (after FasterMoE's shadowing rule, replication.md §2.2): copies
    added one at a time in the same greedy order, each onto the modelled least busy device
    (`timer`) with a free slot that lacks it; the prefix whose busiest device finishes first is
    kept, for "time+copy" charged the copies not already in `resident` [G, K] that cannot hide
    behind the other layers (`ExpertTime.late_copy_s`). A copy adds the expert's weight bytes to
    the grouped GEMM's roofline, so in memory-bound layers replication can lose and the gate
    declines it. Either way `polish` then improves the replica slots (kept under a gate only if
    modelled faster). With `scenarios` [S, E] (loads the prediction may turn out to be, e.g. other
    splits' loads) the gate compares placements by their mean busiest-device time over
    the scenarios (`ExpertTime.span`) instead of under `load` alone; the greedy order stays
    `load`'s.
    """
    slots = layout.round_robin() if homes is None else homes.copy()
    load = np.asarray(load, dtype=np.float64)
    if gate != ReplicaGate.NONE:
        assert timer is not None, "a gated replication needs the cost model"
        return _gated(load, layout, slots, gate, timer, resident, scenarios)
    from planners.eplb_algo import replicate_experts

    g, e = layout.n_devices, layout.n_experts
    cnt = replicate_experts(load[None], e + layout.replicas)[2][0]  # [E] copies per expert
    per_copy = load / cnt
    dev_load = np.array([per_copy[row[row >= 0]].sum() for row in slots])  # [G]
    free = np.full(g, layout.home_slots)  # next free slot index per device
    extra = [ex for ex in np.argsort(-per_copy, kind="stable") for _ in range(cnt[ex] - 1)]
    for ex in extra:
        open_ = np.flatnonzero(free < layout.slots_per_device)
        fresh = [d for d in open_ if ex not in slots[d]]
        cand = np.array(fresh) if fresh else open_
        d = int(cand[np.argmin(dev_load[cand])])
        slots[d, free[d]] = ex
        free[d] += 1
        dev_load[d] += per_copy[ex]
    return polish(slots, load, layout)


def _gated(
    load: np.ndarray,
    layout: Layout,
    slots: np.ndarray,
    gate: str,
    timer: ExpertTime,
    resident: np.ndarray | None,
    scenarios: np.ndarray | None = None,
) -> np.ndarray:
    """Replicas added one at a time in EPLB's greedy order (the expert with the largest per-copy
    load next), each on the modelled least busy device with a free slot that lacks it; of all
    these prefixes, the one whose busiest device finishes first (charged, for "time+copy", the
    longest per-device queue of copies not already resident; lanes: all lanes' copies as one
    queue) is kept. Looking at every prefix
    rather than stopping at the first copy that does not pay lets a copy that only pays together
    with the next one (a hot expert split three ways) be taken."""

    def cost(trial: np.ndarray) -> float:
        span = timer.span(trial, load, scenarios)
        if gate != ReplicaGate.TIME_COPY or resident is None:
            return span
        return span + timer.late_copy_s(timer.queue(trial, resident), span)

    free = np.full(layout.n_devices, layout.home_slots)
    copies = np.bincount(slots[slots >= 0], minlength=layout.n_experts)
    times = timer.device_times(slots, load)  # [G]
    best, best_cost = slots, cost(slots)
    for _ in range(layout.replicas):
        order = np.argsort(-(load / np.maximum(copies, 1)), kind="stable")
        pick = None
        for ex in order[: layout.n_experts]:
            if load[ex] <= 0:
                break
            cand = [
                d
                for d in range(layout.n_devices)
                if free[d] < layout.slots_per_device and ex not in slots[d]
            ]
            if cand:
                pick = int(ex), min(cand, key=lambda c: (times[c], c))
                break
        if pick is None:
            break
        ex, d = pick
        slots = slots.copy()
        slots[d, free[d]] = ex
        free[d] += 1
        copies[ex] += 1
        times = timer.device_times(slots, load)
        c = cost(slots)
        if c < best_cost:
            best, best_cost = slots, c
    polished = polish(best, load, layout)
    return polished if cost(polished) < best_cost else best


def polish(slots: np.ndarray, load: np.ndarray, layout: Layout, rounds: int = 64) -> np.ndarray:
    """Local search over the replica slots (homes stay): refill a replica slot (or fill a free one,
    within the `replicas` budget) with an expert of the busiest device, or empty one of its
    replicas, while that lowers (max device tokens, sum of squares) under the even split.

    The greedy that fills the slots places copies one at a time and can leave the busiest device
    with a better move; this takes the best single-slot move until none helps (at most
    `rounds`; of equally good moves the first in the order they are listed)."""
    g, e, h = layout.n_devices, layout.n_experts, layout.home_slots
    member = np.zeros((g, e))
    for d in range(g):
        np.add.at(member[d], slots[d][slots[d] >= 0], 1.0)

    def scores(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # m [T, G, E] -> max, sum sq [T]
        # each trial's matrix @ vector as one product of the stack: the same gemv per trial
        dev = np.matmul(m, (load / np.maximum(m.sum(1), 1.0))[:, :, None])[:, :, 0]
        return dev.max(1), (dev**2).sum(1)

    slots = slots.copy()
    now_max, now_sq = (float(v[0]) for v in scores(member[None]))
    # replicas placed; a free slot is filled only while this is below the budget
    filled = int((slots[:, h:] >= 0).sum())
    for _ in range(rounds):
        busiest = int(np.argmax(member @ (load / np.maximum(member.sum(0), 1.0))))
        moves: list[tuple[int, int, int]] = []  # (expert put in or -1, device, slot)
        for x in np.flatnonzero((member[busiest] > 0) & (load > 0)):
            for d in range(g):
                if member[d, x]:
                    continue
                for j in range(h, layout.slots_per_device):
                    y = int(slots[d, j])
                    if y < 0 and filled >= layout.replicas:
                        break
                    moves.append((int(x), d, j))
                    if y < 0:
                        break  # free slots of one device are interchangeable
        # or empty one of the busiest device's replicas
        moves += [
            (-1, busiest, j) for j in range(h, layout.slots_per_device) if slots[busiest, j] >= 0
        ]
        if not moves:
            break
        trials = np.repeat(member[None], len(moves), axis=0)
        t_idx = np.arange(len(moves))
        put, dev, slot = (np.array(c) for c in zip(*moves, strict=True))
        out = slots[dev, slot]
        trials[t_idx[out >= 0], dev[out >= 0], out[out >= 0]] -= 1
        trials[t_idx[put >= 0], dev[put >= 0], put[put >= 0]] += 1
        mx, sq = scores(trials)
        better = (mx < now_max) | ((mx == now_max) & (sq < now_sq))
        if not better.any():
            break
        cand = np.flatnonzero(better)
        best = cand[np.lexsort((cand, sq[cand], mx[cand]))[0]]
        now_max, now_sq = float(mx[best]), float(sq[best])
        pick, d, j = moves[best]
        if slots[d, j] >= 0:
            member[d, slots[d, j]] -= 1
            filled -= 1
        if pick >= 0:
            member[d, pick] += 1
            filled += 1
        slots[d, j] = pick
    return slots


class Replicator:
    """Homes and replicas of one layer after another for a replication policy: homes re-placed
    every `rehome_interval` iterations (re-packed from scratch, or under a gate also by
    `swap_homes`, when that pays), replicas by `replicate_onto` with the params' gate; keeps
    what is resident so the "time+copy" gate charges only new copies."""

    def __init__(
        self, p: ReplicaParams, layout: Layout, timer: ExpertTime, homes: list[np.ndarray]
    ) -> None:
        self.p, self.layout, self.timer, self.homes = p, layout, timer, homes
        self.resident: dict[int, np.ndarray] = {}

    @classmethod
    def for_run(
        cls, p: ReplicaParams, ctx: PlanContext, layout: Layout, who: str
    ) -> tuple[Replicator, np.ndarray | None]:
        """The run's replicator, homes packed from `p.initial_load` (else round-robin), and that
        load [MoE layers, E] (None without one); `who` names the planner in errors."""
        n_layers, e = len(ctx.model.moe_layers), ctx.model.n_experts
        init = read_load(p.initial_load, n_layers, e, who) if p.initial_load else None
        homes = [home_slots(layout, None if init is None else init[m]) for m in range(n_layers)]
        return cls(p, layout, ExpertTime.of(ctx, layout), homes), init

    def rehome_due(self, t: int) -> bool:
        return self.p.rehome_interval > 0 and t > 0 and t % self.p.rehome_interval == 0

    def place(
        self,
        moe: int,
        load: np.ndarray,
        home_load: np.ndarray | None = None,
        scenarios: np.ndarray | None = None,
    ) -> np.ndarray:
        """[G, K] for predicted load [E]; re-packs homes by `home_load` [E] when given. With
        `scenarios` [S, E] the gate judges placements on them (`replicate_onto`)."""
        old = self.resident.get(moe)
        slots = self._with_replicas(moe, load, self.homes[moe], scenarios)
        if old is None and self.p.gate != ReplicaGate.NONE:
            # The first placement is preloaded with the model, so its copies cost no transfer:
            # fill every replica slot when that is modelled no slower than the gate's choice;
            # copies that cost nothing hedge against the prediction (a prior) being wrong.
            full = replicate_onto(load, self.layout, self.homes[moe])
            if self.timer.span(full, load, scenarios) <= self.timer.span(slots, load, scenarios):
                slots = full
        if home_load is not None and home_load.sum() > 0:
            # EPLB's packing from scratch, and under a gate also a few swaps from where the homes
            # are: a full re-pack moves nearly every home, and its copies seldom pay
            options = [home_slots(self.layout, home_load)]
            if self.p.gate != ReplicaGate.NONE and old is not None:
                options.append(swap_homes(self.homes[moe], home_load, self.layout))
            for homes in options:
                moved = self._with_replicas(moe, load, homes, scenarios)
                if (
                    self.p.gate == ReplicaGate.NONE
                    or old is None
                    or self._pays(moved, slots, old, load, scenarios)
                ):
                    self.homes[moe], slots = homes, moved
        self.resident[moe] = slots
        return slots

    def _with_replicas(
        self, moe: int, load: np.ndarray, homes: np.ndarray, scenarios: np.ndarray | None
    ) -> np.ndarray:
        return replicate_onto(
            load,
            self.layout,
            homes,
            gate=self.p.gate,
            timer=self.timer,
            resident=self.resident.get(moe),
            scenarios=scenarios,
        )

    def _pays(
        self,
        new: np.ndarray,
        keep: np.ndarray,
        old: np.ndarray,
        load: np.ndarray,
        scenarios: np.ndarray | None = None,
    ) -> bool:
        """The gate applied to re-homing: the busiest device of `new` finishes sooner than with
        `keep`, each charged the time its copies from `old` run late ("time+copy"; `keep`'s
        re-chosen replicas may need copies too, and a move that needs fewer was refused); or as
        soon, and the busiest device alone (its copies aside) as soon too, holding fewer
        predicted tokens (`_fewer_peak_tokens`). Late copies can make the two totals tie
        whatever the spans (each total is then its copy queue): there the shorter span wins."""
        s_new, s_keep = (self.timer.span(s, load, scenarios) for s in (new, keep))
        t_new, t_keep = s_new, s_keep
        if self.p.gate == ReplicaGate.TIME_COPY:
            t_new += self.timer.late_copy_s(self.timer.queue(new, old), s_new)
            t_keep += self.timer.late_copy_s(self.timer.queue(keep, old), s_keep)
        if not math.isclose(t_new, t_keep, rel_tol=1e-9):
            return t_new < t_keep
        if not math.isclose(s_new, s_keep, rel_tol=1e-9):
            return s_new < s_keep
        return self._fewer_peak_tokens(new, keep, load)

    def _fewer_peak_tokens(self, new: np.ndarray, keep: np.ndarray, load: np.ndarray) -> bool:
        """A move the gate finds no slower is taken when it balances the tokens (`new`'s busiest
        device holds fewer of `load`'s than `keep`'s). Memory-bound layers tie: each device
        reads all its experts' weights however the tokens fall, so a re-homing never pays in
        time there; a balanced placement is what a batch hotter than predicted runs fastest on.
        Its copies run as late as keeping's by the gate's model (mostly not at all: they hide
        behind the other layers); the simulator runs them on the links beside the all-to-all,
        which they slow a little (docs/replication-model.md, "Ties go to balance"). With
        `scenarios` the tie is on their mean time, the tokens those of `load`."""
        peak = [predicted_tokens(s, load, self.p.dispatch).sum(1).max() for s in (new, keep)]
        return bool(peak[0] < peak[1])


class PredictionError:
    """How far a policy's placements were planned from the truth: per (iteration, MoE layer), the
    total-variation distance (half the L1 distance of the shares) between the load the placement
    was planned from and the iteration's true load, revealed by its gates. 0 for the oracle."""

    def __init__(self) -> None:
        self.planned: dict[tuple[int, int], np.ndarray] = {}
        self.tv: list[float] = []

    def planned_from(self, t: int, moe: int, load: np.ndarray) -> None:
        self.planned[(t, moe)] = np.asarray(load, dtype=np.float64)

    def observed(self, t: int, moe: int, counts: Any) -> None:
        load, true = self.planned.pop((t, moe)), np.asarray(counts, dtype=np.float64)
        if load.sum() > 0 and true.sum() > 0:
            self.tv.append(0.5 * float(np.abs(load / load.sum() - true / true.sum()).sum()))

    def mean(self) -> float | None:
        return float(np.mean(self.tv)) if self.tv else None
