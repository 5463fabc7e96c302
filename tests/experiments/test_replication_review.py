"""Review of the replication report: plot colours and legends, one-line input errors, and
verdicts that agree with the figures they print."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.figure
import pytest

from core.errors import MoepipeError
from experiments.common.ep_inputs import olmoe_counts
from experiments.common.ep_plots import plot
from experiments.common.ep_rows import gap_line, targets

LABELS = [
    "ep_static",
    "eplb",
    "predictive_replication",
    "oracle_replication",
    *(f"oracle_replication[truth={k}]" for k in range(8)),
]


def _row(case: str, label: str, i: int) -> dict:
    planner = label.split("[")[0]
    return dict(
        case=case,
        run_dir=f"{case}/bs32/{label}",
        batch_size=32,
        planner=label if "[" in label else planner,
        planner_label=label,
        n_batches=3,
        prompt_len=64,
        makespan_s=0.01 + i * 1e-4,
        balancedness=0.9,
        balancedness_per_layer={1: 0.9, 2: 0.8},
        expert_phase_util_per_layer={1: 0.9, 2: 0.8},
    )


def test_every_panel_names_its_lines_and_no_two_planners_share_a_colour(tmp_path, monkeypatch):
    """A case with 12 rows (as esft-g8-b32 has) beside one with 4: the default colour cycle
    repeats after 10 and the first panel's legend named only its 4."""
    rows = [_row("a", lab, i) for i, lab in enumerate(LABELS[:4])]
    rows += [_row("b", lab, i) for i, lab in enumerate(LABELS)]
    figs = []
    monkeypatch.setattr(
        matplotlib.figure.Figure, "savefig", lambda self, *a, **k: figs.append(self)
    )
    plot(rows, tmp_path, tmp_path)
    per_layer = figs[0]
    panel_b = per_layer.axes[1]
    colours = {ln.get_label(): matplotlib.colors.to_hex(ln.get_color()) for ln in panel_b.lines}
    assert len(set(colours.values())) == len(LABELS)  # one colour each
    panel_a = per_layer.axes[0]
    assert all(
        colours[ln.get_label()] == matplotlib.colors.to_hex(ln.get_color()) for ln in panel_a.lines
    )  # the same colour in every panel
    legend = panel_b.get_legend()
    assert legend is not None and {t.get_text() for t in legend.get_texts()} == set(LABELS)


def test_a_missing_olmoe_aggregate_is_one_line(tmp_path):
    (tmp_path / "olmoe-aggregates").mkdir()
    with pytest.raises(MoepipeError, match="olmoe_mixtral_counts.npz"):
        olmoe_counts(str(tmp_path))


def test_a_verdict_never_contradicts_its_rounded_figure():
    st, orc = {"makespan_s": 0.010}, {"makespan_s": 0.008}
    line = gap_line("c", 8, st, {"makespan_s": 0.010 - 0.4975 * 0.002}, orc)
    assert line.startswith("[FAIL]") and "closes 50%" not in line and "49.75%" in line
    rows = [
        dict(
            case="c",
            batch_size=8,
            planner=p,
            balancedness=b,
            makespan_s=ms,
            expert_phase_util=1.0,
            utilisation=1.0,
            gpu_load=1.0,
        )
        for p, b, ms in (
            ("ep_static", 0.7, 0.01),
            ("eplb", 0.94774, 0.009),
            ("oracle_replication", 0.96, 0.008),
            ("predictive_replication", 0.94771, 0.0085),
        )
    ]
    bal = next(ln for ln in targets(rows, ["c"]) if "balancedness" in ln)
    assert bal.startswith("[FAIL]") and "0.94771 < eplb 0.94774" in bal
    # closer still: as many decimals as set them apart, and a share a hair under half
    rows[3]["balancedness"] = 0.94774 - 3e-9
    bal = next(ln for ln in targets(rows, ["c"]) if "balancedness" in ln)
    assert bal.startswith("[FAIL]") and "0.947739997 < eplb 0.947740000" in bal
    line = gap_line("c", 8, st, {"makespan_s": 0.010 - 0.499999 * 0.002}, orc)
    assert line.startswith("[FAIL]") and "closes 49.99%" in line
