"""experiments.bench.sim times a run's phases from inside its own hydra app."""

from __future__ import annotations

from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from experiments.bench import sim as bench_sim

TINY = ["model=tiny", "hardware=tiny", "workload=tiny"]


def test_phases_of_a_run_from_inside_a_hydra_app(tmp_path):
    """bench_sim runs as a hydra app, so hydra's global instance is already set when it composes
    the run's config: the phases are timed, the run dir written, and the app's instance is back
    afterwards (the merged command once failed with 'GlobalHydra is already initialized')."""
    with initialize_config_dir(str(bench_sim.CONF), version_base="1.3"):
        outer = GlobalHydra.instance().hydra
        ops, times = bench_sim.run_phases("flexgen", TINY, tmp_path / "run")
        assert GlobalHydra.instance().hydra is outer
    assert ops > 0 and (tmp_path / "run" / "summary.json").exists()
    assert set(bench_sim.PHASES) - {"startup"} <= set(times)
    assert all(t >= 0 for t in times.values())
