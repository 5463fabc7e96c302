"""Round 28c of issue 48: config values accepted silently, and lines in Python's form; one
class a group (the probe: tests/probes/harness28c.py):
1. a float (or int) that passes its type check but is meaningless further on: `rms_norm_eps=
   1e308` (every normalised activation 0), `rope_theta=1e308`, `workload.routing.skew=1e308`,
   `latent_expand_params` of 23 digits ran with exit 0, from the command line, a model YAML or
   a checkpoint's config.json. Each float field of a model and a routing has a working range
   (core.spec_fields.SPANS), refused past either end in one line that states it; every float
   field of every command's schema refuses 1e308, -1e308, NaN and inf.
2. a field only some families read (`q_lora_rank`, `qk_rope_head_dim` on a Mixtral; the shared
   experts' size on OLMoE) was accepted and changed nothing a run of that family reads.
3. a control character in hydra's flags (`--config-dir`, `-cn`, `--config-path`) or inside a
   user's YAML value: one line naming the flag or the field, with a fix that pastes.
4. a sweep point's failed line (failed.txt) showed a swept value in Python's form (`1e+300`).
Also: `hardware.memory_gb.cpu=-1e308` was an internal error (an int of -inf bytes).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import Any

import pytest

from core.errors import ConfigError
from core.spec import ModelSpec, RoutingConfig
from core.spec_fields import FAMILY_ONLY, MAX_LAYER_PARAMS, SPANS
from tests.conftest import conf
from tests.probes import test_probe_round26c as r26c
from tests.probes import test_probe_round26c_gaps as g26
from tests.probes import test_probe_round27c as r27c
from tests.probes.conftest import cli, one_line, pasted

TINY = ["model=tiny", "hardware=tiny", "workload=tiny"]

# --- 1. finite but absurd numbers ---


def _model(**over: Any) -> ModelSpec:
    return ModelSpec.from_dict(conf("model", "tiny") | over)


def _routing(name: str, v: float) -> RoutingConfig:
    """A routing of `name`=v; hot_share with the one hot expert it needs, but for 0 (none)."""
    hot = name == "hot_share" and not (isinstance(v, float) and v == 0.0)
    return RoutingConfig(**{name: v}, **({"hot_experts": 1} if hot else {}))


_MODEL_SPANS = ("rms_norm_eps", "rope_theta")
_ROUTING_SPANS = ("skew", "layer_corr", "reuse", "hot_share")


def _ends(name: str) -> tuple[list[float], list[float]]:
    """(values refused, values taken) at `SPANS[name]`'s ends: an open end refused and the
    next float inside taken; a closed end taken and the next float outside refused."""
    s = SPANS[name]
    refused, taken = [], []
    for end, outward, is_open in ((s.low, -math.inf, s.low_open), (s.high, math.inf, s.high_open)):
        inward = -outward
        if is_open:
            refused.append(end)
            taken.append(math.nextafter(end, inward))
        else:
            refused.append(math.nextafter(end, outward))
            taken.append(end)
    return refused, taken


@pytest.mark.parametrize("name", [*_MODEL_SPANS, *_ROUTING_SPANS])
def test_each_float_span_is_its_checks(name: str) -> None:
    """Class: a finite float past any meaning (`rms_norm_eps=1e308`, `rope_theta=1e308`,
    `skew=1e308`) was taken with exit 0. The check refuses the value just past each end of
    the stated range (core.spec_fields.SPANS) in one line stating it, and takes each end."""
    build = (lambda v: _model(**{name: v})) if name in _MODEL_SPANS else lambda v: _routing(name, v)
    refused, taken = _ends(name)
    for v in [*refused, 1e308, -1e308, math.nan, math.inf]:
        with pytest.raises(ConfigError) as info:
            build(v)
        assert f"{name}=" in str(info.value) and SPANS[name].words() in str(info.value)
    for v in taken:
        build(v)


@pytest.mark.parametrize("name", ["rms_norm_eps", "rope_theta", "layer_norm_epsilon"])
def test_config_jsons_floats_take_the_same_span(name: str, tiny_ckpt: Path) -> None:
    """Class: the same values in a checkpoint's config.json (transformers takes them; the run
    computed with them): refused naming the file's field, in the spec's range."""
    import json

    from core.hf_config import hf_config_to_spec

    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    if name == "layer_norm_epsilon":  # Switch's
        cfg = json.loads(
            json.dumps(
                {
                    "model_type": "switch_transformers",
                    "num_layers": 2,
                    "d_model": 64,
                    "d_ff": 32,
                    "num_experts": 4,
                    "num_heads": 4,
                    "d_kv": 16,
                    "vocab_size": 128,
                    "encoder_sparse_step": 1,
                }
            )
        )
    span = SPANS["rope_theta" if name == "rope_theta" else "rms_norm_eps"]
    refused, taken = _ends("rope_theta" if name == "rope_theta" else "rms_norm_eps")
    for v in [*refused, 1e308]:
        with pytest.raises(ConfigError) as info:
            hf_config_to_spec(cfg | {name: v}, "ck")
        assert "config.json" in str(info.value) and name in str(info.value), info.value
        assert span.words() in str(info.value)
    for v in taken:
        hf_config_to_spec(cfg | {name: v}, "ck")


@pytest.mark.parametrize("name", ["attn_params", "latent_expand_params"])
def test_a_layers_weight_count_past_any_model_is_refused(name: str) -> None:
    """Class: an int that passes its type check and overflows every figure after it: a
    `latent_expand_params` of 23 digits ran (makespan 3e12 s). At most MAX_LAYER_PARAMS, the
    stated range int_ranges gives for a value omegaconf refuses too."""
    from experiments.common.int_ranges import int_range

    mla = conf("model", "deepseek-v2-lite")
    ModelSpec.from_dict(mla | {name: MAX_LAYER_PARAMS})
    for v in (MAX_LAYER_PARAMS + 1, 12345678901234567890123):
        with pytest.raises(ConfigError, match=f"{name}={v}, more weights in a layer"):
            ModelSpec.from_dict(mla | {name: v})
    assert int_range(f"model.{name}")[:2] == (0, MAX_LAYER_PARAMS)


def _hardware_float(owner: str, name: str) -> Any:
    """The machine's checks (its spec and what a machine can be) of float field `name` of
    schema `owner`, set in the tiny machine where that schema sits."""
    from core.hardware import HardwareSpec, check_physical

    def build(v: float) -> Any:
        hw = conf("hardware", "tiny")
        if owner == "MemorySchema":
            hw = hw | {"memory_gb": dict(hw["memory_gb"]) | {name: v}}
        elif owner == "LinkSchema":
            hw = hw | {"links": {**hw["links"], "h2d": dict(hw["links"]["h2d"]) | {name: v}}}
        elif owner == "ProcessesSchema":
            one = {"expert": v} if name.endswith("_by_kind") else v
            hw = hw | {"processes": dict(hw.get("processes") or {}) | {name: one}}
        else:
            one = {"expert": v} if name.endswith("_by_kind") else v
            hw = hw | {"gpu": dict(hw["gpu"]) | {name: one}}
        return check_physical(HardwareSpec.from_dict(hw))

    return build


def _rendezvous(v: float) -> Any:
    from omegaconf import OmegaConf

    from experiments.common.resolve import run_spec

    executor = {"name": "sim", "rendezvous_timeout_s": v}
    try:
        run_spec(OmegaConf.create({"executor": executor}))
    except ConfigError as e:
        if "rendezvous_timeout_s" in str(e):
            raise
        raise g26._Accepted from None  # past the timeout's check


# a command's own float option, checked by the command (as_float in its main): run in this
# process with the option, the rest of its arguments (refused: one line naming it)
_OWN = {
    ("calibrate", "in_run_s"): ("experiments.calibrate", "out=/nonexistent/c.yaml"),
    ("bench.host", "unit_mb"): ("experiments.bench.host",),
    ("make_checkpoint", "scale"): ("experiments.make_checkpoint", "model=tiny", "out={t}/ck"),
    ("make_checkpoint", "shard_mb"): ("experiments.make_checkpoint", "model=tiny", "out={t}/ck"),
}


def _own_check(cli_here: Any, tmp: Path, module: str, *args: str, name: str) -> Any:
    def check(v: float) -> None:
        r = cli_here(module, *(a.replace("{t}", str(tmp)) for a in args), f"{name}={v}")
        if r.returncode != 0 and f"{name}=" in r.stderr:
            raise ValueError(r.stderr)

    return check


def _float_check(cls: type, name: str, cli_here: Any, tmp: Path) -> Any:
    owner, module = cls.__name__, cls.__module__.removeprefix("experiments.")
    if owner == "MakeCheckpointOptions":
        module = "make_checkpoint"
    if (module, name) in _OWN:
        return _own_check(cli_here, tmp, *_OWN[module, name], name=name)
    if owner in ("MemorySchema", "ComputeSchema", "LinkSchema", "ProcessesSchema"):
        return _hardware_float(owner, name)
    if owner == "RoutingSchema":
        return lambda v: _routing(name, v)
    if owner == "ExecutorSchema":
        return _rendezvous
    if owner == "BenchAccelerateOptions" and name == "acc_limit_s":  # the bench's, for a child
        from experiments.bench.accelerate import BenchAccelerateOptions, from_the_bench

        return lambda v: from_the_bench(BenchAccelerateOptions(checkpoint="c", acc_limit_s=v))
    return r27c._check_of(cls, name)


def _float_fields() -> list[tuple[type, str]]:
    """Every float-typed field of every command's schema (its groups', the planners' params),
    a mapping of floats too (`overhead_us_by_kind`)."""
    found = []
    for cls, _ in {(c, 0) for c, _ in r26c._int_fields()} | _schema_classes():
        hints = typing.get_type_hints(cls)
        found += [(cls, f.name) for f in dataclasses.fields(cls) if "float" in str(hints[f.name])]
    return sorted(set(found), key=lambda x: (x[0].__name__, x[1]))


def _schema_classes() -> set[tuple[type, int]]:
    from experiments.common import hydra_errors

    return {(c, 0) for c in hydra_errors._schema_classes() if not c.__module__.startswith("hydra")}


def test_every_float_field_refuses_absurd_numbers(cli_here: Any, tmp_path: Path) -> None:
    """Class: a float of a command's schema that passes omegaconf's type and is meaningless
    further on. Every float field (over 30: the model's, the machine's, the routing's, the
    executor's, the planners' params, each command's own) refuses 1e308, -1e308, NaN and
    inf by its check: bench.accelerate's and bench.real's `peer_limit` and predictive
    replication's `prior_weight` took 1e308."""
    taken, tried = [], 0
    for cls, name in _float_fields():
        if cls.__module__.startswith("hydra_plugins."):  # a launcher's own
            continue
        check = _float_check(cls, name, cli_here, tmp_path)
        tried += 1
        for v in (1e308, -1e308, math.nan, math.inf):
            if not g26._refuses(check, v):
                taken.append((cls.__name__, name, v))
    assert tried > 30
    assert not taken, taken


# --- 2. another family's fields ---


def _other_family(families: tuple[str, ...]) -> str:
    return next(f for f in ("mixtral", "olmoe", "switch_transformers") if f not in families)


# (attention_bias and mlp_bias: refused by core.spec's older line, "is implemented for")
@pytest.mark.parametrize("key", sorted(set(FAMILY_ONLY) - {"attention_bias", "mlp_bias"}))
def test_a_field_the_family_does_not_read_is_refused(key: str) -> None:
    """Class: a field one family reads, set on another (`q_lora_rank` on a Mixtral, shared
    experts on OLMoE): accepted silently, changing nothing a run of that family reads. Refused
    naming the family and the fields it reads."""
    families, none = FAMILY_ONLY[key]
    family = _other_family(families)
    value = (not none) if isinstance(none, bool) else (2.0 if isinstance(none, float) else 8)
    with pytest.raises(ConfigError) as info:
        _model(family=family, **{key: value})
    said = str(info.value)
    assert f"{key}=" in said and f"family {family}, which reads: " in said, said
    assert f", {key}," not in said.partition("which reads: ")[2]


def test_every_shipped_model_sets_only_fields_its_family_reads() -> None:
    """The other half: each conf/model file (its own family's fields) is taken as it is."""
    for path in sorted(Path("conf/model").glob("*.yaml")):
        ModelSpec.from_dict(conf("model", path.stem))


@pytest.mark.parametrize("key", ["kv_dim", "attn_params"])
def test_the_simulators_attention_knobs_stay_open_to_every_family(key: str) -> None:
    """The other side of class 2: `kv_dim` and `attn_params` size any family's KV cache and
    attention in the simulator (a Mixtral with another attention), so a Mixtral takes them and
    its sizes follow; only make_checkpoint, whose config.json cannot say them, refuses them."""
    base = _model(family="mixtral")
    changed = _model(family="mixtral", **{key: 4096})
    if key == "kv_dim":
        assert changed.kv_elems_per_token == 4096 != base.kv_elems_per_token
    else:
        assert changed.attn_param_count != base.attn_param_count


def test_another_familys_field_in_a_users_model_yaml_is_refused(tmp_path: Path) -> None:
    """Class 2 through a user's model YAML (--config-dir), end to end."""
    (tmp_path / "model").mkdir()
    tiny = (Path("conf/model/tiny.yaml")).read_text().replace("name: tiny", "name: mine")
    (tmp_path / "model" / "mine.yaml").write_text(tiny + "qk_rope_head_dim: 64\n")
    args = ["--config-dir", str(tmp_path), "model=mine", *TINY[1:]]
    one_line(cli("experiments.run", *args, f"hydra.run.dir={tmp_path}/r"), "mixtral", "reads")


def test_a_key_transformers_ignores_in_config_json_is_taken(tiny_ckpt: Path) -> None:
    """A checkpoint's config.json follows transformers: a key its family's config class does
    not know (a newer release's) is kept there and read by nothing; taken here too."""
    import json

    from core.hf_config import hf_config_to_spec

    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    hf_config_to_spec(cfg | {"some_future_field": 1}, "ck")


# --- 3. control characters in hydra's flags and in a user's YAML ---


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--config-dir", "/tmp/a\nb"),
        ("-cd", "/tmp/a\tb"),
        ("--config-name", "config\n"),
        ("-cn", "con\x1bfig"),
        ("--config-path", "/x\r"),
        ("-cp", "a\nb"),
    ],
)
def test_a_control_character_in_a_flag_is_one_line_with_a_fix(
    cli_here: Any, flag: str, value: str
) -> None:
    """Class: a newline (tab, ESC) in a hydra flag's value: hydra read a folder or a config of
    that name. One line naming the flag, with the flag and its value without it, each a
    shell word, as an override's line has."""
    line = one_line(cli_here("experiments.run", flag, value, *TINY), flag)
    fix = line.partition("pass it on one line: ")[2]
    assert fix.split(" ", 1)[0] == flag
    assert pasted(fix.split(" ", 1)[1]) == "".join(c for c in value if c.isprintable())


def test_a_control_character_in_a_users_yaml_value_is_one_line(
    cli_here: Any, tmp_path: Path
) -> None:
    """Class: a quoted YAML value holding a newline or ESC (`family: "mix\\x1btral"`): the
    line named the value's check (or the wrong fix, `hardware=FILE.yaml`), not the file.
    One line naming the file and the field, with the line to write instead."""
    (tmp_path / "model").mkdir()
    tiny = Path("conf/model/tiny.yaml").read_text()
    (tmp_path / "model" / "mine.yaml").write_text(tiny.replace("name: tiny", 'name: "mi\\nne"'))
    r = cli_here("experiments.run", "--config-dir", str(tmp_path), "model=mine", *TINY[1:])
    line = one_line(r, "mine.yaml", "name", "a newline")
    assert line.endswith('write it on one line: name: "mine"'), line


# --- 4. a sweep point's line as typed ---


def test_a_sweep_points_failed_line_shows_the_value_as_typed(tmp_path: Path) -> None:
    """Class: a sweep point's failed.txt (and its line) showed a swept value in Python's form
    (`gpu.tflops=1e+300`): a user could not find it in their command. Shown as typed, in the
    joblib launcher's worker processes too."""
    args = [*TINY, "planner=flexgen", "hardware.gpu.tflops=1e300,2", f"hydra.sweep.dir={tmp_path}"]
    r = cli("experiments.run", "-m", *args)
    assert r.returncode != 0
    (failed,) = tmp_path.rglob("failed.txt")
    assert "tflops=1e300 " in failed.read_text(), failed.read_text()


def test_a_swept_values_items_are_each_shown_as_typed() -> None:
    from experiments.common import typed_values as tv

    tv.set_typed(["disk_mb=1e300,2.50", "scale=[1e300]"])
    try:
        assert tv.as_typed("disk_mb", "1e+300", at="") == "1e300"
        assert tv.with_typed("disk_mb=2.5 and disk_mb=1e+300") == "disk_mb=2.50 and disk_mb=1e300"
        assert tv.with_typed("scale=1e+300") == "scale=1e+300"  # a list's item: not a point's
    finally:
        tv.set_typed([])


# --- also: a negative capacity past an int ---


def test_a_negative_capacity_past_an_int_is_one_line(cli_here: Any) -> None:
    """`hardware.memory_gb.cpu=-1e308` was an internal error (OverflowError: an int of -inf
    bytes); one line naming the field, as typed."""
    r = cli_here("experiments.run", *TINY, "hardware.memory_gb.cpu=-1e308")
    one_line(r, "memory_gb.cpu=-1e308 must be a positive capacity")


@pytest.mark.parametrize(
    ("given", "fix"),
    [
        ("model.top_k=2.0", "pass model.top_k=2"),
        ("workload.batch_size=4.0", "pass workload.batch_size=4"),
        ("model.name=''", "e.g. model=FILE.yaml"),
    ],
)
def test_a_lines_fix_is_in_the_form_it_asks_for(cli_here: Any, given: str, fix: str) -> None:
    """Class (found by the probe): a line's fix said the refused value back. A whole number
    typed as a float (`top_k=2.0`) was told "pass model.top_k=2.0": showing values as typed
    put the typed form into the fix too. An empty model.name was told to pass
    hardware=FILE.yaml."""
    line = one_line(cli_here("experiments.run", *TINY, given))
    assert line.endswith(fix) or f"{fix} " in line or f"{fix};" in line, line


def test_the_probe_lists_over_200_cases() -> None:
    """The probe's case list (harness28c) covers every class above and other commands'."""
    from tests.probes.harness28c import CASES

    assert len(CASES) > 200
    assert {c.cls for c in CASES} >= {"absurd", "family", "control", "sweep", "hf", "command"}
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize(
    ("field", "rope"),
    [
        ("factor", {"rope_type": "linear"}),
        ("factor", {"rope_type": "yarn", "original_max_position_embeddings": 64}),
        ("attention_factor", {"rope_type": "yarn", "factor": 2.0,
                              "original_max_position_embeddings": 64}),
        ("mscale", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}),
    ],
)  # fmt: skip
def test_config_jsons_rope_multipliers_are_bounded(field: str, rope: dict, tiny_ckpt: Path) -> None:
    """Class 1 in a config.json's rope_scaling: a RoPE factor, yarn's attention factor or its
    mscale of 1e308 was taken (a simulated run of it exit 0; a real one computes NaN). Refused
    past 1e6 in one line naming the field; a released model's value taken."""
    import json

    from core.hf_config import hf_config_to_spec

    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    for v in (1e308, 1e7):
        with pytest.raises(ConfigError, match=field) as info:
            hf_config_to_spec(cfg | {"rope_scaling": rope | {field: v}}, "ck")
        assert "1e6" in str(info.value), info.value
    hf_config_to_spec(cfg | {"rope_scaling": rope | {field: 4.0}}, "ck")


def test_deepseeks_routed_scaling_factor_is_bounded() -> None:
    """Class 1 for DeepSeek's routed_scaling_factor (V2's 16, V3's 2.5): 1e308 was taken."""
    from core.hf_config import hf_config_to_spec
    from core.hf_config.from_spec import spec_to_hf_config
    from real.checkpoint import reduced_spec

    cfg = spec_to_hf_config(reduced_spec("deepseek-v2-lite", hidden_size=64, n_layers=2))
    for v in (1e308, 1e7, 0.0):
        with pytest.raises(ConfigError, match="routed_scaling_factor"):
            hf_config_to_spec(cfg | {"routed_scaling_factor": v}, "ck")
    hf_config_to_spec(cfg | {"routed_scaling_factor": 16.0}, "ck")
