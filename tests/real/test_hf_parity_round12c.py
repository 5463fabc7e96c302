"""Parity round 12's loose ends (issue 48): yarn's beta_fast and beta_slow of 0, which
transformers reads as its defaults (`rope_parameters.get("beta_fast") or 32`, `or 1`) and
moepipe refused ("must be a positive number or null"): now read as transformers reads them.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

ORIG = 4096  # original_max_position_embeddings: where the betas choose which dims stretch


def yarn(**betas: float) -> dict:
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG}
    return {"rope_parameters": {"rope_theta": 1e4, **rope, **betas}}


@pytest.fixture(scope="module")
def zero_betas(tmp_path_factory):
    """A mixtral checkpoint saved by transformers with beta_fast 0 and beta_slow 0, and
    transformers' model loaded back from it."""
    from tests.real.test_hf_parity_fields import save

    root = tmp_path_factory.mktemp("round12c")
    return save("mixtral", yarn(beta_fast=0, beta_slow=0), root / "zero")


def test_yarn_betas_of_0_are_transformers(zero_betas, prompt):
    """beta_fast 0 and beta_slow 0: transformers' greedy tokens and float32 logits. Before:
    refused, 'rope_parameters.beta_fast must be a positive number or null, got 0'."""
    from tests.real.test_hf_parity_fields import assert_transformers

    ckpt, hf = zero_betas
    assert_transformers(ckpt, hf, prompt, "f32")


def test_yarn_betas_of_0_are_the_defaults(zero_betas, prompt, tmp_path):
    """0 means 32 and 1: the logits of the same weights with the betas left out are equal, and
    another beta_fast gives others (the betas are read at all)."""
    import shutil

    from real.model import reference_generate
    from tests.real.test_hf_parity_fields import edit_config

    ckpt, _ = zero_betas
    _, zero = reference_generate(ckpt, prompt, 2)
    for name, rope in [("absent", yarn()), ("other", yarn(beta_fast=4, beta_slow=2))]:
        shutil.copytree(ckpt, tmp_path / name)
        edit_config(tmp_path / name, **rope)
    assert torch.equal(zero, reference_generate(tmp_path / "absent", prompt, 2)[1])
    assert not torch.equal(zero, reference_generate(tmp_path / "other", prompt, 2)[1])


@pytest.mark.parametrize("field", ["beta_fast", "beta_slow"])
def test_a_negative_beta_is_refused(zero_betas, tmp_path, field):
    """Below 0 (transformers takes a log of it: NaN frequencies) is still one line naming it."""
    import shutil

    from core.errors import ConfigError
    from real.checkpoint import load_checkpoint
    from tests.real.test_hf_parity_fields import edit_config

    shutil.copytree(zero_betas[0], tmp_path / "c")
    edit_config(tmp_path / "c", **yarn(**{field: -1}))
    with pytest.raises(ConfigError, match=f"{field} must be a positive number, 0 .the default"):
        load_checkpoint(tmp_path / "c")
