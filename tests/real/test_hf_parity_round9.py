"""A ninth round: Switch's dense_act_fn, longrope and proportional RoPE, float16 compute, and
DeepSeek-V2's fields its transformers class ignores, on checkpoints transformers writes.

Usage: python -m pytest -q tests/real/test_hf_parity_round9.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from core.hf_config.runtime import GATED_ACTS
from real.checkpoint import Tensor, load_checkpoint, load_units
from real.model import Model, reference_generate
from tests.real.test_hf_parity_round5 import SWITCH, SWITCH_LAYERS, SWITCH_SPARSE

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def switch(tmp_path_factory):
    """dense_act_fn -> (checkpoint, transformers' model) of one seeded Switch, built on first
    use (the same weights under each activation)."""
    root = tmp_path_factory.mktemp("round9-switch")
    made: dict[str, tuple[Path, Any]] = {}

    def get(act: str) -> tuple[Path, Any]:
        if act not in made:
            sizes = SWITCH | SWITCH_LAYERS | SWITCH_SPARSE
            cfg = transformers.SwitchTransformersConfig(**sizes, dense_act_fn=act)
            torch.manual_seed(0)
            model = transformers.SwitchTransformersForConditionalGeneration(cfg).eval()
            model.save_pretrained(root / act)
            made[act] = root / act, model
        return made[act]

    return get


@pytest.mark.parametrize("act", GATED_ACTS)
def test_switch_dense_act_fn_is_transformers(act, switch, prompt):
    """Every ACT2FN name the causal families run, as Switch's dense_act_fn: moepipe's experts
    and dense FFNs (wo(act(wi x))) equal transformers' SwitchTransformersDenseActDense on the
    saved weights within 1e-6, and a generation runs with it (moepipe's Switch is a causal
    substitute, so its logits are its own). Before: refused ("only 'relu' experts")."""
    ckpt, hf = switch(act)
    spec, units = load_units(ckpt)
    model = Model.from_checkpoint(ckpt, spec)
    assert model.hidden_act == act
    x = torch.randn(5, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    blocks = hf.encoder.block
    checked = 0
    for unit, w in units.items():
        if unit.kind == Tensor.EXPERT:
            mlp = blocks[unit.layer].layer[-1].mlp.experts[f"expert_{unit.expert}"]
            ours = model.expert(w, x)
        elif unit.kind == Tensor.FFN:
            mlp = blocks[unit.layer].layer[-1].mlp
            ours = model._ffn(w, x)
        else:
            continue
        with torch.no_grad():
            torch.testing.assert_close(ours, mlp(x), atol=1e-6, rtol=0)
        checked += 1
    assert checked == spec.n_experts + 1  # one sparse layer's experts, one dense layer
    tokens, _ = reference_generate(ckpt, prompt, 2)
    assert tokens.shape == (2, 2)


def test_switch_dense_act_fn_changes_the_logits(switch, prompt):
    """The activation runs: gelu's logits differ from relu's on the same weights."""
    _, relu = reference_generate(switch("relu")[0], prompt, 2)
    _, gelu = reference_generate(switch("gelu")[0], prompt, 2)
    assert (relu - gelu).abs().max() > 1e-3


def test_switch_unknown_dense_act_fn_is_one_line(switch, tmp_path):
    """An ACT2FN name moepipe does not run (or none at all) is refused naming the field."""
    import shutil

    from core.errors import ConfigError
    from tests.real.test_hf_parity_fields import edit_config

    shutil.copytree(switch("relu")[0], tmp_path / "c")
    edit_config(tmp_path / "c", dense_act_fn="mish")
    with pytest.raises(ConfigError, match="dense_act_fn='mish' is not implemented for switch"):
        load_checkpoint(tmp_path / "c")
