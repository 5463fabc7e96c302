"""A fifth round of config.json fields on checkpoints transformers itself writes
(tests/real/test_hf_parity.py builds them the same way): return_dict false, which transformers'
forward fails on, and Switch's router_dtype, which moves its logits.

Usage: python -m pytest -q tests/real/test_hf_parity_round5.py
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from core.errors import ConfigError
from real.model import reference_generate
from tests.real.test_hf_parity import GEN
from tests.real.test_hf_parity_fields import edit_config, save

transformers = pytest.importorskip("transformers")

CLASSES = {
    "mixtral": "MixtralConfig",
    "qwen2_moe": "Qwen2MoeConfig",
    "olmoe": "OlmoeConfig",
    "deepseek_v2": "DeepseekV2Config",
    "switch_transformers": "SwitchTransformersConfig",
}


SWITCH = dict(vocab_size=128, d_model=32, d_kv=8, d_ff=32, num_heads=4, num_experts=4)
SWITCH_LAYERS = dict(num_layers=2, num_decoder_layers=2)
SWITCH_SPARSE = dict(num_sparse_encoder_layers=1, num_sparse_decoder_layers=1)


def logits_of(hf: Any, prompt: torch.Tensor) -> torch.Tensor:
    """transformers' forward logits over the prompt (Switch: the prompt on both sides)."""
    extra = {"decoder_input_ids": prompt} if hf.config.model_type == "switch_transformers" else {}
    with torch.inference_mode():
        out = hf(prompt, **extra)
    return out[0] if isinstance(out, tuple) else out.logits


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """family -> (checkpoint, transformers' model from it), float32, built on first use."""
    root = tmp_path_factory.mktemp("round5")
    made: dict[str, tuple[Path, Any]] = {}

    def get(family: str) -> tuple[Path, Any]:
        if family not in made:
            if family == "switch_transformers":
                cfg = transformers.SwitchTransformersConfig(
                    **SWITCH, **SWITCH_LAYERS, **SWITCH_SPARSE
                )
                torch.manual_seed(0)
                model = transformers.SwitchTransformersForConditionalGeneration(cfg).eval()
                model.save_pretrained(root / family)
                made[family] = root / family, model
            else:
                made[family] = save(family, {}, root / family)
        return made[family]

    return get


def edited(ckpt: Path, to: Path, **fields: Any) -> Path:
    shutil.copytree(ckpt, to)
    edit_config(to, **fields)
    return to


def test_switch_router_dtype_other_than_float32_is_refused(base, prompt, tmp_path):
    """Switch's router_dtype bfloat16: transformers' router computes its logits and softmax in
    bfloat16, which moves its forward's logits (here a float32 model's); moepipe routed in
    float32, ignoring the field. It is refused in one line naming it."""
    ckpt, hf = base("switch_transformers")
    bad = edited(ckpt, tmp_path / "bf16", router_dtype="bfloat16")
    cls = transformers.SwitchTransformersForConditionalGeneration
    other = cls.from_pretrained(bad, dtype=torch.float32).eval()
    assert not torch.equal(logits_of(other, prompt), logits_of(hf, prompt))
    with pytest.raises(ConfigError, match=r"config.json: router_dtype='bfloat16'; switch_trans"):
        reference_generate(bad, prompt, GEN)
    edit_config(bad, router_dtype="float32")
    assert reference_generate(bad, prompt, GEN)[0].shape == (2, GEN)


@pytest.mark.parametrize("family", CLASSES)
def test_return_dict_false_is_refused(family, base, prompt, tmp_path):
    """return_dict false in config.json: transformers' forward fails in every family (its inner
    model then returns a tuple, read as an output object); moepipe ran it, ignoring the field.
    It is refused in one line naming it. Null, which transformers runs returning a tuple of the
    same logits, runs."""
    ckpt, hf = base(family)
    cls = type(hf)
    bad = edited(ckpt, tmp_path / "false", return_dict=False)
    with pytest.raises(AttributeError, match="'tuple' object has no attribute"):
        logits_of(cls.from_pretrained(bad, dtype=torch.float32).eval(), prompt)
    with pytest.raises(ConfigError, match=r"config.json: return_dict=false: transformers' "):
        reference_generate(bad, prompt, GEN)
    edit_config(bad, return_dict=None)
    null = cls.from_pretrained(bad, dtype=torch.float32).eval()
    assert torch.equal(logits_of(null, prompt), logits_of(hf, prompt))
    assert torch.equal(
        reference_generate(bad, prompt, GEN)[0], reference_generate(ckpt, prompt, GEN)[0]
    )
