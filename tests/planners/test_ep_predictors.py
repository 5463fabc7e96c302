"""predictive_replication's load predictors (ema, window, task_mix, layer_corr) and how far a
planned load was from the truth; each causal: it reads only routing already seen."""

from dataclasses import replace

import numpy as np
import pytest

from core.errors import ConfigError
from core.types import OpKind
from experiments.common.pipeline import simulate_run
from planners.expert_parallel import PredictionError
from tests.planners.ep_common import tiny_spec


def test_prediction_error_is_the_total_variation_of_the_shares():
    err = PredictionError()
    err.planned_from(0, 0, np.array([2.0, 2.0, 0.0, 0.0]))
    err.observed(0, 0, [1, 1, 1, 1])  # shares 1/2 1/2 0 0 against 1/4 each: 0.5
    err.planned_from(1, 0, np.array([3.0, 3.0, 3.0, 3.0]))
    err.observed(1, 0, [2, 2, 2, 2])  # the same shares at another scale: 0
    err.planned_from(1, 1, np.array([1.0, 0.0, 0.0, 0.0]))
    err.observed(1, 1, [0, 0, 0, 5])  # disjoint: 1
    assert err.mean() == pytest.approx(0.5) and not err.planned
    assert PredictionError().mean() is None


def test_predictor_starts_from_the_prior_and_scales_shares_to_the_iteration():
    """Prior [1, 4] load [6, 2, 1, 1]: iteration 0 is predicted as its shares x that iteration's
    selections (20 -> [12, 4, 2, 2]) with no gate to wait for; after observing counts [0, 0, 5, 5]
    the EMA (alpha 0.5) holds shares [0.3, 0.1, 0.3, 0.3], scaled to the next iteration's 10."""
    from core.routing import GateView
    from planners.predictive_replication import LoadPredictor, PredictiveParams

    p = PredictiveParams(predictor="ema", ema_alpha=0.5)
    sel = {0: 20.0, 1: 10.0}
    pred = LoadPredictor(p, 1, 4, sel.__getitem__, np.array([[6.0, 2, 1, 1]]))
    load, used = pred.predict(0, 0)
    assert load.tolist() == pytest.approx([12, 4, 2, 2]) and used == ()
    pred.observe(0, 0, GateView(np.array([[2], [3]]), np.array([0, 0, 5, 5])), gates=(7,))
    load, used = pred.predict(1, 0)
    assert load.tolist() == pytest.approx([3, 1, 3, 3]) and used == (7,)


def test_window_predictor_is_the_mean_share_of_the_last_iterations():
    """window=2: before any iteration the prior's shares; then the mean share of the last two
    observed iterations (the oldest dropped), scaled to the iteration's selections; homes are
    packed by the same mean. The prior scenarios are used only before the first observation."""
    from core.routing import GateView
    from planners.predictive_replication import LoadPredictor, PredictiveParams

    p = PredictiveParams(predictor="window", window=2)
    pred = LoadPredictor(p, 1, 4, lambda t: 8.0, np.array([[1.0, 1, 1, 1]]))
    pred.prior_scen = np.array([[[0.5, 0.5, 0, 0]]])  # [S=1, L=1, E=4] shares
    load, _ = pred.predict(0, 0)
    assert load.tolist() == [2, 2, 2, 2]
    assert pred.scenarios(0, load).tolist() == [[2, 2, 2, 2], [4, 4, 0, 0]]
    for t, counts in enumerate(([4, 0, 0, 0], [0, 4, 0, 0], [0, 0, 4, 0])):
        view = GateView(np.zeros((1, 1), dtype=np.int64), np.array(counts))
        pred.observe(t, 0, view, gates=(10 + t,))
    load, used = pred.predict(3, 0)
    assert load.tolist() == [0, 4, 4, 0] and used == (12,)
    assert pred.home_share(0).tolist() == [0, 0.5, 0.5, 0]
    assert pred.scenarios(0, load) is None


def test_window_predictor_keeps_the_prior_as_prior_weight_iterations():
    """Prior shares [0.5, 0.5, 0, 0] weighted as 2 iterations, one observed share [0, 0, 1, 0]:
    (2 x prior + observed) / 3 = [1/3, 1/3, 1/3, 0], scaled to the 6 selections; homes are packed
    by the same share. Without the weight the one observation alone ([0, 0, 6, 0])."""
    from core.routing import GateView
    from planners.predictive_replication import LoadPredictor, PredictiveParams

    view = GateView(np.zeros((1, 1), dtype=np.int64), np.array([0, 0, 4, 0]))
    prior = np.array([[3.0, 3, 0, 0]])
    for weight, want in ((2.0, [2, 2, 2, 0]), (0.0, [0, 0, 6, 0])):
        p = PredictiveParams(predictor="window", window=4, prior_weight=weight)
        pred = LoadPredictor(p, 1, 4, lambda t: 6.0, prior)
        pred.observe(0, 0, view, gates=(1,))
        assert pred.predict(1, 0)[0].tolist() == pytest.approx(want)
        assert (pred.home_share(0) * 6).tolist() == pytest.approx(want)
    # a layer without a prior (an all-zero row) is the window's mean alone, not shrunk by it
    p = PredictiveParams(predictor="window", window=4, prior_weight=2.0)
    pred = LoadPredictor(p, 2, 4, lambda t: 6.0, np.array([[3.0, 3, 0, 0], [0, 0, 0, 0]]))
    pred.observe(0, 1, view, gates=(1,))
    assert pred.predict(1, 1)[0].tolist() == pytest.approx([0, 0, 6, 0])
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=r"prior_weight=.*a finite number in \[0, 1e\+06\]"):
            PredictiveParams(predictor="window", prior_weight=bad)


def test_task_mix_predicts_from_the_iterations_labels(tmp_path):
    """Per-label loads [3, 1, 0, 0] (shares [.75, .25, 0, 0]) and [0, 0, 2, 2] ([0, 0, .5, .5]);
    iteration 1's tokens labelled [0, 0, 0, 1]: (3 x the first + the second) / 4 = [.5625,
    .1875, .125, .125], times the 8 selections, with no gate to wait for (the labels are known
    when the batch forms); the homes are packed by the same share. Iteration 0 is planned from
    the prior, as the other predictors' first placement, loaded with the model before any
    request. A label never seen at a layer takes the prior's share there; a label beyond
    task_load's, or no task_load, or task_load without task_mix, is one error."""
    from planners.predictive_replication import (
        LoadPredictor,
        PredictedReplicas,
        PredictiveParams,
    )

    loads = np.array([[[3.0, 1, 0, 0], [0, 0, 0, 0]], [[0, 0, 2, 2], [1, 1, 1, 1]]])  # [2, L=2, 4]
    np.save(tmp_path / "tl.npy", loads)
    p = PredictiveParams(predictor="task_mix", task_load=str(tmp_path / "tl.npy"))
    labels = {0: np.array([1, 1, 1, 1]), 1: np.array([0, 0, 0, 1]), 2: np.array([0, 0, 0, 2])}
    prior = np.array([[1.0, 1, 1, 1], [4, 0, 0, 0]])
    pred = LoadPredictor(p, 2, 4, lambda t: 8.0, prior, labels.__getitem__)
    assert pred.predict(0, 0) == (pytest.approx(np.full(4, 2.0)), ())  # the prior, not labels
    load, used = pred.predict(1, 0)
    assert load.tolist() == pytest.approx([4.5, 1.5, 1, 1]) and used == ()
    # MoE layer 1: label 0 has no load there, so its tokens take the prior's [1, 0, 0, 0]
    assert pred.predict(1, 1)[0].tolist() == pytest.approx([6.5, 0.5, 0.5, 0.5])
    with pytest.raises(ConfigError, match="a request label 2 but task_load has 2 labels"):
        pred.predict(2, 0)

    class Homes:  # records what the homes are packed by
        def rehome_due(self, t):
            return True

        def place(self, moe, load, home_load, scenarios):
            self.home = home_load
            return np.zeros((2, 1), dtype=np.int64)

    rep = Homes()
    assert PredictedReplicas(rep, pred).place(1, 0)[1] == ()  # type: ignore[arg-type]
    assert rep.home.tolist() == pytest.approx([0.5625, 0.1875, 0.125, 0.125])
    with pytest.raises(ConfigError, match="predictor task_mix needs task_load="):
        PredictiveParams(predictor="task_mix")
    with pytest.raises(
        ConfigError, match="task_load is read only by predictor task_mix, not window"
    ):
        PredictiveParams(predictor="window", task_load=str(tmp_path / "tl.npy"))


def test_task_mix_learns_each_labels_share_online(tmp_path):
    """After iterations are seen, a label's share at a layer pools its tokens' selections over
    the last `window` iterations, the training share counted in as `prior_weight` times its mean
    selections an iteration; a label a window never saw keeps the training share; and the
    prediction waits for the previous iteration's gate there. window=2, prior_weight=1, top-1:
    label 0 trains as [1, 0, 0, 0]. Iteration 0: label 0's tokens pick experts [1, 1] (2
    selections); iteration 1: [1, 2, 2, 2] (4); iteration 2: [3, 3] (2), which drops iteration 0.
    After 0 and 1: seen [0, 3, 3, 0] over 6, strength 1 x 6 / 2 = 3: ([0, 3, 3, 0] + 3 x [1, 0,
    0, 0]) / 9. After 1 and 2 (window 2): seen [0, 1, 3, 2] over 6, the same strength."""
    from core.routing import GateView
    from planners.predictive_replication import LoadPredictor, PredictiveParams

    np.save(tmp_path / "tl.npy", np.array([[[5.0, 0, 0, 0]], [[0, 0, 0, 5]]]))  # [labels, L=1, E]
    p = PredictiveParams(
        predictor="task_mix", task_load=str(tmp_path / "tl.npy"), window=2, prior_weight=1.0
    )
    labels = {
        0: np.array([0, 0, 1]),
        1: np.array([0, 0, 0, 0]),
        2: np.array([0, 0]),
        3: np.array([0, 1]),
    }
    pred = LoadPredictor(p, 1, 4, lambda t: 9.0, np.ones((1, 4)), labels.__getitem__)
    picks = {0: [1, 1, 0], 1: [1, 2, 2, 2], 2: [3, 3]}  # label 1's token at iteration 0 picks 0
    for t, ids in picks.items():
        ids = np.array(ids)[:, None]
        pred.observe(t, 0, GateView(ids, np.bincount(ids.ravel(), minlength=4)), gates=(10 + t,))
        if t == 1:
            share = ([0, 3, 3, 0] + 3 * np.array([1.0, 0, 0, 0])) / 9
            np.testing.assert_allclose(pred.label_share(0)[0], share)
            # label 1: one selection (expert 0) in 2 iterations, strength 1 x 1 / 2
            np.testing.assert_allclose(pred.label_share(0)[1], [2 / 3, 0, 0, 1 / 3])
    np.testing.assert_allclose(
        pred.label_share(0)[0], ([0, 1, 3, 2] + 3 * np.array([1.0, 0, 0, 0])) / 9
    )
    np.testing.assert_allclose(pred.label_share(0)[1], [0, 0, 0, 1])  # not in the window: trained
    load, used = pred.predict(3, 0)  # labels [0, 1]: half each
    np.testing.assert_allclose(load, 9 * (pred.label_share(0)[0] + [0, 0, 0, 1]) / 2)
    assert used == (12,)


def test_task_mix_places_by_the_labels_and_needs_them(tmp_path):
    """The same routing under two labellings, each label's load making another expert hot: the
    first placement, loaded with the model, is the same under both (it is planned before any
    request); the second batch's holds that label's hot expert on both devices. A routing
    without labels (synthetic), or with another number of them than task_load, is one error."""
    from core.errors import TraceError
    from experiments.common.pipeline import build_schedule
    from tests.conftest import random_routing

    spec = tiny_spec("predictive_replication", lanes=True, replica_slots=1)
    e, n_moe = spec.model.n_experts, len(spec.model.moe_layers)
    loads = np.ones((2, n_moe, e))
    loads[0, :, 0], loads[1, :, 2] = 50, 50  # label 0: expert 0 hot; label 1: expert 2
    np.save(tmp_path / "tl.npy", loads)
    # every slot filled (no gate); the training shares outweigh the uniform routing seen
    spec = replace(
        spec,
        params={
            **spec.params,
            "predictor": "task_mix",
            "gate": "none",
            "prior_weight": 100.0,
            "task_load": str(tmp_path / "tl.npy"),
        },
    )
    base = random_routing(spec.model, spec.workload)
    slots = []
    for label in (0, 1):
        labelled = replace(
            base, labels=np.full(base.expert_ids.shape[:2], label, np.int16), label_names=("a", "b")
        )
        slots.append(build_schedule(spec, labelled).ep.placements)
        assert all([0, 2][label] in row for row in slots[-1][(0, 1, 0)])  # batch 1: hot one
    assert slots[0][(0, 0, 0)] == slots[1][(0, 0, 0)]  # the first placement reads no labels
    assert slots[0][(0, 1, 0)] != slots[1][(0, 1, 0)]
    with pytest.raises(TraceError, match="predictor=task_mix needs each request's label"):
        build_schedule(spec, base)
    three = replace(
        base, labels=np.zeros(base.expert_ids.shape[:2], np.int16), label_names=("a", "b", "c")
    )
    with pytest.raises(ConfigError, match=r"task_load has 2 labels but the routing names 3 \(a, b"):
        build_schedule(spec, three)


def test_layer_corr_first_placements_do_not_read_the_runs_routing(tmp_path):
    """A layer's first placement is loaded before the run, so it cannot follow routing: with a
    table that sends layer 0's expert e to layer 1's expert e, sending iteration 0's tokens at
    MoE layer 0 to experts {0, 1} or to {2, 3} leaves MoE layer 1's first placement the same
    (before, layer_corr placed it from that routing, and its copies cost nothing)."""
    from core.routing import Routing
    from experiments.common.pipeline import build_schedule
    from tests.conftest import random_routing

    spec = tiny_spec("predictive_replication", lanes=True, replica_slots=1)
    e = spec.model.n_experts
    table = np.zeros((len(spec.model.moe_layers), e, e))
    table[1] = 100 * np.eye(e)
    np.save(tmp_path / "t.npy", table)
    spec = replace(
        spec, params={**spec.params, "predictor": "layer_corr", "table": str(tmp_path / "t.npy")}
    )
    base = random_routing(spec.model, spec.workload)
    first = []
    for hot in ([0, 1], [2, 3]):
        ids = base.expert_ids.copy()
        ids[: spec.workload.batch_size, base.step_slice(0, spec.workload), 0] = hot
        s = build_schedule(spec, Routing(ids, base.gate_weights, base.n_experts, "hot"))
        first.append(s.ep.placements[(0, 0, 1)])
    assert first[0] == first[1]


def test_predictive_copies_wait_for_the_routing_they_used():
    """Causal: a replica copy depends on a gate op that precedes it (previous batch or layer)."""
    res = simulate_run(
        tiny_spec("predictive_replication", lanes=True, replica_slots=1, predictor="last")
    )
    ops = res.schedule.ops
    copies = [o for o in ops if o.kind == OpKind.LOAD]
    assert copies
    for c in copies:
        gates = [ops[d] for d in c.deps if ops[d].kind == OpKind.GATE]
        assert gates and all(
            g.layer == c.layer and (g.batch, g.step) != (c.batch, c.step) for g in gates
        )


def test_prior_scenarios_of_the_wrong_shape(tmp_path):
    bad = tmp_path / "groups.npy"
    np.save(bad, np.ones((3, 2, 5)))  # tiny has 2 MoE layers of 4 experts
    with pytest.raises(
        ConfigError,
        match=r"prior_scenarios .*shape \(3, 2, 5\).*\[scenarios >= 1, 2 MoE layers, 4\]",
    ):
        simulate_run(tiny_spec("predictive_replication", prior_scenarios=str(bad)))
