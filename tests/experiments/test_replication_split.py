"""The replication experiment's ESFT splits: the validation split never touches the test
sequences, so params chosen on it are not fitted to the figures the targets are reported on."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from core.errors import MoepipeError
from core.hardware import HardwareSpec
from core.traces import load_esft
from experiments.common.ep_inputs import esft_split
from tests.conftest import NEEDS_TRACES, SHARED_TRACES


@NEEDS_TRACES
def test_unknown_split_is_one_clear_error():
    with pytest.raises(MoepipeError, match="split='dev' unknown; valid: test, validation"):
        esft_split(str(SHARED_TRACES), 0, "dev")


@pytest.mark.skipif(not SHARED_TRACES.exists(), reason="needs ../shared/traces")
def test_validation_and_its_training_exclude_the_test_sequences():
    tr = load_esft(str(SHARED_TRACES))
    residue = tr.seq_id % 5
    test_eval, test_train = esft_split(str(SHARED_TRACES), 0, "test")
    val_eval, val_train = esft_split(str(SHARED_TRACES), 0, "validation")
    assert len(test_eval) == (residue == 0).sum() and len(test_train) == (residue != 0).sum()
    assert len(val_eval) == (residue == 1).sum()
    assert len(val_train) == ((residue != 0) & (residue != 1)).sum()
    # the validation run and its training tables together are exactly the test split's training
    both = np.concatenate([val_eval, val_train])
    assert sorted(map(bytes, both)) == sorted(map(bytes, test_train))


def test_a_batch_larger_than_the_split_is_noted_with_the_largest_that_fits():
    from experiments.common.ep_notes import reuse_lines

    cases = {
        "esft-g8": dict(
            routing="esft_heldout",
            prompt_len=64,
            n_batches=8,
            batch_sizes=[8, 128],
            split_tokens=7197,
        ),
        "switch": dict(
            routing="synthetic_olmoe_top1", prompt_len=512, n_batches=8, batch_sizes=[128]
        ),
    }
    lines = reuse_lines(cases)
    assert len(lines) == 1  # bs=8 (4096 tokens in all) fits; synthetic cases never wrap
    assert "esft-g8 bs=128: 8 batches of 8192 tokens from a 7197-token held-out split" in lines[0]
    assert "9.1 times" in lines[0] and "largest batch without a repeat: bs=14" in lines[0]


def test_a_balanced_dispatch_report_says_so_first():
    """The default (even, the issue's split) adds nothing; dispatch=balanced heads the report
    with one line naming it, since its balancedness and target lines are not the issue's."""
    from experiments.common.ep_notes import dispatch_lines

    assert dispatch_lines("even") == []
    first = dispatch_lines("balanced")[0]
    assert first.startswith("dispatch=balanced: ") and "not split evenly" in first


def test_the_report_says_whether_collectives_took_sms():
    """Under the table, one note: the profile's comm_sms, or that collectives ran free."""
    from dataclasses import replace

    from experiments.common.ep_notes import hardware_lines
    from tests.conftest import ROOT

    hw = HardwareSpec.from_dict(
        yaml.safe_load((ROOT / "conf" / "hardware" / "h200-hgx8.yaml").read_text())
    )
    assert hardware_lines(hw) == [
        "[note] hardware h200-hgx8: a running all-to-all or all-reduce holds 20 of each GPU's 132 "
        "SMs from its compute (comm_sms; comm_sms=0 runs them free); replica copies none "
        "(copy_sms=0: the copy engines move them)"
    ]
    free = replace(hw, gpu=replace(hw.gpu, comm_sms=0, copy_sms=4))
    assert hardware_lines(free) == [
        "[note] hardware h200-hgx8: collectives take no SMs from the GPUs' compute (comm_sms=0); "
        "a replica copy holds 4 on each end (copy_sms: NCCL's p2p kernels)"
    ]


def test_plots_show_a_target_case_at_its_judged_batch():
    """esft-g8 is judged at its fresh bs=8 and plotted there, not at its largest (revisited)
    128; a case with no judged batch, or one whose judged batch did not run, at its largest."""
    from experiments.common.ep_rows import plotted_batches

    rows = [
        dict(case=c, batch_size=b)
        for c, b in (("esft-g8", 8), ("esft-g8", 128), ("switch", 1), ("switch", 128), ("g4", 32))
    ]
    assert plotted_batches(rows, {"esft-g8": 8, "g4": 24}) == {
        "esft-g8": 8,
        "g4": 32,
        "switch": 128,
    }


@pytest.mark.skipif(not SHARED_TRACES.exists(), reason="needs ../shared/traces")
def test_the_five_folds_partition_the_trace_and_train_on_the_other_four():
    tr = load_esft(str(SHARED_TRACES))
    residue = tr.seq_id % 5
    seen = 0
    for k, split in enumerate(["test", "fold1", "fold2", "fold3", "fold4"]):
        ev, train = esft_split(str(SHARED_TRACES), 0, split)
        assert len(ev) == (residue == k).sum() and len(train) == (residue != k).sum()
        seen += len(ev)
    assert seen == tr.n_tokens


@pytest.mark.skipif(not SHARED_TRACES.exists(), reason="needs ../shared/traces")
def test_group_loads_are_the_training_split_one_residue_each():
    """predictive's prior scenarios: one load matrix per training residue, summing to the
    training split's load (the test split's four, the validation split's three)."""
    from experiments.common.ep_inputs import esft_group_loads

    for split, groups in (("test", 4), ("validation", 3), ("fold2", 4)):
        loads = esft_group_loads(str(SHARED_TRACES), split)
        _, train = esft_split(str(SHARED_TRACES), 0, split)
        assert loads.shape == (groups, train.shape[1], 64)
        whole = np.stack(
            [np.bincount(train[:, m].ravel(), minlength=64) for m in range(train.shape[1])]
        )
        assert np.array_equal(loads.sum(0), whole)


def test_batch_balance_sums_layers_as_the_run_metric_does():
    """Batch 0: layers with mean/max 10/20 and 30/40 -> 40/60; batch 1: 5/5 -> 1."""
    import pandas as pd

    from experiments.common.ep_plots import batch_balance

    t = pd.DataFrame({"batch": [0, 0, 1], "mean_tokens": [10, 30, 5], "max_tokens": [20, 40, 5]})
    assert batch_balance(t).tolist() == pytest.approx([40 / 60, 1.0])


def test_the_target_corner_is_eplbs_balance_and_half_the_gap():
    """ep_static 10 ms, oracle 8 ms: half the gap closed is 9 ms; eplb's balancedness 0.9. No
    corner without the oracle, or where the oracle is not faster than ep_static."""
    from experiments.common.ep_plots import target_corner

    rows = [
        dict(planner="ep_static", makespan_s=0.010, balancedness=0.7),
        dict(planner="eplb", makespan_s=0.012, balancedness=0.9),
        dict(planner="oracle_replication", makespan_s=0.008, balancedness=0.95),
    ]
    assert target_corner(rows) == pytest.approx((0.9, 9.0))
    assert target_corner(rows[:2]) is None
    slow = [*rows[:2], dict(planner="oracle_replication", makespan_s=0.011, balancedness=0.95)]
    assert target_corner(slow) is None


@pytest.mark.skipif(not SHARED_TRACES.exists(), reason="needs ../shared/traces")
def test_task_labels_follow_the_evaluation_stream_and_the_task_loads_sum_to_the_training():
    """`esft_tasks` labels each evaluation token in `esft_split`'s order, and its per-task loads
    of the training split add up to the training load matrix eplb and predictive start from."""
    from experiments.common.ep_inputs import esft_routing, esft_tasks, load_matrix

    tr = load_esft(str(SHARED_TRACES))
    ids, train = esft_split(str(SHARED_TRACES), 0, "validation")
    tasks, per_task, names = esft_tasks(str(SHARED_TRACES), 0, "validation")
    assert names == tr.task_names and per_task.shape == (4, 26, 64) and tasks.shape == (len(ids),)
    np.testing.assert_array_equal(per_task.sum(0), load_matrix(train, 64))
    assert set(np.unique(tasks)) == {0, 1, 2, 3}

    def rows(a: np.ndarray) -> np.ndarray:  # each token's [26, 6] ids as one sortable item
        return np.sort(np.ascontiguousarray(a.reshape(len(a), -1)).view(f"V{a[0].nbytes}").ravel())

    for k in range(4):  # the tokens labelled k are exactly task k's validation tokens
        theirs = tr.expert_ids[(tr.task == k) & (tr.seq_id % 5 == 1)].astype(np.int16)
        np.testing.assert_array_equal(rows(ids[tasks == k]), rows(theirs))
    from core.spec import Workload

    wl = Workload(batch_size=2, n_batches=2, prompt_len=8, gen_len=1)
    r = esft_routing(ids, wl, "validation", tasks, names)
    np.testing.assert_array_equal(r.labels.ravel(), tasks[: 4 * 8])
