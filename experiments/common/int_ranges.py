"""The working range of the commands' int-typed fields, in the words of the project's own
checks (core.args, core.spec, the planners' params), for the line of a value omegaconf refuses
by its type before those checks run (`disk_mb=1e300`, `workload.batch_size=2.5`, `n=abc`).

Usage:
    line = int_field_line("disk_mb", "1e+300", at="")  # names disk_mb and [1, 1048576]
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
    "replica_slots": (0, MAX_TOKENS, TOKENS_WHY),
    "repeats": (1, MAX_REPEATS, REPEATS_WHY),
    "repeat": (1, MAX_REPEATS, REPEATS_WHY),
    "disk_mb": (1, MAX_SIZE_MB, SIZE_WHY),
    "units": (1, 4096, "each is a slab slot"),
    "seed": (0, 2**63 - 1, "a 64-bit seed"),
    "klotski_n": (-1, None, ""),
    "lanes": (2, None, ""),
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
# the token counts of a run's workload (core.spec.Workload): no highest of their own (a
# simulated run makes no tensors; prompt_len + gen_len are bound together)
_WORKLOAD_TOKENS = ("batch_size", "n_batches", "prompt_len", "gen_len")


def int_range(key: str) -> tuple[int, int | None, str]:
    """(lowest, highest or None, why the highest) of int-typed field `key` (dotted)."""
    name = re.sub(r"\[\d+\]$", "", key.lstrip("+~").rsplit(".", 1)[-1])  # a list's item
    if name in _RANGES:
        low, high, why = _RANGES[name]
        if key.endswith("workload.seed"):
            return low, 2**64 - 1, why
        if name in _WORKLOAD_TOKENS and key.rsplit(".", 1)[0].endswith("workload"):
            return low, None, ""
        return low, high, why
    if key.endswith("params.n"):  # klotski's: -1 = workload.n_batches, 0 = auto
        return -1, None, ""
    if name.endswith("_mb"):
        return 0, MAX_SIZE_MB, SIZE_WHY
    return (0 if name in _NONE_AT_0 else 1), None, ""


def range_words(key: str) -> str:
    """`int_range(key)` as a line says it: "an integer in [1, 1048576] (why)", or "a positive
    integer" where only its lowest is bound."""
    low, high, why = int_range(key)
    if high is None:
        return integer_words(low)
    return f"an integer in [{low}, {high}]" + (f" ({why})" if why else "")


def int_field_line(key: str, value: str, at: str) -> str:
    """The line for int-typed field `key` given `value`, no integer in its range (a float, a
    word, a number past any range: omegaconf's refusal): the field, what it got and its
    working range, as the project's own check says it (`at`: in which file)."""
    low, _, _ = int_range(key)
    return f"{key}={value}: must be {range_words(key)}{at}; pass e.g. {key}={max(low, 1)}"


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
