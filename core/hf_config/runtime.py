"""What the real model runs from config.json beyond the spec: routing (norm_topk_prob,
routed_scaling_factor, DeepSeek-V2's expert groups), sliding windows (Mixtral's and Qwen3-MoE's,
Qwen2-MoE's per layer), OLMoE's clip_qkv; and the one-line refusals of fields transformers
honours that moepipe does not implement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.hf_config.fields import COUNT, FLAG, HFConfig, Rule
from core.spec import ModelSpec

# the hidden_act names of transformers' ACT2FN that the real model runs in its gated experts
# and FFNs (act(gate) * up), and Switch's dense_act_fn in its ungated ones (wo(act(wi x))),
# each as transformers computes it (real.activations' ACTIVATIONS): every ACT2FN name but
# those of `LEARNED_ACTS`
GATED_ACTS = (
    "silu",
    "swish",
    "gelu",
    "gelu_pytorch_tanh",
    "gelu_new",
    "quick_gelu",
    "relu",
    "sigmoid",
    "tanh",
    "gelu_10",
    "gelu_accurate",
    "gelu_fast",
    "gelu_python",
    "gelu_python_tanh",
    "hardswish",
    "laplace",
    "leaky_relu",
    "linear",
    "mish",
    "relu2",
    "relu6",
    "sqrtsoftplus",
)
# ACT2FN's names whose module holds weights of its own (saved beside each FFN's), which no
# family here ships and moepipe does not load: name -> transformers' class
LEARNED_ACTS = {"prelu": "nn.PReLU", "xielu": "XIELUActivation"}


@dataclass(frozen=True)
class HFRuntime:
    """config.json's settings of the real model that the spec does not carry."""

    renormalize: bool = False  # norm_topk_prob: the top-k router weights sum to 1
    routed_scaling: float = 1.0  # DeepSeek-V2's routed_scaling_factor
    sliding_window: int | None = None  # positions a query sees, itself included; None: all
    sliding_layers: tuple[int, ...] | None = None  # layers with the window; None: every one
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to [-clip_qkv, clip_qkv]
    # DeepSeek-V2's group_limited_greedy: (n_group, topk_group), a token's top-k taken from the
    # topk_group groups of experts with the highest best score; None: plain top-k
    expert_groups: tuple[int, int] | None = None
    hidden_act: str = "silu"  # the FFNs' activation (`GATED_ACTS`); Switch: its dense_act_fn
    # DeepSeek-V3's router: sigmoid scores, its e_score_correction_bias added to choose, groups
    # ranked by their best two; False: a softmax router
    sigmoid_router: bool = False
    # MLA's RoPE layout: "pairs" (V2's adjacent pairs as complex numbers), "interleave" (V3's
    # rope_interleave: even and odd dims), "half" (V3 without it: rotate_half)
    mla_rope: str = "pairs"


def hf_runtime(c: HFConfig, spec: ModelSpec) -> HFRuntime:
    """What transformers 5.24 runs from `c` beyond the spec, for `spec.family`; a one-line
    ConfigError for a field it honours that moepipe does not implement."""
    _refuse_unimplemented(c, spec)
    _refuse_what_transformers_fails_on(c, spec)
    _refuse_head_dims(c, spec)
    _refuse_generate_only(c, spec)
    window, layers = _sliding_window(c, spec)
    clip = c.get("clip_qkv", None) if spec.family == "olmoe" else None
    v3 = spec.family == "deepseek_v3"
    renormalize, routed_scaling = _routing(c, spec)
    return HFRuntime(
        renormalize=renormalize,
        routed_scaling=routed_scaling,
        sliding_window=window,
        sliding_layers=layers,
        clip_qkv=None if clip is None else float(clip),
        expert_groups=_expert_groups(c, spec),
        hidden_act=c.get("dense_act_fn", "relu")
        if spec.family == "switch_transformers"
        else c.get("hidden_act", "silu"),
        sigmoid_router=v3,
        mla_rope=_mla_rope(c) if v3 else "pairs",
    )


def _mla_rope(c: HFConfig) -> str:
    """DeepSeek-V3's MLA RoPE layout: rope_interleave absent takes transformers' default (true);
    null stays None in transformers' class, whose `if config.rope_interleave` then rotates
    halves."""
    absent = "rope_interleave" not in c.fields
    return "interleave" if c.get("rope_interleave", absent) else "half"


def _routing(c: HFConfig, spec: ModelSpec) -> tuple[bool, float]:
    """renormalize and routed_scaling as transformers' router of the family applies them.
    DeepSeek-V2's MoEGate (and transformers') renormalises only a top-k of more than one and
    scales a weight it does not renormalise; V3's renormalises (norm_topk_prob, absent: true;
    null: false) any top-k, then scales every weight (absent: 2.5)."""
    if spec.family == "deepseek_v3":
        absent = "norm_topk_prob" not in c.fields
        norm = bool(c.get("norm_topk_prob", True if absent else None))
        return norm, float(c.get("routed_scaling_factor", 2.5))
    v2 = spec.family == "deepseek_v2"
    # Qwen2-MoE's, Qwen3-MoE's and OLMoE's classes type it bool: transformers refuses a null
    norm = bool(c.get("norm_topk_prob", False, rule=None if v2 else FLAG)) and (
        not v2 or spec.top_k > 1
    )
    return norm, float(c.get("routed_scaling_factor", 1.0)) if v2 else 1.0


def _expert_groups(c: HFConfig, spec: ModelSpec) -> tuple[int, int] | None:
    """DeepSeek-V2's (n_group, topk_group) where topk_method is group_limited_greedy (the full
    V2's: 8 groups, 3 used), and V3's always (8 and 4 absent), checked as transformers' routers
    need them."""
    v3 = spec.family == "deepseek_v3"  # V3 always; V2 with group_limited_greedy
    v2 = spec.family == "deepseek_v2" and c.get("topk_method", "greedy") == "group_limited_greedy"
    if not v2 and not v3:
        return None
    for key in ("n_group", "topk_group"):
        if v3 and key in c.fields and c.fields[key] is None:  # V2 greedy's null means none
            raise c.error(
                f"{key} is null: DeepSeek-V3's router always groups its experts (transformers "
                "fails without); set it (n_group 1, topk_group 1: one group of every expert)"
            )
    groups, keep = c.get("n_group", rule=COUNT), c.get("topk_group", rule=COUNT)
    if spec.n_experts % groups:
        experts = c.name("n_routed_experts")
        raise c.error(
            f"{experts}={spec.n_experts} is not a multiple of n_group={groups}; set n_group to "
            "a divisor of it, as the model's released config.json has it"
        )
    if keep > groups:
        raise c.error(f"topk_group={keep} exceeds n_group={groups}; set it <= {groups}")
    if v3 and spec.n_experts // groups < 2:  # V3 ranks a group by its best two experts
        raise c.error(
            f"n_group={groups} leaves fewer than 2 experts a group; DeepSeek-V3 ranks a group "
            "by its best two (transformers fails too): lower n_group"
        )
    # V2 zeroes the other groups' scores: a top-k past the kept experts takes some of weight 0
    # (which, a tie, changes nothing); V3 masks them to -inf and weighs the ones it takes by
    # their scores, which torch.topk picks among -inf ties in an order it does not define
    if v3 and spec.top_k > keep * (spec.n_experts // groups):
        raise c.error(
            f"num_experts_per_tok={spec.top_k} exceeds the {keep * spec.n_experts // groups} "
            f"experts of topk_group={keep} groups: transformers' DeepseekV3 router then takes "
            "experts of the dropped groups, tied at -inf, in an order torch.topk leaves "
            "undefined, and weighs them by their scores; raise topk_group"
        )
    return groups, keep


# quantization_config's keys of transformers' FineGrainedFP8Config moepipe reads or that change
# nothing once the weights are dequantized at load (which modules hold scales: the checkpoint's
# tensors say), with the values they may take (None: any)
_FP8_KEYS: dict[str, tuple[Any, ...] | None] = {
    "quant_method": ("fp8",),
    "fmt": ("e4m3",),
    "activation_scheme": ("dynamic",),
    "weight_block_size": None,
    "modules_to_not_convert": None,
    "dequantize": None,
    "scale_fmt": ("float",),
    "modules_to_convert": (None,),
    "expert_dtype": ("fp8",),
}


def fp8_block(c: HFConfig) -> tuple[int, int] | None:
    """quantization_config's FP8 block [rows, columns] (DeepSeek-V3's release: float8_e4m3fn
    weights, a float32 weight_scale_inv per block, dequantized at load as transformers does
    without a GPU); None without quantization_config; one line for any other quantization."""
    quant = c.fields.get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if not isinstance(quant, dict) or method != "fp8":  # transformers' quantizer loads it
        raise c.error(
            f"quantization_config (quant_method {method!r}): quantized checkpoints are not "
            "implemented but fp8 (DeepSeek-V3's blocks); use the model's unquantized (bfloat16 "
            "or float32) checkpoint"
        )
    for key, value in quant.items():
        if key not in _FP8_KEYS:
            raise c.error(
                f"quantization_config.{key}: not a field of transformers' FineGrainedFP8Config "
                f"moepipe knows; fp8 runs with {', '.join(_FP8_KEYS)}"
            )
        allowed = _FP8_KEYS[key]
        if allowed is not None and value not in allowed:
            raise c.error(
                f"quantization_config.{key}={value!r}: moepipe runs fp8 weights with "
                f"{' or '.join(map(repr, allowed))} only; use the model's unquantized checkpoint"
            )
    block = quant.get("weight_block_size")
    if not (
        isinstance(block, list) and len(block) == 2 and all(type(n) is int and n > 0 for n in block)
    ):
        raise c.error(
            f"quantization_config.weight_block_size={block!r}: fp8 weights run with a block of "
            "two positive integers [rows, columns] (DeepSeek-V3's [128, 128])"
        )
    return block[0], block[1]


def _refuse_unimplemented(c: HFConfig, spec: ModelSpec) -> None:
    """Refuse fields transformers' class of the family honours whose values moepipe does not
    run: quantized weights or weights of another file (transformers_weights), bidirectional
    attention, another activation, projection biases, DeepSeek's other routing methods."""
    fam = spec.family
    fp8_block(c)  # any quantization but DeepSeek-V3's FP8 blocks is refused
    weights = c.fields.get("transformers_weights")  # transformers loads the file it names
    if weights is not None and weights not in ("model.safetensors", "model.safetensors.index.json"):
        raise c.error(
            f"transformers_weights={weights!r}: transformers loads the weights from that file, "
            "moepipe from model.safetensors (or model.safetensors.index.json): rename the file "
            "to that name and remove the field"
        )
    if fam == "switch_transformers":
        _refuse_switch(c)
        return
    if not c.get("is_causal", True):  # read by transformers' create_causal_mask, any model's
        raise c.error(
            "is_causal=false: transformers then masks attention both ways (bidirectional); "
            f"moepipe runs {fam} as a causal decoder only: remove it or set it true"
        )
    _refuse_act(c, "hidden_act", c.get("hidden_act", "silu"), fam)
    if fam == "deepseek_v2":
        if "topk_method" in c.fields and c.fields["topk_method"] is None:
            raise c.error(
                "topk_method is null: transformers' DeepseekV2 router then picks no experts "
                "(it fails); set 'greedy' (V2-Lite's) or 'group_limited_greedy' (V2's)"
            )
        methods = {"topk_method": ("greedy", "group_limited_greedy"), "scoring_func": ("softmax",)}
        for key, valid in methods.items():
            value = c.get(key, valid[0])
            if value not in valid:
                raise c.error(
                    f"{key}={value!r}; only {' and '.join(map(repr, valid))} DeepSeek-V2 "
                    "routing is implemented (V2's and V2-Lite's)"
                )


def _refuse_what_transformers_fails_on(c: HFConfig, spec: ModelSpec) -> None:
    """Refuse values of fields without effect elsewhere that transformers' model of the family
    fails on, which moepipe would run: return_dict false (its inner model's output, then a
    tuple, is not read as one), is_encoder_decoder true in a decoder-only family (generate()
    fails) and a pad_token_id outside the vocabulary (the causal families' embeddings take it
    as padding_idx, which torch refuses there)."""
    if c.fields.get("return_dict") is False:  # null, as absent, runs: a tuple of the logits
        raise c.error(
            f"return_dict=false: transformers' {spec.family} forward fails on it (its model's "
            "output, then a tuple, is not read as one); remove it or set it true"
        )
    enc_dec = c.fields.get("is_encoder_decoder")  # transformers takes any truthy value
    if enc_dec and spec.family != "switch_transformers":
        shown = "true" if enc_dec is True else repr(enc_dec)
        raise c.error(
            f"is_encoder_decoder={shown}: transformers' generate() then runs {spec.family} as "
            "an encoder-decoder and fails; moepipe runs it as the decoder it is: set it false"
        )
    pad, vocab = c.fields.get("pad_token_id"), spec.vocab_size
    outside = isinstance(pad, int) and not isinstance(pad, bool) and not -vocab <= pad < vocab
    if outside and spec.family != "switch_transformers":  # T5's embedding has no padding_idx
        raise c.error(
            f"pad_token_id={pad} is outside the vocabulary (vocab_size={vocab}): transformers' "
            f"{spec.family} embedding refuses it as its padding index; set it below "
            f"{vocab} or null"
        )


def check_act_known(c: HFConfig, fam: str) -> None:
    """Refuse an activation name transformers' ACT2FN lacks, for a simulated run too: no
    framework builds that model (transformers' class fails on it), so its timing is of none.
    One with learned weights (`LEARNED_ACTS`) is a model, which a simulated run times."""
    field = "dense_act_fn" if fam == "switch_transformers" else "hidden_act"
    act = c.get(field, "relu" if field == "dense_act_fn" else "silu")
    if act not in LEARNED_ACTS:
        _refuse_act(c, field, act, fam)


def _refuse_act(c: HFConfig, field: str, act: str, fam: str) -> None:
    """Refuse an activation the real model does not run: one with learned weights of its own
    (`LEARNED_ACTS`), or a name transformers' ACT2FN does not have."""
    if act in LEARNED_ACTS:
        raise c.error(
            f"{field}={act!r} is transformers' {LEARNED_ACTS[act]}, an activation with learned "
            f"weights of its own, which moepipe does not load for {fam}; any other ACT2FN name "
            "runs"
        )
    if act not in GATED_ACTS:
        raise c.error(
            f"{field}={act!r} is not implemented for {fam}; transformers' activations "
            f"{', '.join(map(repr, GATED_ACTS))} are"
        )


def _refuse_switch(c: HFConfig) -> None:
    """moepipe's Switch is a substitute (DESIGN: a causal decoder over the encoder's weights),
    but still the experts' dense_act_fn (ACT2FN's, those of `GATED_ACTS`) and routers without
    bias computing in float32, as switch-base ships: transformers' router_dtype of bfloat16 (or
    float16) rounds its router's logits and softmax."""
    fam = "switch_transformers"
    _refuse_act(c, "dense_act_fn", c.get("dense_act_fn", "relu"), fam)
    if c.get("router_bias", False):
        raise c.error(f"router_bias=true; {fam} routers without a bias are implemented")
    router_dtype = c.get("router_dtype", "float32")
    if router_dtype != "float32":
        raise c.error(
            f"router_dtype={router_dtype!r}; {fam} routers computing in 'float32' (switch-base's) "
            "are implemented: set it 'float32'"
        )


def _refuse_head_dims(c: HFConfig, spec: ModelSpec) -> None:
    """Refuse heads the real model cannot run, naming the field, before the weights saved for
    them are blamed: an odd rotary dim (RoPE turns pairs; transformers' validate_rope refuses
    one on load, and moepipe's Switch runs RoPE on d_kv), and OLMoE heads other than hidden_size
    / num_attention_heads (its q_norm spans hidden_size: transformers' OlmoeAttention fails),
    and DeepSeek-V3's head_dim other than qk_rope_head_dim (transformers' fails too)."""
    why = "transformers refuses an odd one too"
    if spec.mla:
        field, rotated = "qk_rope_head_dim", c.get("qk_rope_head_dim")
    elif spec.family == "switch_transformers":
        field, rotated = "d_kv", spec.head_dim
        why = "moepipe's Switch runs RoPE in place of T5's relative position buckets"
    elif c.get("head_dim", None) is not None:
        field, rotated = "head_dim", spec.head_dim
    else:
        field = f"head_dim (hidden_size={spec.hidden_size} / num_attention_heads={spec.n_heads})"
        rotated = spec.head_dim
    if rotated % 2:
        raise c.error(
            f"{field}={rotated} is odd; RoPE rotates pairs of dims, so {spec.family} heads need "
            f"an even rotary dim ({why})"
        )
    if spec.family == "olmoe" and spec.n_heads * spec.head_dim != spec.hidden_size:
        raise c.error(
            f"head_dim={spec.head_dim} x num_attention_heads={spec.n_heads} differs from "
            f"hidden_size={spec.hidden_size}; OLMoE's q_norm spans hidden_size, so transformers "
            "runs (and moepipe implements) only heads of hidden_size / num_attention_heads"
        )
    given = c.get("head_dim", None)  # V3's rotary embedding takes its dims from head_dim
    if spec.family == "deepseek_v3" and given not in (None, c.get("qk_rope_head_dim")):
        raise c.error(
            f"head_dim={given} differs from qk_rope_head_dim={c.get('qk_rope_head_dim')}: "
            "transformers' DeepseekV3 then makes RoPE frequencies for head_dim dims and fails "
            "on its keys; remove head_dim or set it to qk_rope_head_dim"
        )


def _refuse_generate_only(c: HFConfig, spec: ModelSpec) -> None:
    """Refuse attention fields transformers' generate() reads from any config (its masks and
    DynamicCache) where the family's forward does not: a window or chunks of Mixtral's,
    Qwen3-MoE's, OLMoE's or DeepSeek-V2's its decoding applies and its forward ignores.
    Qwen2-MoE's config always has layer_types (`_sliding_window` reads them), so generate()
    reads no other field of it."""
    if spec.family not in ("mixtral", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3"):
        return
    keys = ["attention_chunk_size", "layer_types"]
    if spec.family not in ("mixtral", "qwen3_moe"):  # their own field: `_sliding_window` reads it
        keys.append("sliding_window")
    for key in keys:
        value = c.fields.get(key)
        if key == "layer_types" and isinstance(value, list):  # every layer full: nothing changes
            value = value if set(value) - {"full_attention"} else None
        if value is not None:
            shown = f"a list of {len(value)}" if isinstance(value, list) else repr(value)
            raise c.error(
                f"{key} is {shown}: {spec.family}'s transformers class has no such field; "
                "transformers' generate() applies it and its forward ignores it, so moepipe "
                "runs neither: remove it or set it null"
            )


def _sliding_window(c: HFConfig, spec: ModelSpec) -> tuple[int | None, tuple[int, ...] | None]:
    """(window, layers with it) as transformers runs them: Mixtral's sliding_window on every
    layer, and Qwen3-MoE's where use_sliding_window is true (its config sets the window null
    otherwise; null: none); Qwen2-MoE's on the layers config.json's layer_types marks
    sliding_attention, or without it (transformers' default) the even-indexed layers below
    max_window_layers, where use_sliding_window is true. A window of 1 is refused:
    transformers' sliding cache keeps its last `sliding_window - 1` positions by the slice
    [-0:], every one, so its decode steps see them all where its prefill sees one."""
    window_rule = Rule(
        lambda v: COUNT.ok(v) and v >= 2,
        "an integer >= 2 (transformers' decode steps do not keep a window of 1)",
    ).or_null()
    if spec.family == "mixtral":
        return c.get("sliding_window", None, rule=window_rule), None
    if spec.family == "qwen3_moe":
        if not c.get("use_sliding_window", False):
            return None, None
        absent = "sliding_window" not in c.fields  # transformers' default then, 4096
        return c.get("sliding_window", 4096 if absent else None, rule=window_rule), None
    if spec.family != "qwen2_moe":
        return None, None
    used = c.get("use_sliding_window", False)
    types = c.get("layer_types", None)
    if types is not None and len(types) != spec.n_layers:
        raise c.error(
            f"layer_types has {len(types)} entries for num_hidden_layers={spec.n_layers}; "
            "give one per layer"
        )
    if types is None:
        below = c.get("max_window_layers", 28)  # transformers' default
        types = [
            "sliding_attention" if used and i % 2 == 0 and i < below else "full_attention"
            for i in range(spec.n_layers)
        ]
    layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not layers:
        return None, None
    if not used:  # transformers then sets sliding_window to 0: those layers would see nothing
        raise c.error(
            "layer_types marks sliding_attention layers but use_sliding_window is false; "
            "set use_sliding_window: true (with sliding_window) or mark them full_attention"
        )
    absent = "sliding_window" not in c.fields  # transformers' default then, 4096; null: none
    window = c.get("sliding_window", 4096 if absent else None, rule=window_rule)
    if window is None:
        raise c.error("use_sliding_window is true but sliding_window is null; set the window")
    return window, layers
