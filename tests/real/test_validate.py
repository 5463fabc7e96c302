"""validate keeps going when one planner's real run is refused: that planner is reported as
skipped (with the reason) and the others are compared; a fault in a real run (a dead rank, NaN
weights, a changed checkpoint) fails the command."""

from __future__ import annotations

import pytest

from core.errors import CapacityError, MoepipeError
from experiments import validate as v


def _opts(ckpt, out, planners):
    return dict(
        v._DEFAULTS,
        checkpoint=str(ckpt),
        hardware="tiny",
        repeats=1,
        planners=planners,
        out=str(out),
        gpu_frac=0.9,
        cpu_frac=0.5,
    )


def _flexgen_fails(monkeypatch, error: Exception) -> None:
    """validate's real runs of flexgen raise `error`; the other planners' run."""
    real = v.real_execute

    def run(ckpt, spec, mode, **kw):
        if spec.planner == "flexgen":
            raise error
        return real(ckpt, spec, mode, **kw)

    monkeypatch.setattr(v, "real_execute", run)


def test_a_real_run_refused_skips_that_planner_only(mixtral_tiny, tmp_path, monkeypatch):
    _flexgen_fails(
        monkeypatch, CapacityError("device pool 1 MB cannot hold one layer's working set (9 MB)")
    )
    opts = dict(_opts(mixtral_tiny, tmp_path, "sequential,flexgen"), repeats=2)
    table = v.validate(opts).set_index("planner")
    assert "working set" in table.loc["flexgen", "skipped"]
    assert (
        table.loc["sequential", "real_runs"] == 2 and table.loc["sequential", "real_makespan_s"] > 0
    )
    assert (tmp_path / "validate.md").exists() and not (tmp_path / "flexgen").exists()


def test_probe_predicts_each_run_at_the_links_its_probe_saw(mixtral_tiny, tmp_path, monkeypatch):
    """links=probe: one probe per real run, taken before it, and the prediction simulates the
    planner at the probe's bandwidths (a probe that saw a disk 4x slower than calibrated gives
    a longer predicted makespan than the calibrated prediction)."""
    calls: list[float] = []
    real = v.real_execute

    def slow_probe(ckpt, hw, device, budget_s, runs, gpu_frac, cpu_frac, dtype=None):
        calls.append(gpu_frac)
        return {}, {"disk": hw["links"]["disk"]["gbps"] * 1e9 / 4}

    def counted(ckpt, spec, mode, **kw):
        calls.append(-1.0)
        return real(ckpt, spec, mode, **kw)

    monkeypatch.setattr(v, "measure_in_run", slow_probe)
    monkeypatch.setattr(v, "real_execute", counted)
    opts = dict(
        v._DEFAULTS,
        checkpoint=str(mixtral_tiny),
        hardware="tiny",
        repeats=2,
        planners="sequential",
        out=str(tmp_path),
        gpu_frac=0.5,
        cpu_frac=0.2,
        links="probe",
    )
    row = v.validate(opts).set_index("planner").loc["sequential"]
    assert calls == [0.5, -1.0, 0.5, -1.0]  # a probe, at validate's device pool, before each run
    assert row["disk_bytes"] > 0  # the disk tier is active, so the probe's disk figure counts
    assert row["sim_probe_makespan_s"] > row["sim_makespan_s"]
    # every probe saw the same slow disk, so pooling them predicts what each probe did
    assert row["sim_window_makespan_s"] == pytest.approx(row["sim_probe_makespan_s"])
    assert row["err_probe_paired_makespan_s"] > row["err_makespan_s"]  # each run vs a slower disk
    assert row["err_probe_makespan_s"] == pytest.approx(
        row["sim_probe_makespan_s"] / row["real_makespan_s"] - 1
    )
    # two runs: the median compared is the lower middle, not the slower one
    assert row["real_makespan_s"] == row["real_makespan_min_s"]


def test_unknown_links_is_refused_before_any_run(tmp_path):
    opts = dict(v._DEFAULTS, checkpoint=str(tmp_path), links="fresh")
    with pytest.raises(MoepipeError, match="links='fresh' unknown; valid: calibrated, probe"):
        v.validate(opts)


def test_a_planner_param_no_planner_takes_is_one_line(tmp_path):
    opts = dict(
        v._DEFAULTS, checkpoint=str(tmp_path), planners="eplb", planner_params={"densee": "x"}
    )
    with pytest.raises(MoepipeError, match=r"planner_params: planner eplb: unknown param"):
        v.validate(opts)


# two processes validated end to end, 2.5-2.8 s each: data-parallel dense in the slow suite
@pytest.mark.parametrize(
    "params",
    [pytest.param({}, marks=pytest.mark.slow), {"dense": "tensor"}],
    ids=["data", "tensor"],
)
def test_distributed_validation_covers_every_op_and_device_tokens(mixtral_tiny, tmp_path, params):
    """executor.distributed=true: eplb on 2 processes (a profile of h200-hgx8 with 2 GPUs), its
    dense work data- or tensor-parallel (planner_params.dense); the real trace holds each op of
    the schedule once (coverage 1) and each device's expert tokens equal the simulator's; the
    simulator runs again at the p2p rate the runs saw."""
    import yaml

    hw = yaml.safe_load((v.ROOT / "conf" / "hardware" / "h200-hgx8.yaml").read_text())
    hw.update(name="hgx2", n_gpus=2)
    path = tmp_path / "hgx2.yaml"
    path.write_text(yaml.safe_dump(hw))
    opts = dict(
        v._DEFAULTS,
        checkpoint=str(mixtral_tiny),
        hardware=str(path),
        repeats=1,
        planners="eplb",
        out=str(tmp_path / "val"),
        gpu_frac=2.0,
        cpu_frac=0.5,
        links="calibrated",
        planner_params=params,
        **{"executor.distributed": "true"},
    )
    row = v.validate(opts).set_index("planner").loc["eplb"]
    assert row["coverage"] == 1.0 and row["device_tokens_equal"]
    assert row["sim_device_tokens"] == row["real_device_tokens"]
    assert (
        row["run_p2p_gbps"] > 0
        and row["err_run_links_makespan_s"] == row["err_run_links_makespan_s"]
    )


def test_every_planner_skipped_is_an_error_and_writes_nothing(mixtral_tiny, tmp_path, monkeypatch):
    """A table of skipped rows alone used to be written, and the command exited 0."""

    def refuse(ckpt, spec, mode, **kw):
        raise CapacityError("device pool 1 MB cannot hold one layer's working set (9 MB)")

    monkeypatch.setattr(v, "real_execute", refuse)
    out = tmp_path / "out"
    with pytest.raises(MoepipeError, match="every planner was skipped.*sequential: device pool"):
        v.validate(_opts(mixtral_tiny, out, "sequential,flexgen"))
    assert not out.exists()


def test_a_failed_validation_leaves_the_earlier_one_whole(mixtral_tiny, tmp_path, monkeypatch):
    """Its outputs replace an earlier validation's only once all are written: one that fails
    midway (here the second planner's real run; a Ctrl-C or a full disk likewise) leaves the
    earlier run dirs, timelines and tables as they were, with none of its own, and a new one
    replaces the earlier's files, those of planners it did not run too."""
    out = tmp_path / "out"
    v.validate(_opts(mixtral_tiny, out, "sequential,flexgen"))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert {p.name for p in out.iterdir()} == {
        "sequential",
        "flexgen",
        "timeline_sequential.png",
        "timeline_flexgen.png",
        "validate.csv",
        "validate.md",
    }
    real = v.real_execute
    _flexgen_fails(monkeypatch, RuntimeError("the machine went away"))
    with pytest.raises(RuntimeError):
        v.validate(_opts(mixtral_tiny, out, "sequential,flexgen"))
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    monkeypatch.setattr(v, "real_execute", real)
    v.validate(_opts(mixtral_tiny, out, "sequential"))
    assert {p.name for p in out.iterdir()} == {
        "sequential",
        "timeline_sequential.png",
        "validate.csv",
        "validate.md",
    }


@pytest.mark.parametrize(
    "fault",
    [
        "rank 1 died (signal 9, SIGKILL); the run stopped",
        "non-finite values (NaN or inf) in the output of layer 1 (MoE) at step 0, batch 0",
        "ck/model.safetensors: changed while the run read the checkpoint",
    ],
)
def test_a_fault_in_a_real_run_fails_validate(mixtral_tiny, tmp_path, monkeypatch, fault):
    """A rank killed (or stopped) mid-run, NaN weights, a checkpoint changed under the run were
    a `skipped` row like a refused plan's: the command exited 0 with a table that left the
    planner out. A fault fails the command with its line and writes nothing."""
    _flexgen_fails(monkeypatch, MoepipeError(fault))
    out = tmp_path / "out"
    with pytest.raises(MoepipeError, match=fault.replace("(", r"\(").replace(")", r"\)")):
        v.validate(_opts(mixtral_tiny, out, "sequential,flexgen"))
    assert not out.exists()
