"""Reports over sweeps: every <img> exists and decodes, the page names the winner, lines keep
other swept axes apart, a failed report keeps the earlier one, bad requests are one line. Most
read the tiny compare sweep shared with test_sweep.py (tests/experiments/conftest.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from PIL import Image

from experiments.common.tables import collect
from experiments.report import main as report_main
from tests.experiments.conftest import SERIAL, TINY


def test_report_lines_keep_the_other_swept_axes_apart() -> None:
    """Throughput against n over a sweep of n and batch size: one line per batch size, not
    their mean (before, Klotski at bs 4 and 16 was drawn as one line of their averages)."""
    from experiments.common.ranking import line_groups

    df = pd.DataFrame(
        {
            "system": ["klotski_at_n"] * 4,
            "n_batches": [2, 6, 2, 6],
            "workload.batch_size": [4, 4, 16, 16],
            "throughput_tok_s": [1.8, 4.6, 5.7, 8.3],
        }
    )
    lines = line_groups(df, "n_batches")
    assert [label for label, _ in lines] == ["klotski_at_n, bs 4", "klotski_at_n, bs 16"]
    assert lines[1][1]["throughput_tok_s"].tolist() == [5.7, 8.3]
    assert len(line_groups(df, "n_batches", "workload.batch_size")) == 1
    # runs of one point that differ in another override (sub-dirs of its dir): lines of their own
    df2 = df.assign(run_dir=["p/a=1", "p/a=1", "p/a=2", "p/a=2"], **{"workload.batch_size": 4})
    assert [label for label, _ in line_groups(df2, "n_batches")] == [
        "klotski_at_n, a=1",
        "klotski_at_n, a=2",
    ]


def test_report_lines_average_only_repeats_of_one_config() -> None:
    """Runs that differ in a planner param or the executor are lines of their own (FlexGen with
    sync on and off was drawn as one line of their means, and a real run averaged with the
    sim's); other seeds of one config are repeats, averaged; Klotski's own n (an output, one
    per batch size) does not split its line against batch size."""
    from experiments.common.ranking import line_groups

    df = pd.DataFrame(
        {
            "system": ["flexgen"] * 4 + ["klotski"] * 2,
            "workload.batch_size": [8, 16, 8, 16, 8, 16],
            "n_batches": [15, 15, 15, 15, 63, 61],
            "workload.n_batches": [15] * 4 + [-1, -1],
            "planner.params.sync": [True, True, False, False, None, None],
            "workload.seed": [0, 1, 0, 1, 0, 0],
            "executor.name": ["sim"] * 6,
            "throughput_tok_s": [6.7, 8.25, 7.9, 9.2, 30.0, 31.0],
        }
    )
    lines = line_groups(df, "workload.batch_size")
    assert [label for label, _ in lines] == ["flexgen, sync False", "flexgen, sync True", "klotski"]
    assert lines[1][1]["throughput_tok_s"].tolist() == [6.7, 8.25]
    real = df.assign(
        **{
            "executor.name": ["sim", "sim", "real", "real", "sim", "sim"],
            "executor.device": [None, None, "cpu", "cpu", None, None],
        }
    )
    assert [label for label, _ in line_groups(real, "workload.batch_size")][:2] == [
        "flexgen, real, sync False",  # its runs' sync differs from the sim's too: named
        "flexgen, sim, sync True",
    ]  # executor.device says no more than the executor
    seeds = df.assign(**{"planner.params.sync": True})
    # repeats: one line
    assert [len(g) for _, g in line_groups(seeds, "workload.batch_size")] == [4, 2]


def images_of(page: Path) -> list[Path]:
    return [page.parent / src for src in re.findall(r"<img src='([^']+)'", page.read_text())]


def test_report_images_exist_and_decode(swept: Path) -> None:
    """The report the sweep wrote at its end (`report_main`'s own: the tests below)."""
    imgs = images_of(swept / "report" / "index.html")
    assert any(p.name == "throughput_vs_batch.png" for p in imgs) and any(
        p.name == "gantt.png" for p in imgs
    )
    for p in imgs:
        with Image.open(p) as im:
            im.load()
            assert im.size[0] > 100 and im.size[1] > 100


def test_a_report_that_fails_leaves_the_earlier_one_whole(swept: Path, tmp_path: Path) -> None:
    """The report is written into a folder of its own and moved in whole: one that fails at a
    run's trace (after the first figures) leaves an earlier report's files as they were, and
    where there was none, no folder. Before, the first figures were left, or overwritten beside
    the old page."""
    mine = tmp_path / "sweep"
    shutil.copytree(swept, mine)
    out = mine / "report"  # the sweep's own, written at its end
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "index.html" in before and any(name.endswith(".png") for name in before)
    for trace in mine.rglob("trace.parquet"):  # (the gantt figure reads one run's)
        trace.write_bytes(b"not parquet")
    assert report_main([f"dir={mine}", f"out={out}"]) == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert report_main([f"dir={mine}", f"out={tmp_path / 'new'}"]) == 2
    assert not (tmp_path / "new").exists()


def test_report_draws_what_the_bubbles_waited_for(swept: Path, tmp_path: Path) -> None:
    """The tiny sweep's GPUs never idle (no causes: no figure, a note says why); given causes
    (collect's IDLE.<cause> columns, seconds), one bar a run, and the table names the main one."""
    from experiments.common.figures import fig_idle_causes
    from experiments.common.ranking import IDLE, short_table

    df, _ = collect(swept)
    assert not fig_idle_causes(df, tmp_path / "none.png")
    ms = df["makespan_s"]
    df[f"{IDLE}.load_expert@disk"], df[f"{IDLE}.late@gpu"] = 0.3 * ms, 0.1 * ms
    assert fig_idle_causes(df, tmp_path / "idle.png")
    with Image.open(tmp_path / "idle.png") as im:
        assert im.size[0] > 100 and im.size[1] > 100
    assert short_table(df).count("load expert@disk 75%") == len(df)


def test_report_names_the_winner_and_its_margin_above_the_first_figure(
    swept: Path, tmp_path: Path
) -> None:
    """The page answers first: before any figure it names the system with the highest
    throughput (each system at its best batch size), its ratio over each other system, and what
    its GPU bubble waits on; the ranked table and the runs table list the fastest first."""
    from experiments.common.ranking import IDLE
    from experiments.common.report_page import write_report

    df, _ = collect(swept)
    # the tiny runs fit the GPU: both systems run the same times, a tie; make one the faster
    df.loc[df["system"] == "sequential", "throughput_tok_s"] /= 2
    best = df.groupby("system")["throughput_tok_s"].max().sort_values(ascending=False)
    winner, other = best.index
    ms = df["makespan_s"]  # the tiny runs never idle: give every run a bubble of known causes
    df[f"{IDLE}.load_expert@disk"], df[f"{IDLE}.late@gpu"] = 0.3 * ms, 0.1 * ms
    page = write_report(swept, tmp_path, df=df).read_text()
    top = page[: page.index("<img")]
    assert f"{winner} has the highest throughput" in top
    assert f"{best[winner]:.2f} tok/s" in top
    assert f"{best[winner] / best[other]:.2f}x {other} ({best[other]:.2f})" in top
    assert (
        "waits on load expert@disk 75%, late@gpu 25%: mostly expert weights read from disk" in top
    )
    ranked = re.findall(r"<td>(sequential|fiddler)</td>", top)
    assert ranked == [winner, other]
    runs = page[page.index("Runs (fastest first)") :]
    order = re.findall(r"<td>(sequential|fiddler)</td>", runs)
    assert order[0] == winner and "bubble_waits_on" in runs and "load expert@disk 75%" in runs


def test_report_plots_the_balancedness_of_expert_parallel_runs(
    tmp_path: Path, cli_here: Any
) -> None:
    """The load-balance figure looked for a plan.*load_balance* key no planner writes, so it
    never appeared: it is drawn from the runs' balancedness_per_layer, a line per planner."""
    d = tmp_path / "ep"
    r = cli_here(
        "experiments.run",
        "-m",
        *TINY,
        "planner=ep_static,eplb",
        "+planner.params.n_devices=2",
        "+hardware.n_gpus=2",
        f"hydra.sweep.dir={d}",
        SERIAL,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert report_main([f"dir={d}", f"out={tmp_path / 'rep'}"]) == 0
    png = tmp_path / "rep" / "load_balance.png"
    assert png.exists() and Image.open(png).size[0] > 100
    assert "load_balance.png" in (tmp_path / "rep" / "index.html").read_text()


def test_report_rejects_unknown_metric_and_column(
    swept: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert report_main([f"dir={swept}", f"out={tmp_path}", "metric=tokens_per_banana"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the runs' metrics:" in err[0] and "throughput_tok_s" in err[0]
    # what the runs measured, not their config keys or flags
    assert "skip_finished" not in err[0] and "hardware.n_gpus" not in err[0]
    assert report_main([f"dir={swept}", f"out={tmp_path}", "metric=throughput"]) == 2
    assert "did you mean 'throughput_tok_s'?" in capsys.readouterr().err
    assert report_main([f"dir={swept}", f"out={tmp_path}", "columns=[no.such]"]) == 2
    assert "valid:" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["makespan_s", "n_batches"])  # (no throughput: collect skips)
def test_report_of_summaries_without_a_key_it_reads_is_one_line(
    swept: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    """Summaries not written by experiments.run (hand-made, another version) that all lack a
    key the report reads: one line naming the key, exit 2."""
    d = tmp_path / "sweep"
    shutil.copytree(swept, d)
    for p in d.rglob("summary.json"):
        s = json.loads(p.read_text())
        s.pop(key, None)
        p.write_text(json.dumps(s))
        (p.parent / "files.sha256").unlink()  # hand-made: no record of what a run wrote
    assert report_main([f"dir={d}", f"out={tmp_path / 'rep'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0] and "run the sweep again" in err[0], err


def test_report_opens_in_headless_chromium(swept: Path, tmp_path: Path) -> None:
    browser = next(
        (b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None
    )
    if browser is None:
        pytest.skip("no chromium binary on PATH (apt-get install -y chromium)")
    shutil.copytree(swept / "report", tmp_path, dirs_exist_ok=True)  # the sweep's own report
    page = tmp_path / "index.html"
    check = (
        "<script>addEventListener('load',()=>{const i=[...document.images];document.title="
        "'IMAGES '+i.length+' BROKEN '+"
        "i.filter(x=>!(x.complete&&x.naturalWidth>0)).length;});</script>"
    )
    page.write_text(page.read_text().replace("</body>", check + "</body>"))
    r = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=5000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    m = re.search(r"<title>IMAGES (\d+) BROKEN (\d+)</title>", r.stdout)
    assert m, r.stderr[-2000:]
    assert int(m.group(1)) == len(images_of(tmp_path / "index.html")) > 0 and m.group(2) == "0"
