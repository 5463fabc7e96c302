"""What the expert-parallel planners' tests share: `tiny_spec`, a run of tiny on 4 GPUs,
and a stand-in cost model whose times can be worked out by hand."""

from pathlib import Path

import numpy as np
import yaml

from core.hardware import HardwareSpec
from core.spec import ModelSpec, RoutingConfig, Workload
from experiments.common.pipeline import RunSpec
from planners.expert_parallel import ExpertTime, Layout


def tiny_spec(planner: str, **params) -> RunSpec:
    model = ModelSpec.from_dict(yaml.safe_load(Path("conf/model/tiny.yaml").read_text()))
    hw = HardwareSpec.from_dict(
        {**yaml.safe_load(Path("conf/hardware/tiny.yaml").read_text()), "n_gpus": 4}
    )
    wl = Workload(
        batch_size=2,
        n_batches=3,
        prompt_len=8,
        gen_len=2,
        routing=RoutingConfig(source="synthetic"),
    )
    return RunSpec(model, hw, wl, planner, {"n_devices": 2, **params})


class _MaxCost:
    """Stand-in cost model: an op takes max(flops, touch_bytes) s (1 flop/s, 1 B/s, no overhead)."""

    def compute_s(self, device, kind, flops, touch_bytes, share=1.0):
        return max(flops, touch_bytes) / share

    def compute_vec(self, device, kind, flops, touch, share=1.0):
        return np.maximum(flops, touch) / share


def _timer(copy_s: float = 0.0) -> ExpertTime:
    """1 token = 1 flop, 1 expert = 1 byte: a device takes max(tokens, distinct experts) s."""
    return ExpertTime(_MaxCost(), 1.0, 1, True, copy_s)  # type: ignore[arg-type]


LAY = Layout(n_devices=2, n_experts=4, home_slots=2, replica_slots=1, replicas=2, lanes=True)
