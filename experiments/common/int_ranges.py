"""The working range of the commands' int-typed fields, in the words of the project's own
checks (core.args, core.spec, the planners' params), for the line of a value omegaconf refuses
by its type before those checks run (`disk_mb=1e300`, `workload.batch_size=2.5`, `n=abc`).

A field's range is its checks': a model's (core.spec), a machine's (core.hardware), a
workload's, a planner's params' or a command's own, told apart by the schema omegaconf names
(`owner`) or the key's prefix (`model.`, `hardware.`, `planner.params.`, `workload.`).

Usage:
    line = int_field_line("disk_mb", "1e+300", at="")  # names disk_mb and [1, 1048576]
    int_range("model.hidden_size")  # (1, 16777216, "wider than any model")
"""

from __future__ import annotations

import re

from core.args import MAX_REPEATS, MAX_SIZE_MB, MAX_TOKENS, REPEATS_WHY, SIZE_WHY, TOKENS_WHY
from core.errors import integer_words

# a field's last name -> (lowest, highest or None, why the highest); by what each is checked
# against once typed right: core.args' as_int/as_size_mb, core.spec, the planners' params
_RANGES: dict[str, tuple[int, int | None, str]] = {
    **{k: (1, MAX_TOKENS, TOKENS_WHY) for k in ("batch_size", "n_batches", "prompt_len")},
    **{k: (1, MAX_TOKENS, TOKENS_WHY) for k in ("gen_len", "rows", "acc_batch")},
    **{k: (1, MAX_TOKENS, TOKENS_WHY) for k in ("batch", "kv_heads", "head_dim")},
    "positions": (2, MAX_TOKENS, TOKENS_WHY),  # bench.host's: a cache of 2 positions or more
    "replica_slots": (0, MAX_TOKENS, TOKENS_WHY),
    "repeats": (1, MAX_REPEATS, REPEATS_WHY),
    "repeat": (1, MAX_REPEATS, REPEATS_WHY),
    "disk_mb": (1, MAX_SIZE_MB, SIZE_WHY),
    "units": (1, 4096, "each is a slab slot"),
    "seed": (0, 2**63 - 1, "a 64-bit seed"),
    "klotski_n": (-1, None, ""),
    "lanes": (2, None, ""),
    "k": (0, None, ""),  # prefetch_eval's: 0 = the trace's top-k
}
# fields of the model and the hardware whose 0 means none (or unknown): 0 or more
_NONE_AT_0 = {
    "dense_ffn_size",
    "shared_ffn_size",
    "kv_dim",
    "attn_params",
    "qk_head_dim",
    "latent_expand_params",
    "qk_rope_head_dim",
    "q_lora_rank",
    "disk_dtype_bytes",
    "sms",
    "comm_sms",
    "copy_sms",
    "hot_experts",
    "moe_layers",  # a layer's index, from 0
    "klotski_attn",
    "n",
    "guess_k",
    "prefetch_distance",
    "history",
    "hot_k",
    "disk_speculate",
}
# the token counts of a run's workload (core.spec.Workload): a simulated run makes no tensors;
# prompt_len + gen_len are bound together, to a model's longest context
_WORKLOAD_TOKENS = ("batch_size", "n_batches", "prompt_len", "gen_len")
# the schemas whose fields are a model's (core.spec.ModelSpec checks them), a machine's
# (core.hardware), a planner's params (`*ParamsSchema`)
_MODEL_OWNERS = ("ModelSchema", "MakeCheckpointOptions")
_HARDWARE_OWNERS = ("HardwareSchema", "ComputeSchema")


def _scoped() -> dict[str, dict[str, tuple[int, int | None, str]]]:
    """The ranges of the model's, the machine's, the workload's and the planners' fields, from
    the constants their checks use (imported here: only a refused value's line reads them)."""
    import os

    from core.hardware import PHYSICAL
    from core.spec import MAX_EXPERTS, MAX_LAYERS, MAX_POSITIONS, MAX_WIDTH
    from core.spec_fields import MAX_LAYER_PARAMS
    from planners.ep.params import MAX_DEVICES
    from planners.klotski import MAX_WARMUP_SEQUENCES
    from planners.n_planner import N_MAX

    wide = "wider than any model"
    sms = int(PHYSICAL["sms"][1])
    tokens = (1, MAX_POSITIONS - 1, f"prompt_len + gen_len at most {MAX_POSITIONS}")
    return {
        "model": {
            "n_layers": (1, MAX_LAYERS, "more than any model has"),
            **dict.fromkeys(
                ("hidden_size", "expert_ffn_size", "n_heads", "n_kv_heads", "head_dim"),
                (1, MAX_WIDTH, wide),
            ),
            "vocab_size": (1, MAX_WIDTH, wide),
            **dict.fromkeys(
                ("dense_ffn_size", "shared_ffn_size", "kv_dim", "qk_head_dim"), (0, MAX_WIDTH, wide)
            ),
            **dict.fromkeys(("qk_rope_head_dim", "q_lora_rank"), (0, MAX_WIDTH, wide)),
            **dict.fromkeys(
                ("attn_params", "latent_expand_params"),
                (0, MAX_LAYER_PARAMS, "more weights in a layer than any whole model has"),
            ),
            "n_experts": (1, MAX_EXPERTS, "expert ids are int16"),
            "top_k": (1, MAX_EXPERTS, "at most n_experts"),
            "dtype_bytes": (1, 8, "1, 2, 4 or 8"),
            "disk_dtype_bytes": (0, 4, "0, 1, 2 or 4"),
        },
        "hardware": {
            "n_gpus": (1, int(PHYSICAL["n_gpus"][1]), "past the largest clusters"),
            "sms": (0, sms, "past any GPU"),
            **dict.fromkeys(("comm_sms", "copy_sms"), (0, sms - 1, "together below sms")),
        },
        "workload": {
            "batch_size": (1, None, ""),
            "n_batches": (1, None, ""),
            "prompt_len": tokens,
            "gen_len": tokens,
            "seed": (0, 2**64 - 1, "a 64-bit seed"),
        },
        "params": {
            "n_devices": (0, MAX_DEVICES, "0 = hardware.n_gpus; the all-to-all grows as G^2"),
            "replica_slots": (0, None, ""),
            "replicas": (-1, None, ""),
            "n": (-1, None, ""),  # klotski's: -1 = workload.n_batches, 0 = auto
            "attn_batches": (0, N_MAX, "the most batches a group holds"),
            "warmup_sequences": (1, MAX_WARMUP_SEQUENCES, "its counts settle long before"),
            "rehome_interval": (0, None, ""),
        },
        "command": {
            "jobs": (1, 4 * (os.cpu_count() or 1), "4 worker processes per core here"),
            "n_layers": (1, MAX_LAYERS, "more than any model has"),
        },
    }


def _scope(key: str, owner: type | None) -> str:
    """Which checks take `key` of schema `owner` (where omegaconf said it): a model's, ..."""
    name = getattr(owner, "__name__", "")
    if name in _MODEL_OWNERS or key.startswith("model."):
        return "model"
    if name in _HARDWARE_OWNERS or key.startswith("hardware."):
        return "hardware"
    if name.endswith("ParamsSchema") or ".params." in key:
        return "params"
    if name == "ReplicationSchema" or key.startswith("replication."):  # the planners' budget
        return "params"
    if name == "WorkloadSchema" or key.startswith("workload.") and "routing" not in key:
        return "workload"
    return "command"


def int_range(key: str, owner: type | None = None) -> tuple[int, int | None, str]:
    """(lowest, highest or None, why the highest) of int-typed field `key` (dotted) of schema
    `owner` (the dataclass omegaconf names; else read from the key's prefix)."""
    name = re.sub(r"\[\d+\]$", "", key.lstrip("+~").rsplit(".", 1)[-1])  # a list's item
    scoped = _scoped()
    scope = _scope(key.lstrip("+~"), owner)
    if name in scoped[scope]:
        return scoped[scope][name]
    if name in _RANGES:
        return _RANGES[name]
    if name.endswith("_mb"):
        return 0, MAX_SIZE_MB, SIZE_WHY
    return (0 if name in _NONE_AT_0 else 1), None, ""


def range_words(key: str, owner: type | None = None) -> str:
    """`int_range(key, owner)` as a line says it: "an integer in [1, 1048576] (why)", or "a
    positive integer" where only its lowest is bound."""
    low, high, why = int_range(key, owner)
    if high is None:
        return integer_words(low)
    return f"an integer in [{low}, {high}]" + (f" ({why})" if why else "")


def int_field_line(key: str, value: str, at: str, owner: type | None = None) -> str:
    """The line for int-typed field `key` given `value`, no integer in its range (a float, a
    word, a number past any range: omegaconf's refusal): the field, what it got and its
    working range, as the project's own check says it (`at`: in which file)."""
    low, _, _ = int_range(key, owner)
    return f"{key}={value}: must be {range_words(key, owner)}{at}; pass e.g. {key}={max(low, 1)}"


# the units a key's name carries (`budget_gb`, `latency_us`), as a line says them
_UNITS = (
    ("gbps", "GB/s"),
    ("_gb", "GB"),
    ("tflops", "TFLOP/s"),
    ("_us", "microseconds"),
    ("_ms", "milliseconds"),
    ("_bytes", "bytes"),
    ("_s", "seconds"),
)


def unit_given(key: str, text: str) -> str | None:
    """The unit the nearest part of dotted `key` names, where `text` is a number with a unit
    written after it (`16GB`; not 1e+300, whose `e` is no unit); None otherwise."""
    if not re.match(r"\s*[-+.\d]+\s*[a-zA-Z]", text) or _number(text) is not None:
        return None
    for part in reversed(key.split(".")):
        unit = next((u for suffix, u in _UNITS if part.endswith(suffix)), None)
        if unit:
            return unit
    return None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def whole_float(text: str) -> int | None:
    """The integer a float's text holds (1e9, 8.0), or None."""
    x = _number(text)
    return int(x) if x is not None and x.is_integer() and abs(x) < 2**63 else None
