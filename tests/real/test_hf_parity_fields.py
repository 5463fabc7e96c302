"""More config.json fields on checkpoints transformers itself writes (tests/real/test_hf_parity.py
has the families' main cases and builds them the same way): degenerate sizes transformers still
saves weights for, and fields left to transformers' defaults.

Usage: python -m pytest -q tests/real/test_hf_parity_fields.py
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from core.errors import ConfigError
from core.hf_config import hf_config_to_spec
from real.checkpoint import load_checkpoint
from real.model import reference_generate
from tests.real.test_hf_parity import DTYPES, GEN, hf_config, hf_generate_out, hf_greedy

transformers = pytest.importorskip("transformers")


def save(family: str, fields: dict[str, Any], to: Path, dtype: str = "f32") -> tuple[Path, Any]:
    """A seeded model of the family with `fields` in `dtype` (a key of DTYPES), saved by
    transformers to `to`, and transformers' model loaded back from it."""
    return save_cast(family, fields, to, DTYPES[dtype], DTYPES[dtype])


def save_cast(
    family: str,
    fields: dict[str, Any],
    to: Path,
    saved: torch.dtype,
    run: torch.dtype,
    prepare: Callable[[Any], None] | None = None,
) -> tuple[Path, Any]:
    """`save`, the model saved in `saved` and loaded back in `run`; `prepare(model)` first
    where given (to draw weights transformers initialises to constants)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, fields))
    if prepare is not None:
        prepare(model)
    model.to(saved).eval().save_pretrained(to)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(to, dtype=run)
    return to, loaded.eval()


def edit_config(ckpt: Path, **fields: Any) -> None:
    """Rewrite `fields` into the checkpoint's config.json (a field transformers' classes do not
    write, or a value they refuse to)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(cfg | fields))


def load_hf(ckpt: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def assert_transformers(ckpt: Path, hf: Any, prompt: torch.Tensor, dtype: str) -> None:
    """moepipe's greedy tokens are transformers', its last logits within 1e-4 in float32 (one
    bf16 step of |logit| < 4 in bfloat16), as tests/real/test_hf_parity.py asks."""
    tokens, logits = reference_generate(ckpt, prompt, GEN)
    hf_tokens, hf_logits = hf_greedy(hf, prompt)
    assert torch.equal(tokens, hf_tokens)
    tol = 1e-4 if dtype == "f32" else 2**-6
    torch.testing.assert_close(logits, hf_logits, atol=tol, rtol=0)


# (family, the field that sizes the shared expert 0): transformers still saves one, of width 0
NO_SHARED = [("qwen2_moe", "shared_expert_intermediate_size"), ("deepseek_v2", "n_shared_experts")]


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family, field", NO_SHARED, ids=[f for f, _ in NO_SHARED])
def test_a_shared_expert_of_width_0_runs_as_none(family, field, dtype, prompt, tmp_path):
    """A shared expert sized 0 adds exactly 0, so moepipe runs the model without one and gives
    transformers' logits; before, its saved tensors of no elements (and Qwen2-MoE's gate) were
    refused as read by nothing. A shared expert with weights config.json sizes 0 is still."""
    ckpt, hf = save(family, {field: 0}, tmp_path / "ckpt", dtype)
    assert_transformers(ckpt, hf, prompt, dtype)
    if dtype == "f32":
        full, _ = save(family, {}, tmp_path / "full")
        cfg = json.loads((full / "config.json").read_text()) | {field: 0}
        (full / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ConfigError, match="shared_expert"):
            load_checkpoint(full)


# (family, fields): a sliding window of 1 on every layer (Mixtral) or the even ones (Qwen2-MoE)
WINDOW_1 = [
    ("mixtral", {"sliding_window": 1}),
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 1, "max_window_layers": 2}),
]


@pytest.mark.parametrize("family, fields", WINDOW_1, ids=[f for f, _ in WINDOW_1])
def test_a_sliding_window_of_1_is_refused(family, fields, prompt, tmp_path):
    """transformers' prefill with a window of 1 sees the query alone, but its decode steps see
    every position (its sliding cache keeps the last `sliding_window - 1` by the slice [-0:]):
    moepipe, which kept to the window, was 3.3 (Mixtral) and 2.9 (Qwen2-MoE) off its logits
    after 3 decode steps. It is refused in one line naming the field; a window of 2 matches."""
    ckpt, _ = save(family, fields, tmp_path / "one")
    with pytest.raises(ConfigError, match=r"sliding_window must be an integer >= 2"):
        reference_generate(ckpt, prompt, GEN)
    ckpt, hf = save(family, fields | {"sliding_window": 2}, tmp_path / "two")
    assert_transformers(ckpt, hf, prompt, "f32")


# (family, fields at transformers' defaults, those config.json then leaves out)
ABSENT = [
    ("mixtral", {"num_experts_per_tok": 2}, ("num_experts_per_tok",)),
    ("olmoe", {"num_experts_per_tok": 8}, ("num_experts_per_tok",)),
    ("qwen2_moe", {"intermediate_size": 5632, "mlp_only_layers": [0]}, ("intermediate_size",)),
    (
        "deepseek_v2",
        {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128},
        ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
    ),
]


@pytest.mark.parametrize("family, fields, keys", ABSENT, ids=[f for f, _, _ in ABSENT])
def test_a_size_left_out_takes_transformers_default(family, fields, keys, prompt, tmp_path):
    """A config.json without a size transformers' config class has a default for runs that
    default, as transformers does; before, moepipe refused it ("num_experts_per_tok is
    missing"). One without a default there (DeepSeek-V2's num_experts_per_tok) is still refused."""
    ckpt, _ = save(family, fields, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in keys}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    assert_transformers(ckpt, hf, prompt, "f32")
    if family == "deepseek_v2":
        cfg.pop("num_experts_per_tok")
        (ckpt / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ConfigError, match="num_experts_per_tok is missing"):
            load_checkpoint(ckpt)


def test_family_defaults_are_transformers():
    """core.hf_config's table of the families' defaults is transformers' config classes'."""
    from core.hf_config.fields import FAMILY_DEFAULTS

    for family, defaults in FAMILY_DEFAULTS.items():
        made = transformers.AutoConfig.for_model(family)
        assert {k: getattr(made, k) for k in defaults} == defaults, family


def test_a_config_without_dtype_runs_the_weights_dtype(prompt, tmp_path):
    """A config.json with neither dtype nor torch_dtype runs its weights in their own dtype, as
    transformers loads them; before, float32 weights were refused as "config.json says
    torch.bfloat16", which it does not."""
    ckpt, hf = save("mixtral", {}, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("dtype", None)
    cfg.pop("torch_dtype", None)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(ckpt)[0].dtype_bytes == 4
    assert_transformers(ckpt, hf, prompt, "f32")


def test_yarn_factor_null_is_the_stretch_of_max_positions(prompt, tmp_path):
    """YaRN with factor null (DeepSeek-V3's configs) stretches max_position_embeddings over
    original_max_position_embeddings, as transformers computes it (here 64 / 16 = 4); before,
    it was refused ("rope_parameters.factor must be a positive number, got None")."""
    from real.attention import Rope
    from real.checkpoint import hf_config as read_config

    rope = {"rope_type": "yarn", "rope_theta": 1e6, "original_max_position_embeddings": 16}
    ckpt, hf = save("mixtral", {"rope_parameters": rope | {"factor": None}}, tmp_path / "null")
    assert json.loads((ckpt / "config.json").read_text())["rope_parameters"]["factor"] is None
    four, hf_four = save("mixtral", {"rope_parameters": rope | {"factor": 4.0}}, tmp_path / "four")
    # the same RoPE bit for bit, so the same logits bit for bit in one implementation
    spec = load_checkpoint(ckpt)[0]
    null_rope, four_rope = (Rope.from_config(read_config(c), spec) for c in (ckpt, four))
    assert torch.equal(null_rope.inv_freq, four_rope.inv_freq)
    assert null_rope.attention_factor == four_rope.attention_factor
    tokens, logits = reference_generate(ckpt, prompt, GEN)
    assert torch.equal(reference_generate(four, prompt, GEN)[1], logits)
    hf_tokens, hf_logits = hf_greedy(hf, prompt)
    assert torch.equal(hf_greedy(hf_four, prompt)[1], hf_logits)
    # and transformers' within 1e-4 (two OpenMP threads block its matmuls otherwise than
    # moepipe's), its tokens where the top two logits are clearly apart
    torch.testing.assert_close(logits, hf_logits, atol=1e-4, rtol=0)
    assert_tokens_where_clear(tokens, hf, prompt)


def assert_tokens_where_clear(tokens: torch.Tensor, hf: Any, prompt: torch.Tensor) -> None:
    """moepipe's greedy tokens [B, GEN] are transformers' (`hf`'s on `prompt`) up to each
    sequence's first step whose top two logits lie within 1e-4 (there either may be taken
    within the logits' tolerance, and the steps after it follow from that choice); the first
    step of every sequence must be clear, so each sequence is compared."""
    out = hf_generate_out(hf, prompt, GEN)
    steps = torch.stack(out.logits, 1).float()  # [B, GEN, V]
    top2 = steps.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-4  # [B, GEN]
    hf_tokens = out.sequences[:, prompt.shape[1] :]
    for b in range(len(tokens)):
        upto = int(clear[b].long().cumprod(0).sum())  # steps before the first unclear one
        assert upto >= 1, f"sequence {b}'s first token is a near tie: no parity to check"
        assert torch.equal(tokens[b, :upto], hf_tokens[b, :upto]), b


def test_qwen2_moe_sliding_window_left_out_is_transformers(prompt, tmp_path):
    """Qwen2-MoE with use_sliding_window true and no sliding_window runs transformers' default
    window, 4096; before, it was refused as "sliding_window is null", which it was not."""
    from real.model import Model

    window = dict(use_sliding_window=True, sliding_window=4096, max_window_layers=2)
    ckpt, _ = save("qwen2_moe", window, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("sliding_window")
    (ckpt / "config.json").write_text(json.dumps(cfg))
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    assert hf.config.sliding_window == 4096
    assert Model.from_checkpoint(ckpt, load_checkpoint(ckpt)[0]).sliding_window == 4096
    assert_transformers(ckpt, hf, prompt, "f32")


def test_switch_tie_left_out_ties_the_head(tmp_path):
    """Switch's config.json without tie_word_embeddings ties the head to the embedding, as
    transformers' default does (and its save_pretrained leaves lm_head out); before, moepipe
    took the head as untied and refused "tensor lm_head.weight is missing"."""
    sizes = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=32, num_heads=4, num_experts=4)
    layers = dict(num_layers=2, num_decoder_layers=2)
    sparse = dict(num_sparse_encoder_layers=1, num_sparse_decoder_layers=1)
    cfg = transformers.SwitchTransformersConfig(**sizes, **layers, **sparse)
    torch.manual_seed(0)
    transformers.SwitchTransformersForConditionalGeneration(cfg).save_pretrained(tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    fields.pop("tie_word_embeddings")
    (tmp_path / "config.json").write_text(json.dumps(fields))
    _, index = load_checkpoint(tmp_path)
    assert index["lm_head.weight"] is index["shared.weight"]


def test_switch_decoder_sparse_step_0_is_not_refused(tmp_path):
    """transformers writes decoder_sparse_step 0 where a Switch config asks for more sparse
    decoder layers than it has (its default 3 of 2 here): no decoder block sparse. moepipe, which
    reads the encoder alone, refused it ("decoder_sparse_step must be a positive integer"),
    checking it by Qwen2-MoE's rule; Qwen2-MoE's 0, which transformers divides by, still is."""
    sizes = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=32, num_heads=4, num_experts=4)
    layers = dict(num_layers=2, num_decoder_layers=2, num_sparse_encoder_layers=1)
    cfg = transformers.SwitchTransformersConfig(**sizes, **layers)
    assert cfg.decoder_sparse_step == 0
    transformers.SwitchTransformersForConditionalGeneration(cfg).save_pretrained(tmp_path)
    assert load_checkpoint(tmp_path)[0].moe_layers == (1,)
    qwen = hf_config("qwen2_moe", {}).to_dict() | {"decoder_sparse_step": 0}
    with pytest.raises(ConfigError, match="decoder_sparse_step must be a positive integer"):
        hf_config_to_spec(qwen, "q")


def test_partial_rotary_factor_of_a_scaled_rope_is_refused(prompt, tmp_path):
    """partial_rotary_factor below 1 in a scaled RoPE: transformers computes frequencies for part
    of a head and then fails to apply them to a whole one; moepipe ran whole-head RoPE, ignoring
    the field. It is refused in one line naming it. With default RoPE transformers' classes of
    these families ignore the field, and so moepipe does, with transformers' logits."""
    rope = {"rope_theta": 1e6, "partial_rotary_factor": 0.5}
    scaled = {"rope_parameters": rope | {"rope_type": "linear", "factor": 4.0}}
    ckpt, _ = save("mixtral", scaled, tmp_path / "linear")
    with pytest.raises(ConfigError, match=r"partial_rotary_factor=0.5 with linear"):
        reference_generate(ckpt, prompt, GEN)
    ckpt, hf = save("mixtral", {"rope_parameters": rope | {"rope_type": "default"}}, tmp_path / "d")
    assert_transformers(ckpt, hf, prompt, "f32")


# (family, fields of transformers' config, the config.json field then set odd, its value)
ODD_ROTARY = [
    ("mixtral", {"hidden_size": 60, "head_dim": 16}, "head_dim", 15),
    ("qwen2_moe", {"hidden_size": 60}, "head_dim", None),  # hidden_size / heads: 15
    ("olmoe", {"hidden_size": 60}, "head_dim", None),
    ("deepseek_v2", {}, "qk_rope_head_dim", 5),
]


@pytest.mark.parametrize("family, fields, key, odd", ODD_ROTARY, ids=[f for f, *_ in ODD_ROTARY])
def test_an_odd_rotary_dim_is_refused_naming_the_field(family, fields, key, odd, tmp_path):
    """An odd rotary dim, which transformers refuses on load (its validate_rope: "RoPE requires
    an even rotary dimension"), is refused in one line naming the field; before, a checkpoint
    of such heads (written by moepipe, as transformers writes none) failed an assert in RoPE."""
    from core.hf_config import hf_config_to_spec
    from real.checkpoint_write import write_checkpoint

    cfg = hf_config(family, fields).to_dict()
    cfg[key] = odd
    write_checkpoint(hf_config_to_spec(cfg, "odd"), tmp_path)
    with pytest.raises(ConfigError, match=rf"{key}[^=]*=(15|5) is odd; RoPE rotates pairs"):
        reference_generate(tmp_path, torch.zeros(1, 4, dtype=torch.long), 2)
    from huggingface_hub.errors import StrictDataclassClassValidationError

    with pytest.raises(StrictDataclassClassValidationError, match="RoPE requires an even rotary"):
        transformers.AutoConfig.from_pretrained(tmp_path)


def test_switch_of_odd_d_kv_is_refused_naming_it(tmp_path):
    """Switch of an odd d_kv runs in transformers (T5's relative position buckets), but not in
    moepipe's substitute, which runs RoPE on d_kv: refused naming d_kv, where before an assert
    in RoPE failed."""
    sizes = dict(vocab_size=64, d_model=32, d_kv=15, d_ff=32, num_heads=4, num_experts=4)
    layers = dict(num_layers=2, num_decoder_layers=2, num_sparse_encoder_layers=1)
    cfg = transformers.SwitchTransformersConfig(**sizes, **layers, num_sparse_decoder_layers=1)
    transformers.SwitchTransformersForConditionalGeneration(cfg).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"d_kv=15 is odd; .* in place of T5's relative"):
        reference_generate(tmp_path, torch.zeros(1, 4, dtype=torch.long), 2)


def test_olmoe_heads_not_spanning_hidden_size_are_refused_naming_head_dim(prompt, tmp_path):
    """OLMoE's q_norm spans hidden_size, so transformers saves a model of head_dim 8 x 4 heads
    over hidden_size 64 but cannot run it; moepipe refuses it naming head_dim, where before it
    blamed the saved q_norm ("has shape [64], config.json expects [32]")."""
    ckpt, hf = save("olmoe", {"head_dim": 8}, tmp_path / "ckpt")
    with pytest.raises(RuntimeError):
        hf_greedy(hf, prompt)
    with pytest.raises(ConfigError, match=r"head_dim=8 x num_attention_heads=4 differs from hid"):
        load_checkpoint(ckpt)


# (family, a field its config class lacks that transformers' generate() reads from any config)
GENERATE_ONLY = [
    ("mixtral", {"attention_chunk_size": 3}),
    ("olmoe", {"sliding_window": 3}),
    ("deepseek_v2", {"sliding_window": 3}),
    ("olmoe", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3}),
]


@pytest.mark.parametrize(
    "family, fields", GENERATE_ONLY, ids=[f"{f}-{next(iter(k))}" for f, k in GENERATE_ONLY]
)
def test_a_window_only_generate_applies_is_refused(family, fields, prompt, tmp_path):
    """transformers' generate() builds its masks and cache from sliding_window, layer_types or
    attention_chunk_size of any config, where the forward of these families ignores them: its
    greedy logits move (observed 2.3 to 3.3 off moepipe's, which ignored the field) while its
    forward's do not. moepipe refuses the field in one line naming it."""
    ckpt, hf = save(family, fields, tmp_path / "ckpt")
    key = next(iter(fields))
    with pytest.raises(ConfigError, match=rf"{key} is .*: {family}'s transformers class has no"):
        load_checkpoint(ckpt)
    plain, plain_hf = save(family, {}, tmp_path / "plain")
    with torch.inference_mode():
        assert torch.equal(hf(prompt).logits, plain_hf(prompt).logits)
    assert (hf_greedy(hf, prompt)[1] - hf_greedy(plain_hf, prompt)[1]).abs().max() > 0.5


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "deepseek_v2"])
def test_layer_types_all_full_attention_run(family, prompt, tmp_path):
    """layer_types marking every layer full_attention changes nothing transformers runs, so a
    config.json that carries it (as newer transformers versions write) runs as without it."""
    plain, _ = save(family, {}, tmp_path / "plain")
    config = json.loads((plain / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    (plain / "config.json").write_text(json.dumps(config))
    load_checkpoint(plain)
