"""Probe class: a size that would eat the machine's memory or run for hours instead of being
refused. A run's size is checked before the work it sizes (its ops before planning, the
synthetic generator's tables before routing), a count no routing can hold is refused where the
model is built, and the expert-parallel all-to-all is counted in G x E, not G x G x E, so a
run of thousands of devices runs instead of asking for the memory of a cluster."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.dispatch import micro_batch_seqs, traffic
from core.spec import ModelSpec, Workload
from planners.ep.params import MAX_DEVICES, EPParams
from tests.probes.conftest import TINY, one_line, raises_one_line


def _planner_never_made(*args: Any, **kw: Any) -> Any:
    raise AssertionError("the planner was made: the size was not checked first")


@pytest.mark.parametrize("planner", ["flexgen", "klotski"])
def test_a_million_generated_tokens_is_refused_before_planning(
    tmp_path: Path, planner: str, cli_here: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gen_len=10**6 on the tiny model: little routing (a 200 MB check skipped it, and with it
    the check of the ops), about 4e7 ops (60 GB at 1.5 KB each). It planned until the machine's
    memory ran out; Klotski's choice of n read every step first. Now one line naming gen_len,
    before any planner is made (this machine's RAM set to 8 GB, below the need)."""
    monkeypatch.setattr("experiments.common.pipeline._available_ram_bytes", lambda: 8 * 10**9)
    monkeypatch.setattr("experiments.common.pipeline.make_planner", _planner_never_made)
    args = [*TINY[:-1], f"planner={planner}", "workload.gen_len=1000000"]
    r = cli_here("experiments.run", *args, f"hydra.run.dir={tmp_path / 'run'}")
    one_line(r, "gen_len=1000000", "ops", "RAM", "lower gen_len")


def test_more_experts_than_an_int16_id_holds_is_refused(tiny_model: ModelSpec) -> None:
    """Routing holds expert ids as int16: expert 39999 was stored as -25537 and the run went on
    with it. The model is refused where it is built (its YAML or a config.json alike)."""
    raises_one_line(lambda: replace(tiny_model, n_experts=40000), "n_experts=40000", "32767")
    replace(tiny_model, n_experts=32767)  # the largest an id holds


def test_synthetic_tables_beyond_any_machines_ram_are_one_line(
    tmp_path: Path, cli_here: Any
) -> None:
    """2000 MoE layers of 32767 experts: the generator's [L, E, E] tables are about 100 TB.
    It said "out of memory" (numpy's refusal) naming nothing; now the line names the layers
    and n_experts, and what to do."""
    args = [*TINY, "model.n_layers=2000", "model.moe_layers=null", "model.n_experts=32767"]
    r = cli_here("experiments.run", *args, f"hydra.run.dir={tmp_path / 'run'}")
    one_line(r, "2000 MoE layers", "n_experts=32767", "workload.routing.source=trace")


def _traffic_by_pairs(tokens: np.ndarray, sources: np.ndarray) -> np.ndarray:
    """`traffic` by its definition: the overlap of source s's run of each expert with
    destination d's, pair by pair."""
    g, e = tokens.shape
    src = np.vstack([np.zeros(e, np.int64), np.cumsum(sources, 0)])
    dst = np.vstack([np.zeros(e, np.int64), np.cumsum(tokens, 0)])
    out = np.zeros((g, g), np.int64)
    for s in range(g):
        for d in range(g):
            lo, hi = np.maximum(src[s], dst[d]), np.minimum(src[s + 1], dst[d + 1])
            out[s, d] = np.clip(hi - lo, 0, None).sum()
    return out


def test_the_all_to_all_of_thousands_of_devices_is_counted_in_g_by_e() -> None:
    """traffic() built [G, G, E] arrays: 3000 devices of 3000 experts asked for 216 GB at
    once (400 devices of 1000 experts took 5 GB and most of two minutes). Now its arrays are
    [G, E]: 2000 devices of 2000 experts run (64 GB as [G, G, E], past this machine's
    memory); the pairs are those of the definition on small random cases, zero counts
    included."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        g, e = int(rng.integers(1, 7)), int(rng.integers(1, 7))
        sources = rng.integers(0, 4, (g, e)) * (rng.random((g, e)) < 0.7)
        tokens = np.zeros((g, e), np.int64)
        for j in range(e):  # the column's pairs cut among the devices at random
            cuts = np.sort(rng.integers(0, sources[:, j].sum() + 1, g - 1))
            tokens[:, j] = np.diff(np.concatenate([[0], cuts, [sources[:, j].sum()]]))
        assert (traffic(tokens, sources) == _traffic_by_pairs(tokens, sources)).all()
    g = 2000
    sources = np.eye(g, dtype=np.int64)  # device d's one token routes to expert d
    tokens = np.roll(sources, 1, axis=0)  # and expert d runs on device d + 1
    moved = traffic(tokens, sources)
    d = np.arange(g)
    assert moved.sum() == g and (moved[d, (d + 1) % g] == 1).all()


def test_micro_batch_seqs_of_many_devices_are_each_devices_contiguous_share() -> None:
    """The closed form (a sum over G devices, called for each of G devices, was G^2 Python
    steps a layer: 3000 devices spent a minute there) gives each device its share in order."""
    for bs, g in [(7, 3), (2, 5), (16, 4), (1000, 3000)]:
        spans = [micro_batch_seqs(bs, g, 1, d, -1) for d in range(g)]
        sizes = [s1 - s0 for s0, s1 in spans]
        assert spans[0][0] == 0 and spans[-1][1] == bs
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_more_expert_parallel_devices_than_modelled_is_one_line(
    tmp_path: Path, cli_here: Any
) -> None:
    """10,000 devices of 10,000 experts ran for minutes in 8 GB and had not finished (each
    device's receive waits on every other's send). n_devices is refused before routing is
    built; the hardware's n_gpus behind n_devices=0 where the layout is resolved."""
    raises_one_line(lambda: EPParams(n_devices=MAX_DEVICES + 1), "n_devices=2049", "at most")
    args = [*TINY[:-1], "planner=eplb", "model.n_experts=2049", "hardware.n_gpus=2049"]
    r = cli_here("experiments.run", *args, f"hydra.run.dir={tmp_path / 'run'}")
    one_line(r, "n_devices=0", "n_gpus=2049", f"at most {MAX_DEVICES}")


class _Stop(Exception):
    pass


def test_klotskis_warm_up_of_a_long_prompt_is_bounded(
    tiny_model: ModelSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Klotski's choice of n generates warm-up routing of whole sequences before any check of
    the run's size: a prompt of 3M tokens ran past a minute there. Its sequences are now cut
    to WARMUP_POSITIONS, whatever the workload's."""
    from planners.klotski import WARMUP_POSITIONS, warmup_table

    seen: list[int] = []

    def record(model: ModelSpec, wl: Workload, first_chunk: int = 0) -> Any:
        seen.append(wl.seq_positions)
        raise _Stop

    monkeypatch.setattr("core.synthetic.synthetic_routing", record)
    for prompt, gen in [(3_000_000, 4), (8, 10_000_000), (WARMUP_POSITIONS, 2)]:
        wl = Workload(batch_size=2, n_batches=2, prompt_len=prompt, gen_len=gen)
        with pytest.raises(_Stop):
            warmup_table(tiny_model, wl, 8)
    assert seen == [WARMUP_POSITIONS] * 3


@pytest.mark.parametrize("count", [2**62, 1e300], ids=["int64 wraps", "float"])
def test_an_aggregate_count_past_any_trace_is_named(tmp_path: Path, count: float) -> None:
    """Counts of 2**62 in the aggregate counts file: a row of 8 summed to 2**65, wrapped to 0,
    and the line said the row counts no tokens. Now a count past MAX_COUNT is named as such."""
    from core.traces import COUNTS_FILE, COUNTS_NAME, load_counts

    (tmp_path / COUNTS_NAME).mkdir()
    counts = np.full((5, 3, 8), count, dtype=np.int64 if isinstance(count, int) else float)
    np.savez(tmp_path / COUNTS_NAME / COUNTS_FILE, mixtral_counts_topk=counts)
    load = lambda: load_counts(tmp_path, "mixtral_counts_topk", 8)  # noqa: E731
    raises_one_line(load, COUNTS_FILE, "mixtral_counts_topk", "above 1e+15")
