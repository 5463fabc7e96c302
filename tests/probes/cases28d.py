"""Round 28d's probe cases (issue 48), run by `tests.probes.harness28d`: the FILES every
command reads and writes, none of earlier rounds' cases. Inputs: a run dir's summary.json,
trace.parquet and config.yaml as collect, report and trace_json read them; a checkpoint's
config.json (field types, duplicate keys, special files) and safetensors headers as validate,
calibrate and the benches read them; ESFT dumps as convert_traces reads them; YAMLs of a user's
conf dir. Outputs: full and read-only disks, odd paths, an output that is a file.

Usage: python -m tests.probes.harness28d [CLASS_OR_ID ...]
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.probes.cases26d import both, config, header, raw_bytes, text
from tests.probes.cases26d_cmd import _fill, _ro
from tests.probes.harness26d import Case

COL, REP, TJ = "experiments.collect", "experiments.report", "experiments.trace_json"
VAL, CAL, ACC = "experiments.validate", "experiments.calibrate", "experiments.bench.accelerate"
CONV, RUN = "experiments.convert_traces", "experiments.run"
V = ("checkpoint={ck}", "hardware=tiny", "repeats=1", "out={t}/v", "planners=[flexgen]",
     "gpu_frac=2")  # fmt: skip
A = ("checkpoint={ck}", "hardware=tiny", "repeats=1", "n_batches=1")
C = ("checkpoint={ck}", "out={t}/cal.yaml", "in_run_s=0.5")
SIM = ("hardware=tiny", "workload=tiny", "planner=flexgen", "hydra.run.dir={t}/out")


def _sweep(edit: Callable[[Path], Any] | None = None) -> Callable[[Path], None]:
    """A sweep {t}/sw of two finished runs, a and b, b's files edited by `edit(b)`."""

    def setup(t: Path) -> None:
        shutil.copytree(t / "run", t / "sw/a")
        shutil.copytree(t / "run", t / "sw/b")
        if edit:
            edit(t / "sw/b")

    return setup


def _in_run(edit: Callable[[Path], Any]) -> Callable[[Path], None]:
    def setup(t: Path) -> None:
        edit(t / "run")

    return setup


def _write(name: str, body: str | bytes) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        p = d / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
        p.write_bytes(body if isinstance(body, bytes) else body.encode())

    return edit


def _special(name: str, kind: str) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        p = d / name
        p.unlink(missing_ok=True)
        if kind == "dir":
            p.mkdir()
        elif kind == "loop":
            p.symlink_to(p.name)
        elif kind == "fifo":
            os.mkfifo(p)
        elif kind == "dangling":
            p.symlink_to("nowhere")

    return edit


def _half(name: str) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        p = d / name
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])

    return edit


def _json_edit(name: str, fn: Callable[[Any], Any]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        p = d / name
        s = json.loads(p.read_text())
        new = fn(s)
        p.write_text(json.dumps(s if new is None else new))

    return edit


def _yaml_edit(old: str, new: str) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        p = d / "config.yaml"
        body = p.read_text()
        assert old in body, old
        p.write_text(body.replace(old, new, 1))

    return edit


def _parquet(fn: Callable[[Any], Any]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        import pandas as pd

        df = pd.read_parquet(d / "trace.parquet")
        fn(df).to_parquet(d / "trace.parquet")

    return edit


def _runfile_mutations() -> list[tuple[str, str, Callable[[Path], None]]]:
    """(id, file, edit of a run dir) for each malformed run-dir file."""
    out: list[tuple[str, str, Callable[[Path], None]]] = []
    for name, short in (("summary.json", "sum"), ("trace.parquet", "tr"), ("config.yaml", "cfg")):
        out += [
            (f"{short}_empty", name, _write(name, "")),
            (f"{short}_half", name, _half(name)),
            (f"{short}_binary", name, _write(name, b"\x00\xff\xfe\x80" * 64)),
            (f"{short}_dir", name, _special(name, "dir")),
            (f"{short}_loop", name, _special(name, "loop")),
            (f"{short}_dangling", name, _special(name, "dangling")),
        ]
    s, y = "summary.json", "config.yaml"
    out += [
        ("sum_list", s, _write(s, "[1, 2]")),
        ("sum_bom", s, lambda d: (d / s).write_bytes(b"\xef\xbb\xbf" + (d / s).read_bytes())),
        ("sum_dupkey", s, lambda d: (d / s).write_text(
            (d / s).read_text().rstrip()[:-1] + ', "makespan_s": -1}')),
        ("sum_old_no_fields", s, _json_edit(s, lambda j: j.pop("routing_fields", None))),
        ("sum_old_no_plan", s, _json_edit(s, lambda j: j.pop("plan", None))),
        ("sum_busy_list", s, _json_edit(s, lambda j: j.update(busy_s=[1.0]))),
        ("sum_peak_str", s, _json_edit(s, lambda j: j.update(peak_bytes={"gpu": "big"}))),
        ("sum_tokens_neg", s, _json_edit(s, lambda j: j.update(tokens_generated=-12))),
        ("sum_huge_num", s, lambda d: (d / s).write_text(
            (d / s).read_text().replace('"ops": 71', '"ops": 1' + "0" * 400))),
        ("cfg_list", y, _write(y, "- 1\n- 2\n")),
        ("cfg_scalar", y, _write(y, "hello\n")),
        ("cfg_tab", y, lambda d: (d / y).write_text((d / y).read_text() + "\tbad: 1\n")),
        ("cfg_no_model", y, _yaml_edit("model:", "modelx:")),
        ("cfg_bs_str", y, _yaml_edit("batch_size: 2", "batch_size: two")),
        ("cfg_python_tag", y, lambda d: (d / y).write_text(
            (d / y).read_text() + "x: !!python/object/apply:os.system ['true']\n")),
        ("cfg_dupkey", y, lambda d: (d / y).write_text((d / y).read_text() + "seed: 9\nseed: 8\n")),
        ("tr_other_cols", "trace.parquet", _parquet(lambda df: df.add_suffix("x"))),
        ("tr_no_rows", "trace.parquet", _parquet(lambda df: df.iloc[:0])),
        ("tr_end_before_start", "trace.parquet", _parquet(_swap_times)),
        ("tr_nan_time", "trace.parquet", _parquet(_nan_time)),
        ("tr_str_time", "trace.parquet", _parquet(_str_time)),
    ]  # fmt: skip
    return out


def _time_cols(df: Any) -> tuple[str, str]:
    start = next(c for c in df.columns if "start" in c)
    end = next(c for c in df.columns if "end" in c)
    return start, end


def _swap_times(df: Any) -> Any:
    s, e = _time_cols(df)
    df[s], df[e] = df[e].copy() + 1.0, df[s].copy()
    return df


def _nan_time(df: Any) -> Any:
    s, _ = _time_cols(df)
    df.loc[df.index[0], s] = float("nan")
    return df


def _str_time(df: Any) -> Any:
    s, _ = _time_cols(df)
    df[s] = df[s].astype(str)
    return df


# a missing or not yet complete summary.json is a run still running: collect and report skip it
_SKIPPED = {"sum_empty", "sum_half", "sum_dir"}


def _rundir_cases() -> list[Case]:
    cases = []
    for i, name, edit in _runfile_mutations():
        tr = name == "trace.parquet"
        exp = "ok" if (i in _SKIPPED or tr) else "fail"
        cases.append(Case(f"col_{i}", "rundir", COL, ("dir={t}/sw", "out={t}/o"),
                          setup=_sweep(edit), expect=exp, names=() if tr else (name,)))  # fmt: skip
        cases.append(Case(f"rep_{i}", "rundir", REP, ("dir={t}/sw", "out={t}/o"),
                          setup=_sweep(edit), expect=exp, names=() if tr else (name,)))  # fmt: skip
        texp = "ok" if name == "config.yaml" else "fail"  # it reads no config.yaml
        cases.append(Case(f"tj_{i}", "rundir", TJ, ("runs=[{run}]", "out={t}/o.json"),
                          setup=_in_run(edit), expect=texp, names=(name,) if texp == "fail" else (),
                          timeout=60))  # fmt: skip
    return cases


def _cfg(i: str, setup: Callable[[Path], None], *names: str, cmd: str = VAL) -> Case:
    args = {VAL: V, ACC: A, CAL: C, RUN: ("+model.hf_config={ck}", *SIM)}[cmd]
    tag = {VAL: "val", ACC: "acc", CAL: "cal", RUN: "sim"}[cmd]
    return Case(f"cj_{tag}_{i}", "hf_config", cmd, args, setup=setup, names=names, timeout=240)


def _null(key: str) -> Callable[[Path], None]:
    def setup(t: Path) -> None:
        p = t / "ck/config.json"
        p.write_text(json.dumps({**json.loads(p.read_text()), key: None}))

    return setup


def _cj_dup(t: Path) -> None:
    p = t / "ck/config.json"
    body = p.read_text().rstrip()
    p.write_text(body[:-1] + ', "num_local_experts": 4}')


def _cj_huge(t: Path) -> None:
    p = t / "ck/config.json"
    cfg = json.loads(p.read_text())
    cfg["padding"] = "x" * (300 * 2**20)
    p.write_text(json.dumps(cfg))


def _ck(edit: Callable[[Path], None], name: str = "config.json") -> Callable[[Path], None]:
    def setup(t: Path) -> None:
        edit(t / "ck")

    return setup


def _cj_cases() -> list[Case]:
    c = config
    typed = [
        ("rope_theta_str", c(rope_theta="1e6"), "rope_theta"),
        ("topk_str", c(num_experts_per_tok="2"), "num_experts_per_tok"),
        ("head_dim_float", c(head_dim=1.5), "head_dim"),
        ("vocab_null", _null("vocab_size"), "vocab_size"),
        ("heads_list", c(num_attention_heads=[4]), "num_attention_heads"),
        ("eps_str", c(rms_norm_eps="1e-5"), "rms_norm_eps"),
        ("maxpos_bool", c(max_position_embeddings=True), "max_position_embeddings"),
        ("dtype_null", _null("torch_dtype"), "torch_dtype"),
        ("scaling_list", c(rope_scaling=[2]), "rope_scaling"),
        ("scaling_factor_str", c(rope_scaling={"type": "linear", "factor": "4"}), "factor"),
        ("sliding_str", c(sliding_window="x"), "sliding_window"),
        ("kv_str", c(num_key_value_heads="2"), "num_key_value_heads"),
        ("inter_str", c(intermediate_size="32"), "intermediate_size"),
        ("act_int", c(hidden_act=3), "hidden_act"),
        ("act_unknown", c(hidden_act="nosuch"), "hidden_act"),
        ("layers_float", c(num_hidden_layers=2.0), "num_hidden_layers"),
        ("experts_neg", c(num_local_experts=-8), "num_local_experts"),
        ("theta_neg", c(rope_theta=-1.0), "rope_theta"),
        ("theta_zero", c(rope_theta=0), "rope_theta"),
        ("dup_key", _cj_dup, "config.json"),
        ("latin1", text("ck/config.json", '{"model_type": "mixtral", "x": "\xe9"}'.encode(
            "latin-1")), "config.json"),
        ("utf16", text("ck/config.json", '{"model_type": "mixtral"}'.encode("utf-16")),
         "config.json"),
        ("loop", _ck(_special("config.json", "loop")), "config.json"),
        ("dir", _ck(_special("config.json", "dir")), "config.json"),
        ("fifo", _ck(_special("config.json", "fifo")), "config.json"),
        ("dangling", _ck(_special("config.json", "dangling")), "config.json"),
        ("huge", _cj_huge, "config.json"),
        ("nan_literal", lambda t: (t / "ck/config.json").write_text(
            (t / "ck/config.json").read_text().rstrip()[:-1] + ', "rope_theta": NaN}'),
         "rope_theta"),
    ]  # fmt: skip
    cases = [_cfg(i, s, *n) for i, s, *n in typed]
    for i, s, *n in typed:
        if i in (
            "rope_theta_str",
            "topk_str",
            "dup_key",
            "latin1",
            "loop",
            "fifo",
            "vocab_null",
            "heads_list",
            "eps_str",
            "scaling_factor_str",
            "experts_neg",
            "act_unknown",
        ):
            cases.append(_cfg(i, s, *n, cmd=ACC))
            cases.append(_cfg(i, s, *n, cmd=CAL))
            cases.append(_cfg(i, s, *n, cmd=RUN))
    return cases


def _first(head: dict, part: str = "q_proj") -> dict:
    return next(v for k, v in head.items() if part in k)


def _set(part: str, key: str, value: Any) -> Callable[[dict], None]:
    def edit(head: dict) -> None:
        _first(head, part)[key] = value

    return edit


def _gap(head: dict) -> None:
    """Every tensor from the second byte on moved 8 bytes later: a gap after the first."""
    first = min(v["data_offsets"][0] for k, v in head.items() if k != "__metadata__")
    for k, v in head.items():
        if k != "__metadata__" and v["data_offsets"][0] > first:
            v["data_offsets"] = [v["data_offsets"][0] + 8, v["data_offsets"][1] + 8]


def _renamed_empty(head: dict) -> None:
    k = next(k for k in head if "q_proj" in k)
    head[""] = head.pop(k)


def _st_cases() -> list[Case]:
    def st(i: str, setup: Callable[[Path], None], *names: str, cmd: str = VAL) -> Case:
        args = {VAL: V, ACC: A, CAL: C}[cmd]
        tag = {VAL: "val", ACC: "acc", CAL: "cal"}[cmd]
        return Case(f"st_{tag}_{i}", "safetensors", cmd, args, setup=setup, names=names,
                    timeout=240)  # fmt: skip

    rows = [
        ("gap", both(header(_gap), raw_bytes(lambda b: b + bytes(8))), "back to back"),
        ("shape_huge", header(_set("q_proj", "shape", [2**40, 2**40])), "shape"),
        ("shape_zero", header(_set("q_proj", "shape", [0, 64])), "shape"),
        ("shape_scalar", header(_set("q_proj", "shape", [])), "shape"),
        ("meta_null", header(lambda h: h.update({"__metadata__": None})), "__metadata__"),
        ("meta_nested", header(lambda h: h.update({"__metadata__": {"a": {"b": "c"}}})),
         "__metadata__"),
        ("meta_value_null", header(lambda h: h.update({"__metadata__": {"a": None}})),
         "__metadata__"),
        ("offsets_neg", header(_set("q_proj", "data_offsets", [-4, 4])), "data_offsets"),
        ("offsets_float", header(_set("q_proj", "data_offsets", [0.0, 4.5])), "data_offsets"),
        ("offsets_null", header(_set("q_proj", "data_offsets", None)), "data_offsets"),
        ("dtype_lower", header(_set("q_proj", "dtype", "f32")), "dtype"),
        ("dtype_bool", header(_set("q_proj", "dtype", "BOOL")), "q_proj"),
        ("name_empty", header(_renamed_empty), "tensor ''"),
        ("entry_extra_key", header(_set("q_proj", "extra", 1)), "safetensors"),
        ("header_space_first", header(lambda h: b" " + json.dumps(h).encode()), "safetensors"),
        ("header_nan", header(lambda h: json.dumps(h).replace('"F32"', '"F32", "x": NaN', 1)
                              .encode()), "safetensors"),
        ("header_over_100mb", raw_bytes(lambda b: struct.pack("<Q", 101 * 2**20) + b[8:]),
         "safetensors"),
        ("len_unaligned_ok", raw_bytes(lambda b: b), ),
    ]  # fmt: skip
    cases = [st(i, s, *n) for i, s, *n in rows if i != "len_unaligned_ok"]
    for i, s, *n in rows:
        if i in ("gap", "shape_huge", "meta_nested", "offsets_neg", "dtype_bool", "name_empty"):
            cases.append(st(i, s, *n, cmd=ACC))
            cases.append(st(i, s, *n, cmd=CAL))
    return cases


def _dump(t: Path, edit: Callable[[Path], None] | None = None, tasks: int = 2) -> None:
    """A small ESFT dump at {t}/src: `tasks` tasks of 26 layer files, 2 sequences of 2 tokens."""
    ids = "\t".join(str(i) for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11))
    w = "\t".join(["0.1000"] * 12)
    for k in range(tasks):
        d = t / "src" / f"task{k}"
        d.mkdir(parents=True)
        for layer in range(1, 27):
            (d / f"expert_weights_{layer}.txt").write_text(f"{ids}\t\t{w}\n{ids}\t\t{w}\n")
    if edit:
        edit(t / "src/task0/expert_weights_1.txt")


def _conv(
    i: str,
    edit: Callable[[Path], None] | None,
    *names: str,
    expect: str = "fail",
    out: str = "out={t}/o.npz",
    setup: Callable[[Path], None] | None = None,
) -> Case:
    def made(t: Path) -> None:
        _dump(t, edit)
        if setup:
            setup(t)

    return Case(f"conv_{i}", "esft", CONV, ("src={t}/src", out), setup=made, names=names,
                expect=expect)  # fmt: skip


def _line(body: str) -> Callable[[Path], None]:
    def edit(p: Path) -> None:
        p.write_text(body)

    return edit


def _conv_cases() -> list[Case]:
    ids = "\t".join(str(i) for i in range(12))
    w = "\t".join(["0.1000"] * 12)
    return [
        _conv("ok", None, expect="ok"),
        _conv("word", _line(f"a\t{ids[2:]}\t\t{w}\n{ids}\t\t{w}\n"), "expert_weights_1"),
        _conv("no_sep", _line(f"{ids}\t{w}\n{ids}\t\t{w}\n"), "expert_weights_1"),
        _conv("short_w", _line(f"{ids}\t\t0.1\n{ids}\t\t{w}\n"), "expert_weights_1"),
        _conv("neg_id", _line(f"-1\t{ids[2:]}\t\t{w}\n{ids}\t\t{w}\n"), "expert_weights_1"),
        _conv("big_id", _line(f"64\t{ids[2:]}\t\t{w}\n{ids}\t\t{w}\n"), "expert_weights_1"),
        _conv("nan_w", _line(f"{ids}\t\tnan\t{w[7:]}\n{ids}\t\t{w}\n"), "expert_weights_1"),
        _conv("neg_w", _line(f"{ids}\t\t-0.5\t{w[7:]}\n{ids}\t\t{w}\n"), "expert_weights_1"),
        _conv("dup_id", _line(f"0\t0\t{ids[4:]}\t\t{w}\n{ids}\t\t{w}\n"), "expert_weights_1"),
        _conv("one_line", _line(f"{ids}\t\t{w}\n"), "expert_weights_1"),
        _conv("empty", _line(""), "expert_weights_1"),
        _conv("latin1", lambda p: p.write_bytes(b"\xe9" + p.read_bytes()), "expert_weights_1"),
        _conv("crlf", lambda p: p.write_bytes(p.read_bytes().replace(b"\n", b"\r\n")),
              expect="ok"),
        _conv("dir", lambda p: (p.unlink(), p.mkdir()), "expert_weights_1"),
        _conv("loop", lambda p: (p.unlink(), p.symlink_to(p.name)), "expert_weights_1"),
        _conv("fifo", lambda p: (p.unlink(), os.mkfifo(p)), "expert_weights_1"),
        _conv("gone", lambda p: p.unlink(), "expert_weights_[1]"),
        _conv("out_file_dir", None, "o.npz", setup=lambda t: (t / "o.npz").mkdir()),
        _conv("out_full", None, "full", out="out={t}/full/o.npz", setup=_fill),
        _conv("out_ro", None, "ro", out="out={t}/ro/o.npz", setup=_ro),
        _conv("out_parent_file", None, "f", out="out={t}/f/o.npz", setup=text("f", "x")),
        _conv("out_odd", None, expect="ok", out="out='{t}/a b\u00e9#%.npz'"),
        _conv("out_is_src", None, "src", out="out={t}/src"),
        _conv("out_in_src", None, expect="ok", out="out={t}/src/o.npz"),
    ]  # fmt: skip


def _quoted(arg: str) -> str:
    """`key=value` with the value in hydra's quotes, as its line says to pass it."""
    key, _, value = arg.partition("=")
    return f"{key}='{value}'"


def _out_cases() -> list[Case]:
    o = "output"
    cases = []
    for mod, base, what in (
        (COL, ("dir={t}/sw",), "out={t}/{d}/c"),
        (REP, ("dir={t}/sw",), "out={t}/{d}/r"),
        (TJ, ("runs=[{run}]",), "out={t}/{d}/t.json"),
        (VAL, tuple(a for a in V if not a.startswith("out=")), "out={t}/{d}/v"),
        (CAL, ("disk_dir={t}/cd", "disk_mb=1"), "out={t}/{d}/h.yaml"),  # a tiny checkpoint's
        # in-run runs do not fit the share calibrate gives them: its outputs, without one
        (
            "experiments.make_checkpoint",
            (
                "model=mixtral-tiny",
                "n_layers=2",
                "hidden_size=64",
                "n_heads=4",
                "n_kv_heads=2",
                "expert_ffn_size=32",
                "vocab_size=128",
            ),
            "out={t}/{d}/ck2",
        ),
    ):
        tag = mod.rsplit(".", 1)[-1][:6]
        sw = _sweep()
        cases += [
            Case(f"out_{tag}_full", o, mod, (*base, what.format(t="{t}", d="full")),
                 setup=lambda t, sw=sw: (sw(t), _fill(t)), names=("full",), timeout=240),
            Case(f"out_{tag}_ro", o, mod, (*base, what.format(t="{t}", d="ro")),
                 setup=lambda t, sw=sw: (sw(t), _ro(t)), names=("ro",), timeout=240),
            Case(f"out_{tag}_parent_file", o, mod, (*base, what.format(t="{t}", d="f")),
                 setup=lambda t, sw=sw: (sw(t), text("f", "x")(t)), names=("f",), timeout=240),
            Case(f"out_{tag}_odd", o, mod, (*base, _quoted(what.format(t="{t}", d="a b\u00e9#%"))),
                 setup=sw, expect="ok", timeout=240),
            Case(f"out_{tag}_loop", o, mod, (*base, what.format(t="{t}", d="lp")),
                 setup=lambda t, sw=sw: (sw(t), (t / "lp").symlink_to("lp")), names=("lp",),
                 timeout=240),
        ]  # fmt: skip
    return cases


def _conf_cases() -> list[Case]:
    """A user's conf dir (--config-dir) and hardware profiles given by path."""
    hw = (Path(__file__).resolve().parents[2] / "conf/hardware/tiny.yaml").read_text()
    args = ("--config-dir", "{t}/cfg", "model=tiny", "hardware=mine", "workload=tiny",
            "planner=flexgen", "hydra.run.dir={t}/out")  # fmt: skip

    def conf(
        i: str, body: str | bytes | None, *names: str, expect: str = "fail", special: str = ""
    ) -> Case:
        def setup(t: Path) -> None:
            p = t / "cfg/hardware/mine.yaml"
            p.parent.mkdir(parents=True)
            if body is not None:
                p.write_bytes(body if isinstance(body, bytes) else body.encode())
            if special:
                _special("mine.yaml", special)(p.parent)

        return Case(f"conf_{i}", "conf", RUN, args, setup=setup, names=names, expect=expect)

    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi", strict=True)
    )
    return [
        conf("bom", b"\xef\xbb\xbf" + hw.encode(), expect="ok"),
        conf("latin1", hw.replace("name: tiny", "name: tin\xe9").encode("latin-1"), "mine.yaml"),
        conf("dup_top", hw + "name: other\n", "name"),
        conf("python_tag", hw + "x: !!python/object/apply:os.system ['true']\n", "mine.yaml"),
        conf("bomb", hw + bomb, "mine.yaml"),
        conf("loop", None, "mine.yaml", special="loop"),
        conf("dir", None, "mine", special="dir"),
        conf("fifo", None, "mine.yaml", special="fifo"),
        conf("dangling", None, "mine.yaml", special="dangling"),
        conf("huge", hw + "# " + "x" * (200 * 2**20) + "\n", "mine.yaml"),
        conf("anchor_merge", hw.replace("name: tiny", "name: tiny\nbase: &b {x: 1}\nm: {<<: *b}"),
             "base"),
        conf("doc_two", hw + "---\nname: other\n", "mine.yaml"),
        conf("unicode_name", hw.replace("name: tiny", "name: \u00e9t\u00e9"), expect="ok"),
    ]  # fmt: skip


def _klotski_results(t: Path) -> None:
    """{t}/k: reproduce_klotski's out of a quick Table 3 (made once under the probe's home)."""
    import subprocess
    import sys

    from tests.conftest import user_env

    base = t.parent / "base_klotski"
    if not (base / "results.csv").exists():
        args = [f"out={base}", "quick=true", "only=[table3]", "jobs=1"]
        subprocess.run([sys.executable, "-m", "experiments.reproduce_klotski", *args],
                       env=user_env(), capture_output=True, check=True)  # fmt: skip
    shutil.copytree(base, t / "k")


def _klotski_cases() -> list[Case]:
    """report_only=true over an earlier out's results.csv and results.json, each malformed."""
    csv = "results.csv"

    def k(i: str, edit: Callable[[Path], Any] | None, *names: str, expect: str = "fail") -> Case:
        def setup(t: Path) -> None:
            _klotski_results(t)
            if edit:
                edit(t / "k")

        return Case(f"klo_{i}", "klotski", "experiments.reproduce_klotski",
                    ("out={t}/k", "report_only=true"), setup=setup, names=names,
                    expect=expect, timeout=400)  # fmt: skip

    def sed(line: int, old: str, new: str) -> Callable[[Path], None]:
        def edit(d: Path) -> None:
            rows = (d / "results.csv").read_text().split("\n")
            rows[line] = rows[line].replace(old, new, 1)
            (d / "results.csv").write_text("\n".join(rows))

        return edit

    return [
        k("ok", None, expect="ok"),
        k("csv_empty", _write(csv, ""), "results.csv"),
        k("csv_half", _half(csv), "results.csv"),
        k("csv_binary", _write(csv, b"\x00\xff\xfe\x80" * 64), "results.csv"),
        *(k(f"csv_{kind}", _special(csv, kind), "results.csv")
          for kind in ("dir", "loop", "dangling", "fifo")),
        k("csv_cut_newline", lambda d: (d / "results.csv").write_text(
            (d / "results.csv").read_text()[:-1]), "results.csv"),
        k("csv_header_other", sed(0, "table,", "tablex,"), "results.csv"),
        k("csv_cols_fewer", sed(0, ",sim_s", ""), "results.csv"),
        k("csv_tput_word", sed(1, "rtx3090-env1,0,{},15,16,4,", "rtx3090-env1,0,{},15,16,4,x"),
          "results.csv"),
        k("csv_n_float", sed(1, ",{},15,", ",{},1.5,"), "results.csv"),
        k("csv_table_unknown", sed(1, "table3,", "nosuch,"), "results.csv"),
        k("json_gone", lambda d: (d / "results.json").unlink(), expect="ok"),  # reads the csv
        k("runs_gone", lambda d: shutil.rmtree(d / "runs"), expect="ok"),
    ]  # fmt: skip


CASES = [
    *_rundir_cases(), *_cj_cases(), *_st_cases(), *_conv_cases(), *_out_cases(), *_conf_cases(),
    *_klotski_cases(),
]  # fmt: skip
