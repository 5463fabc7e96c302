"""More config.json fields on checkpoints transformers itself writes (tests/real/test_hf_parity.py
has the families' main cases and builds them the same way): fields whose tensors moepipe must
name rather than call unread, and degenerate sizes transformers still saves weights for.

Usage: python -m pytest -q tests/real/test_hf_parity_fields.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from core.errors import ConfigError
from real.checkpoint import load_checkpoint
from tests.real.test_hf_parity import hf_config

transformers = pytest.importorskip("transformers")


def save(family: str, fields: dict[str, Any], to: Path) -> tuple[Path, Any]:
    """A seeded float32 model of the family with `fields`, saved by transformers to `to`, and
    transformers' model loaded back from it."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, fields)).eval()
    model.save_pretrained(to)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(to, dtype=torch.float32)
    return to, loaded.eval()


# (family, field): biases transformers' class adds (and saves) where the field is true
BIASES = [
    ("olmoe", "attention_bias"),
    ("deepseek_v2", "attention_bias"),
    ("deepseek_v2", "mlp_bias"),
]


@pytest.mark.parametrize("family, field", BIASES, ids=[f"{f}-{k}" for f, k in BIASES])
def test_a_bias_field_is_named_not_its_tensors(family, field, tmp_path):
    """A checkpoint with the biases of a field moepipe does not run is refused naming the field,
    as a config.json alone is; before, the bias tensors were named as read by nothing ("a field
    moepipe does not model, or a config.json of another model"), the field not at all."""
    ckpt, _ = save(family, {field: True}, tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=rf"config.json: {field}=true; {family} projections"):
        load_checkpoint(ckpt)
