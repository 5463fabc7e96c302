"""A third round of config.json fields on checkpoints transformers itself writes
(tests/real/test_hf_parity.py builds them the same way): a saved LM head where config.json ties
it, DeepSeek-V2's num_key_value_heads, and a top-level partial_rotary_factor.

Usage: python -m pytest -q tests/real/test_hf_parity_round3.py
"""

from __future__ import annotations

import pytest
import torch

from core.errors import ConfigError
from real.checkpoint import load_checkpoint
from real.model import reference_generate
from real.shards import read_header, read_tensor, save_shard
from tests.real.test_hf_parity import GEN
from tests.real.test_hf_parity_fields import assert_transformers, edit_config, load_hf, save

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2"])
def test_a_saved_head_runs_where_config_json_ties_it(family, prompt, tmp_path):
    """tie_word_embeddings true over a checkpoint that saves its own lm_head: transformers
    (from_pretrained) runs the saved head where it differs from the embedding, and so does
    moepipe; before, moepipe ran the embedding as the head (observed 3.6 and 4.4 off)."""
    ckpt, _ = save(family, {}, tmp_path / "ckpt")
    edit_config(ckpt, tie_word_embeddings=True)
    hf = load_hf(ckpt)
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)
    assert_transformers(ckpt, hf, prompt, "f32")


def test_a_tied_checkpoint_of_the_head_alone_runs_it_as_the_embedding(prompt, tmp_path):
    """A tied checkpoint that saves lm_head but not the embedding: transformers ties the
    embedding to the saved head, and so does moepipe; before, it refused the checkpoint
    ("model.embed_tokens.weight is missing")."""
    ckpt, _ = save("mixtral", {"tie_word_embeddings": True}, tmp_path / "ckpt")
    file = ckpt / "model.safetensors"
    tensors = {name: read_tensor(e).clone() for name, e in read_header(file).items()}
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_shard(tensors, file, {"format": "pt"})
    assert_transformers(ckpt, load_hf(ckpt), prompt, "f32")


def test_deepseek_kv_heads_other_than_heads_are_refused_naming_the_field(tmp_path):
    """DeepSeek-V2 with num_key_value_heads 2 of 4 heads: transformers saves it but its MLA
    fails on it (it repeats the per-head keys by heads / kv heads); moepipe ran it as 4 key/value
    heads, ignoring the field. It is refused in one line naming the field (at v_head_dim 16, not
    the qk dims' 24: where they are one width, transformers' sdpa runs it as 4 key/value heads,
    and so does moepipe, tests/real/test_hf_parity_round27.py)."""
    ckpt, hf = save("deepseek_v2", {"num_key_value_heads": 2}, tmp_path / "ckpt")
    with pytest.raises(RuntimeError):
        hf(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"num_key_value_heads=2 with num_attention_heads=4 a"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v2"])
def test_a_top_level_partial_rotary_factor_of_a_scaled_rope_is_refused(family, prompt, tmp_path):
    """partial_rotary_factor 0.5 at config.json's top level with dynamic RoPE: transformers
    moves it into rope_parameters and then fails, as with it inside; moepipe read only the one
    inside and ran whole-head RoPE. It is refused in one line naming the field; with default
    RoPE both ignore it and agree."""
    theta = 1e4
    dynamic = {"rope_type": "dynamic", "factor": 8.0, "rope_theta": theta}
    fields = {"max_position_embeddings": 2, "rope_parameters": dynamic}
    ckpt, _ = save(family, fields, tmp_path / "dynamic")
    edit_config(ckpt, partial_rotary_factor=0.5)
    with pytest.raises(RuntimeError):
        load_hf(ckpt)(prompt)
    with pytest.raises(ConfigError, match=r": partial_rotary_factor=0.5 with dynamic RoPE"):
        reference_generate(ckpt, prompt, GEN)
    plain, _ = save(family, {}, tmp_path / "default")
    edit_config(plain, partial_rotary_factor=0.5)
    assert_transformers(plain, load_hf(plain), prompt, "f32")
