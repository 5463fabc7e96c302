"""What a real run holds against what its planner counts: each term of core.spec's
activation_bytes covers the executor's own buffers at their largest (and the paper's 3 hidden
states per prompt token, which the placements counted before, do not); the host slabs stay
within the host tier; a batch's host KV cache holds the layers the schedule offloads.

Fixture: mixtral-tiny (4 layers, 8 experts, top-2, float32), 4 batches of 2 sequences, 6 prompt
tokens, 3 generated, on the offload hardware of test_executor (10 MB device pool, 8 MB host).
"""

import os

import torch

from core.activations import activation_bytes
from core.spec import RoutingConfig, Workload
from core.types import OpKind, RoutingSource, Tier
from experiments.common.pipeline import RunSpec
from experiments.common.real_run import open_store, real_execute
from real.checkpoint import load_checkpoint
from real.executor import Executor
from real.state import host_kv_layers
from tests.real.test_executor import OFFLOAD, WORKLOAD, hardware

GROUP = Workload(
    batch_size=2,
    n_batches=4,
    prompt_len=6,
    gen_len=3,
    routing=RoutingConfig(source=RoutingSource.SYNTHETIC),
)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def held(ex: Executor) -> dict[str, int]:
    """The executor's activation buffers now, by activation_bytes' terms (under its lock)."""
    with ex._refs_lock:
        gates = [p for b in ex._batches for p in (*b.pending.values(), *b.gating.values())]
        return {
            "hidden": sum(_nbytes(t) for b in ex._batches for t in b.hidden.values()),
            "gate": sum(
                _nbytes(p.normed)
                + _nbytes(p.slots)
                + _nbytes(p.ids)
                + _nbytes(p.weights)
                + _nbytes(p.shared)
                for p in gates
            ),
            "logits": sum(_nbytes(b.logits) for b in ex._batches),
        }


def test_activation_terms_cover_the_executors_buffers(mixtral_tiny, monkeypatch):
    """At every op's end, the hidden states, the pending MoE layers and the logits the executor
    holds stay within their terms; the gate term is tight (every batch's layer at once, which
    the expert phase holds, plus one batch's next); the old 3 hidden states fall short."""
    model, _ = load_checkpoint(mixtral_tiny)
    peaks: dict[str, int] = {}
    run_op = Executor._run_op

    def spy(self, op, spec, stream):
        run_op(self, op, spec, stream)
        for k, v in held(self).items():
            peaks[k] = max(peaks.get(k, 0), v)

    monkeypatch.setattr(Executor, "_run_op", spy)
    spec = RunSpec(
        model, hardware(0.05, 0.05), GROUP, "klotski", {"n": -1, "real_activations": True}
    )
    real_execute(mixtral_tiny, spec, "replay")
    terms = activation_bytes(model, GROUP)
    assert peaks["hidden"] <= terms.hidden
    assert peaks["gate"] <= terms.gate
    assert peaks["logits"] <= terms.logits // 2  # the other half: their copy into the output
    tokens = GROUP.n_sequences * GROUP.prompt_len
    per_token = terms.gate // (tokens + GROUP.batch_size * GROUP.prompt_len)
    assert peaks["gate"] >= tokens * per_token
    old = 3 * tokens * model.hidden_size * model.dtype_bytes
    assert sum(peaks.values()) > old


def test_klotskis_placement_reserves_the_real_activations():
    """With real_activations the GPU's resident bytes grow by the executor's activations less
    the paper's 3 hidden states; without, they are as before."""
    from planners.n_planner import placement_for
    from real.checkpoint import reduced_spec

    model = reduced_spec("mixtral-tiny")
    hw = hardware(0.05, 0.05)
    paper = placement_for(model, hw, GROUP, 2)
    real = placement_for(model, hw, GROUP, 2, real_activations=True)
    three = 3 * GROUP.n_sequences * GROUP.prompt_len * model.hidden_size * model.dtype_bytes
    grown = activation_bytes(model, GROUP).total - three
    assert real.resident_bytes[Tier.GPU] - paper.resident_bytes[Tier.GPU] == grown


def test_host_slabs_stay_within_the_host_tier(mixtral_tiny):
    """After a run that streams experts from disk, the store's host slabs (pinned on CUDA) hold
    no more than the host tier's memory and one unit: the preload's copies of device-resident
    units are released, and new slabs are cut within the tier."""
    model, _ = load_checkpoint(mixtral_tiny)
    spec = RunSpec(model, OFFLOAD, WORKLOAD, "klotski", {"n": -1})
    store = open_store(mixtral_tiny, spec)
    try:
        real_execute(mixtral_tiny, spec, "replay", store=store)
        largest = max(r.nbytes for r in store.records.values())
        assert store.slabs.reserved_bytes <= OFFLOAD.memory_bytes[Tier.CPU] + largest
    finally:
        store.close()


def test_a_batchs_host_kv_holds_the_layers_it_offloads(mixtral_tiny, monkeypatch):
    """A replay makes each batch's host KV cache for the layers the schedule stores or loads,
    and none for the layers whose KV stays on the device."""
    model, _ = load_checkpoint(mixtral_tiny)
    made: dict[int, tuple] = {}
    host_kv = Executor._host_kv

    def spy(self, batch, max_len, layers=None):
        kv = host_kv(self, batch, max_len, layers)
        made[len(made)] = (layers, kv)
        return kv

    monkeypatch.setattr(Executor, "_host_kv", spy)
    # a 9 MB device pool keeps the KV of layers 0-2 and offloads layer 3's
    wl = WORKLOAD.with_(batch_size=4, prompt_len=64)
    result, _ = real_execute(mixtral_tiny, RunSpec(model, hardware(0.009, 0.016), wl, "flexgen"))
    offloaded = host_kv_layers(result.schedule.ops)
    assert offloaded == {0: frozenset({3}), 1: frozenset({3})}
    assert any(op.kind == OpKind.KV_STORE for op in result.schedule.ops)
    assert len(made) == len(offloaded)
    for layers, kv in made.values():
        assert layers in offloaded.values()
        for i, tensors in enumerate(kv.layers):
            assert bool(tensors) == (i in layers)


def test_onednn_primitive_cache_is_bounded_unless_the_user_set_it(monkeypatch):
    """A CPU run bounds oneDNN's cache of per-shape primitives (each expert op's token count is
    a new shape); a capacity the user set stays."""
    from real.interpreter import cache_freed_memory

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    cache_freed_memory.__wrapped__()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16"
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")
    cache_freed_memory.__wrapped__()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "256"
