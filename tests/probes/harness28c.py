"""Round 28c's probe (issue 48): config VALUES across every command, as a new user types them:
numbers finite but absurd (1e308, 23 digits), NaN, inf, -0, wrong types, empty strings,
unicode, lists where a scalar belongs, null, a key twice, another family's fields, control
characters in hydra's flags and in a user's YAML, and a sweep point's failed line. Each case
is run once and sorted by `tests.probes.harness26d.classify` into one of its `KINDS`.

Usage: python -m tests.probes.harness28c [CLASS_OR_ID ...]   (one row a case, then counts)
"""

from __future__ import annotations

import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from tests.probes.cases26d import MK, RUN, config, text
from tests.probes.harness26d import KINDS, Case, run_case

SIM = ("hardware=tiny", "workload=tiny", "planner=flexgen", "hydra.run.dir={t}/out")
TINY = ("model=tiny", *SIM)
# a released model's 2 layers: room for them, and synthetic routing (no trace is needed)
ROOM = (*SIM, "hardware.memory_gb.gpu=64", "workload.routing.source=synthetic")
OLMOE = ("model=olmoe-1b-7b", "model.n_layers=2", *ROOM)
CAL, VAL = "experiments.calibrate", "experiments.validate"
ACC, BREAL = "experiments.bench.accelerate", "experiments.bench.real"
MKARGS = ("model=mixtral-tiny", "out={t}/mk", "n_layers=1", "hidden_size=32", "vocab_size=64")
HF = ("+model.hf_config={ck}", *SIM)
REAL = ("executor=real", "checkpoint={ck}", *SIM)
BIG = "12345678901234567890123"  # 23 digits


def _run(cid: str, cls: str, value: str, *names: str, base: tuple[str, ...] = TINY) -> Case:
    """`experiments.run` with one override `value`, refused naming `names` (its key's last part
    where none is given)."""
    key = value.partition("=")[0].lstrip("+")
    return Case(cid, cls, RUN, (*base, value), names=names or (key.rsplit(".", 1)[-1],))


def _ok(cid: str, cls: str, module: str, *args: str) -> Case:
    return Case(cid, cls, module, args, expect="ok")


# --- 1. numbers finite but absurd, or not numbers, in every float field and some ints ---
_ABSURD = ("1e308", "-1e308", "nan", "inf", "-inf", "-0.0", "0")
_FLOATS_RUN = {  # key -> values refused (beyond _ABSURD's); each a case
    "model.rms_norm_eps": ("1", "2.5", "1e-400"),
    "model.rope_theta": ("0.5", "1e13"),
    "workload.routing.skew": ("65", "-1e-9"),
    "workload.routing.layer_corr": ("1.5",),
    "workload.routing.reuse": ("-0.1",),
    "hardware.links.h2d.gbps": ("1e7",),
    "hardware.links.h2d.latency_us": ("-1",),
    "hardware.gpu.tflops": ("1e7",),
    "hardware.memory_gb.cpu": ("1e6",),
    "executor.rendezvous_timeout_s": ("1e6",),
}
# 0 is right for some (skew 0: even routing, -0.0 too); those are designed
_ZERO_OK = {"workload.routing.skew", "workload.routing.layer_corr", "workload.routing.reuse"}
_ZERO_OK |= {"hardware.links.h2d.latency_us"}


def _float_cases() -> list[Case]:
    out = []
    for key, more in _FLOATS_RUN.items():
        for v in (*_ABSURD, *more):
            cid = f"f_{key.rsplit('.', 1)[-1]}_{v}"
            if v in ("0", "-0.0") and key in _ZERO_OK:
                out.append(_ok(cid, "absurd", RUN, *TINY, f"{key}={v}"))
                continue
            out.append(_run(cid, "absurd", f"{key}={v}"))
    return out


_INTS = [
    _run("i_latent_23", "absurd", f"model.latent_expand_params={BIG}"),
    _run("i_attn_params_23", "absurd", f"model.attn_params={BIG}"),
    _run("i_attn_params_1e15", "absurd", "model.attn_params=1000000000000000"),
    _run("i_hidden_23", "absurd", f"model.hidden_size={BIG}"),
    _run("i_seed_23", "absurd", f"workload.seed={BIG}"),
    _run("i_hot_23", "absurd", f"workload.routing.hot_experts={BIG}"),
    _run("i_batch_neg0", "absurd", "workload.batch_size=-0"),
    _run("i_n_gpus_23", "absurd", f"hardware.n_gpus={BIG}"),
    _run("i_params_n_23", "absurd", f"planner.params.n={BIG}"),
]

# --- wrong types, empty strings, unicode, lists, null, a key twice ---
_TYPES = [
    _run("t_eps_word", "type", "model.rms_norm_eps=abc"),
    _run("t_eps_empty", "type", "model.rms_norm_eps=''"),
    _run("t_eps_list", "type", "model.rms_norm_eps=[1e-5]"),
    _run("t_eps_null", "type", "model.rms_norm_eps=null"),
    _run("t_eps_unicode", "type", "model.rms_norm_eps=１e-5"),
    _run("t_theta_true", "type", "model.rope_theta=true"),
    _run("t_theta_dict", "type", "model.rope_theta={a:1}"),
    _run("t_skew_empty", "type", "workload.routing.skew=''"),
    _run("t_skew_null", "type", "workload.routing.skew=null"),
    _run("t_skew_list", "type", "workload.routing.skew=[1,2]"),
    _run("t_name_empty", "type", "model.name=''", "model.name"),
    _run("t_name_unicode_ok", "type", "model.name=modèle", "model.name"),
    _run("t_family_unicode", "type", "model.family=mixtràl", "family"),
    _run("t_family_null", "type", "model.family=null", "family"),
    _run("t_family_list", "type", "model.family=[mixtral]", "family"),
    _run("t_topk_null", "type", "model.top_k=null"),
    _run("t_topk_list", "type", "model.top_k=[2]"),
    _run("t_topk_float", "type", "model.top_k=2.0"),
    _run("t_bs_empty", "type", "workload.batch_size=''"),
    _run("t_bs_unicode", "type", "workload.batch_size=٣"),
    _run("t_source_empty", "type", "workload.routing.source=''", "source"),
    _run("t_source_null", "type", "workload.routing.source=null", "source"),
    _run("t_tasks_nested", "type", "workload.routing.tasks=[[law]]", "tasks"),
    _run("t_tasks_twice", "type", "workload.routing.tasks=[law,law]", "tasks"),
    _run("t_activation_empty", "type", "model.activation=''", "activation"),
    _run("t_dtype_unicode", "type", "executor.dtype=ｆloat32", "dtype", base=REAL),
    _run("t_device_empty", "type", "executor.device=''", "device", base=REAL),
    _run("t_qkv_bias_word", "type", "model.qkv_bias=maybe", "qkv_bias"),
    _run("t_moe_layers_str", "type", "model.moe_layers=abc", "moe_layers"),
    _run("t_moe_layers_twice", "type", "model.moe_layers=[0,0]", "moe_layers"),
    _run("t_moe_layers_neg", "type", "model.moe_layers=[-1]", "moe_layers"),
    _run("t_block_3", "type", "model.disk_block=[1,2,3]", "disk_block"),
    _run("t_block_floats", "type", "model.disk_block=[1.5,2]", "disk_block"),
    Case("t_key_twice", "type", RUN, (*TINY, "model.top_k=1", "model.top_k=2"), names=("top_k",)),
    Case("t_key_twice_plus", "type", RUN, (*TINY, "+model.x=1", "+model.x=2"), names=("model.x",)),
]

# --- 2. another family's fields ---
_FAMILY = [
    _run("fam_mixtral_rope_dim", "family", "model.qk_rope_head_dim=64", "mixtral"),
    _run("fam_mixtral_q_lora", "family", "model.q_lora_rank=8", "mixtral"),
    _run("fam_mixtral_latent", "family", "model.latent_expand_params=64", "mixtral"),
    _run("fam_mixtral_qk_head", "family", "model.qk_head_dim=32", "mixtral"),
    _run("fam_mixtral_shared", "family", "model.shared_ffn_size=64", "mixtral"),
    _run("fam_mixtral_qkv_bias", "family", "model.qkv_bias=false", "mixtral"),
    _run("fam_olmoe_shared", "family", "model.shared_ffn_size=64", "olmoe", base=OLMOE),
    _run("fam_olmoe_qkv_bias", "family", "model.qkv_bias=false", "olmoe", base=OLMOE),
    _run("fam_olmoe_q_lora", "family", "model.q_lora_rank=8", "olmoe", base=OLMOE),
    _run(
        "fam_switch_rope",
        "family",
        "model.rope_theta=10000",
        "switch",
        base=("model=switch-base-128", "model.n_layers=2", "model.moe_layers=[1]", *ROOM),
    ),
    Case(
        "fam_yaml_mixtral_mla",
        "family",
        RUN,
        ("--config-dir", "{t}/c", "model=mine", *SIM),
        names=("q_lora_rank", "mixtral"),
        setup=text(
            "c/model/mine.yaml",
            "name: mine\nfamily: mixtral\nn_layers: 2\n"
            "hidden_size: 64\nexpert_ffn_size: 128\nn_experts: 4\ntop_k: 2\nn_heads: 4\n"
            "n_kv_heads: 2\nhead_dim: 16\nvocab_size: 256\nq_lora_rank: 32\n",
        ),
    ),  # fmt: skip
    _ok(
        "fam_ds_own",
        "family",
        RUN,
        "model=deepseek-v2-lite",
        "model.n_layers=2",
        "model.moe_layers=[1]",
        *ROOM,
    ),  # fmt: skip
    _ok("fam_qwen_own", "family", RUN, "model=qwen1.5-moe-a2.7b", "model.n_layers=2", *ROOM),
    Case(  # transformers ignores a key MixtralConfig lacks: a checkpoint's own file is the model
        "fam_hf_unknown_key_ok",
        "family",
        RUN,
        HF,
        expect="ok",
        setup=config(some_future_field=1),
    ),
]

# --- config.json's values read the same way ---
_HF = [
    Case("hf_eps_1e308", "hf", RUN, HF, names=("config.json", "rms_norm_eps"),
         setup=config(rms_norm_eps=1e308)),
    Case("hf_eps_1", "hf", RUN, HF, names=("config.json", "rms_norm_eps"),
         setup=config(rms_norm_eps=1.0)),
    Case("hf_theta_1e308", "hf", RUN, HF, names=("config.json", "rope_theta"),
         setup=config(rope_theta=1e308)),
    Case("hf_theta_half", "hf", RUN, HF, names=("config.json", "rope_theta"),
         setup=config(rope_theta=0.5)),
    Case("hf_theta_ok", "hf", RUN, HF, expect="ok", setup=config(rope_theta=5e5)),
]  # fmt: skip


# --- other commands' numeric options ---
def _cmd(cid: str, module: str, *args: str, names: tuple[str, ...]) -> Case:
    return Case(cid, "command", module, args, names=names)


_VAL = ("checkpoint={ck}", "hardware=tiny", "out={t}/v", "repeats=1")
_CMDS = [
    *(_cmd(f"mk_scale_{v}", MK, *MKARGS, f"scale={v}", names=("scale",))
      for v in ("1e308", "nan", "-1", "0", "inf")),
    *(_cmd(f"mk_shard_{v}", MK, *MKARGS, f"shard_mb={v}", names=("shard_mb",))
      for v in ("1e308", "nan", "-1", "0")),
    *(_cmd(f"mk_eps_{v}", MK, *MKARGS, f"rms_norm_eps={v}", names=("rms_norm_eps",))
      for v in ("1e308", "1", "nan")),
    *(_cmd(f"mk_theta_{v}", MK, *MKARGS, f"rope_theta={v}", names=("rope_theta",))
      for v in ("1e308", "0.5")),
    _cmd("mk_q_lora_mixtral", MK, *MKARGS, "q_lora_rank=8", names=("q_lora_rank",)),
    *(_cmd(f"val_gpu_frac_{v}", VAL, *_VAL, f"gpu_frac={v}", names=("gpu_frac",))
      for v in ("1e308", "nan", "-1", "0")),
    *(_cmd(f"val_cpu_frac_{v}", VAL, *_VAL, f"cpu_frac={v}", names=("cpu_frac",))
      for v in ("1e308", "inf", "-1")),
    *(_cmd(f"cal_in_run_{v}", CAL, "out={t}/c.yaml", f"in_run_s={v}", names=("in_run_s",))
      for v in ("1e308", "nan", "-1")),
    *(_cmd(f"acc_{k}_{v}", ACC, "checkpoint={ck}", "hardware=tiny", f"{k}={v}", names=(k,))
      for k in ("gpu_frac", "cpu_frac", "peer_limit", "acc_limit_s") for v in ("1e308", "nan")),
    *(_cmd(f"breal_{k}_{v}", BREAL, "model=tiny", "hardware=tiny", "out_dir={t}/b",
           *(() if k == "budget_gb" else ("budget_gb=0.0003",)), f"{k}={v}", names=(k,))
      for k in ("budget_gb", "peer_limit") for v in ("1e308", "nan", "-1")),
    *(_cmd(f"host_unit_{v}", "experiments.bench.host", f"unit_mb={v}", names=("unit_mb",))
      for v in ("1e308", "nan", "0")),
    *(_run(f"par_{k}_{v}", "params", f"{k}={v}", base=(*TINY[:-2], p, TINY[-1]))
      for k, p in (("planner.params.cache_share", "planner=mixtral_offloading"),
                   ("planner.params.resident_share", "planner=fiddler"),
                   ("planner.params.lane_share", "planner=eplb"))
      for v in ("1e308", "nan", "-0.5")),
]  # fmt: skip

# --- 3. control characters in hydra's flags and inside a user's YAML ---
_MODEL_YAML = (
    "name: mine\nfamily: mixtral\nn_layers: 2\nhidden_size: 64\nexpert_ffn_size: 128\n"
    "n_experts: 4\ntop_k: 2\nn_heads: 4\nn_kv_heads: 2\nhead_dim: 16\nvocab_size: 256\n"
)
_CONTROL = [
    Case("cc_config_dir_nl", "control", RUN, ("--config-dir", "{t}/a\nb", *TINY),
         names=("--config-dir",)),
    Case("cc_config_dir_tab", "control", RUN, ("--config-dir={t}/a\tb", *TINY),
         names=("--config-dir",)),
    Case("cc_config_name_nl", "control", RUN, ("--config-name", "config\n", *TINY),
         names=("--config-name",)),
    Case("cc_cn_esc", "control", RUN, ("-cn", "con\x1bfig", *TINY), names=("-cn",)),
    Case("cc_config_path_cr", "control", RUN, ("--config-path", "/x\r", *TINY),
         names=("--config-path",)),
    Case("cc_cp_nl", "control", RUN, ("-cp", "a\nb", *TINY), names=("-cp",)),
    Case("cc_cfg_dir_cal", "control", CAL, ("--config-dir", "/x\ny", "out={t}/c.yaml"),
         names=("--config-dir",)),
    Case("cc_yaml_name_nl", "control", RUN, ("--config-dir", "{t}/c", "model=mine", *SIM),
         names=("name", "mine.yaml", "a newline"),
         setup=text("c/model/mine.yaml", _MODEL_YAML.replace("name: mine", 'name: "mi\\nne"'))),
    Case("cc_yaml_family_esc", "control", RUN, ("--config-dir", "{t}/c", "model=mine", *SIM),
         names=("family", "mine.yaml"),
         setup=text("c/model/mine.yaml",
                    _MODEL_YAML.replace("family: mixtral", 'family: "mix\\x1btral"'))),
    Case("cc_yaml_hw_name_tab", "control", RUN,
         ("--config-dir", "{t}/c", "model=tiny", "hardware=mine", "workload=tiny",
          "hydra.run.dir={t}/out"), names=("name", "mine.yaml"),
         setup=text("c/hardware/mine.yaml",
                    (Path(__file__).parents[2] / "conf/hardware/tiny.yaml").read_text()
                    .replace("name: tiny", 'name: "ti\\tny"', 1))),
]  # fmt: skip


# --- values in a user's model YAML (as hydra's YAML loader reads them) ---
def _yaml(cid: str, line: str, *names: str, expect: str = "fail") -> Case:
    body = _MODEL_YAML + line + "\n"
    return Case(
        cid, "yaml", RUN, ("--config-dir", "{t}/c", "model=mine", *SIM), expect=expect,
        names=names, setup=text("c/model/mine.yaml", body),
    )  # fmt: skip


_YAML = [
    _yaml("y_eps_1e308", "rms_norm_eps: 1.0e+308", "rms_norm_eps"),
    _yaml("y_eps_nan", "rms_norm_eps: .nan", "rms_norm_eps"),
    _yaml("y_theta_inf", "rope_theta: .inf", "rope_theta"),
    _yaml("y_theta_str", "rope_theta: 1e308", "rope_theta"),  # YAML 1.1: a string
    _yaml("y_theta_neg0", "rope_theta: -0.0", "rope_theta"),
    _yaml("y_top_k_twice", "top_k: 1", "top_k"),  # top_k is in _MODEL_YAML already
    _yaml("y_q_lora", "q_lora_rank: 16", "q_lora_rank", "mixtral"),
    _yaml("y_shared", "shared_ffn_size: 64", "shared_ffn_size", "mixtral"),
    _yaml("y_latent_23", f"latent_expand_params: {BIG}", "latent_expand_params"),
    _yaml("y_eps_list", "rms_norm_eps: [1.0e-5]", "rms_norm_eps"),
    _yaml("y_eps_null", "rms_norm_eps: null", "rms_norm_eps"),
    _yaml("y_base_ok", "", expect="ok"),
]


# --- 4. a sweep point's failed line shows the value as typed ---
def _failed_says(said: str) -> Callable[[Path], str | None]:
    """A sweep's kind from its failed point's failed.txt: `good` where it says `said` (the
    value as typed), else `wrong` (the other point's summary.json is a result, as designed)."""

    def after(t: Path) -> str | None:
        failed = sorted((t / "sw").rglob("failed.txt"))
        return "good" if failed and said in failed[0].read_text() else "wrong"

    return after


def _sweep(cid: str, swept: str, said: str, launcher: str) -> Case:
    args = ("-m", *TINY[:-1], swept, "hydra.sweep.dir={t}/sw", f"hydra/launcher={launcher}")
    return Case(cid, "sweep", RUN, args, names=("failed",), after=_failed_says(said))


_SWEEP = [
    _sweep("sw_tflops_basic", "hardware.gpu.tflops=1e300,2", "tflops=1e300 ", "basic"),
    _sweep("sw_tflops_joblib", "hardware.gpu.tflops=1e300,2", "tflops=1e300 ", "joblib"),
    _sweep("sw_gbps_joblib", "hardware.links.h2d.gbps=2,1e7", "gbps=1e7 ", "joblib"),
    _sweep("sw_mem_basic", "hardware.memory_gb.cpu=1E6,2", "cpu=1E6 ", "basic"),
    _sweep("sw_eps_joblib", "model.rms_norm_eps=1e300,1e-5", "rms_norm_eps=1e300:", "joblib"),
    _sweep("sw_theta_basic", "model.rope_theta=2,1E13", "rope_theta=1E13:", "basic"),
]  # fmt: skip

CASES = [*_float_cases(), *_INTS, *_TYPES, *_FAMILY, *_HF, *_CMDS, *_CONTROL, *_YAML, *_SWEEP]


def main(selected: list[str]) -> Counter:
    home = Path(tempfile.gettempdir()) / "probe28c"
    home.mkdir(exist_ok=True)
    cases = [c for c in CASES if not selected or c.cls in selected or c.id in selected]
    counts: Counter = Counter()
    for case in cases:
        kind, line = run_case(case, home)
        counts[kind] += 1
        print(f"{kind:10} {case.cls:8} {case.id:26} {line[:220]}", flush=True)
    print(f"{len(cases)} cases: " + ", ".join(f"{k} {counts[k]}" for k in KINDS))
    return counts


if __name__ == "__main__":
    main(sys.argv[1:])
