"""The reference model: deterministic, replayed routing, every family runs, and the pieces an
executor calls one by one (weights streamed through the tiered store from disk, one unit in the
device pool at a time) reproduce reference_generate bit for bit."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from core.errors import ConfigError
from core.hf_config import spec_to_hf_config
from core.routing import Routing
from core.types import Tensor, Tier
from real.checkpoint import Unit, load_checkpoint, load_units, reduced_spec
from real.checkpoint_write import write_checkpoint
from real.model import (
    KVCache,
    Model,
    Rope,
    expert_tokens,
    head_shard,
    kv_shard,
    live_routing,
    moe_output,
    new_slots,
    put_expert,
    reference_generate,
)
from real.store import TieredStore
from tests.real.conftest import small_overrides

FAMILIES = [
    "mixtral-tiny",
    "qwen1.5-moe-a2.7b",
    "qwen3-30b-a3b",
    "olmoe-1b-7b",
    "deepseek-v2-lite",
    "deepseek-v3",
    "switch-base-128",
]


def test_reference_is_deterministic(mixtral_tiny, prompt):
    t1, l1 = reference_generate(mixtral_tiny, prompt, 5)
    t2, l2 = reference_generate(mixtral_tiny, prompt, 5)
    assert t1.shape == (2, 5) and l1.shape == (2, 512)
    assert torch.equal(t1, t2) and torch.equal(l1, l2)
    assert torch.isfinite(l1).all()


def test_forced_routing(mixtral_tiny, prompt):
    """Replaying the model's own routing changes nothing; routing elsewhere changes the output."""
    tokens, logits = reference_generate(mixtral_tiny, prompt, 5)
    own = live_routing(mixtral_tiny, prompt, 5)
    assert own.expert_ids.shape == (2, 6 + 5 - 1, 4, 2)
    t_own, l_own = reference_generate(mixtral_tiny, prompt, 5, forced_routing=own)
    assert torch.equal(t_own, tokens) and torch.equal(l_own, logits)
    shifted = Routing((own.expert_ids + 1) % 8, own.gate_weights, 8)
    _, l_other = reference_generate(mixtral_tiny, prompt, 5, forced_routing=shifted)
    assert not torch.allclose(l_other, logits, atol=1e-3)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_runs_with_spread_routing(name, small_ckpt, prompt):
    ckpt = small_ckpt(name)
    tokens, logits = reference_generate(ckpt, prompt, 3)
    assert tokens.shape == (2, 3) and torch.isfinite(logits).all() and logits.std() > 0.1
    ids = live_routing(ckpt, prompt, 3).expert_ids
    used = np.unique(ids)
    assert len(used) >= min(4, ids.max() + 1), f"routing is degenerate: {used}"


@pytest.mark.parametrize("name", FAMILIES)
def test_kv_cache_holds_what_the_simulator_counts(name):
    """Per token and layer the cache holds spec.kv_elems_per_token elements: keys + values for
    GQA, DeepSeek-V2's latent + shared RoPE key (576 = 512 + 64 for the full model)."""
    spec = reduced_spec(name, **small_overrides(name))
    kv = KVCache.allocate(spec, batch=2, max_len=5)
    assert len(kv.layers) == spec.n_layers
    assert all((t.shape[0], t.shape[2]) == (2, 5) for layer in kv.layers for t in layer)
    assert sum(t[0, :, 0].numel() for t in kv.layers[0]) == spec.kv_elems_per_token
    full = reduced_spec("deepseek-v2-lite")
    assert sum(t[0, :, 0].numel() for t in KVCache.allocate(full, 1, 1).layers[0]) == 576


def run_piecewise(
    store: TieredStore, model: Model, prompt: torch.Tensor, gen_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What an executor does: load each unit disk -> host -> device just before use, free after."""
    s = model.spec

    def use(unit: Unit):
        store.read_disk(unit)
        w = store.to_device(unit)
        return w

    def done(unit: Unit):
        store.free(unit)
        store.evict(unit, Tier.CPU)

    b, p = prompt.shape
    kv = KVCache.allocate(s, b, p + gen_len)
    out, step_in, start = [], prompt, 0
    for _ in range(gen_len):
        positions = torch.arange(start, start + step_in.shape[1])
        hidden = model.embed(use(Unit(Tensor.EMBED)), step_in)
        done(Unit(Tensor.EMBED))
        for layer in range(s.n_layers):
            hidden = model.attention(
                layer, use(Unit(Tensor.ATTENTION, layer)), hidden, kv, positions
            )
            done(Unit(Tensor.ATTENTION, layer))
            if not s.is_moe(layer):
                hidden = model.dense_ffn(use(Unit(Tensor.FFN, layer)), hidden)
                done(Unit(Tensor.FFN, layer))
                continue
            normed, ids, weights = model.gate(layer, use(Unit(Tensor.GATE, layer)), hidden)
            done(Unit(Tensor.GATE, layer))
            slots = new_slots(normed, s.top_k)
            for e in reversed(range(s.n_experts)):  # any order gives the same bits
                rows, slot = expert_tokens(ids, e)
                if len(rows):
                    unit = Unit(Tensor.EXPERT, layer, e)
                    put_expert(slots, rows, slot, model.expert(use(unit), normed[rows]))
                    done(unit)
            shared = None
            if s.shared_ffn_size:
                shared = model.shared_ffn(use(Unit(Tensor.FFN, layer)), normed)
                done(Unit(Tensor.FFN, layer))
            hidden = moe_output(hidden, slots, weights, shared, model.float32_combine)
        logits = model.head(use(Unit(Tensor.HEAD)), hidden)
        done(Unit(Tensor.HEAD))
        out.append(logits.argmax(-1))
        start += step_in.shape[1]
        step_in = out[-1][:, None]
    return torch.stack(out, 1), logits


@pytest.mark.parametrize(
    "name", ["mixtral-tiny", "qwen-dense", "deepseek-v2-lite", "switch-base-128"]
)
def test_pieces_through_the_store_equal_reference(name, mixtral_tiny, small_ckpt, tmp_path, prompt):
    """Exact equality: same kernels, same token groups, experts combined order-independently."""
    if name == "mixtral-tiny":
        ckpt = mixtral_tiny
    elif name == "qwen-dense":
        over = small_overrides("qwen1.5-moe-a2.7b") | dict(moe_layers=[0, 2], dense_ffn_size=48)
        ckpt = write_checkpoint(
            reduced_spec("qwen1.5-moe-a2.7b", **over), tmp_path / "q", norm_topk_prob=True
        )
    else:
        ckpt = small_ckpt(name)
    ref_tokens, ref_logits = reference_generate(ckpt, prompt, 4)
    probe = TieredStore(ckpt, device_capacity_bytes=1)
    biggest = max(probe.unit_bytes(u) for u in probe.records)
    probe.close()
    store = TieredStore(
        ckpt,
        device_capacity_bytes=biggest,
        host_capacity_bytes=biggest,
    )
    model = Model.from_checkpoint(ckpt, load_checkpoint(ckpt)[0])
    with torch.inference_mode():
        tokens, logits = run_piecewise(store, model, prompt, 4)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(logits, ref_logits)
    assert store.pool.used_bytes == 0 and store.host.used_bytes == 0
    store.close()


def test_gate_forced_ids_take_router_weights(mixtral_tiny):
    """Replay with ids only: the weights are the router's own at the forced ids."""
    spec, units = load_units(mixtral_tiny)
    model = Model(spec)
    hidden = torch.randn(2, 3, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    w = units[Unit(Tensor.GATE, 1)]
    _, ids, weights = model.gate(1, w, hidden)
    _, ids2, weights2 = model.gate(1, w, hidden, forced_ids=ids)
    assert torch.equal(ids2, ids) and torch.allclose(weights2, weights)
    assert torch.allclose(weights.sum(-1), torch.ones(6))  # Mixtral renormalises over top-k
    other = (ids + 1) % spec.n_experts
    _, ids3, weights3 = model.gate(1, w, hidden, forced_ids=other, forced_weights=weights)
    assert torch.equal(ids3, other) and torch.equal(weights3, weights)


# Families whose Hugging Face class runs our checkpoint layout as is (DeepSeek-V2 with MLA, its
# float32 router and its interleaved RoPE). Not here: Switch (HF's class is an encoder-decoder).
HF_FAMILIES = [name for name in FAMILIES if name != "switch-base-128"]


def hf_generate(ckpt, prompt: torch.Tensor, gen_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own model class on our checkpoint, in the checkpoint's dtype, greedy:
    (tokens [B, gen_len], last logits [B, V] float32) as reference_generate returns them."""
    transformers = pytest.importorskip("transformers")
    dtype = torch.bfloat16 if load_checkpoint(ckpt)[0].dtype_bytes == 2 else torch.float32
    from tests.real.test_hf_parity import hf_generate_out  # the unpadded prompt moepipe runs

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype).eval()
    out = hf_generate_out(hf, prompt, gen_len)
    return out.sequences[:, prompt.shape[1] :], out.logits[-1].float()


@pytest.mark.parametrize("name", HF_FAMILIES)
def test_reference_equals_hugging_face(name, small_ckpt, prompt):
    """reference_generate against transformers' own model class on the same checkpoint, in the
    checkpoint's dtype: a wrong RoPE, GQA or MLA, norm (OLMoE's QK-norm, DeepSeek's latent norm),
    router normalisation or precision, or shared expert gate changes the logits far beyond the
    1e-3 allowed here (observed: 0 in bf16, DeepSeek-V2 included, and 5e-7 for Mixtral, whose
    reduced checkpoint is float32)."""
    ckpt = small_ckpt(name)
    tokens, logits = reference_generate(ckpt, prompt, 3)
    hf_tokens, hf_logits = hf_generate(ckpt, prompt, 3)
    assert torch.equal(hf_tokens, tokens)
    torch.testing.assert_close(hf_logits, logits, atol=1e-3, rtol=0)


# config.json RoPE scalings that change the logits within the test's 9 positions. YaRN as in the
# real DeepSeek-V2-Lite (legacy `rope_scaling` key) but stretched 4x from 1024 positions, so its
# frequency ramp is partial (DeepSeek's R = 8: the 4 pairs keep [1, 2/3, 1/3, 0] of their
# frequency), and with mscale != mscale_all_dim, so its cos/sin factor (1.065) and DeepSeek's
# softmax factor (1.069^2) are not 1. Linear in transformers 5's `rope_parameters` form, its
# rope_theta overriding the top-level one.
YARN = {
    "rope_scaling": {
        "type": "yarn",
        "factor": 4,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    }
}
LINEAR = {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}


@pytest.mark.parametrize(
    "name, dtype_bytes, fields",
    [
        ("deepseek-v2-lite", 4, YARN),
        ("deepseek-v2-lite", 2, YARN),
        ("mixtral-tiny", 4, LINEAR),
        ("mixtral-tiny", 2, LINEAR),
        ("olmoe-1b-7b", 2, LINEAR),
        ("olmoe-1b-7b", 2, YARN),
    ],
    ids=[
        "yarn-deepseek-f32",
        "yarn-deepseek-bf16",
        "linear-mixtral-f32",
        "linear-mixtral-bf16",
        "linear-olmoe-bf16",
        "yarn-olmoe-bf16",
    ],
)
def test_scaled_rope_equals_hugging_face(name, dtype_bytes, fields, tmp_path, prompt):
    """reference_generate with config.json's YaRN or linear RoPE scaling against transformers, as
    test_reference_equals_hugging_face (observed: 0 in bf16, below 1e-6 in float32); the same
    weights and routing with plain RoPE give logits far from these, so the scaling is exercised
    (observed: 0.18 to 3.7 apart)."""
    spec = reduced_spec(name, **small_overrides(name), dtype_bytes=dtype_bytes)
    plain = write_checkpoint(spec, tmp_path / "plain", seed=1)
    scaled = write_checkpoint(
        spec, tmp_path / "scaled", seed=1, rope_scaling=fields.get("rope_scaling")
    )
    if "rope_parameters" in fields:  # transformers 5's form, which the writer does not write
        cfg = json.loads((scaled / "config.json").read_text())
        (scaled / "config.json").write_text(json.dumps(cfg | fields))
    tokens, logits = reference_generate(scaled, prompt, 3)
    hf_tokens, hf_logits = hf_generate(scaled, prompt, 3)
    assert torch.equal(hf_tokens, tokens)
    torch.testing.assert_close(hf_logits, logits, atol=1e-3, rtol=0)
    _, plain_logits = reference_generate(plain, prompt, 3, live_routing(scaled, prompt, 3))
    assert (plain_logits - logits).abs().max() > 0.1


def test_yarn_of_deepseek_v2_lite_equals_hugging_face():
    """On the real DeepSeek-V2-Lite config.json (YaRN 40x from 4096 positions, mscale =
    mscale_all_dim = 0.707): the same frequencies and cos/sin factor (1) as transformers' rotary
    embedding, and the same softmax scale as its attention (1/sqrt(192) times 1.26^2), bit for
    bit. The attention module is built on the meta device, so its weights take no memory."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_ds

    spec = reduced_spec("deepseek-v2-lite")
    yarn = {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    }
    cfg = spec_to_hf_config(spec) | {"max_position_embeddings": 163840, "rope_scaling": yarn}
    rope = Rope.from_config(cfg, spec, where="config.json")
    hf_cfg = transformers.DeepseekV2Config.from_dict(cfg)
    hf_rope = hf_ds.DeepseekV2RotaryEmbedding(hf_cfg)
    with torch.device("meta"):
        hf_scale = hf_ds.DeepseekV2Attention(hf_cfg, layer_idx=0).scaling
    assert torch.equal(rope.inv_freq, hf_rope.inv_freq)
    assert rope.attention_factor == hf_rope.attention_scaling == 1.0
    assert 192**-0.5 * rope.softmax_mscale * rope.softmax_mscale == hf_scale != 192**-0.5
    assert not torch.equal(rope.inv_freq, Model(spec).rope.inv_freq)


@pytest.mark.parametrize(
    "scaling, field",
    [
        ({"rope_type": "axial", "factor": 2.0}, "rope_scaling.rope_type='axial'"),
        ({"type": "su", "factor": 2.0}, "rope_scaling.type='su'"),
        ({"type": "nosuch"}, "rope_scaling.type='nosuch'"),
    ],
)
def test_unimplemented_rope_scaling_is_refused_in_one_line(scaling, field, tmp_path):
    """A RoPE type the real model does not run (axial, Phi-3's su, any other string) is one
    line naming the file, the field and the types it runs, where the model is built: running it
    as plain RoPE would give logits other than transformers'. A type it runs with a missing field
    is a one-line error naming the field."""
    spec = reduced_spec("mixtral-tiny")
    ckpt = write_checkpoint(spec, tmp_path / "ckpt", seed=1, rope_scaling=scaling)
    with pytest.raises(ConfigError) as err:
        Model.from_checkpoint(ckpt, spec)
    line = str(err.value)
    assert line.startswith(f"{ckpt / 'config.json'}: {field} is not implemented")
    assert "'default', 'linear', 'dynamic', 'yarn', 'llama3'" in line and "\n" not in line
    cfg = spec_to_hf_config(spec) | {"rope_scaling": {"type": "yarn"}}
    with pytest.raises(ConfigError, match=r"rope_scaling\.factor is missing; yarn needs a"):
        Rope.from_config(cfg, spec, where="ckpt/config.json")
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    with pytest.raises(ConfigError, match=r"rope_scaling\.high_freq_factor is missing; llama3"):
        Rope.from_config(cfg, spec, where="ckpt/config.json")


@pytest.mark.parametrize(
    "fields",
    [
        {"rope_type": "dynamic", "factor": 3.0},
        {"rope_type": "dynamic", "factor": 1.5},
        {"type": "dynamic", "factor": 2.0},  # the legacy rope_scaling form
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    ],
)
def test_dynamic_and_llama3_frequencies_are_transformers(fields):
    """The frequencies of each step, bit for bit transformers' rotary embedding fed the same
    steps: a prompt within max_position_embeddings (16), one past it, decode steps growing past
    it (dynamic NTK raises its base at each), and a new short prompt (reset to the original)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral import modeling_mixtral as hf_mixtral

    spec = reduced_spec("mixtral-tiny")
    key = "rope_scaling" if "type" in fields else "rope_parameters"
    cfg = spec_to_hf_config(spec) | {"max_position_embeddings": 16, "head_dim": spec.head_dim}
    cfg[key] = fields | {"rope_theta": 1e4}
    rope = Rope.from_config(cfg, spec, where="config.json")
    hf_rope = hf_mixtral.MixtralRotaryEmbedding(transformers.MixtralConfig.from_dict(cfg))
    seen = []
    for start, n in [(0, 6), (0, 17), (17, 1), (18, 1), (19, 1), (0, 4)]:
        positions = torch.arange(start, start + n)
        hf_rope(torch.zeros(1), positions[None])  # updates its inv_freq to this step's
        mine = rope.inv_freq_on(torch.device("cpu"), positions)
        assert torch.equal(mine, hf_rope.inv_freq), (start, n)
        seen.append(mine)
    plain = Rope.plain(spec.head_dim, 1e4).inv_freq
    if "dynamic" in fields.values():  # plain within 16 positions, a new base at every length
        assert torch.equal(seen[0], plain) and torch.equal(seen[-1], plain)
        assert len({tuple(f.tolist()) for f in seen[1:5]}) == 4
    else:  # llama3 scales whatever the length
        assert all(torch.equal(f, seen[0]) for f in seen) and not torch.equal(seen[0], plain)


def test_deepseek_routed_scaling_factor_equals_hugging_face(tmp_path, prompt):
    """config.json's routed_scaling_factor (1.0 in DeepSeek-V2-Lite) scales the routed experts'
    weights: at 2.5 the logits move far from the unscaled ones and match transformers' (before,
    the factor was ignored: 0.32 apart)."""
    name = "deepseek-v2-lite"
    spec = reduced_spec(name, **small_overrides(name), dtype_bytes=4)
    ckpt = write_checkpoint(spec, tmp_path / "c", seed=1)
    _, plain = reference_generate(ckpt, prompt, 3)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(cfg | {"routed_scaling_factor": 2.5}))
    tokens, logits = reference_generate(ckpt, prompt, 3)
    hf_tokens, hf_logits = hf_generate(ckpt, prompt, 3)
    assert torch.equal(hf_tokens, tokens)
    torch.testing.assert_close(hf_logits, logits, atol=1e-3, rtol=0)
    assert (plain - logits).abs().max() > 0.1
    for key, value in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        (ckpt / "config.json").write_text(json.dumps(cfg | {key: value}))
        with pytest.raises(ConfigError, match=f"config.json: {key}='{value}'; only"):
            Model.from_checkpoint(ckpt, spec)


def test_switch_router_equals_hugging_face_in_bf16():
    """Switch's router in bf16 as transformers' SwitchTransformersTop1Router runs it: float32
    logits, probabilities rounded to bf16, their argmax (ties to the lower expert) and its
    probability. Before, the logits were bf16: 24 of 4,096 tokens chose another expert."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.switch_transformers import modeling_switch_transformers as hs

    spec = reduced_spec("switch-base-128", dtype_bytes=2)
    g = torch.Generator().manual_seed(0)
    h, e, t = spec.hidden_size, spec.n_experts, 4096
    router = (torch.randn(e, h, generator=g) / h**0.5).bfloat16()
    x = torch.randn(1, t, h, generator=g).bfloat16()
    w = {"post_norm": torch.ones(h, dtype=torch.bfloat16), "router": router}
    normed, ids, weights = Model(spec).gate(spec.moe_layers[0], w, x)
    cfg = transformers.SwitchTransformersConfig(d_model=h, num_experts=e, expert_capacity=10**9)
    hf = hs.SwitchTransformersTop1Router(cfg).eval()  # eval: no jitter noise
    hf.classifier.weight.data = router.float()
    with torch.no_grad():
        mask, probs, _ = hf(normed[None])
    assert torch.equal(mask[0].argmax(-1), ids[:, 0])
    assert torch.equal(probs[0, :, 0].float(), weights[:, 0])


@pytest.mark.parametrize("name", FAMILIES)
def test_attention_flops_are_what_the_real_attention_runs(name, small_ckpt):
    """The simulator's attention flops equal the matmuls the real attention runs (torch's flop
    counter, on SDPA's math path, which computes every score of a prefill's square where the
    planners count the causal half), at a prefill and a decode step. A decode step of MLA
    re-expands every cached latent through kv_b (the spec counted only the new token's: 66x
    too few at 512 positions). The spec counts a norm's or bias's parameters as 2 flops each a
    token, where the counter counts matmuls only."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    spec, units = load_units(small_ckpt(name))
    model = Model.from_checkpoint(small_ckpt(name), spec)
    w, b, p = units[Unit(Tensor.ATTENTION, 0)], 3, 7
    vectors = sum(t.numel() for t in w.values() if t.dim() == 1) - spec.hidden_size
    kv = KVCache.allocate(spec, b, p + 1)
    for tokens, context, start in ((b * p, p, 0), (b, p + 1, p)):
        x = torch.randn(b, tokens // b, spec.hidden_size).to(next(iter(w.values())).dtype)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
            model.attention(0, w, x, kv, torch.arange(start, start + tokens // b))
        counted = spec.attention_flops(tokens, context, sequences=b) - 2 * vectors * tokens
        assert fc.get_total_flops() == counted, (tokens, fc.get_flop_counts())


def test_written_mla_variants_round_trip_and_equal_hugging_face(tmp_path, prompt):
    """moepipe's own writer with DeepSeek-V2's q compression (q_lora_rank) and RoPE dims out of
    V2-Lite's proportion: config.json gives the same spec back, and transformers runs it to the
    same tokens and logits (observed 5e-7 apart in float32)."""
    name = "deepseek-v2-lite"
    over = small_overrides(name) | dict(q_lora_rank=24, qk_rope_head_dim=4, dtype_bytes=4)
    spec = reduced_spec(name, **over)
    ckpt = write_checkpoint(spec, tmp_path / "dsq", seed=1)
    assert load_checkpoint(ckpt)[0] == dataclasses.replace(spec, name="dsq")
    tokens, logits = reference_generate(ckpt, prompt, 3)
    hf_tokens, hf_logits = hf_generate(ckpt, prompt, 3)
    assert torch.equal(hf_tokens, tokens)
    torch.testing.assert_close(hf_logits, logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "name, over",
    [
        ("deepseek-v2-lite", dict(q_lora_rank=24, qk_rope_head_dim=4)),
        ("qwen1.5-moe-a2.7b", dict(qkv_bias=False)),
        ("mixtral-tiny", {}),
    ],
    ids=["mla-q_lora", "qwen-no-bias", "mixtral-sliding-window"],
)
def test_head_shards_of_new_fields_sum_to_the_whole(name, over, tmp_path):
    """Tensor-parallel attention with the config.json fields read since: q_b's rows split by head
    (q_a and its norm whole), no Qwen biases, a sliding window: the shards' parts sum to the
    whole attention, at a prefill and a decode step."""
    spec = reduced_spec(name, **small_overrides(name), **over, dtype_bytes=4)
    ckpt = write_checkpoint(spec, tmp_path / "c", seed=1)
    spec, units = load_units(ckpt)
    model = Model.from_checkpoint(ckpt, spec)
    if spec.family == "mixtral":  # a window shorter than the prefill
        model = dataclasses.replace(model, sliding_window=3)
    w, b, p = units[Unit(Tensor.ATTENTION, 0)], 2, 5
    g = torch.Generator().manual_seed(0)
    halves = [(0, spec.n_heads // 2), (spec.n_heads // 2, spec.n_heads)]
    whole_kv = KVCache.allocate(spec, b, p + 1)
    kv_heads = [hi - lo for lo, hi in (kv_shard(spec, h) for h in halves)]
    kvs = [KVCache.allocate(spec, b, p + 1, kv_heads=n) for n in kv_heads]
    for start, n in ((0, p), (p, 1)):
        x = torch.randn(b, n, spec.hidden_size, generator=g)
        positions = torch.arange(start, start + n)
        whole = model.attention_part(0, w, x, whole_kv, positions)
        parts = [
            model.attention_part(0, head_shard(spec, w, h), x, kv, positions)
            for h, kv in zip(halves, kvs, strict=True)
        ]
        torch.testing.assert_close(sum(parts), whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "name, key, value",
    [
        ("mixtral-tiny", "sliding_window", "4"),
        ("mixtral-tiny", "sliding_window", 0),
        ("olmoe-1b-7b", "clip_qkv", "8"),
        ("olmoe-1b-7b", "clip_qkv", -1.0),
    ],
)
def test_bad_window_or_clip_is_one_line(name, key, value, tmp_path):
    """A sliding_window or clip_qkv of the wrong type or range (Mixtral's window 0 included)
    names the field and the file."""
    spec = reduced_spec(name, **small_overrides(name))
    ckpt = write_checkpoint(spec, tmp_path / "c")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(cfg | {key: value}))
    with pytest.raises(ConfigError, match=rf"config.json: {key} must be .*, got {value!r}"):
        Model.from_checkpoint(ckpt, spec)
