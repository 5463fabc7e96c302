"""Shared fixtures for the real executor's tests: seeded checkpoints written once per session.

`small_overrides(name)` shrinks any conf/model to a few layers of width 64 while keeping its
family's structure (dense layers, shared experts, GQA ratio, top-k).
"""

from pathlib import Path

import pytest
import torch

from core.schedule import ScheduleBuilder
from core.types import Resource
from real.checkpoint import CONF_MODEL_DIR, reduced_spec
from real.checkpoint_write import write_checkpoint

ALL_MODELS = sorted(p.stem for p in CONF_MODEL_DIR.glob("*.yaml"))


def small_overrides(name: str) -> dict:
    base = reduced_spec(name)
    kw = dict(hidden_size=64, n_heads=4, expert_ffn_size=32, vocab_size=128)
    kw["n_layers"] = 4 if base.family == "switch_transformers" else 3
    kw["n_experts"] = min(base.n_experts, 16 if base.top_k > 2 else 8)
    if base.n_kv_heads != base.n_heads:
        kw["n_kv_heads"] = 2
    if base.dense_ffn_size and base.family != "switch_transformers":
        kw["dense_ffn_size"] = 48
    return kw


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="session")
def mixtral_tiny(ckpt_root) -> Path:
    return write_checkpoint(reduced_spec("mixtral-tiny"), ckpt_root / "mixtral-tiny", seed=0)


@pytest.fixture(scope="session")
def small_ckpt(ckpt_root):
    """name -> a reduced checkpoint of that conf/model (written on first use; its own directory,
    so `small_ckpt("mixtral-tiny")` does not overwrite the `mixtral_tiny` fixture)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            spec = reduced_spec(name, **small_overrides(name))
            made[name] = write_checkpoint(spec, ckpt_root / "small" / name, seed=1)
        return made[name]

    return get


@pytest.fixture
def prompt() -> torch.Tensor:
    """[B=2, P=6] token ids < 128 (valid for every reduced model)."""
    return torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="session")
def f32_ckpt(ckpt_root):
    """name -> the `small_overrides` checkpoint of that conf/model in float32 (bf16 would round
    a forward split over devices, by sequence or by head, differently from the whole)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            spec = reduced_spec(name, **small_overrides(name), dtype_bytes=4)
            made[name] = write_checkpoint(spec, ckpt_root / "f32" / name, seed=1)
        return made[name]

    return get


def two_rank_builder() -> ScheduleBuilder:
    """A schedule builder with streams gpu{d}, send{d} (p2p_out) and in{d} (p2p) on devices 0
    and 1: the ops of two ranks' transfers."""
    b = ScheduleBuilder({})
    for d in (0, 1):
        b.stream(f"gpu{d}", Resource.GPU, d)
        b.stream(f"send{d}", Resource.P2P_OUT, d)
        b.stream(f"in{d}", Resource.P2P, d)
    return b
