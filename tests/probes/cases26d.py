"""Round 26d's probe cases (issue 48), run by `tests.probes.harness26d`: each class of the issue
(malformed config.json and safetensors, OSErrors, hydra, inputs accepted silently, results
lost), as a new user and a failing machine would meet them, none of earlier rounds' cases.

Usage: python -m tests.probes.harness26d [CLASS_OR_ID ...]
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.probes.harness26d import Case

SIM = ("hardware=tiny", "workload=tiny", "planner=flexgen", "hydra.run.dir={t}/out")
TINY = ("model=tiny", *SIM)
HF = ("+model.hf_config={ck}", *SIM)
REAL = ("executor=real", "checkpoint={ck}", *SIM)
RUN, MK = "experiments.run", "experiments.make_checkpoint"
ST = "ck/model.safetensors"


def config(**changes: Any) -> Callable[[Path], None]:
    """Set (None: remove) keys of the checkpoint's config.json."""

    def setup(t: Path) -> None:
        path = t / "ck" / "config.json"
        cfg = json.loads(path.read_text())
        for k, v in changes.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        path.write_text(json.dumps(cfg))

    return setup


def text(rel: str, body: str | bytes) -> Callable[[Path], None]:
    """Write `body` at `rel` under the case's folder."""

    def setup(t: Path) -> None:
        path = t / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        path.write_bytes(body if isinstance(body, bytes) else body.encode())

    return setup


def header(edit: Callable[[dict], Any], rel: str = ST) -> Callable[[Path], None]:
    """Rewrite the shard's JSON header by `edit` (it changes the dict in place, or returns
    bytes to use as the header's text); the data bytes are kept."""

    def setup(t: Path) -> None:
        path = t / rel
        raw = path.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        head = json.loads(raw[8 : 8 + n])
        new = edit(head)
        body = new if isinstance(new, bytes) else json.dumps(head).encode()
        path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])

    return setup


def raw_bytes(edit: Callable[[bytes], bytes], rel: str = ST) -> Callable[[Path], None]:
    def setup(t: Path) -> None:
        path = t / rel
        path.write_bytes(edit(path.read_bytes()))

    return setup


def _padded(head: dict) -> bytes:
    body = json.dumps(head).encode()
    return body + b" " * (8 - (8 + len(body)) % 8 + 8)


def resaved(edit: Callable[[dict], Any]) -> Callable[[Path], None]:
    """The shard written again by safetensors, its tensors edited by `edit` (in place)."""

    def setup(t: Path) -> None:
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(t / ST, "pt") as f:
            meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open)
        edit(tensors)
        save_file(tensors, t / ST, metadata=meta)

    return setup


def both(*setups: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(t: Path) -> None:
        for s in setups:
            s(t)

    return setup


def _first(head: dict, part: str = "q_proj") -> dict:
    return next(v for k, v in head.items() if part in k)


def _set(part: str, key: str, value: Any) -> Callable[[dict], None]:
    def edit(head: dict) -> None:
        _first(head, part)[key] = value

    return edit


def _summary(edit: Callable[[dict], Any]) -> Callable[[Path], None]:
    def setup(t: Path) -> None:
        path = t / "run" / "summary.json"
        s = json.loads(path.read_text())
        new = edit(s)
        path.write_text(new if isinstance(new, str) else json.dumps(s))

    return setup


def kept(rel: str, body: str) -> Callable[[Path], str | None]:
    """After: the user's file at `rel` still holds `body`."""

    def after(t: Path) -> str | None:
        path = t / rel
        return None if path.is_file() and path.read_text() == body else "lost"

    return after


def hf(i: str, setup: Callable[[Path], None], *names: str, real: bool = False) -> Case:
    return Case(f"hf_{i}", "hf_config", RUN, REAL if real else HF, setup=setup, names=names)


def st(i: str, setup: Callable[[Path], None], *names: str, expect: str = "fail") -> Case:
    return Case(f"st_{i}", "safetensors", RUN, REAL, setup=setup, names=names, expect=expect)


def hy(i: str, *args: str, names: tuple[str, ...] = (), expect: str = "fail", **kw: Any) -> Case:
    from tests.conftest import overridden

    flags: list[str] = []
    rest = list(args)
    while rest and rest[0].startswith("-"):  # a flag, and its value where it takes one
        flags += rest[:2] if rest[0] in ("--config-dir", "--config-name", "--cfg") else rest[:1]
        rest = rest[len(flags[-2:]) if rest[0].startswith("--c") else 1 :]
    more = tuple(overridden(list(TINY), *rest))
    return Case(f"hy_{i}", "hydra", RUN, (*flags, *more), names=names, expect=expect, **kw)


def _hf_cases() -> list[Case]:
    c = config
    return [
        hf("topk_over", c(num_experts_per_tok=9), "num_experts_per_tok"),
        hf("topk_zero", c(num_experts_per_tok=0), "num_experts_per_tok"),
        hf("topk_neg", c(num_experts_per_tok=-2), "num_experts_per_tok"),
        hf("hidden_bool", c(hidden_size=True), "hidden_size"),
        hf("hidden_float", c(hidden_size=64.5), "hidden_size"),
        hf("hidden_neg", c(hidden_size=-64), "hidden_size"),
        hf("hidden_list", c(hidden_size=[64]), "hidden_size"),
        Case("hf_hidden_default", "hf_config", RUN, HF, setup=c(hidden_size=None), expect="ok"),
        hf("layers_zero", c(num_hidden_layers=0), "num_hidden_layers"),
        hf("layers_huge", c(num_hidden_layers=10**30), "num_hidden_layers"),
        hf("experts_zero", c(num_local_experts=0), "num_local_experts"),
        hf("experts_str", c(num_local_experts="8"), "num_local_experts"),
        hf("kv_not_divide", c(num_key_value_heads=3), "num_key_value_heads"),
        hf("kv_over_heads", c(num_key_value_heads=8), "num_key_value_heads"),
        hf("head_dim_zero", c(head_dim=0), "head_dim"),
        hf("vocab_zero", c(vocab_size=0), "vocab_size"),
        hf("inter_zero", c(intermediate_size=0), "intermediate_size"),
        hf("type_unknown", c(model_type="llama"), "model_type"),
        hf("type_missing", c(model_type=None), "model_type"),
        hf("type_int", c(model_type=3), "model_type"),
        hf("dtype_unknown", c(torch_dtype="float8"), "torch_dtype"),
        hf("dtype_int", c(torch_dtype=16), "torch_dtype"),
        Case("hf_act_sim", "hf_config", RUN, HF, setup=c(hidden_act="gelu_new"), expect="ok"),
        hf("rope_nan", text("ck/config.json", '{"model_type":"mixtral","rope_theta":NaN}'), "rope"),
        hf("eps_inf", c(rms_norm_eps=1e400), "rms_norm_eps"),
        hf("rope_scaling_str", c(rope_scaling="yarn"), "rope_scaling"),
        hf("rope_scaling_nofactor", c(rope_scaling={"type": "linear"}), "factor", real=True),
        hf("rope_scaling_neg", c(rope_scaling={"type": "linear", "factor": -2}), "factor"),
        hf("rope_scaling_type", c(rope_scaling={"type": "nosuch", "factor": 2}), "nosuch",
           real=True),
        hf("maxpos_zero", c(max_position_embeddings=0), "max_position_embeddings"),
        hf("empty_object", text("ck/config.json", "{}")),
        hf("bom", text("ck/config.json", b"\xef\xbb\xbf{}"), "config.json"),
        hf("trailing", text("ck/config.json", '{"model_type": "mixtral"} x'), "config.json"),
        hf("number_top", text("ck/config.json", "42"), "config.json"),
        hf("empty_file", text("ck/config.json", ""), "config.json"),
        hf("deep_nesting", text("ck/config.json", "[" * 100000 + "]" * 100000), "config.json"),
        hf("tie_str", c(tie_word_embeddings="yes"), "tie_word_embeddings"),
        hf("sliding_neg", c(sliding_window=-1), "sliding_window"),
        hf("real_topk_over", c(num_experts_per_tok=9), "num_experts_per_tok", real=True),
        hf("real_layers_more", c(num_hidden_layers=3), "layers", real=True),
        hf("real_hidden_other", c(hidden_size=128), "hidden", real=True),
        hf("real_experts_more", c(num_local_experts=16), "expert", real=True),
        hf("real_vocab_more", c(vocab_size=256), "vocab", real=True),
        hf("real_family_other", c(model_type="olmoe"), real=True),
        hf("real_clip_neg", c(model_type="olmoe", clip_qkv=-1.0), "clip_qkv", real=True),
        hf("real_eps_zero", c(rms_norm_eps=0), "rms_norm_eps", real=True),
        hf("real_kv_zero", c(num_key_value_heads=0), "num_key_value_heads", real=True),
        hf("real_dtype_f16", c(torch_dtype="float16"), real=True),
        Case("hf_dir_is_file", "hf_config", RUN, ("+model.hf_config={t}/f", *SIM),
             setup=text("f", "x"), names=("JSON",)),
        Case("hf_config_dir", "hf_config", RUN, HF, names=("config.json",),
             setup=lambda t: ((t / "ck/config.json").unlink(), (t / "ck/config.json").mkdir())),
        Case("hf_config_fifo", "hf_config", RUN, HF, names=("config.json",), timeout=60,
             setup=lambda t: ((t / "ck/config.json").unlink(), os.mkfifo(t / "ck/config.json"))),
        Case("hf_config_dangling", "hf_config", RUN, HF, names=("config.json",),
             setup=lambda t: ((t / "ck/config.json").unlink(),
                              (t / "ck/config.json").symlink_to(t / "nowhere"))),
    ]  # fmt: skip


def _dup_key(head: dict) -> bytes:
    body = json.dumps(head)
    name = next(k for k in head if "q_proj" in k)
    extra = json.dumps({name: head[name]})[1:-1]
    return (body[:-1] + ", " + extra + "}").encode()


def index(body: Any) -> Callable[[Path], None]:
    return text("ck/model.safetensors.index.json", json.dumps(body))


def sharded(t: Path) -> None:
    (t / ST).rename(t / "ck/model-00001-of-00001.safetensors")


def wmap(target: str) -> Callable[[Path], None]:
    def setup(t: Path) -> None:
        from safetensors import safe_open

        with safe_open(t / ST, "pt") as f:
            names = list(f.keys())
        (t / ST).rename(t / "ck" / "w.safetensors")
        body = {"weight_map": {n: "w.safetensors" for n in names}}
        body["weight_map"][names[0]] = target
        (t / "ck/model.safetensors.index.json").write_text(json.dumps(body))

    return setup


def _st_cases() -> list[Case]:
    return [
        st("len_past_end", raw_bytes(lambda b: struct.pack("<Q", 10**9) + b[8:]), "safetensors"),
        st("len_zero", raw_bytes(lambda b: struct.pack("<Q", 0) + b[8:]), "safetensors"),
        st("len_huge", raw_bytes(lambda b: struct.pack("<Q", 2**63) + b[8:]), "safetensors"),
        st("short_file", raw_bytes(lambda b: b[:5]), "safetensors"),
        st("empty_file", raw_bytes(lambda b: b""), "safetensors"),
        st("not_json", header(lambda h: b"{not json" + b" " * 20), "safetensors"),
        st("not_utf8", header(lambda h: b'{"\xff": 1}'), "safetensors"),
        st("dup_key", header(_dup_key), "safetensors"),
        st("dtype_unknown", header(_set("q_proj", "dtype", "X9")), "dtype"),
        st("dtype_f8", header(_set("q_proj", "dtype", "F8_E4M3")), "dtype"),
        st("dtype_int", header(_set("q_proj", "dtype", 7)), "dtype"),
        st("shape_neg", header(_set("q_proj", "shape", [-64, -64])), "shape"),
        st("shape_str", header(_set("q_proj", "shape", "64x64")), "shape"),
        st("shape_float", header(_set("q_proj", "shape", [64.0, 64])), "shape"),
        st("shape_swapped", header(_set("k_proj", "shape", [64, 32])), "k_proj"),
        st("offsets_reversed", header(lambda h: _first(h).update(
            data_offsets=_first(h)["data_offsets"][::-1])), "data_offsets"),
        st("offsets_past_end", header(lambda h: _first(h, "lm_head").update(
            data_offsets=[0, 10**9])), "data_offsets"),
        st("offsets_three", header(_set("q_proj", "data_offsets", [0, 1, 2])), "data_offsets"),
        st("offsets_str", header(_set("q_proj", "data_offsets", ["0", "4"])), "data_offsets"),
        st("offsets_overlap", header(lambda h: _first(h, "k_proj").update(
            data_offsets=_first(h, "q_proj")["data_offsets"][:1] * 1 + [
                _first(h, "q_proj")["data_offsets"][0] + 4096])), "data_offsets"),
        st("metadata_list", header(lambda h: h.update({"__metadata__": [1]})), "__metadata__"),
        st("metadata_int_value", header(lambda h: h["__metadata__"].update(x=1)), "metadata"),
        st("trailing_bytes", raw_bytes(lambda b: b + b"\0" * 64), "safetensors"),
        st("data_short", raw_bytes(lambda b: b[:-64]), "safetensors"),
        st("header_padded", header(_padded), expect="ok"),
        st("tensor_missing", resaved(lambda d: d.pop(next(k for k in d if "v_proj" in k))),
           "v_proj"),
        st("tensor_extra", resaved(lambda d: d.update(x=d["lm_head.weight"].clone())), "x"),
        st("tensor_transposed", resaved(lambda d: d.update(
            {k: d[k].T.contiguous() for k in d if "layers.0.block_sparse_moe.experts.0.w1" in k})),
           "w1"),
        st("tensor_bf16_one", resaved(lambda d: d.update(
            {k: d[k].bfloat16() for k in d if "layers.0.self_attn.q_proj" in k})), "q_proj"),
        st("tensor_int", resaved(lambda d: d.update(
            {k: d[k].int() for k in d if "layers.0.self_attn.q_proj" in k})), "q_proj"),
        st("dtype_mixed", header(_set("q_proj", "dtype", "F16")), "q_proj"),
    ]  # fmt: skip


def _st_files_cases() -> list[Case]:
    """Index files, shard names and what stands where a shard belongs."""
    return [
        st("index_list", index([1, 2]), "index"),
        st("index_nomap", index({"metadata": {}}), "weight_map"),
        st("index_map_list", index({"weight_map": ["a"]}), "weight_map"),
        st("index_missing_shard", both(sharded, index({"weight_map": {
            "lm_head.weight": "model-00002-of-00002.safetensors"}})), "model-00002"),
        st("index_escape", wmap("../outside.safetensors"), "outside"),
        st("index_absolute", wmap("/etc/passwd"), "passwd"),
        st("index_shard_dir", both(wmap("sub"), lambda t: (t / "ck/sub").mkdir()), "sub"),
        st("index_empty_name", wmap(""), "weight_map"),
        st("index_not_utf8", text("ck/model.safetensors.index.json", b"\xff\xfe"), "index"),
        st("shard_symlink_loop", lambda t: ((t / ST).unlink(), (t / ST).symlink_to(t / ST)),
           "model.safetensors"),
        st("shard_dangling", lambda t: ((t / ST).unlink(), (t / ST).symlink_to(t / "gone")),
           "model.safetensors"),
        st("shard_is_dir", lambda t: ((t / ST).unlink(), (t / ST).mkdir()), "model.safetensors"),
        st("shard_fifo", lambda t: ((t / ST).unlink(), os.mkfifo(t / ST)), "model.safetensors"),
        st("shard_dev_zero", lambda t: ((t / ST).unlink(), (t / ST).symlink_to("/dev/zero")),
           "model.safetensors"),
        st("no_weights", lambda t: (t / ST).unlink(), "safetensors"),
        st("two_layouts", both(wmap("w.safetensors"), lambda t: (t / "ck/x.safetensors")
                                .write_bytes((t / "ck/w.safetensors").read_bytes())), expect="ok"),
        st("nan_weight", raw_bytes(lambda b: b[:-4] + struct.pack("<f", float("nan"))),
           "non-finite"),
        st("inf_norm", raw_bytes(lambda b: b[:9000] + struct.pack("<f", float("inf")) +
                                 b[9004:]), "finite"),
    ]  # fmt: skip
