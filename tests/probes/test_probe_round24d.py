"""Round 24d of issue 48: are the printed numbers true? Each number an analysis command prints
or writes, recomputed from the files it reads (trace.parquet, summary.json, config.yaml).
Classes found:

- a ranking decided by rounding noise: lines of equal throughput (the same times summed in
  another order, 1e-16 apart) were ranked 1, 2, 3, the first named the winner alone and
  credited with none of the points ("fastest at 0 of the 2 points"), and a line's "best point"
  was the batch size its last bits favoured; ties now share a rank and are named as ties;
- a fixed number of decimals that rounds a number to nothing: a tiny run's makespan (10 us,
  0.4 ms) printed `0.00 s` by the run's line, the compare table, and report's ranked table,
  and a replication table's milliseconds alike, validate's line and validate.md (its 0.6 ms
  simulated makespan 0.001 s, its per-op milliseconds 0.000, its 0.28 MB CPU "0 MB") and every
  markdown table of the commands: such a number now keeps 3 significant digits;
- a number rounded twice: reproduce_klotski's Fig. 14 table rounded each tok/s to 2 decimals
  and printed 3 (1.876 as 1.880: 17 of its 20 cells, and 9.446 beside the vs-FlexGen table's
  9.446 for the same run as 9.450); validate_lanes' markdown rounded to 4, then to 3;
- one name, two quantities: replication's table and throughput.png said `tok/s` of prompt
  tokens (21625 for an esft-g8 run) where report and collect say tok/s of generated tokens for
  the same run (2703): they say prompt tokens now;
- a share, an error or an efficiency rounded onto a bound it does not reach: the main job's
  flexgen bubble, 99.53% of it waiting on expert loads and 0.47% on the KV cache, read
  `load expert@h2d 100%` (all of it), validate_lanes' errors of -99.98% read -100% (a
  prediction of nothing), an efficiency of 0.9996 read 1.000; each keeps the digits that set it
  off its bound now (`core.shown.short_of`): 99.5%, -99.98%, 0.9996. So does a ratio at 1
  (report's `1.00x` for a leader 0.02% faster, which reads as a tie) or at its target
  (reproduce_klotski's `1.100x ... [FAIL]` against `<= 1.10x`).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pandas as pd
import pytest

from core.types import Tier
from experiments.common.ranking import answer, ranking, short_table
from experiments.common.report_page import _answer_html
from experiments.common.tables import markdown

# two throughputs of one schedule's times, summed in two orders (the tiny sweep's flexgen and
# fiddler): equal but for the last bits
EQUAL = (1157293.1068536448, 1157293.1068536434)


def runs(*rows: tuple[str, int, float]) -> pd.DataFrame:
    """A collected sweep of tiny runs: (system, batch size, tok/s) each."""
    out: list[dict[str, Any]] = []
    for system, batch, tok_s in rows:
        tokens = batch * 2 * 3
        out.append(
            {
                "system": system,
                "model.name": "tiny",
                "hardware.name": "tiny",
                "workload.batch_size": batch,
                "workload.n_batches": 2,
                "workload.prompt_len": 8,
                "workload.gen_len": 3,
                "n_batches": 2,
                "throughput_tok_s": tok_s,
                "makespan_s": tokens / tok_s,
                "gpu_bubble_frac": 0.0,
                "efficiency": 1.0,
                "dag_efficiency": 1.0,
                "status": "ok",
            }
        )
    return pd.DataFrame(out)


def test_equal_throughputs_tie_in_the_ranking_not_by_their_rounding() -> None:
    """Two systems equal to 1e-15 at both batch sizes, a third half as fast: the two share
    rank 1, each is fastest (tied) at both points, and the answer names the tie."""
    hi, lo = EQUAL
    (key, t), = ranking(
        runs(("zeta", 2, lo), ("zeta", 4, hi), ("alpha", 2, hi), ("alpha", 4, lo),
             ("mid", 2, hi / 2), ("mid", 4, hi / 2))
    )  # fmt: skip
    assert t["planner"].tolist() == ["alpha", "zeta", "mid"]
    assert t["rank"].tolist() == [1, 1, 3]
    assert t["wins"].tolist() == [2, 2, 0]
    text = answer(key, t)
    assert text.startswith("alpha and zeta tie for the highest throughput on tiny / tiny")
    assert "2.00x mid" in text and "x zeta" not in text
    # each line's best point: the first of its two equal ones, said to be tied
    assert "zeta at batch 2, n 2, tied at 1 other point" in text


def test_a_faster_line_still_wins_alone() -> None:
    """1% apart is no tie: one winner, its ratio over the other, its wins counted."""
    ((key, t),) = ranking(runs(("a", 2, 101.0), ("b", 2, 100.0), ("a", 4, 99.0), ("b", 4, 100.0)))
    assert t["rank"].tolist() == [1, 2] and t["wins"].tolist() == [1, 1]
    assert answer(key, t).startswith("a has the highest throughput on tiny / tiny, 101.00 tok/s")


def test_a_makespan_of_microseconds_is_not_printed_as_zero() -> None:
    """12 tokens at 1157293 tok/s take 1.04e-05 s: the compare table and the report's ranked
    table print that, not 0.00; a number of 1 or more keeps its 2 decimals (README's table)."""
    d = runs(("a", 2, EQUAL[0]), ("b", 2, 29987.33))
    table = short_table(d)
    assert " 1.04e-05 " in table and " 0.0004 " in table and " 0.00 " not in table
    page = "".join(_answer_html(d))
    assert "<td>1.04e-05</td>" in page and "<td>0.00</td>" not in page
    from experiments.common.tables import fixed  # new with the fix

    assert [fixed(256.6), fixed(0.5), fixed(0.0), fixed(1.0)] == ["256.60", "0.5", "0.00", "1.00"]


def test_validate_prints_a_makespan_under_a_millisecond_to_its_digits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tiny checkpoint's simulated makespan of 0.000595 s: validate's line and validate.md
    print it (and a 0.28 MB CPU), not 0.001 s and 0 MB; a markdown table's 0.083 us op too."""
    from experiments import validate

    row = {
        "planner": "klotski",
        "sim_makespan_s": 0.000595,
        "real_makespan_s": 0.0296,
        "err_makespan_s": 0.000595 / 0.0296 - 1,
        "err_gpu_bubble_s": -0.71,
        "real_makespan_over_lb": 1.07,
        "real_makespan_over_dag_lb": 1.07,
        "sim_bubble_waits_on": "-",
        "real_bubble_waits_on": "-",
        "bubble_causes_tv": 0.5,
        "real_runs": 1,
        "real_makespan_min_s": 0.0296,
        "real_makespan_max_s": 0.0296,
        "compute-expert_sim_ms": 0.000083,
    }
    validate._print_row("klotski", row, {}, False, False, 92)
    assert "makespan sim 0.000595 s real 0.0296 s (-98.0%)" in capsys.readouterr().out
    model = SimpleNamespace(name="ck", total_bytes=562_000)
    hw = SimpleNamespace(name="tiny", memory_bytes={Tier.GPU: 844_000, Tier.CPU: 281_000})
    setup = SimpleNamespace(model=model, hw=hw, out=tmp_path)
    validate._write_tables(setup, [row])  # type: ignore[arg-type]
    md = (tmp_path / "validate.md").read_text()
    assert md.startswith("# sim vs real: ck (0.562 MB), hardware tiny, GPU 0.844 MB, CPU 0.281 MB")
    assert "| 0.000595 | 0.0296 |" in md and "| 8.3e-05 |" in md
    assert markdown(pd.DataFrame({"tok/s": [30.43]})).endswith("| 30.430 |")


def test_reproduce_klotskis_fig14_prints_each_throughput_once_rounded() -> None:
    """Fig. 14's cells have the third decimal of their own value, as the vs-FlexGen table's."""
    from experiments.reproduce_klotski import report

    df = pd.DataFrame(
        {"table": "fig14", "planner": "klotski", "n": [1, 1], "batch_size": [4, 8]}
    ).assign(gen_len=2, throughput_tok_s=[1.0497, 1.8763])
    assert "| 1 | 1.050 | 1.876 |" in report(df)


def test_replications_tok_s_says_it_counts_prompt_tokens() -> None:
    """An esft-g8 run of 2 batches of 8 sequences of 8 prompt tokens in 5.92 ms: 21622 prompt
    tokens/s, under a header that says so (its throughput_tok_s, of 16 generated tokens, is
    2703)."""
    from experiments.common.ep_rows import table

    row = {
        "case": "esft-g8",
        "batch_size": 8,
        "n_batches": 2,
        "prompt_len": 8,
        "planner_label": "ep_static",
        "makespan_s": 0.00592,
        "balancedness": 0.67,
        "utilisation": 0.93,
        "expert_phase_util": 0.95,
        "plan": {"ep": {"copies": 0}},
    }
    head, _, line = table([row]).splitlines()
    assert head.split()[4] == "prompt_tok/s" and line.split()[4] == "21622"


def test_a_share_or_error_is_not_rounded_onto_its_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The main job's flexgen bubble: 99.53% on expert loads is not `100%`; an exact 100% still
    is. An efficiency of 0.9996 and a bubble of 99.996% keep their digits; validate's error
    of -99.98% is not -100%."""
    from core.bubbles import top_cause
    from experiments import validate
    from experiments.common.ranking import causes_text

    flexgen = {"load expert@h2d": 0.99531, "kv-load@h2d": 0.00469}
    assert top_cause(flexgen) == "load expert@h2d 99.5%"
    assert top_cause({"load expert@h2d": 2.0}) == "load expert@h2d 100%"
    assert causes_text(pd.Series(flexgen)) == "load expert@h2d 99.5%"
    d = runs(("a", 2, 100.0)).assign(efficiency=0.9996, gpu_bubble_frac=0.99996)
    line = short_table(d).splitlines()[1]
    assert " 99.996 0.9996  1.000 " in line  # dag_efficiency is 1: it reads 1.000
    row = {"err_makespan_s": -0.9998, "err_gpu_bubble_s": 0.0004, "real_makespan_over_lb": 1.0}
    row |= {"real_makespan_over_dag_lb": 1.0, "bubble_causes_tv": 0.0, "real_runs": 1}
    row |= {k: "-" for k in ("sim_bubble_waits_on", "real_bubble_waits_on")}
    row |= {k: 0.1 for k in ("sim_makespan_s", "real_makespan_s")}
    validate._print_row("a", row | {"real_makespan_min_s": 0.1, "real_makespan_max_s": 0.1}, {},
                        False, False, 1)  # fmt: skip
    assert "(-99.98%), bubble +0.04%" in capsys.readouterr().out


def test_a_ratio_reads_as_its_bound_only_where_it_is() -> None:
    """A leader 0.02% faster is 1.0002x, not 1.00x (a tie); Klotski at 1.1004x its bound
    fails a target of <= 1.10x and says 1.1004x, not 1.100x."""
    from experiments.reproduce_klotski import targets

    ((key, t),) = ranking(runs(("a", 2, 100.02), ("b", 2, 100.0)))
    assert "1.0002x b (100.00)" in answer(key, t)
    auto_n = {"table": "auto_n", "model": "m", "hardware": "h", "n": 61, "efficiency": 0.9}
    (line,) = targets(pd.DataFrame([auto_n | {"dag_efficiency": 1 / 1.1004}]))
    assert line.startswith("[FAIL]") and "takes 1.1004x the schedule's lower bound" in line
