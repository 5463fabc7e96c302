"""A checkpoint's generation settings: `generation_config.json` (or, without one, config.json's
generation fields, as transformers falls back to them), every field of transformers 5.24's
GenerationConfig classified in `GENERATION_COVERAGE`, and those that change greedy tokens read
into a `Greedy` that real.decoding applies as transformers' logits processors do. moepipe runs
`generate(do_sample=False, max_new_tokens=gen_len, eos_token_id=None)` with an unpadded prompt:
the fields that call sets (USER) are logged once as not applied.

Usage: `read_generation(ckpt_dir, vocab_size)` -> Greedy.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import ConfigError, cannot_read
from core.files import read_small
from core.hf_config.coverage import NO_EFFECT, READ, REFUSED, Entry, Handling
from core.hf_config.fields import loads_hf_json

log = logging.getLogger(__name__)

GENERATION_FILE = "generation_config.json"
USER = Handling.USER
_R6 = "test_hf_parity_round6.py::"
_HONOURED = (READ, _R6 + "test_honoured_field_equals_transformers_generate")
_CALL = "set by moepipe's call: " + _R6 + "test_user_field_is_logged_not_applied"
_GREEDY = (USER, "greedy decoding, do_sample=False: " + _CALL)
_LENGTH = (USER, "every sequence runs gen_len steps, eos_token_id=None: " + _CALL)
_QUIET = (NO_EFFECT, "an output, cache or assistant switch: " + _R6 + "test_no_effect_field_...")
_REFUSE = (REFUSED, "another decoding than greedy's: " + _R6 + "test_refused_field_is_one_line...")

# every field of transformers' GenerationConfig and what moepipe does with it
GENERATION_COVERAGE: dict[str, Entry] = {
    "repetition_penalty": _HONOURED,
    "no_repeat_ngram_size": _HONOURED,
    "bad_words_ids": _HONOURED,
    "suppress_tokens": _HONOURED,
    "begin_suppress_tokens": _HONOURED,
    "forced_bos_token_id": _HONOURED,
    "forced_eos_token_id": _HONOURED,
    "do_sample": _GREEDY,
    "temperature": _GREEDY,
    "top_k": _GREEDY,
    "top_p": _GREEDY,
    "min_p": _GREEDY,
    "typical_p": _GREEDY,
    "top_h": _GREEDY,
    "epsilon_cutoff": _GREEDY,
    "eta_cutoff": _GREEDY,
    "max_new_tokens": _LENGTH,
    "max_length": _LENGTH,
    "min_new_tokens": _LENGTH,  # suppresses eos only, which the call leaves out
    "min_length": _LENGTH,
    "max_time": _LENGTH,
    "eos_token_id": _LENGTH,
    "pad_token_id": (USER, "the prompt is unpadded (an all-ones attention_mask): " + _CALL),
    "num_return_sequences": (USER, "one sequence a prompt: " + _CALL),
    "num_beams": _REFUSE,
    "num_beam_groups": _REFUSE,
    "diversity_penalty": _REFUSE,
    "penalty_alpha": _REFUSE,
    "dola_layers": _REFUSE,
    "guidance_scale": _REFUSE,
    "sequence_bias": _REFUSE,
    "exponential_decay_length_penalty": _REFUSE,
    "encoder_repetition_penalty": _REFUSE,
    "encoder_no_repeat_ngram_size": _REFUSE,
    "force_words_ids": _REFUSE,
    "constraints": _REFUSE,
    "watermarking_config": _REFUSE,
    "token_healing": _REFUSE,
    "stop_strings": _REFUSE,
    "prompt_lookup_num_tokens": _REFUSE,
    "assistant_early_exit": _REFUSE,
    "use_mtp": _REFUSE,
    "speculation_type": _REFUSE,
    # beam search's, never run at num_beams 1; sampling-free rescaling that keeps the argmax
    "length_penalty": _QUIET,
    "early_stopping": _QUIET,
    "remove_invalid_values": _QUIET,
    "renormalize_logits": _QUIET,
    "bos_token_id": (NO_EFFECT, "read only without a prompt: " + _R6 + "test_no_effect_field_..."),
    "decoder_start_token_id": _QUIET,
    "output_attentions": _QUIET,
    "output_hidden_states": _QUIET,
    "output_scores": _QUIET,
    "output_logits": _QUIET,
    "return_dict_in_generate": _QUIET,
    "use_cache": _QUIET,
    "cache_implementation": _QUIET,
    "cache_config": _QUIET,
    "max_cache_len": _QUIET,
    "low_memory": _QUIET,
    "prefill_chunk_size": _QUIET,
    # transformers fails on both (a compile_config from a file is a dict, not a CompileConfig)
    "compile_config": (REFUSED, "transformers' generate() fails: " + _R6 + "test_refused_..."),
    "disable_compile": _QUIET,
    "continuous_batching_config": _QUIET,
    "is_assistant": (REFUSED, "true: transformers' generate() fails: " + _R6 + "test_refused_..."),
    "num_assistant_tokens": _QUIET,
    "num_assistant_tokens_schedule": _QUIET,
    "assistant_confidence_threshold": _QUIET,
    "assistant_lookbehind": _QUIET,
    "target_lookbehind": _QUIET,
    "assistant_ensemble_weight": _QUIET,
    "max_matching_ngram_size": _QUIET,
    "transformers_version": _QUIET,
    "_from_model_config": _QUIET,
}
# transformers' global defaults of the refused fields: these (and null) run
REFUSED_DEFAULTS: dict[str, Any] = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "diversity_penalty": 0.0,
    "guidance_scale": 1.0,
    "encoder_repetition_penalty": 1.0,
    "encoder_no_repeat_ngram_size": 0,
    "token_healing": False,
    "use_mtp": False,
    "is_assistant": False,
}


@dataclass(frozen=True)
class Greedy:
    """The generation settings greedy decoding applies to each step's float32 logits, in
    transformers' order; the defaults change nothing (plain argmax)."""

    repetition_penalty: float = 1.0  # seen tokens' logits divided (> 0) or multiplied (< 0) by it
    no_repeat_ngram_size: int = 0  # an n-gram of the sequence never repeats; 0: off
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # token sequences never completed
    forced_bos_token_id: int | None = None  # the only choice at length 1 (a 1-token prompt)
    forced_eos_token_id: tuple[int, ...] = ()  # the only choices at the run's last step
    suppress_tokens: tuple[int, ...] = ()  # never chosen
    begin_suppress_tokens: tuple[int, ...] = ()  # not chosen at the first generated step
    # a forced_bos_token_id outside the vocabulary: a 1-token prompt's one-line refusal
    # (transformers fails there), ignored by a longer prompt; "": none
    forced_bos_refusal: str = ""

    @property
    def plain(self) -> bool:
        return self == Greedy()


def read_generation(ckpt_dir: str | Path, vocab_size: int) -> Greedy:
    """The checkpoint's generation settings; a ConfigError in one line naming the file and the
    field for a malformed file, a refused field or a value transformers would fail on."""
    d = Path(ckpt_dir)
    path = d / GENERATION_FILE
    own = _read_generation_file(path) if path.exists() or path.is_symlink() else None
    if own is not None:
        fields, where = own, str(path)
    else:  # transformers reads config.json as a generation config then
        fields, where = _read_object(d / "config.json"), str(d / "config.json")
        fields = {k: v for k, v in fields.items() if k in GENERATION_COVERAGE}
    unapplied = []
    for key, value in fields.items():
        how = GENERATION_COVERAGE.get(key, (NO_EFFECT, ""))[0]  # others: custom entries
        if how == REFUSED and value is not None and value != REFUSED_DEFAULTS.get(key):
            default = ""
            if key in REFUSED_DEFAULTS:
                default = f" or set it to {_show(REFUSED_DEFAULTS[key])}"
            raise ConfigError(
                f"{where}: {key}={_show(value)}: moepipe decodes greedily, one beam, without "
                f"it; remove the field{default}"
            )
        if how == USER and value is not None:
            unapplied.append(f"{key}={_show(value)}")
    if unapplied:
        _log_once(
            f"{where}: {', '.join(unapplied)} not applied: moepipe decodes greedily, gen_len "
            "steps a sequence, no eos stop (docs/commands.md)"
        )
    return _greedy(fields, where, vocab_size)


def _read_generation_file(path: Path) -> dict[str, Any] | None:
    """generation_config.json's fields, or None (logged in one line) where transformers falls
    back to config.json's: a file it cannot open as a regular file or read as UTF-8 JSON
    (GenerationConfig.from_pretrained's OSError). JSON of another type than an object, or
    nested past Python's recursion limit, fails transformers' load: refused in one line."""
    fix = "a generation config is a small JSON object"
    why = ""
    try:
        if not path.is_file():  # transformers' cached_file: not a file, as missing
            why = "not a regular file"
        else:
            fields = loads_hf_json(read_small(path, fix=fix).decode("utf-8"), str(path))
    except OSError as e:
        why = f"cannot read it ({e.strerror})"
    except UnicodeDecodeError as e:
        why = f"not UTF-8 text (byte {e.start})"
    except ValueError as e:  # JSONDecodeError; loads_json's own for nesting too deep
        if getattr(e, "msg", "") == "nested too deeply":  # transformers' json.loads fails
            raise ConfigError(
                f"{path}: not valid JSON (nested too deeply); fix or remove it"
            ) from None
        why = f"not valid JSON ({e})"
    if why:
        _log_once(
            f"{path}: {why}; ignored: transformers then reads config.json's generation "
            "fields instead, and so does moepipe (fix or remove the file)"
        )
        return None
    if not isinstance(fields, dict):  # transformers' GenerationConfig.from_dict fails on it
        raise ConfigError(
            f"{path}: holds a JSON {type(fields).__name__}, not an object of fields; fix or "
            "remove it"
        )
    return fields


def _suppressed(
    fields: Mapping[str, Any], key: str, where: str, vocab: int, ignored: list[str]
) -> tuple[int, ...]:
    """suppress_tokens' or begin_suppress_tokens' ids as transformers' processors apply them:
    torch.isin of the vocabulary's ids in the list's tensor, so an id outside [0, vocab) (or
    a fraction) suppresses nothing, and is added to `ignored`; a list of true/false alone, of
    other types than numbers, or no list fails transformers: refused in one line."""
    v = fields.get(key)
    if v is None:
        return ()
    numbers = isinstance(v, list) and all(isinstance(t, int | float) for t in v)
    if not numbers or (v and all(isinstance(t, bool) for t in v)):
        raise ConfigError(
            f"{where}: {key} must be a list of token ids or null, got {_show(v)} (transformers' "
            "generate() fails on it); list ids below vocab_size, or remove the field"
        )
    kept = [int(t) for t in v if float(t).is_integer() and 0 <= t < vocab]
    outside = [t for t in v if not (float(t).is_integer() and 0 <= t < vocab)]
    if outside:
        ignored.append(f"{key} {_show(outside)} (not token ids below vocab_size={vocab})")
    return tuple(dict.fromkeys(kept))


def _no_repeat(fields: Mapping[str, Any], where: str, ignored: list[str]) -> int:
    """no_repeat_ngram_size as transformers' generate() takes it: at most 0 (or null) adds no
    processor (a negative one is added to `ignored`); above 0 its processor takes an integer
    and fails on anything else (refused in one line)."""
    ngram = fields.get("no_repeat_ngram_size")
    if ngram is None:
        return 0
    if isinstance(ngram, int | float) and ngram <= 0:
        if ngram < 0:
            ignored.append(f"no_repeat_ngram_size={_show(ngram)} (not positive)")
        return 0
    if not isinstance(ngram, int):  # true runs as 1, as transformers' processor takes it
        raise ConfigError(
            f"{where}: no_repeat_ngram_size must be an integer >= 0 or null, got "
            f"{_show(ngram)}; set it as the model's released generation_config.json has it"
        )
    return int(ngram)


def _forced_bos(fields: Mapping[str, Any], where: str, vocab: int) -> tuple[int | None, str]:
    """forced_bos_token_id, applied at a 1-token prompt only (as transformers' processor):
    an id in [-vocab, vocab) is the token it indexes (-1: the last); another value is kept as
    the one-line refusal a 1-token prompt gets (transformers fails there) and is ignored by
    a longer prompt, as transformers ignores it."""
    bos = fields.get("forced_bos_token_id")
    if bos is None:
        return None, ""
    if isinstance(bos, int) and not isinstance(bos, bool) and -vocab <= bos < vocab:
        return bos % vocab, ""
    return None, (
        f"{where}: forced_bos_token_id={_show(bos)} is not a token id below vocab_size="
        f"{vocab}: transformers' generate() fails on it for a 1-token prompt; fix the field "
        "or give a longer prompt"
    )


def _greedy(fields: Mapping[str, Any], where: str, vocab: int) -> Greedy:
    def bad(key: str, what: str) -> ConfigError:
        return ConfigError(
            f"{where}: {key} must be {what}, got {_show(fields[key])}; set it as the model's "
            "released generation_config.json has it"
        )

    def token(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab

    penalty = fields.get("repetition_penalty")
    if penalty is None:
        penalty = 1.0
    elif penalty != 1 and not (isinstance(penalty, float) and penalty > 0):
        # transformers' processor fails on an integer (2, not 2.0)
        raise bad("repetition_penalty", "a positive float (2.0, not 2) or null")
    ignored: list[str] = []
    ngram = _no_repeat(fields, where, ignored)
    words = fields.get("bad_words_ids")
    if words is not None and not (
        isinstance(words, list)
        and words
        and all(isinstance(w, list) and w and all(token(t) for t in w) for w in words)
    ):
        raise bad("bad_words_ids", f"a non-empty list of non-empty lists of ids below {vocab}")
    eos: Any = fields.get("forced_eos_token_id")
    if not (eos is None or token(eos) or isinstance(eos, list) and eos and all(map(token, eos))):
        raise bad(
            "forced_eos_token_id", f"a token id below {vocab}, a non-empty list of them or null"
        )
    bos, bos_refusal = _forced_bos(fields, where, vocab)
    if bos_refusal:
        shown = _show(fields["forced_bos_token_id"])
        ignored.append(f"forced_bos_token_id={shown} (not a token id; a 1-token prompt is refused)")
    suppress = _suppressed(fields, "suppress_tokens", where, vocab, ignored)
    begin = _suppressed(fields, "begin_suppress_tokens", where, vocab, ignored)
    if ignored:
        _log_once(
            f"{where}: ignored, as transformers' generate() ignores them: {'; '.join(ignored)}"
        )
    return Greedy(
        float(penalty),
        ngram,
        tuple(tuple(w) for w in words or ()),
        bos,
        (eos,) if token(eos) else tuple(eos or ()),
        suppress,
        begin,
        bos_refusal,
    )


def _read_object(path: Path) -> dict[str, Any]:
    """A JSON object's fields; one line naming the file for one unreadable or malformed."""
    try:
        data = read_small(path, fix="a generation config is a small JSON object")
    except OSError as e:
        raise ConfigError(cannot_read(path, e)) from None
    try:
        fields = loads_hf_json(data.decode("utf-8"), str(path))  # a key twice: the last, logged
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {e.start}); re-save it as the JSON it should be"
        ) from None
    except (ValueError, RecursionError) as e:
        raise ConfigError(
            f"{path}: not valid JSON ({str(e) or 'nested too deeply'}); fix or remove it"
        ) from None
    if not isinstance(fields, dict):
        raise ConfigError(
            f"{path}: holds a JSON {type(fields).__name__}, not an object of fields; fix or "
            "remove it"
        )
    return fields


def _show(value: Any) -> str:
    """A value as JSON writes it (true, null, 1.5), short enough for one line."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


@functools.cache
def _log_once(message: str) -> None:
    """Log `message` once a process: a run loads its checkpoint more than once."""
    log.warning(message)
