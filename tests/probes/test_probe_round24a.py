"""Probe round 24a (issue 48): a run's routing read back as data, not prose.

Classes:
1. collect, report and replication read a run dir's summary.json `routing` back against its
   config.yaml by parsing moepipe's own free text (`synthetic skew=1 ... seed=0`, `trace <name>
   [tasks] ... start seq S, wrapped Kx, its first L of N MoE layers`) with regular expressions:
   a reworded description would have broken the check without a word. A run now writes
   `routing_fields` beside the text, from the same routing object, and the check compares
   those with config.yaml; the text is printed, never parsed.
2. A summary.json with the text but no `routing_fields` (an older moepipe's) cannot be checked
   against its config: collect skips it with a line saying to run it again, and a rerun into
   its dir runs it again instead of reusing it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.probes.conftest import tiny_run

_KNOBS = {"skew": 1.0, "layer_corr": 0.5, "reuse": 0.25, "hot_experts": 2, "hot_share": 0.5}
# config.yaml's workload.routing (every knob, as a run's resolved config holds them)
_CONFIGS = {
    "synthetic": {"source": "synthetic", "tasks": [], "exclude_tasks": [], **_KNOBS},
    "trace": {"source": "trace", "tasks": ["law", "math"], "exclude_tasks": ["math"], **_KNOBS},
}
# the routing_fields a run of each of them (workload.seed 7, two MoE layers) writes
_RAN = {
    "synthetic": {"source": "synthetic", **_KNOBS, "seed": 7, "moe_layers": 2},
    "trace": {
        "source": "trace",
        "trace": "esft-dsv2lite",
        "tasks": ["law"],
        "exclude_tasks": ["math"],
        "tokens": 9,
        "sequences": 4,
        "start_seq": 3,
        "seed": 7,
        "wrapped": 0,
        "moe_layers": 2,
        "trace_moe_layers": 26,
    },
}
_DROP = object()  # a field the summary does not hold


def _config(kind: str, **over: Any) -> dict[str, Any]:
    routing = {**_CONFIGS[kind], **over.pop("routing", {})}
    return {
        "executor": {"name": "sim"},
        "model": {"moe_layers": [1, 2]},
        "workload": {"seed": 7, "routing": routing},
        **over,
    }


def _disagrees(config: dict[str, Any], ran: dict[str, Any], text: str = "(words)") -> Any:
    from experiments.common.run_config import config_disagrees

    fields = {k: v for k, v in ran.items() if v is not _DROP}
    return config_disagrees(config, {"routing": text, "routing_fields": fields})


@pytest.mark.parametrize(
    ("kind", "field", "value", "words"),
    [
        ("synthetic", "skew", 2, "workload.routing.skew is 1.0 where the run's summary.json has "),
        ("synthetic", "layer_corr", 0.4, "workload.routing.layer_corr is 0.5"),
        ("synthetic", "reuse", 0, "workload.routing.reuse is 0.25"),
        ("synthetic", "hot_experts", 0, "workload.routing.hot_experts is 2"),
        ("synthetic", "hot_share", 0.75, "workload.routing.hot_share is 0.5"),
        ("synthetic", "seed", 8, "workload.seed is 7"),
        ("synthetic", "seed", _DROP, "workload.seed is 7 where the run's summary.json has no "),
        ("synthetic", "moe_layers", 3, "len(model.moe_layers) is 2"),
        ("synthetic", "source", "trace", "workload.routing.source is 'synthetic'"),
        ("synthetic", "source", _DROP, "has no routing_fields.source"),
        ("trace", "tasks", ["law", "intent"], "workload.routing.tasks is ['law']"),
        ("trace", "exclude_tasks", [], "workload.routing.exclude_tasks is ['math']"),
        ("trace", "seed", 3, "workload.seed is 7"),
        ("trace", "moe_layers", 26, "len(model.moe_layers) is 2"),
        ("trace", "source", "live", "workload.routing.source is 'trace'"),
    ],
)
def test_each_routing_field_that_differs_is_named(
    kind: str, field: str, value: Any, words: str
) -> None:
    """Each field config.yaml draws, where the summary's routing_fields hold another value
    (or none): the line names config.yaml's key and the summary's field."""
    line = _disagrees(_config(kind), {**_RAN[kind], field: value})
    assert line is not None and words in line, line
    assert f"routing_fields.{field}" in line, line


@pytest.mark.parametrize(
    ("config", "ran"),
    [
        (_config("synthetic"), _RAN["synthetic"]),
        (_config("trace"), _RAN["trace"]),
        (_config("synthetic", routing={"source": "auto"}), _RAN["trace"] | {"exclude_tasks": []}),
        (_config("synthetic", routing={"source": "auto"}), _RAN["synthetic"]),
        # a share of no hot experts draws nothing
        (_config("synthetic", routing={"hot_experts": 0}), _RAN["synthetic"] | {"hot_experts": 0}),
        # no task named: every task of the trace's less those excluded
        (_config("trace", routing={"tasks": []}), _RAN["trace"] | {"tasks": ["a", "law"]}),
        # a real run's checkpoint, not config.yaml's model, has the layers
        (_config("trace", executor={"name": "real"}), _RAN["trace"] | {"moe_layers": 26}),
        (
            _config("synthetic", executor={"name": "real", "routing_mode": "live"}),
            {"source": "live"},
        ),
        # a replication case draws its own (a fitted skew, a split of the trace)
        (_config("synthetic", replication={"routing": "esft_heldout"}), {"source": "esft"}),
        # a hand-made config's string that is no list of layers (json recursed past its limit)
        (_config("synthetic", model={"moe_layers": "[" * 5000}), _RAN["synthetic"]),
    ],
    ids=[
        "synthetic",
        "trace",
        "auto_trace",
        "auto_synthetic",
        "no_hot",
        "all_tasks",
        "real",
        "live",
        "replication",
        "deep_string",
    ],
)
def test_agreeing_routing_fields_are_accepted(config: dict[str, Any], ran: dict[str, Any]) -> None:
    assert _disagrees(config, ran) is None


def test_the_description_is_not_read() -> None:
    """The text a summary prints is not what it is checked by: words that a parser of the old
    wording would read as another skew and seed pass where the fields agree, and words that
    agree do not hide fields that differ."""
    config, ran = _config("synthetic"), _RAN["synthetic"]
    assert _disagrees(config, ran, "synthetic skew=9 layer_corr=0 reuse=0 seed=99") is None
    assert _disagrees(config, ran, "Zipf(1) routing, seed seven") is None
    said = "synthetic skew=1 layer_corr=0.5 reuse=0.25 hot=2@0.5 seed=7"
    line = _disagrees(config, {**ran, "skew": 3}, said)
    assert line is not None and "routing_fields.skew 3" in line, line


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run (one subprocess a test session); each test edits a copy."""
    return tiny_run(tmp_path_factory.mktemp("r24a") / "run")


def _edited(run: Path, tmp_path: Path, edit: Any) -> Path:
    """A copy of `run` in a sweep folder of its own, its summary.json edited in place by
    `edit` and its files.sha256 written again: as a run of the same code would leave it."""
    import shutil

    from experiments.common.run_dir import MANIFEST, write_manifest

    copy = tmp_path / "sweep" / "r"
    shutil.copytree(run, copy)
    summary = json.loads((copy / "summary.json").read_text())
    edit(summary)
    (copy / "summary.json").write_text(json.dumps(summary))
    (copy / MANIFEST).unlink()
    write_manifest(copy, {})
    return copy


def test_a_reworded_routing_text_is_still_collected(run: Path, tmp_path: Path) -> None:
    """A summary whose text no parser knows, its fields a run's: collected as it is."""
    from experiments.common.tables import collect

    def reword(s: dict[str, Any]) -> None:
        s["routing"] = "generated: Zipf popularity, layer transitions, reuse (seed 0)"

    _edited(run, tmp_path, reword)
    df, problems = collect(tmp_path / "sweep")
    assert problems == [] and list(df["routing"]) == [
        "generated: Zipf popularity, layer transitions, reuse (seed 0)"
    ]


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda s: s["routing_fields"].update(skew=9), "routing_fields.skew 9: not the config"),
        (lambda s: s.pop("routing_fields"), "has routing but no routing_fields"),
        (lambda s: s.update(routing_fields="skew=1"), "routing_fields 'skew=1', not a mapping"),
    ],
    ids=["other_skew", "older_version", "not_a_mapping"],
)
def test_a_summary_that_cannot_be_checked_is_skipped_and_run_again(
    run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, edit: Any, words: str
) -> None:
    """collect's `skipped` line saying to run it again; a rerun into the dir (`finished`) does
    not reuse a summary without its fields (an older moepipe's), as it reuses no other code's."""
    from experiments.common.run_dir import finished
    from experiments.common.tables import collect

    copy = _edited(run, tmp_path, edit)
    df, problems = collect(tmp_path / "sweep")
    assert df.empty and len(problems) == 1 and words in problems[0], problems
    assert "run the sweep again" in problems[0]
    if "skew 9" not in words:  # (a summary of this version, its skew edited: the config's check)
        with caplog.at_level(logging.WARNING):
            assert not finished(copy, (copy / "config.yaml").read_text())
        assert "routing_fields" in caplog.text and "running again" in caplog.text


def test_a_runs_own_fields_agree_with_its_config(run: Path) -> None:
    """What a synthetic run writes is what its config.yaml is checked against, key for key."""
    from experiments.common.run_config import config_disagrees

    config = yaml.safe_load((run / "config.yaml").read_text())
    summary = json.loads((run / "summary.json").read_text())
    fields = summary["routing_fields"]
    routing = config["workload"]["routing"]
    assert fields == {
        "source": "synthetic",
        **{k: routing[k] for k in _KNOBS},
        "seed": config["workload"]["seed"],
        "moe_layers": 2,
    }
    assert config_disagrees(config, summary) is None


def test_a_trace_replays_fields_agree_with_its_config() -> None:
    """The ESFT trace replay's fields, written as JSON, against the config that drew them; the
    start sequence and layer cut its text says are the fields' own."""
    from core.traces import N_LAYERS, TRACE_FILE, TRACE_NAME, esft_routing
    from experiments.common.run_config import config_disagrees
    from tests.core.test_traces import model, workload

    trace_dir = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
    if not (trace_dir / TRACE_NAME / TRACE_FILE).exists():
        pytest.skip("../shared/traces is absent")
    wl = workload(trace_dir, tasks=("law", "intent"), exclude_tasks=("intent",))
    routing = esft_routing(model(layers=3), wl.with_(seed=130))
    fields = json.loads(json.dumps(routing.fields))
    assert fields["tasks"] == ["law"] and fields["exclude_tasks"] == ["intent"]
    assert fields["moe_layers"] == 3 and fields["trace_moe_layers"] == N_LAYERS
    said = f"start seq {fields['start_seq']}, wrapped {fields['wrapped']}x, its first 3 of"
    assert f"in {fields['sequences']} sequences, {said}" in routing.description
    config = {
        "model": {"moe_layers": [0, 1, 2]},
        "workload": {"seed": 130, "routing": {"source": "trace", "tasks": ["law", "intent"]}},
    }
    config["workload"]["routing"]["exclude_tasks"] = ["intent"]
    summary = {"routing": routing.description, "routing_fields": fields}
    assert config_disagrees(config, summary) is None
    config["workload"]["seed"] = 131
    assert "workload.seed is 131" in str(config_disagrees(config, summary))


@pytest.mark.parametrize(
    ("mode", "source", "words"),
    [
        ("replay", "live", "executor.routing_mode is 'replay' where the run's summary.json has "),
        ("live", "synthetic", "executor.routing_mode is 'live' where the run's summary.json has "),
    ],
)
def test_a_live_gate_and_a_replay_are_told_apart(mode: str, source: str, words: str) -> None:
    """A real run's text behind `live: ` was not compared at all: its source is now a field."""
    config = _config("synthetic", executor={"name": "real", "routing_mode": mode})
    line = _disagrees(config, {**_RAN["synthetic"], "source": source})
    assert line is not None and f"{words}routing_fields.source {source!r}" in line, line


@pytest.mark.parametrize("mode", ["replay", "live"])
def test_a_real_runs_fields_are_its_routings(tiny_ckpt: Path, mode: str) -> None:
    """A real run writes the fields of the routing it forced (replay) or that it is live, which
    its config agrees with, and the replay's text as before, behind `replay: `."""
    from experiments.common.real_run import real_execute
    from experiments.common.run_config import config_disagrees
    from tests.real.test_executor import spec_for

    spec = spec_for(tiny_ckpt, "flexgen")
    summary = real_execute(tiny_ckpt, spec, mode)[0].summary
    config = _config("synthetic", executor={"name": "real", "routing_mode": mode})
    config["workload"]["seed"] = spec.workload.seed
    config["workload"]["routing"].update(hot_experts=0, skew=1.0)
    if mode == "live":
        assert summary["routing_fields"] == {"source": "live"}
    else:
        assert summary["routing"].startswith("replay: synthetic skew=1 ")
        assert summary["routing_fields"]["source"] == "synthetic"
    assert config_disagrees(config, summary) is None
    config["executor"]["routing_mode"] = "live" if mode == "replay" else "replay"
    assert "executor.routing_mode" in str(config_disagrees(config, summary))
