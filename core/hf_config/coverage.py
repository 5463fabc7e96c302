"""Every field transformers 5.24's config classes of the seven families take, and what moepipe does
with it: `COVERAGE[family][field]` is (how, why). READ: moepipe honours it (the why cites the
test that proves it); NO_EFFECT: transformers' logits do not change with it (a forward, or greedy
generate); REFUSED_UNLESS_DEFAULT: another value is refused in one line naming the file and the
field; SUBSTITUTED: a part of Switch (T5's decoder, relative positions, capacity) that moepipe's
causal substitute over the encoder's weights replaces. `ROPE_COVERAGE`: rope_parameters' keys;
`EXTRA_COVERAGE`: fields outside the classes that transformers' shared code reads, and
those released config.json files carry that nothing reads (NO_EFFECT: accepted, ignored);
core.hf_config.generation's `GENERATION_COVERAGE`: generation_config.json's (USER: set by
moepipe's own call, greedy for gen_len steps, and logged as not applied).

Usage: tests/real/test_hf_parity_round5.py checks the table against transformers' classes.
"""

from __future__ import annotations

from enum import StrEnum


class Handling(StrEnum):
    READ = "read"  # moepipe runs it as transformers does
    NO_EFFECT = "no_effect"  # transformers' logits are the same at any value
    REFUSED_UNLESS_DEFAULT = "refused_unless_default"  # another value: a one-line ConfigError
    SUBSTITUTED = "substituted"  # Switch only: T5's part moepipe's substitute replaces
    USER = "user"  # generation_config.json: the run's own call sets it; logged as not applied


READ, NO_EFFECT = Handling.READ, Handling.NO_EFFECT
REFUSED, SUBSTITUTED = Handling.REFUSED_UNLESS_DEFAULT, Handling.SUBSTITUTED
Entry = tuple[Handling, str]

_P = "test_hf_parity.py::test_equals_transformers"  # the main parity cases, by family
_P4 = "test_hf_parity_round4.py::test_equals_transformers"
_P5 = "test_hf_parity_round5.py::test_read_field_equals_transformers"
_P8 = "test_hf_parity_round8.py::test_bias_equals_transformers"
_P10 = "test_hf_parity_round10.py::test_qwen3_moe_equals_transformers"
_P10V3 = "test_hf_parity_round10b.py::test_deepseek_v3_equals_transformers"
_P12 = "test_hf_parity_round12.py::test_field_equals_transformers"
_P12U = "test_hf_parity_round12.py::test_a_released_field_no_class_takes_is_ignored"
_P12S = "test_hf_parity_round12.py::test_switch_t5_feed_forward_fields_are_ignored"
_QUIET = "round5's test_no_effect_field_leaves_transformers_logits"
_OUT = (NO_EFFECT, "an output or training switch: " + _QUIET)

# PreTrainedConfig's own fields, the same in every family
BASE: dict[str, Entry] = {
    "model_type": (READ, "picks the family: " + _P),
    "architectures": (READ, "model_type's family: test_probe_hf_config.py::test_architectures_"),
    "transformers_version": _OUT,
    "output_hidden_states": _OUT,
    "output_attentions": _OUT,
    # false: transformers' forward fails (null runs, returning a tuple)
    "return_dict": (REFUSED, "round5's test_return_dict_false_is_refused"),
    "dtype": (READ, "the saved dtype: test_hf_parity_round7.py::test_any_saved_dtype_runs_..."),
    "chunk_size_feed_forward": (NO_EFFECT, "none of these families chunks: " + _QUIET),
    # true: transformers' generate() fails on a decoder-only family (its forward runs)
    "is_encoder_decoder": (REFUSED, "false: round5's test_is_encoder_decoder_true_is_refused"),
    "id2label": (NO_EFFECT, "classification heads only: " + _QUIET),
    "label2id": (NO_EFFECT, "classification heads only: " + _QUIET),
    "problem_type": (NO_EFFECT, "classification losses only: " + _QUIET),
    "use_cache": (NO_EFFECT, "a KV cache changes no logit: " + _QUIET),
    # outside the vocabulary transformers' causal families fail, and moepipe refuses it
    "pad_token_id": (NO_EFFECT, "padding_idx trains, not runs: " + _QUIET),
    "bos_token_id": (NO_EFFECT, "a tokenizer's: " + _QUIET),
    "eos_token_id": (NO_EFFECT, "stops generate(), changes no logit: " + _QUIET),
    "tie_word_embeddings": (READ, "qwen2_moe-tied in " + _P + ", test_hf_parity_round3.py"),
}
# the decoder fields every causal family (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2 and
# V3) takes
DECODER: dict[str, Entry] = BASE | {
    "vocab_size": (READ, _P),
    "hidden_size": (READ, _P),
    "intermediate_size": (READ, "experts (Mixtral, OLMoE) or dense layers: " + _P),
    "num_hidden_layers": (READ, _P),
    "num_attention_heads": (READ, _P),
    "num_key_value_heads": (READ, "mixtral-kv8 in " + _P + "; one (MQA): *-mqa in " + _P12),
    # every ACT2FN name but prelu and xielu (learned weights: refused in one line)
    "hidden_act": (READ, "test_hf_parity_round12.py::test_activation_is_act2fn_bit_for_bit"),
    "max_position_embeddings": (READ, "dynamic RoPE's threshold: *-dynamic in " + _P),
    "initializer_range": (NO_EFFECT, "initial weights only; loaded ones win: " + _QUIET),
    "rms_norm_eps": (READ, "*-rms_norm_eps in " + _P4 + ", " + _P5 + "; *-mqa in " + _P12),
    "rope_parameters": (READ, "every RoPE type run: *-yarn, *-llama3, ... in " + _P),
    "attention_dropout": (NO_EFFECT, "training only: " + _QUIET),
    "num_experts_per_tok": (READ, _P),
    "output_router_logits": _OUT,
}
_AUX = {"router_aux_loss_coef": (NO_EFFECT, "a training loss: " + _QUIET)}
_NORM = "norm_topk_prob"
_F9 = "test_hf_parity_fields.py, test_hf_parity_round9.py::test_rope_type_is_transformers"

COVERAGE: dict[str, dict[str, Entry]] = {
    "mixtral": DECODER
    | _AUX
    | {
        "head_dim": (READ, "mixtral-head_dim in " + _P4),
        "sliding_window": (READ, "mixtral-sliding_window in " + _P),
        "num_local_experts": (READ, _P + "; num_experts too (round4's attribute_map test)"),
        "router_jitter_noise": (NO_EFFECT, "training only: mixtral-router_jitter_noise in " + _P4),
    },
    "qwen2_moe": DECODER
    | _AUX
    | {
        "use_sliding_window": (READ, "qwen2_moe-sliding_window in " + _P),
        "sliding_window": (READ, "qwen2_moe-sliding_window in " + _P),
        "max_window_layers": (READ, "qwen2_moe-max_window_layers in " + _P),
        "layer_types": (READ, "qwen2_moe-layer_types in " + _P5),
        "decoder_sparse_step": (READ, "qwen2_moe-sparse_step in " + _P4),
        "mlp_only_layers": (READ, "qwen2_moe-sparse_step in " + _P4),
        "moe_intermediate_size": (READ, _P),
        "shared_expert_intermediate_size": (READ, "qwen2_moe-sparse_step in " + _P4),
        "num_experts": (READ, _P),
        _NORM: (READ, "qwen2_moe-norm_topk_prob in " + _P4),
        "qkv_bias": (READ, "qwen2_moe-no_qkv_bias in " + _P),
    },
    "qwen3_moe": DECODER
    | _AUX
    | {
        "use_sliding_window": (READ, "qwen3_moe-sliding_window in " + _P10),
        "sliding_window": (READ, "qwen3_moe-sliding_window in " + _P10),
        "decoder_sparse_step": (READ, "qwen3_moe-sparse_step in " + _P10),
        "mlp_only_layers": (READ, "qwen3_moe-sparse_step in " + _P10),
        "moe_intermediate_size": (READ, _P10),
        "num_experts": (READ, _P10 + "; num_local_experts too, the name save_pretrained writes"),
        "num_local_experts": (READ, _P10),
        _NORM: (READ, "qwen3_moe-norm_topk_prob in " + _P10),
        "attention_bias": (READ, "qwen3_moe-attention_bias in " + _P10),
    },
    "olmoe": DECODER
    | _AUX
    | {
        "attention_bias": (READ, "olmoe attention_bias in " + _P8),
        "clip_qkv": (READ, "olmoe-clip_qkv in " + _P),
        "num_experts": (READ, _P + "; num_local_experts too (round4's attribute_map test)"),
        _NORM: (READ, "olmoe-norm_topk_prob in " + _P4),
    },
    "deepseek_v2": DECODER
    | {
        "pretraining_tp": (NO_EFFECT, "transformers' DeepseekV2 never reads it: " + _QUIET),
        # transformers' DeepseekV2Config overwrites both from the MLA sizes
        "head_dim": (NO_EFFECT, "set to qk_rope_head_dim on load: " + _QUIET),
        "qk_head_dim": (NO_EFFECT, "set to qk_nope + qk_rope on load: " + _QUIET),
        "attention_bias": (READ, "deepseek_v2 attention_bias in " + _P8),
        "mlp_bias": (READ, "deepseek_v2 mlp_bias in " + _P8),
        "first_k_dense_replace": (READ, "deepseek_v2-layers in " + _P4),
        "kv_lora_rank": (READ, "deepseek_v2-mla_dims in " + _P),
        "q_lora_rank": (READ, "deepseek_v2-q_lora_rank in " + _P),
        "qk_nope_head_dim": (READ, "deepseek_v2-mla_dims in " + _P),
        "qk_rope_head_dim": (READ, "deepseek_v2-mla_dims in " + _P),
        "v_head_dim": (READ, "deepseek_v2-mla_dims in " + _P),
        "n_group": (READ, "deepseek_v2-group_limited_greedy in " + _P),
        "topk_group": (READ, "deepseek_v2-group_limited_greedy in " + _P),
        "topk_method": (READ, "deepseek_v2-group_limited_greedy in " + _P),
        "n_routed_experts": (READ, _P + "; num_experts too (round4's attribute_map test)"),
        "n_shared_experts": (READ, "deepseek_v2-layers in " + _P4),
        "moe_intermediate_size": (READ, _P),
        "routed_scaling_factor": (READ, "deepseek_v2-layers in " + _P4),
        # DeepSeek's own modeling code's rule, which transformers' router lacks (logged)
        _NORM: (READ, "test_hf_parity.py::test_deepseek_norm_topk_prob_follows_deepseek..."),
    },
    "deepseek_v3": DECODER
    | {
        "pretraining_tp": (NO_EFFECT, "transformers' DeepseekV3 never reads it: " + _QUIET),
        # its rotary embedding's dims: another than qk_rope_head_dim fails in transformers
        "head_dim": (REFUSED, "qk_rope_head_dim: round5's test_refused_field_is_one_line..."),
        "qk_head_dim": (NO_EFFECT, "set to qk_nope + qk_rope on load: " + _QUIET),
        # multi-token prediction layers, which transformers' DeepseekV3 does not build
        "num_mtp_layers": (NO_EFFECT, "no MTP module in transformers: " + _QUIET),
        "num_nextn_predict_layers": (NO_EFFECT, "num_mtp_layers' stored name: " + _QUIET),
        "attention_bias": (READ, "deepseek_v3-q_lora_rank in " + _P10V3),
        "first_k_dense_replace": (READ, _P10V3),
        "kv_lora_rank": (READ, "deepseek_v3-mla_dims in " + _P10V3),
        "q_lora_rank": (READ, "deepseek_v3-q_lora_rank in " + _P10V3),
        "qk_nope_head_dim": (READ, "deepseek_v3-mla_dims in " + _P10V3),
        "qk_rope_head_dim": (READ, "deepseek_v3-mla_dims in " + _P10V3),
        "v_head_dim": (READ, "deepseek_v3-mla_dims in " + _P10V3),
        "n_group": (READ, "the topk_group best groups: " + _P10V3 + "; 1: *-one_group in " + _P12),
        "topk_group": (READ, "sigmoid scores of the topk_group best groups: " + _P10V3),
        "n_routed_experts": (READ, _P10V3 + "; num_local_experts too, its stored name"),
        "n_shared_experts": (READ, "deepseek_v3-shared, deepseek_v3-one_group in " + _P12),
        "moe_intermediate_size": (READ, _P10V3),
        "routed_scaling_factor": (READ, "deepseek_v3-no_norm_top1 in " + _P10V3),
        _NORM: (READ, "deepseek_v3-no_norm_top1 in " + _P10V3),
        # null: None in transformers' class, which rotates halves then (round28's null test)
        "rope_interleave": (READ, "deepseek_v3-rope_half in " + _P10V3),
    },
    "switch_transformers": BASE
    | {
        "is_encoder_decoder": (SUBSTITUTED, "moepipe runs the encoder as a causal decoder"),
        "tie_word_embeddings": (READ, "test_hf_parity_fields.py::test_switch_tie_left_out..."),
        "vocab_size": (READ, "test_hf_parity.py::test_switch_tied_head_runs..."),
        "d_model": (READ, "test_hf_parity.py::test_switch_tied_head_runs..."),
        "d_kv": (READ, "test_hf_parity_fields.py::test_switch_of_odd_d_kv_is_refused..."),
        "d_ff": (READ, "test_hf_parity.py::test_switch_tied_head_runs..."),
        "num_layers": (READ, "the encoder's blocks: test_spec_sizes.py's Switch tests"),
        "num_sparse_encoder_layers": (READ, "test_spec_sizes.py's Switch tests"),
        "encoder_sparse_step": (READ, "test_checkpoint.py's Switch sparse blocks test"),
        "num_heads": (READ, "test_hf_parity.py::test_switch_tied_head_runs..."),
        "num_experts": (READ, "test_hf_parity.py::test_switch_tied_head_runs..."),
        "layer_norm_epsilon": (READ, "the encoder's RMSNorm"),
        "dense_act_fn": (READ, "test_hf_parity_round9.py::test_switch_dense_act_fn_is..."),
        "router_bias": (REFUSED, "false: test_hf_parity.py::test_switch_tied_head_runs..."),
        "router_dtype": (REFUSED, "float32: round5's test_switch_router_dtype_..."),
        "num_decoder_layers": (SUBSTITUTED, "the decoder, which moepipe does not run"),
        "num_sparse_decoder_layers": (SUBSTITUTED, "the decoder, which moepipe does not run"),
        "decoder_sparse_step": (SUBSTITUTED, "the decoder, which moepipe does not run"),
        "relative_attention_num_buckets": (SUBSTITUTED, "moepipe's substitute runs RoPE"),
        "relative_attention_max_distance": (SUBSTITUTED, "moepipe's substitute runs RoPE"),
        "expert_capacity": (SUBSTITUTED, "moepipe's experts drop no token"),
        "router_ignore_padding_tokens": (NO_EFFECT, "the router's training loss: " + _QUIET),
        "is_decoder": (SUBSTITUTED, "moepipe runs the encoder as a causal decoder"),
        "add_cross_attention": (SUBSTITUTED, "the decoder, which moepipe does not run"),
        "router_jitter_noise": (NO_EFFECT, "training only: " + _QUIET),
        "dropout_rate": (NO_EFFECT, "training only: " + _QUIET),
        "router_z_loss_coef": (NO_EFFECT, "a training loss: " + _QUIET),
        "router_aux_loss_coef": (NO_EFFECT, "a training loss: " + _QUIET),
        "initializer_factor": (NO_EFFECT, "initial weights only: " + _QUIET),
        "add_router_probs": _OUT,
    },
}
_ROPE = "test_hf_parity.py (*-yarn, *-llama3, *-dynamic) and test_hf_parity_round4.py"
# transformers' RopeParameters keys (`type`: rope_scaling's older name of rope_type)
ROPE_COVERAGE: dict[str, Entry] = {
    "rope_type": (READ, "default, linear, dynamic, yarn, llama3; others refused: " + _ROPE),
    "rope_theta": (READ, _ROPE),
    "factor": (READ, _ROPE),
    "original_max_position_embeddings": (READ, _ROPE),
    "attention_factor": (READ, "mixtral-yarn_attention_factor in " + _P4),
    "beta_fast": (READ, _ROPE),
    "beta_slow": (READ, _ROPE),
    "truncate": (READ, "mixtral-yarn_attention_factor in " + _P4),
    "low_freq_factor": (READ, "*-llama3 in " + _P),
    "high_freq_factor": (READ, "*-llama3 in " + _P),
    "mscale": (READ, "deepseek_v2-yarn in " + _P + "; V3's release: *-yarn_shipped in " + _P12),
    # DeepSeek's softmax takes it under linear, dynamic and llama3 too (elsewhere: refused)
    "mscale_all_dim": (READ, "deepseek_v2-yarn in " + _P + "; *-linear_mscale in " + _P12),
    "partial_rotary_factor": (REFUSED, "1 with scaled RoPE but proportional: " + _F9),
    "short_factor": (READ, "test_hf_parity_round9.py::test_rope_type_is_transformers"),
    "long_factor": (READ, "test_hf_parity_round9.py::test_rope_type_is_transformers"),
    # multimodal RoPE's: no family here reads it
    "mrope_section": (NO_EFFECT, _QUIET),
}
_F = "test_hf_parity_fields.py"
# Fields no class above takes that transformers' shared code (masks, RoPE standardisation,
# loading) reads from any config.json, and DeepSeek's own modeling code's fields
EXTRA_COVERAGE: dict[str, Entry] = {
    "torch_dtype": (READ, "dtype's older name: round4's test_a_dtype_without_kernels..."),
    "rope_scaling": (
        READ,
        "rope_parameters' older name: "
        "test_hf_parity_round12.py::test_v3_shipped_legacy_rope_scaling_equals_transformers",
    ),
    "rope_theta": (READ, "transformers moves it into rope_parameters"),
    "original_max_position_embeddings": (READ, "round4's test_a_top_level_original_max..."),
    "partial_rotary_factor": (REFUSED, "1 with scaled RoPE but proportional: round3, round9"),
    "is_causal": (REFUSED, "true: round4's test_is_causal_false_is_refused"),
    "attention_chunk_size": (REFUSED, "null: " + _F + "::test_a_window_only_generate..."),
    # Mixtral's, Qwen3-MoE's, OLMoE's and DeepSeek-V2's (Qwen2-MoE's own fields are read above)
    "layer_types": (REFUSED, "all full_attention: " + _F + "::test_a_window_only_generate..."),
    "sliding_window": (REFUSED, "null (OLMoE, DeepSeek-V2): " + _F),
    "quantization_config": (
        READ,
        "fp8 blocks, dequantized at load; other methods refused: "
        "test_hf_parity_round11.py::test_deepseek_v3_fp8_...",
    ),
    "transformers_weights": (REFUSED, "model.safetensors: round5's test_transformers_weights_..."),
    "per_layer_config": (NO_EFFECT, "no family here applies it: " + _QUIET),
    # released config.json files' fields no class here takes and nothing reads: DeepSeek's own
    # code's training and expert-parallel settings and remote-code map, Qwen3-30B-A3B's
    # max_window_layers (Qwen2-MoE's field), T5's and Switch's feed-forward and router names
    "aux_loss_alpha": (NO_EFFECT, "a training loss: " + _P12U),
    "seq_aux": (NO_EFFECT, "a training loss: " + _P12U),
    "ep_size": (NO_EFFECT, "DeepSeek's expert parallelism: " + _P12U),
    "auto_map": (NO_EFFECT, "remote code, unused without trust_remote_code: " + _P12U),
    "max_window_layers": (NO_EFFECT, "Qwen3-MoE: " + _P12U),
    "feed_forward_proj": (NO_EFFECT, "Switch: " + _P12S),
    "is_gated_act": (NO_EFFECT, "Switch: " + _P12S),
    "router_type": (NO_EFFECT, "Switch: " + _P12S),
    # Qwen2-MoE's, Qwen3-MoE's and OLMoE's attention read it though their classes lack it
    # (OLMoE's only as hidden_size / num_attention_heads, else refused: its q_norm spans
    # hidden_size)
    "head_dim": (READ, "qwen2_moe-head_dim in " + _P + "; every case of " + _P10),
    # V2: DeepSeek's reading (layers between dense); V3: transformers' (ignored), both warned
    "moe_layer_freq": (
        READ,
        "V2 DeepSeek's: test_hf_parity.py::test_weights_config_json...; V3 transformers': "
        "test_hf_parity_round11.py::test_deepseek_v3_moe_layer_freq_follows_transformers...",
    ),
    # V3: transformers' sigmoid at any value, warned (round11's test_deepseek_v3_router_...)
    "scoring_func": (REFUSED, "softmax, DeepSeek's: test_model.py's DeepSeek routing test"),
}
