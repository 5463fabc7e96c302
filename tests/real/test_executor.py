"""The real executor against the plain in-memory forward, for every registered planner.

Fixture: mixtral-tiny (4 layers, 8 experts, float32), 2 batches x 2 sequences, 6 prompt tokens,
3 generated. The offload hardware (10 MB device pool, 8 MB host, disk) streams experts from disk.
Tolerance: generated tokens equal exactly; last-step logits within atol=rtol=1e-4 (float32; a
schedule may run an expert over the tokens of several batches at once, which changes BLAS
blocking, so bits may differ at ~1e-6).
"""

from pathlib import Path

import pandas as pd
import pytest
import torch

from core.errors import MoepipeError
from core.hardware import HardwareSpec
from core.spec import RoutingConfig, Workload
from core.types import OpKind, RoutingSource
from experiments.common.pipeline import RunSpec, simulate_run
from experiments.common.real_run import prompts_for, real_execute
from planners.registry import planner_names
from real.checkpoint import load_checkpoint
from real.executor import Executor
from real.model import reference_generate
from real.store import ALIGN, round_up
from tests.conftest import RESIDENT

ATOL = RTOL = 1e-4
CUDA_TOL = 1e-3  # CUDA kernels against the CPU reference


def hardware(gpu_gb: float, cpu_gb: float, n_gpus: int = 1) -> HardwareSpec:
    return HardwareSpec.from_dict(
        dict(
            name=f"test-{gpu_gb}-{cpu_gb}-{n_gpus}",
            memory_gb=dict(gpu=gpu_gb, cpu=cpu_gb, disk=1.0),
            gpu=dict(tflops=0.05, mem_bw_gbps=10),
            cpu=dict(tflops=0.02, mem_bw_gbps=5),
            links=dict(h2d=dict(gbps=5), d2h=dict(gbps=5), disk=dict(gbps=1)),
            n_gpus=n_gpus,
        )
    )


OFFLOAD = hardware(0.010, 0.008)  # experts on disk / host: every load path runs
RESIDENT_2GPU = hardware(0.05, 0.05, n_gpus=2)  # expert-parallel planners keep experts resident
# fiddler holds no host copy of the experts it keeps on the GPU: the rest fit OFFLOAD's CPU, so
# a smaller one sends two layers' experts to disk
FIDDLER = hardware(0.010, 0.003)
WORKLOAD = Workload(
    batch_size=2,
    n_batches=2,
    prompt_len=6,
    gen_len=3,
    routing=RoutingConfig(source=RoutingSource.SYNTHETIC),
)


# Planners that peek at the coming routing (upper bounds) cannot run on the model's own gate.
REPLAY_ONLY = {"oracle_replication"}


def spec_for(ckpt: Path, planner: str) -> RunSpec:
    """The offload hardware, or two resident GPUs for planners that keep every expert resident."""
    model, _ = load_checkpoint(ckpt)
    hw = RESIDENT_2GPU if planner in RESIDENT else FIDDLER if planner == "fiddler" else OFFLOAD
    return RunSpec(model, hw, WORKLOAD, planner)


def assert_matches_reference(ckpt: Path, spec: RunSpec, result, out, tol: float = ATOL) -> None:
    """Tokens equal and logits within `tol` of the in-memory forward (CPU), which replays exactly
    what the run's gates used (replay: the trace; live: the model's own)."""
    wl = spec.workload.with_(n_batches=result.summary["n_batches"])
    ref_tokens, ref_logits = reference_generate(
        ckpt, prompts_for(spec.model, wl), wl.gen_len, out.routing
    )
    assert torch.equal(out.tokens, ref_tokens)
    torch.testing.assert_close(out.logits, ref_logits, atol=tol, rtol=tol)


def runnable(planners: list[str]) -> list[tuple[str, str]]:
    """(planner, routing mode) pairs; an upper bound that peeks at routing runs on replay only."""
    return [
        (p, m)
        for p in planners
        for m in ("replay", "live")
        if not (m == "live" and p in REPLAY_ONLY)
    ]


@pytest.mark.parametrize("mode", ["replay", "live"])
@pytest.mark.parametrize("planner", planner_names())
def test_matches_in_memory_forward(mixtral_tiny, planner, mode):
    spec = spec_for(mixtral_tiny, planner)
    if mode == "live" and planner in REPLAY_ONLY:
        with pytest.raises(MoepipeError, match="oracle"):
            real_execute(mixtral_tiny, spec, mode)
        return
    result, out = real_execute(mixtral_tiny, spec, mode)
    if planner not in RESIDENT:  # the offload path ran: weights came from disk through the store
        assert result.summary["bytes_moved"].get("disk", 0) > 0
    wl = spec.workload.with_(n_batches=result.summary["n_batches"])
    assert_matches_reference(mixtral_tiny, spec, result, out)
    if mode == "live":  # and the model's own routing is what a free-running forward picks
        free_tokens, _ = reference_generate(mixtral_tiny, prompts_for(spec.model, wl), wl.gen_len)
        assert torch.equal(out.tokens, free_tokens)
    trace = result.trace
    assert sorted(trace["op_id"]) == list(range(len(result.schedule)))  # every op exactly once
    assert (trace["end_s"] >= trace["start_s"]).all()
    assert set(trace["source"]) == {"real"}
    assert out.fallback_loads == 0
    assert set(result.summary) == set(simulate_run(spec).summary)


@pytest.mark.parametrize("mode", ["replay", "live"])
@pytest.mark.parametrize("planner", ["ep_static", "predictive_replication"])
def test_expert_parallel_with_shared_experts_matches_in_memory_forward(f32_ckpt, planner, mode):
    """DeepSeek-V2 shape (a dense layer, MoE layers with shared experts, top-6) on 2 GPUs'
    streams, one sequence each: each gates its own sequence, runs its shared experts before the
    routed ones, and the batch's routing is whole once both gates ran."""
    ckpt = f32_ckpt("deepseek-v2-lite")
    spec = spec_for(ckpt, planner)
    result, out = real_execute(ckpt, spec, mode)
    t = result.trace
    gates = t[t["kind"] == OpKind.GATE.value]
    assert gates.groupby(["step", "layer", "batch"])["stream"].nunique().eq(2).all()
    keys = ["step", "layer", "batch", "stream"]
    moe = t[t["layer"].isin(gates["layer"].unique())]
    shared = moe[moe["kind"] == OpKind.FFN.value].groupby(keys)["end_s"].max()
    routed = moe[moe["kind"] == OpKind.EXPERT.value].groupby(keys)["start_s"].min()
    both = pd.concat([shared, routed], axis=1, join="inner")
    assert len(both) and (both["end_s"] <= both["start_s"]).all()
    assert_matches_reference(ckpt, spec, result, out)


@pytest.mark.parametrize("mode", ["replay", "live"])
@pytest.mark.parametrize("planner", ["ep_static", "predictive_replication"])
def test_micro_batches_match_in_memory_forward(mixtral_tiny, planner, mode):
    """Two-batch overlap on 2 GPUs' streams: batch 5, GPU 0's 3 sequences and GPU 1's 2 each
    split in two micro-batches, each gated, computed and added on its own while the other's
    ops run (live: the planner sees each micro-batch's routing at its own gate)."""
    model, _ = load_checkpoint(mixtral_tiny)
    spec = RunSpec(
        model,
        RESIDENT_2GPU,
        WORKLOAD.with_(batch_size=5),
        planner,
        {"micro_batches": 2, "replica_slots": 1},
    )
    result, out = real_execute(mixtral_tiny, spec, mode)
    t = result.trace
    gates = t[t["kind"] == OpKind.GATE.value]
    assert gates.groupby(["step", "layer", "batch"])["micro"].nunique().eq(2).all()
    assert set(t.loc[t["kind"] == OpKind.EXPERT.value, "micro"]) == {0, 1}
    assert_matches_reference(mixtral_tiny, spec, result, out)


@pytest.mark.parametrize("mode", ["replay", "live"])
@pytest.mark.parametrize(
    "name, planner, devices, micro",
    [
        ("mixtral-tiny", "eplb", 2, 1),
        ("mixtral-tiny", "ep_static", 4, 1),
        ("olmoe-1b-7b", "predictive_replication", 2, 1),
        ("deepseek-v2-lite", "ep_static", 2, 1),
        ("mixtral-tiny", "predictive_replication", 2, 2),
        ("deepseek-v2-lite", "eplb", 2, 2),
    ],
)
def test_tensor_parallel_dense_matches_in_memory_forward(
    mixtral_tiny, f32_ckpt, name, planner, devices, micro, mode
):
    """dense=tensor on G GPUs' streams of one process: each runs every sequence on its 1/G of
    the heads (mixtral: GQA's 2 kv heads, one each on 2 GPUs, each held by 2 of 4; OLMoE:
    QK-norm's statistics summed inside attention; DeepSeek: MLA's latent whole on each, its
    dense layer's and shared experts' FFN columns split) and of the vocabulary, and the
    schedule's all-reduce ops sum the parts. Every all-reduce op runs once, on its device's
    link. micro=2 (two-batch overlap): batch 3 as micro-batches of sequences 0-1 and 2, each
    with its own attention, gate, experts and all-reduces; logits within 1e-5."""
    ckpt = mixtral_tiny if name == "mixtral-tiny" else f32_ckpt(name)
    model, _ = load_checkpoint(ckpt)
    hw = hardware(0.05, 0.05, n_gpus=devices)
    wl = WORKLOAD.with_(batch_size=3) if micro > 1 else WORKLOAD
    params = {"dense": "tensor", "n_devices": devices, "micro_batches": micro}
    spec = RunSpec(model, hw, wl, planner, params)
    result, out = real_execute(ckpt, spec, mode)
    assert_matches_reference(ckpt, spec, result, out, 1e-5 if micro > 1 else ATOL)
    t = result.trace
    assert sorted(t["op_id"]) == list(range(len(result.schedule)))  # every op exactly once
    assert set(t["source"]) == {"real"}
    reduce = t[t["kind"] == OpKind.ALL_REDUCE.value]
    links = {"p2p"} | {f"p2p:{d}" for d in range(1, devices)}
    assert len(reduce) and set(reduce["resource"].astype(str)) == links
    assert not t["kind"].isin([OpKind.DISPATCH.value, OpKind.COMBINE.value]).any()
    heads = t[t["kind"] == OpKind.HEAD.value]
    assert len(heads) == devices * wl.n_batches * wl.gen_len * micro
    per_step = heads.groupby(["step", "batch", "stream"])["tokens"].sum()
    assert (per_step == wl.batch_size).all()  # every device's heads cover every sequence
    if micro > 1:  # every dense, expert and all-reduce op belongs to one micro-batch
        kinds = [OpKind.ATTENTION, OpKind.GATE, OpKind.EXPERT, OpKind.ALL_REDUCE, OpKind.HEAD]
        assert set(t.loc[t["kind"].isin([k.value for k in kinds]), "micro"]) == {0, 1}


RESIDENT_1GPU = hardware(0.05, 0.05)
LANES = dict(n_devices=4, lanes=True, replica_slots=1)  # 4 concurrent lanes on one device


def lanes_spec(ckpt: Path, planner: str) -> RunSpec:
    """An expert-parallel planner over 4 lanes of one device: the replication paper's single-GPU
    case (on CUDA, 4 CUDA streams on one GPU)."""
    model, _ = load_checkpoint(ckpt)
    return RunSpec(model, RESIDENT_1GPU, WORKLOAD, planner, LANES)


def check_lanes_run(ckpt: Path, planner: str, mode: str, device: str | None = None) -> None:
    spec = lanes_spec(ckpt, planner)
    result, out = real_execute(ckpt, spec, mode, device=device)
    experts = result.trace[result.trace["kind"].astype(str) == "compute-expert"]
    assert set(experts["resource"].astype(str)) == {"gpu", "gpu:1", "gpu:2", "gpu:3"}
    assert experts["stream"].nunique() == 4  # the 4 lanes' own streams (CUDA streams on CUDA)
    assert_matches_reference(ckpt, spec, result, out, CUDA_TOL if device == "cuda" else ATOL)


@pytest.mark.parametrize("planner, mode", runnable(sorted(RESIDENT)))
def test_lanes_on_one_device_match_in_memory_forward(mixtral_tiny, planner, mode):
    check_lanes_run(mixtral_tiny, planner, mode)


@pytest.mark.parametrize("mode", ["replay", "live"])
def test_shared_lanes_run_the_same_way(mixtral_tiny, mode):
    """lane_sharing=shared changes only how the simulator shares the GPU (real CUDA streams share
    it anyway): the real run of such a schedule still matches the in-memory forward."""
    model, _ = load_checkpoint(mixtral_tiny)
    spec = RunSpec(
        model,
        RESIDENT_1GPU,
        WORKLOAD,
        "predictive_replication",
        {**LANES, "lane_sharing": "shared"},
    )
    result, out = real_execute(mixtral_tiny, spec, mode)
    assert result.schedule.ep.lane_sharing == "shared"
    assert result.trace["sm_s"].isna().all()  # a real trace cannot see the SMs
    assert_matches_reference(mixtral_tiny, spec, result, out)


@pytest.mark.parametrize("planner", ["sequential", "fiddler", "klotski"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_live_run_finds_every_expert_its_gates_choose(mixtral_tiny, planner, batch_size):
    """A live run's weights sit where the placement puts them before its first op, for experts
    one dry routing never chose too (fiddler keeps some of a layer's experts on the GPU, the
    rest in host RAM): no synchronous fallback read. One sequence of 7 tokens at top-2 cannot
    choose all 8 experts of a layer, nor could 3 sequences on the first dry routing."""
    model, _ = load_checkpoint(mixtral_tiny)
    wl = WORKLOAD.with_(batch_size=batch_size, n_batches=1, prompt_len=5, gen_len=2)
    spec = RunSpec(model, OFFLOAD, wl, planner)
    result, out = real_execute(mixtral_tiny, spec, "live")
    assert out.fallback_loads == 0
    assert_matches_reference(mixtral_tiny, spec, result, out)


def test_an_expert_runs_its_tokens_in_chunks(mixtral_tiny, monkeypatch):
    """Klotski runs a hot expert over every batch's tokens in one op; in chunks of rows (3
    here, 8,192 in a run) its output is the same."""
    import real.ops

    monkeypatch.setattr(real.ops, "EXPERT_ROWS", 3)
    spec = spec_for(mixtral_tiny, "klotski")
    result, out = real_execute(mixtral_tiny, spec, "replay")
    assert_matches_reference(mixtral_tiny, spec, result, out)


def test_a_live_runs_host_kv_is_made_before_it_starts(mixtral_tiny, monkeypatch):
    """Pinning a batch's host KV cache takes longer than its copies: a live run makes the ones
    its dry plans offload before its clock starts, not on the planner thread mid-run."""
    model, _ = load_checkpoint(mixtral_tiny)
    spec = RunSpec(
        model, hardware(0.0085, 0.016), WORKLOAD.with_(batch_size=4, prompt_len=64), "flexgen"
    )
    real_host_kv, started = Executor._host_kv, []

    def spy(self, batch, max_len, layers=None):
        started.append(getattr(self, "_started", False))
        return real_host_kv(self, batch, max_len, layers)

    monkeypatch.setattr(Executor, "_host_kv", spy)
    real_execute(mixtral_tiny, spec, "live")
    assert started and not any(started)


def test_a_run_leaves_the_callers_autograd_on(mixtral_tiny):
    torch.set_grad_enabled(True)
    real_execute(mixtral_tiny, spec_for(mixtral_tiny, "flexgen"), "live")
    assert torch.is_grad_enabled()


def test_disk_tier_is_used(mixtral_tiny):
    """The offload fixture really reads experts from disk (else the tests above prove less)."""
    result, _ = real_execute(mixtral_tiny, spec_for(mixtral_tiny, "flexgen"), "replay")
    assert result.summary["bytes_moved"].get("disk", 0) > 0


CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("mode", ["replay", "live"])
def test_offloaded_kv_round_trips_through_position_major_host_cache(
    mixtral_tiny, monkeypatch, mode, device
):
    """A GPU just above flexgen's working set puts most layers' KV in host memory. After each
    KV_STORE the device span stands released: here it is overwritten with NaN, so the tokens
    match only if the next step's KV_LOAD brings back every past position. The host copies are
    position-major, so each span moved is one contiguous block (CUDA: pinned, no temporary)."""
    model, _ = load_checkpoint(mixtral_tiny)
    wl = WORKLOAD.with_(batch_size=4, prompt_len=64)
    spec = RunSpec(model, hardware(0.0085, 0.016), wl, "flexgen")
    real_copy, moved = Executor._kv_copy, []

    def released_after_store(self, op, to_device):
        real_copy(self, op, to_device)
        host = self._batches[op.batch].kv_host.layers[op.layer]
        assert all(t.is_contiguous() and t.shape[0] == wl.prompt_len + wl.gen_len for t in host)
        moved.append(to_device)
        if not to_device:
            for t in self._batches[op.batch].kv_dev[op.layer]:
                t.fill_(float("nan"))

    real_kv_dev, held, runs, lengths = Executor._kv_dev, [], [], {}

    def counting(self, bst, op):
        kv = real_kv_dev(self, bst, op)
        held.append(sum(x is not None for b in self._batches for x in b.kv_dev))
        runs.append(self)
        lengths.setdefault((op.batch, op.layer), set()).add((op.step, kv[0].shape[2]))
        return kv

    monkeypatch.setattr(Executor, "_kv_copy", released_after_store)
    monkeypatch.setattr(Executor, "_kv_dev", counting)
    result, out = real_execute(mixtral_tiny, spec, mode, device=device)
    kinds = result.trace["kind"].value_counts()
    assert kinds["kv-load"] == moved.count(True) > 0 and kinds["kv-store"] == moved.count(False)
    # the device holds a host-kept layer's cache only between its KV_LOAD and KV_STORE
    stored = result.trace.loc[result.trace["kind"] == "kv-store", ["batch", "layer"]]
    kept = {(b, layer) for b in range(wl.n_batches) for layer in range(model.n_layers)}
    kept -= set(map(tuple, stored.to_numpy()))
    assert all(
        runs[-1]._batches[b].kv_dev[layer] is None for b, layer in map(tuple, stored.to_numpy())
    )
    assert len(kept) <= max(held) < wl.n_batches * model.n_layers
    # a host-kept layer's device cache holds the step's positions, the bytes the schedule
    # allocates for it; a device-kept one every position the run writes
    p, full = wl.prompt_len, wl.prompt_len + wl.gen_len
    for b, layer in map(tuple, stored.to_numpy()):
        assert lengths[(b, layer)] == {(t, p + t) for t in range(wl.gen_len)}, (b, layer)
    assert all({n for _, n in lengths[k]} == {full} for k in kept)
    assert_matches_reference(mixtral_tiny, spec, result, out, ATOL if device == "cpu" else CUDA_TOL)


def test_host_activation_buffers_are_slots_of_the_store_slabs(mixtral_tiny, monkeypatch):
    """Fiddler moves activations between host and device for its CPU experts. Their host
    buffers are slabs of the store's (pinned at their exact size on CUDA), not taken from
    PyTorch's pinned allocator, which rounds each up to a power of two."""
    runs = []
    real_copy = Executor._scratch_copy

    def spy(self, op):
        real_copy(self, op)
        runs.append(self)

    monkeypatch.setattr(Executor, "_scratch_copy", spy)
    real_execute(mixtral_tiny, spec_for(mixtral_tiny, "fiddler"), "replay")
    ex = runs[0]
    host = [b for key, b in ex._scratch.items() if key.startswith("host")]
    slabs = [(s.data_ptr(), s.data_ptr() + s.numel()) for s, _, _ in ex.store.slabs._slabs.values()]
    # each in a slab of its own size: a buffer taken once a run leaves no unused slots beside it
    own = [(b.data_ptr(), b.data_ptr() + round_up(b.numel(), ALIGN)) for b in host]
    assert host and all(o in slabs for o in own)
    # and not handed out again while the executor holds it: not to the other direction's
    # buffer, nor to the next buffer of that size (a unit's weights, say)
    assert len({b.data_ptr() for b in host}) == len(host) == 2
    again = [ex.store.slabs.take(b.numel(), alone=True) for b in host]
    assert not {a.data_ptr() for a in again} & {b.data_ptr() for b in host}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("planner, mode", runnable(planner_names()))
def test_cuda_streams_match_in_memory_forward(mixtral_tiny, planner, mode):
    """Every planner on CUDA streams: the offload planners' copy streams, and the replication
    planners' G devices as G CUDA streams on one GPU (issue 5's single-GPU case)."""
    spec = spec_for(mixtral_tiny, planner)
    result, out = real_execute(mixtral_tiny, spec, mode, device="cuda")
    assert set(result.trace["source"]) == {"real"} and out.fallback_loads == 0
    assert_matches_reference(mixtral_tiny, spec, result, out, CUDA_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["replay", "live"])
def test_cuda_streams_fill_shared_buffers_part_by_part(f32_ckpt, mode):
    """DeepSeek-V2 shape on 2 GPUs' CUDA streams of one GPU: each stream gates and runs the
    shared experts of its own sequence into buffers the first of them zeroes; every part's rows
    must survive the other stream's fill (real/ops.py `_landed`)."""
    ckpt = f32_ckpt("deepseek-v2-lite")
    spec = spec_for(ckpt, "predictive_replication")
    result, out = real_execute(ckpt, spec, mode, device="cuda")
    assert out.fallback_loads == 0
    assert_matches_reference(ckpt, spec, result, out, CUDA_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("planner", sorted(RESIDENT))
def test_cuda_lanes_match_in_memory_forward(mixtral_tiny, planner):
    """4 lanes as 4 CUDA streams on one GPU, against the CPU in-memory forward."""
    check_lanes_run(mixtral_tiny, planner, "replay", device="cuda")


def test_a_run_dir_holds_its_prompts_and_tokens(mixtral_tiny, tmp_path):
    """A real run's dir holds tokens.safetensors (`prompts` [S, P], `tokens` [S, gen_len],
    int64): the tokens a free-running in-memory forward generates from those prompts, readable
    without moepipe's API. A simulated run has no tokens, so no file."""
    from safetensors.numpy import load_file

    from experiments.common.pipeline import TOKENS_FILE, write_run

    spec = spec_for(mixtral_tiny, "flexgen")
    result, out = real_execute(mixtral_tiny, spec, "live")
    write_run(tmp_path / "real", result)
    saved = load_file(tmp_path / "real" / TOKENS_FILE)
    wl = spec.workload.with_(n_batches=result.summary["n_batches"])
    assert saved["prompts"].shape == (wl.n_sequences, wl.prompt_len)
    assert saved["tokens"].shape == (wl.n_sequences, wl.gen_len)
    assert torch.equal(torch.from_numpy(saved["tokens"]), out.tokens)
    free, _ = reference_generate(mixtral_tiny, torch.from_numpy(saved["prompts"]), wl.gen_len)
    assert torch.equal(torch.from_numpy(saved["tokens"]), free)
    write_run(tmp_path / "sim", simulate_run(spec))
    assert not (tmp_path / "sim" / TOKENS_FILE).exists()


@pytest.mark.parametrize("mode", ["replay", "live"])
@pytest.mark.parametrize("attn_batches", [0, 2])
def test_attention_over_several_batches_matches_in_memory_forward(mixtral_tiny, attn_batches, mode):
    """Klotski's attention over spans of batches (the group's at decode, or pairs at every
    step, the last span shorter): one call per span over the group's device cache of the layer,
    whose per-batch slices the spans read and write in place, and one gate op per span; tokens
    and logits as the in-memory forward's, every op traced once under its own id."""
    model, _ = load_checkpoint(mixtral_tiny)
    wl = WORKLOAD.with_(n_batches=3)
    spec = RunSpec(model, OFFLOAD, wl, "klotski", {"n": -1, "attn_batches": attn_batches})
    result, out = real_execute(mixtral_tiny, spec, mode)
    spans = [o for o in result.schedule.ops if o.kind == OpKind.ATTENTION and o.batches > 1]
    assert spans, "the placement keeps KV on the device: the planner merges"
    assert {o.batches for o in spans} == ({3} if attn_batches == 0 else {2})
    assert all(o.step > 0 for o in spans) == (attn_batches == 0)
    assert_matches_reference(mixtral_tiny, spec, result, out)
    trace = result.trace
    assert sorted(trace["op_id"]) == list(range(len(result.schedule)))
    merged = trace[trace["batches"] > 1]
    gates = [o for o in result.schedule.ops if o.kind == OpKind.GATE and o.batches > 1]
    assert len(gates) == len(spans), "the gates follow the attention's spans"
    assert len(merged) == 2 * len(spans)
    assert set(merged["kind"]) == {str(OpKind.ATTENTION), str(OpKind.GATE)}
    assert out.fallback_loads == 0


def test_consecutive_batch_caches_are_one_view_else_none():
    """A span's caches are one view only where they are the next rows of one tensor each."""
    from real.ops import _consecutive

    group = (torch.arange(6 * 2 * 3.0).view(6, 2, 3, 1), torch.zeros(6, 2, 3, 1))
    caches = [tuple(t[k * 2 : (k + 1) * 2] for t in group) for k in range(3)]
    whole = _consecutive(caches[1:])
    assert whole is not None and torch.equal(whole[0], group[0][2:6])
    whole[1][0, 0, 0, 0] = 7.0  # a view: writes land in the batches' caches
    assert caches[1][1][0, 0, 0, 0] == 7.0
    assert _consecutive([caches[0], caches[2]]) is None  # not adjacent
    apart = tuple(t.clone() for t in caches[1])
    assert _consecutive([caches[0], apart]) is None  # made apart
