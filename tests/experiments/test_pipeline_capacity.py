"""The KV-cache check that runs before any routing is built (experiments.common.pipeline)."""

from __future__ import annotations

from unittest import mock

import pytest

from core.errors import CapacityError, MoepipeError
from core.types import Tier
from experiments.common.pipeline import (
    ROUTING_PEAK_FACTOR,
    RunSpec,
    check_kv_fits,
    routing_bytes,
    simulate_run,
)


def test_a_kv_cache_beyond_gpu_and_cpu_memory_is_refused_before_routing(
    tiny_model, tiny_hw, tiny_workload, monkeypatch
):
    """A prompt so long that its KV cache cannot fit in GPU + CPU memory is refused by
    `simulate_run` with one CapacityError naming the KV cache, and no routing is loaded (for
    millions of tokens the routing alone would take more memory than the machine has). The
    check applies to routing of at least ROUTING_CHECK_BYTES; set to 0 here to reach it."""
    monkeypatch.setattr("experiments.common.pipeline.ROUTING_CHECK_BYTES", 0)
    room = tiny_hw.memory_bytes[Tier.GPU] * max(1, tiny_hw.n_gpus) + tiny_hw.memory_bytes[Tier.CPU]
    per_position = tiny_workload.n_sequences * tiny_model.kv_bytes_per_token * tiny_model.n_layers
    prompt = room // per_position + 2  # one position past the room
    wl = tiny_workload.with_(prompt_len=prompt)
    spec = RunSpec(tiny_model, tiny_hw, wl, "flexgen", {})
    # whatever RAM this machine has free (here: less than the group's routing needs, more
    # than one batch's), the configuration's own limit is named
    need = routing_bytes(spec) * ROUTING_PEAK_FACTOR
    monkeypatch.setattr("experiments.common.pipeline._available_ram_bytes", lambda: need - 1)
    with (
        mock.patch("experiments.common.pipeline.load_routing") as load,
        pytest.raises(CapacityError, match="KV cache"),
    ):
        simulate_run(spec)
    load.assert_not_called()
    check_kv_fits(RunSpec(tiny_model, tiny_hw, tiny_workload, "flexgen", {}))  # fits: no error


def test_routing_larger_than_this_machines_ram_is_refused_before_it_is_built(
    tiny_model, tiny_hw, tiny_workload, monkeypatch
):
    """Routing whose generator would need more RAM than the machine has available is one
    MoepipeError naming prompt_len, before any routing is built (a 4M-token prompt took 14 GB)."""
    monkeypatch.setattr("experiments.common.pipeline.ROUTING_CHECK_BYTES", 0)
    monkeypatch.setattr("experiments.common.pipeline._available_ram_bytes", lambda: 1000)
    spec = RunSpec(tiny_model, tiny_hw, tiny_workload, "flexgen", {})
    with (
        mock.patch("experiments.common.pipeline.load_routing") as load,
        pytest.raises(MoepipeError, match="prompt_len") as e,
    ):
        simulate_run(spec)
    assert not isinstance(e.value, CapacityError)  # about this machine, not the simulated one
    load.assert_not_called()
