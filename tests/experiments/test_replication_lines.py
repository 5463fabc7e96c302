"""experiments.replication's verdict and note lines, and its cases (own kernels, variants and
planner params, training files), on hand-made rows and tiny runs."""

from pathlib import Path

import pandas as pd
import pytest
import yaml

from core.hardware import HardwareSpec
from core.types import OpKind, Resource
from experiments.common.ep_rows import gap_line, utilisation_lines


def test_gap_line_says_in_words_when_the_oracle_is_not_faster():
    st, pr, orc = ({"makespan_s": s} for s in (0.010, 0.009, 0.011))
    line = gap_line("c", 8, st, pr, orc)
    assert "nan" not in line and "no gap to close" in line and "predictive is faster" in line
    assert "closes 50%" in gap_line("c", 8, st, {"makespan_s": 0.0095}, {"makespan_s": 0.009})


def test_gap_line_does_not_judge_a_gap_within_noise():
    """An oracle 0.3% faster than ep_static (esft-g8 bs=8: 24.42 vs 24.34 ms) is no gap to
    close: [n/a ], not a PASS for closing 100% of it; 1% and up is judged."""
    st, orc = {"makespan_s": 0.02442}, {"makespan_s": 0.02434}
    line = gap_line("c", 8, st, dict(orc), orc)
    assert line.startswith("[n/a ]") and "0.33%" in line and "PASS" not in line
    assert gap_line("c", 8, st, dict(orc), orc, verdict=False).startswith("[note]")
    wide = {"makespan_s": 0.985 * 0.02442}
    assert gap_line("c", 8, st, dict(wide), wide).startswith("[PASS]")


def test_sharing_lines_compare_shared_lanes_with_partitioned_ones():
    from experiments.common.ep_notes import sharing_lines

    def row(case, planner, ms, phase, sharing):
        return dict(
            case=case,
            planner=planner,
            model="m",
            batch_size=8,
            n_devices=2,
            makespan_s=ms / 1e3,
            expert_phase_util=phase,
            plan={"ep": {"lanes": True, "lane_sharing": sharing, "grouped_gemm": True}},
        )

    rows = [
        row("p", "ep_static", 10, 0.5, "partition"),
        row("p", "predictive_replication", 8, 0.9, "partition"),
        row("s", "ep_static", 6, 0.95, "shared"),
        row("s", "predictive_replication", 6, 0.95, "shared"),
    ]
    assert sharing_lines(rows) == [
        "[note] s bs=8: lanes sharing the SMs: ep_static 6.00 ms (phase 0.950), predictive 6.00 ms "
        "(phase 0.950), gain 0.0%; partitioned (p): ep_static 10.00 ms (phase 0.500), predictive "
        "8.00 ms (phase 0.900), gain 20.0%"
    ]


def test_loop_lines_set_one_lane_beside_g_lanes():
    from experiments.common.ep_notes import loop_lines

    def row(planner, n, util, ms, label=None):
        return dict(
            case="c",
            batch_size=16,
            planner=planner,
            planner_label=label or planner,
            n_devices=n,
            utilisation=util,
            gpu_load=util + 0.1,
            makespan_s=ms / 1e3,
            plan={"ep": {"lanes": True, "n_devices": n}},
        )

    rows = [
        row("ep_static", 8, 0.7, 50),
        row("predictive_replication", 8, 0.75, 40),
        row("ep_static[1 lane]", 1, 0.15, 200),
    ]
    assert loop_lines(rows) == [
        "[note] c bs=16: one lane (ep_static[1 lane]) -> 8 lanes (ep_static) -> with replicas "
        "(predictive): utilisation 0.150 -> 0.700 -> 0.750, GPU load 0.250 -> 0.800 -> 0.850, "
        "makespan 200.00 -> 50.00 -> 40.00 ms (5.00x)"
    ]
    assert loop_lines(rows[:2]) == []


def test_eplb_lines_set_predictive_beside_eplb_at_each_interval():
    from experiments.common.ep_notes import eplb_lines

    def row(planner, bal, ms, copies, interval=None, bs=128, case="c"):
        plan = {"ep": {"copies": copies}, **({"eplb": {"interval": interval}} if interval else {})}
        return dict(
            case=case,
            batch_size=bs,
            n_batches=8,
            planner=planner,
            balancedness=bal,
            makespan_s=ms / 1e3,
            plan=plan,
        )

    rows = [
        row("eplb[interval=8]", 0.95, 64.0, 0, 8),
        row("eplb", 0.97, 68.0, 4000, 2),
        row("predictive_replication", 0.97, 65.0, 1200),
        row("eplb", 0.5, 9.0, 9, 2, bs=8),
        row("ep_static", 0.8, 74.0, 0),
    ]
    assert eplb_lines(rows, ["c", "absent"]) == [
        "[note] c bs=128: eplb re-placing every 2 batches 0.9700 / 68.00 ms / 4000 copies, never "
        "in 8 batches 0.9500 / 64.00 ms / 0 copies; predictive 0.9700 / 65.00 ms / 1200 copies: at "
        "least as balanced as eplb's most balanced, slower than its fastest"
    ]
    rows[2].update(balancedness=0.96, makespan_s=0.063)
    assert eplb_lines(rows, ["c"])[0].endswith(
        "less balanced than eplb's most balanced, at least as fast as its fastest"
    )
    assert eplb_lines(rows[1:], ["c"]) == []  # eplb at one interval only
    rows.append(row("oracle_replication", 0.99, 64.0, 900))  # with the oracle: the gap each closes
    line = eplb_lines(rows, ["c"])[0]
    assert "8 batches 0.9500 / 64.00 ms / 0 copies, closes 100% of the gap" in line
    assert "every 2 batches 0.9700 / 68.00 ms / 4000 copies, closes 60% of the gap" in line
    rows[-1].update(makespan_s=0.07395)  # a gap of 0.05 ms: no shares, its size instead
    line = eplb_lines(rows, ["c"])[0]
    assert "closes" not in line and line.endswith(
        "(the ep_static -> oracle gap is 0.05 ms, under 1%)"
    )


def test_prediction_lines_order_the_planners_by_their_distance_from_the_truth():
    from experiments.common.ep_notes import prediction_lines

    def row(planner, tv, bal, ms, bs=32):
        return dict(
            case="c",
            batch_size=bs,
            planner=planner,
            balancedness=bal,
            makespan_s=ms / 1e3,
            plan={"ep": {} if tv is None else {"prediction_tv": tv}},
        )

    rows = [
        row("ep_static", None, 0.77, 10.83),
        row("eplb", None, 0.912, 15.33),
        row("oracle_replication", 0.0, 0.936, 10.19),
        row("predictive_replication", 0.082, 0.8975, 10.28),
        row("oracle_replication[truth=0.5]", 0.037, 0.911, 10.23),
        row("predictive_replication", 0.5, 0.5, 99.0, bs=8),
    ]
    assert prediction_lines(rows, ["c", "absent"], {"c": 32}) == [
        "[note] c bs=32: distance of the load planned from to each batch's (mean total variation) "
        "-> balancedness / makespan: predictive_replication 0.082 -> 0.8975 / 10.28 ms; "
        "oracle_replication[truth=0.5] 0.037 -> 0.9110 / 10.23 ms; oracle_replication 0.000 -> "
        "0.9360 / 10.19 ms; eplb 0.9120 / 15.33 ms"
    ]
    assert prediction_lines(rows, ["c"], {})[0].startswith("[note] c bs=32:")  # else the largest
    assert prediction_lines(rows[2:], ["c"], {"c": 32}) == []  # no eplb to set them beside


def test_targets_are_judged_where_no_held_out_token_runs_twice():
    """A 1,000-token split and 8 batches of 4-token sequences: bs=16 (512 tokens) is fresh, bs=64
    wraps. The verdicts are at 16; 64 is a note that says it revisits; without a fresh batch the
    verdicts are at the largest and say so."""
    from experiments.common.ep_rows import fresh_batch, targets

    case = dict(prompt_len=4, n_batches=8, batch_sizes=[1, 16, 64])
    assert fresh_batch(case, 1000) == 16 and fresh_batch(case, 10) is None

    def row(planner, bs, bal, ms):
        return dict(
            case="c",
            batch_size=bs,
            planner=planner,
            balancedness=bal,
            makespan_s=ms,
            expert_phase_util=1.0,
            utilisation=1.0,
            gpu_load=1.0,
        )

    rows = [
        row(p, bs, bal + (0.1 if bs == 64 else 0), ms)
        for bs in (16, 64)
        for p, bal, ms in (
            ("ep_static", 0.7, 10.0),
            ("eplb", 0.9, 9.0),
            ("oracle_replication", 0.95, 8.0),
            ("predictive_replication", 0.85 if bs == 16 else 0.95, 9.5),
        )
    ]
    lines = [ln for ln in targets(rows, ["c"], fresh={"c": 16}) if ln[7:].startswith("c bs=")]
    assert lines[:2] == [
        "[FAIL] c bs=16: predictive balancedness 0.8500 < eplb 0.9000",
        "[FAIL] c bs=16: predictive closes 25% of the ep_static -> oracle makespan gap "
        "(ep_static 10000.00 ms, oracle 8000.00 ms, predictive 9500.00 ms); target >= 50%",
    ]
    assert lines[2] == (
        "[note] c bs=64 (revisits held-out tokens): predictive balancedness 1.0500 >= eplb 1.0000"
    )
    assert lines[3].startswith("[note] c bs=64 (revisits held-out tokens): predictive closes 25%")
    assert len(lines) == 4
    wrapped = [ln for ln in targets(rows, ["c"], fresh={"c": None}) if ln[7:].startswith("c bs=")]
    assert wrapped[0].startswith("[PASS] c bs=64 (revisits held-out tokens): predictive")
    assert len(wrapped) == 2
    # a case not held-out ESFT (absent from `fresh`): judged at its largest, nothing revisited
    other = [ln for ln in targets(rows, ["c"], fresh={}) if ln[7:].startswith("c bs=")]
    assert other[0].startswith("[PASS] c bs=64: predictive") and len(other) == 2


def test_utilisation_lines_judge_where_ep_static_is_low_and_name_the_bound():
    def row(case, bs, planner, util):
        """A run whose GPUs idle 1 - util of its 1 s, on 5 causes (the line names 4)."""
        idle = 1 - util
        causes = {
            "compute-attention@gpu": 0.4 * idle,
            "compute-gate@gpu": 0.3 * idle,
            "compute-expert@gpu": 0.2 * idle,
            "launch": 0.06 * idle,
            "host": 0.04 * idle,
        }
        return dict(
            case=case,
            batch_size=bs,
            planner=planner,
            utilisation=util,
            makespan_s=1.0,
            gpu_idle_causes_s=causes,
        )

    rows = [
        row("a", 128, "ep_static", 0.5),
        row("a", 128, "eplb", 0.8),
        row("a", 128, "predictive_replication", 0.95),
        row("a", 128, "oracle_replication", 0.97),
        row("a", 1, "ep_static", 0.44),
        row("a", 1, "predictive_replication", 0.45),
        row("a", 1, "oracle_replication", 0.45),
        row("b", 128, "ep_static", 0.7),
    ]
    assert utilisation_lines(rows, "utilisation", "util") == [
        "[PASS] a bs=128: util ep_static 0.500 < 0.6 -> "
        "predictive_replication 0.950 (target >= 0.9)",
        "[FAIL] a bs=1: util ep_static 0.440 < 0.6 -> predictive_replication 0.450 (target >= 0.9; "
        "the oracle upper bound reaches 0.450)",
        # what the best planner's GPUs waited for, 55% of the run in all (core.bubbles)
        "       predictive_replication's GPUs computed nothing 55.0% of the run, waiting on "
        "compute-attention@gpu 22.0%, compute-gate@gpu 16.5%, compute-expert@gpu 11.0%, "
        "launch 3.3%, other 2.2%",
    ]
    assert utilisation_lines(rows[-1:], "utilisation", "util") == [
        "[n/a ] util: no case has ep_static below 0.6 (lowest 0.700, b bs=128)"
    ]
    # a variant counts as what it varies: an ep_static variant is no replication planner
    more = [
        {**row("a", 1, "ep_static[1 lane]", 0.99), "variant_of": "ep_static"},
        {**row("a", 1, "eplb[interval=8]", 0.47), "variant_of": "eplb"},
    ]
    assert utilisation_lines(rows + more, "utilisation", "util")[1].startswith(
        "[FAIL] a bs=1: util ep_static 0.440 < 0.6 -> eplb[interval=8] 0.470"
    )
    for ep, setting in (
        ({"n_devices": 8, "lanes": False}, "8 GPUs"),
        ({"n_devices": 8, "lanes": True}, "8 lanes of one GPU, each 1/G of its SMs"),
        (
            {"n_devices": 4, "lanes": True, "lane_sharing": "shared"},
            "4 lanes of one GPU, sharing its SMs",
        ),
    ):
        marked = [dict(r, plan={"ep": ep}) for r in rows[:4]]
        assert utilisation_lines(marked, "utilisation", "util")[0].startswith(
            f"[PASS] a bs=128 ({setting}): util"
        )


def test_work_conserving_estimate_by_hand():
    """Lanes of half a 1 TFLOPS GPU, 1 ms per-op overhead. One expert phase: lane 0 runs 3
    GFLOP (6 + 1 = 7 ms at its half), lane 1 1 GFLOP (3 ms); then 2 ms of dense work: makespan
    9 ms. Work-conserving, the phase needs its 4 ms of work on the whole GPU plus one overhead
    (5 ms; lane 0 alone at the whole GPU would need 3 + 1): 2 ms less, 7 ms. The note compares
    the gains; off lanes there is no estimate."""
    from core.ep_layout import EPLayout
    from core.schedule import ScheduleBuilder
    from experiments.common.ep_inputs import work_conserving_s
    from experiments.common.ep_notes import work_conserving_lines
    from experiments.common.pipeline import RunResult

    raw = yaml.safe_load(Path("conf/hardware/tiny.yaml").read_text())
    raw["gpu"]["overhead_us"] = 1000
    hw = HardwareSpec.from_dict(raw)
    b = ScheduleBuilder(hw.memory_bytes)
    for d in (0, 1):
        b.stream(f"lane{d}", Resource.GPU, d, 0.5)
    b.stream("compute", Resource.GPU)
    for d, flops in ((0, 3e9), (1, 1e9)):
        b.add(OpKind.EXPERT, f"lane{d}", flops=flops, step=0, layer=1, batch=0)
    b.add(OpKind.ATTENTION, "compute", (0, 1), step=0, layer=2, batch=0)
    b.ep = EPLayout(n_devices=2, lanes=True, lane_share=0.5, dense=None)
    trace = pd.DataFrame(
        {
            "op_id": [0, 1, 2],
            "kind": [str(OpKind.EXPERT)] * 2 + [str(OpKind.ATTENTION)],
            "stream": ["lane0", "lane1", "compute"],
            "step": [0] * 3,
            "layer": [1, 1, 2],
            "batch": [0] * 3,
            "start_s": [0.0, 0.0, 0.007],
            "end_s": [0.007, 0.003, 0.009],
        }
    )
    result = RunResult(b.build(), trace, {})
    assert work_conserving_s(result, hw) == pytest.approx(0.007)
    b.ep = EPLayout(n_devices=2, lanes=False)
    assert work_conserving_s(RunResult(b.build(), trace, {}), hw) is None
    rows = [
        dict(
            case="s",
            batch_size=8,
            planner="ep_static",
            n_devices=2,
            makespan_s=0.009,
            wc_makespan_s=0.007,
        ),
        dict(
            case="s",
            batch_size=8,
            planner="predictive_replication",
            n_devices=2,
            makespan_s=0.0075,
            wc_makespan_s=0.0065,
        ),
    ]
    assert work_conserving_lines(rows) == [
        "[note] s bs=8 (lanes): each lane's kernels run on 1/2 of the SMs; if they could use the "
        "SMs idle lanes leave (work-conserving), ep_static would take about 7.00 ms, not 9.00, "
        "and predictive 6.50, not 7.50: replication's gain 16.7% -> 7.1%"
    ]
