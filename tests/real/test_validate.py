"""validate keeps going when one planner's real run is refused: that planner is reported as
skipped (with the reason) and the others are compared."""

from __future__ import annotations

from core.errors import CapacityError
from experiments import validate as v


def test_a_real_run_refused_skips_that_planner_only(mixtral_tiny, tmp_path, monkeypatch):
    real = v.real_execute

    def refuse_flexgen(ckpt, spec, mode, **kw):
        if spec.planner == "flexgen":
            raise CapacityError("device pool 1 MB cannot hold one layer's working set (9 MB)")
        return real(ckpt, spec, mode, **kw)

    monkeypatch.setattr(v, "real_execute", refuse_flexgen)
    opts = dict(v._DEFAULTS, checkpoint=str(mixtral_tiny), hardware="tiny", repeats=2,
                planners="sequential,flexgen", out=str(tmp_path), gpu_frac=0.9, cpu_frac=0.5)  # fmt: skip
    table = v.validate(opts).set_index("planner")
    assert "working set" in table.loc["flexgen", "skipped"]
    assert (
        table.loc["sequential", "real_runs"] == 2 and table.loc["sequential", "real_makespan_s"] > 0
    )
    assert (tmp_path / "validate.md").exists() and not (tmp_path / "flexgen").exists()
