"""The real ESFT routing trace: loading, validation errors, workload windows, and the converter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from core.errors import TraceError
from core.routing import load_routing
from core.spec import ModelSpec, RoutingConfig, Workload
from core.trace_convert import convert_esft
from core.traces import TRACE_FILE, TRACE_NAME, esft_routing, load_esft

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def traces_dir() -> Path:
    d = (REPO / ".." / "shared" / "traces").resolve()
    if not (d / TRACE_NAME / TRACE_FILE).exists():
        pytest.skip("../shared/traces is absent")
    return d


def model(
    layers: int = 26, experts: int = 64, top_k: int = 6, name: str = "dsv2lite-like"
) -> ModelSpec:
    return ModelSpec(
        name=name,
        family="deepseek_v2",
        n_layers=layers,
        moe_layers=tuple(range(layers)),
        hidden_size=64,
        expert_ffn_size=32,
        n_experts=experts,
        top_k=top_k,
        n_heads=2,
        n_kv_heads=2,
        head_dim=32,
        vocab_size=100,
    )


def workload(
    trace_dir: Path, bs: int = 2, n: int = 2, prompt: int = 8, gen: int = 3, **routing: object
) -> Workload:
    cfg = RoutingConfig(source="trace", trace_dir=str(trace_dir), **routing)  # type: ignore[arg-type]
    return Workload(batch_size=bs, n_batches=n, prompt_len=prompt, gen_len=gen, routing=cfg)


def test_load_shapes(traces_dir: Path) -> None:
    tr = load_esft(traces_dir)
    assert tr.expert_ids.shape == (33279, 26, 6)
    assert tr.gate_weights.shape == tr.expert_ids.shape
    assert tr.task_names == ("intent", "law", "summary", "translation")
    assert len(np.unique(tr.seq_key)) == 127 + 33 + 13 + 40


def test_relative_trace_dir_resolves_against_cwd(
    traces_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(traces_dir.parent)
    assert load_esft("traces").n_tokens == 33279


def test_windows_continue_into_next_sequence(traces_dir: Path) -> None:
    """intent sequences have 47..88 tokens, so 4 windows of 40 positions span several of them."""
    tr = load_esft(traces_dir)
    wl = workload(traces_dir, bs=2, n=2, prompt=40, gen=1, tasks=("intent",))
    r = esft_routing(model(), wl)
    assert r.expert_ids.shape == (4, 40, 26, 6) and r.expert_ids.dtype == np.int16
    intent = np.flatnonzero(tr.task == 0)[:160]  # already in (seq_id, pos) order
    assert len(np.unique(tr.seq_id[intent])) > 2
    np.testing.assert_array_equal(r.expert_ids, tr.expert_ids[intent].reshape(4, 40, 26, 6))
    np.testing.assert_array_equal(r.gate_weights, tr.gate_weights[intent].reshape(4, 40, 26, 6))
    assert "wrapped 0x" in r.description
    r.check_fits(model(), wl)


def test_windows_carry_each_tokens_task(traces_dir: Path) -> None:
    """Each window position is labelled with its token's task, and a batch's labels line up
    with its ids: windows that run from intent's last sequence into law's first change label."""
    tr = load_esft(traces_dir)
    wl = workload(traces_dir, bs=2, n=2, prompt=40, gen=1, tasks=("intent", "law"))
    r = esft_routing(model(), wl.with_(seed=126))  # intent's last sequence (<= 88 tokens), then law
    assert r.label_names == tr.task_names and r.labels is not None
    start = np.flatnonzero((tr.task == 0) & (tr.seq_id == 126))[0]
    take = np.arange(start, start + 160)  # intent's tokens are followed by law's in the file
    np.testing.assert_array_equal(r.expert_ids.reshape(160, 26, 6), tr.expert_ids[take])
    np.testing.assert_array_equal(r.labels.ravel(), tr.task[take])
    assert set(np.unique(r.labels)) == {0, 1}
    labels, ids = r.batch_labels(0, 1, wl), r.batch_ids(0, 3, 1, wl)
    assert labels.shape == (len(ids),) == (2 * 40,)
    np.testing.assert_array_equal(labels, tr.task[take[80:]])


def test_wraps_and_excludes(traces_dir: Path) -> None:
    tr = load_esft(traces_dir)
    n_summary = int((tr.task == 2).sum())
    wl = workload(traces_dir, bs=10, n=2, prompt=1000, gen=1, tasks=("summary",))
    r = esft_routing(model(), wl)
    assert f"wrapped {(20 * 1000 - 1) // n_summary}x" in r.description
    only = workload(traces_dir, exclude_tasks=("intent", "law", "translation"))
    np.testing.assert_array_equal(
        esft_routing(model(), only).expert_ids,
        esft_routing(model(), workload(traces_dir, tasks=("summary",))).expert_ids,
    )


def test_seed_rotates_start_sequence(traces_dir: Path) -> None:
    tr = load_esft(traces_dir)
    r0 = esft_routing(model(), workload(traces_dir, tasks=("law",)))
    r1 = esft_routing(model(), workload(traces_dir, tasks=("law",)).with_(seed=1))
    first_of_seq1 = np.flatnonzero((tr.task == 1) & (tr.seq_id == 1))[0]
    np.testing.assert_array_equal(r1.expert_ids[0, 0], tr.expert_ids[first_of_seq1])
    assert not np.array_equal(r0.expert_ids, r1.expert_ids)
    np.testing.assert_array_equal(
        r0.expert_ids, esft_routing(model(), workload(traces_dir, tasks=("law",))).expert_ids
    )


def test_a_layer_cut_replays_the_traces_first_moe_layers(traces_dir: Path) -> None:
    """A DeepSeek-V2-Lite cut to its first layers (num_hidden_layers) has fewer MoE layers: it
    replays the trace's first ones, token for token as the whole model would; auto picks the
    trace for it; a model with more MoE layers than the trace is still refused."""
    from core.routing import resolve_source
    from core.types import RoutingSource

    whole = esft_routing(model(), workload(traces_dir))
    cut = esft_routing(model(7), workload(traces_dir))
    assert cut.expert_ids.shape == whole.expert_ids.shape[:2] + (7, 6)
    np.testing.assert_array_equal(cut.expert_ids, whole.expert_ids[:, :, :7])
    np.testing.assert_array_equal(cut.gate_weights, whole.gate_weights[:, :, :7])
    assert cut.description.endswith("its first 7 of 26 MoE layers")
    assert not whole.description.endswith("MoE layers")
    assert resolve_source(model(7), RoutingSource.AUTO) == RoutingSource.TRACE
    assert resolve_source(model(7, 8, 2), RoutingSource.AUTO) == RoutingSource.SYNTHETIC
    with pytest.raises(TraceError, match=r"\(26 layers, 64 experts, top-6\).*has \(27, 64, 6\)"):
        esft_routing(model(27), workload(traces_dir))


def test_shape_mismatch_names_both_shapes(traces_dir: Path) -> None:
    with pytest.raises(
        TraceError, match=r"\(26 layers, 64 experts, top-6\).*mixtral-8x7b has \(32, 8, 2\)"
    ):
        esft_routing(model(32, 8, 2, "mixtral-8x7b"), workload(traces_dir))


def test_unknown_task(traces_dir: Path) -> None:
    with pytest.raises(TraceError, match="unknown task.*'chess'.*intent"):
        esft_routing(model(), workload(traces_dir, tasks=("chess",)))
    with pytest.raises(TraceError, match="selects no tokens"):
        esft_routing(model(), workload(traces_dir, tasks=("law",), exclude_tasks=("law",)))


def test_load_routing_dispatches_to_trace(traces_dir: Path) -> None:
    r = load_routing(model(), workload(traces_dir))
    assert r.n_experts == 64 and r.top_k == 6


def test_missing_file_names_file_and_fix(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=rf"{tmp_path}.*{TRACE_FILE}.*workload.routing.trace_dir"):
        load_esft(tmp_path)


def _write(tmp_path: Path, **arrays: np.ndarray) -> Path:
    d = tmp_path / TRACE_NAME
    d.mkdir(exist_ok=True)
    np.savez(d / TRACE_FILE, **arrays)
    return tmp_path


def _good(t: int = 5) -> dict[str, np.ndarray]:
    return dict(
        expert_ids=np.broadcast_to(np.arange(6, dtype=np.uint8), (t, 26, 6)),
        gate_weights=np.full((t, 26, 6), 1 / 6, np.float32),
        task=np.zeros(t, np.uint8),
        seq_id=np.zeros(t, np.int32),
        pos=np.arange(t, dtype=np.int32),
        task_names=np.array(["intent"]),
    )


def test_corrupt_files(tmp_path: Path) -> None:
    d = tmp_path / TRACE_NAME
    d.mkdir()
    (d / TRACE_FILE).write_bytes(b"not a zip at all")
    with pytest.raises(TraceError, match=rf"{TRACE_FILE}: not a readable npz"):
        load_esft(tmp_path)
    arrays = _good()
    del arrays["pos"]
    with pytest.raises(TraceError, match=r"missing array\(s\) \['pos'\]"):
        load_esft(_write(tmp_path, **arrays))
    with pytest.raises(TraceError, match=r"expert_ids has shape \(5, 26, 4\)"):
        load_esft(_write(tmp_path, **(_good() | {"expert_ids": np.zeros((5, 26, 4), np.uint8)})))
    with pytest.raises(TraceError, match=r"seq_id has shape \(4,\)"):
        load_esft(_write(tmp_path, **(_good() | {"seq_id": np.zeros(4, np.int32)})))
    twice = _good()["expert_ids"].copy()
    twice[3, 7, 5] = twice[3, 7, 0]  # the same expert twice in one token's top-6
    with pytest.raises(TraceError, match=r"token 3 repeats an expert .* at MoE layer 8"):
        load_esft(_write(tmp_path, **(_good() | {"expert_ids": twice})))
    assert load_esft(_write(tmp_path, **_good())).n_tokens == 5


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"num_experts": np.int16(32)}, "num_experts is 32, the ESFT model's is 64"),
        ({"top_k": np.int16(3)}, "top_k is 3, the ESFT model's is 6"),
        ({"model_layer": np.arange(1, 6, dtype=np.int16)}, r"model_layer is \[1, 2, 3, 4, 5\]"),
        ({"pos": np.full(5, -1, np.int32)}, "pos must be token positions >= 0"),
    ],
)
def test_a_trace_of_another_model_is_refused(tmp_path: Path, extra: dict, message: str) -> None:
    """The model the file records (convert_esft writes num_experts, top_k and model_layer) must
    be the one the loader assumes, and positions are >= 0: such files were read as ESFT's."""
    meta = dict(num_experts=np.int16(64), top_k=np.int16(6), model_layer=np.arange(1, 27))
    assert load_esft(_write(tmp_path, **_good(), **meta)).n_tokens == 5
    with pytest.raises(TraceError, match=rf"{TRACE_FILE}: corrupt trace, {message}"):
        load_esft(_write(tmp_path, **(_good() | meta | extra)))


def test_converter_small_directory(tmp_path: Path) -> None:
    """Two tasks, two layers; one sequence of 2 tokens and one of 1 token per task."""
    src = tmp_path / "expert_scores"
    for task, base in (("b", 10), ("a", 20)):
        (src / task).mkdir(parents=True)
        for layer in (1, 2):
            ids = [list(range(base + layer, base + layer + 12)), list(range(6))]
            w = [[0.1] * 12, [0.5, 0.1, 0.1, 0.1, 0.1, 0.1]]
            lines = [
                "\t".join(map(str, i)) + "\t\t" + "\t".join(f"{x:.4f}" for x in ww)
                for i, ww in zip(ids, w, strict=True)
            ]
            (src / task / f"expert_weights_{layer}.txt").write_text("\n".join(lines) + "\n")
    out = convert_esft(tmp_path, tmp_path / "out.npz")
    z = np.load(out)
    assert list(z["task_names"]) == ["a", "b"]
    assert z["expert_ids"].shape == (6, 2, 6)
    np.testing.assert_array_equal(z["task"], [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(z["seq_id"], [0, 0, 1, 0, 0, 1])
    np.testing.assert_array_equal(z["pos"], [0, 1, 0, 0, 1, 0])
    np.testing.assert_array_equal(z["expert_ids"][1, 1], range(28, 34))  # task a, token 1, layer 2
    assert z["gate_weights"][2, 0, 0] == np.float32(0.5)


def test_converter_rejects_mismatched_layers(tmp_path: Path) -> None:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "expert_weights_1.txt").write_text(
        "\t".join(map(str, range(6))) + "\t\t" + "\t".join(["0.1"] * 6) + "\n"
    )
    (tmp_path / "t" / "expert_weights_2.txt").write_text(
        "\t".join(map(str, [*range(6), *range(6)])) + "\t\t" + "\t".join(["0.1"] * 12) + "\n"
    )
    with pytest.raises(TraceError, match=r"expert_weights_2.txt line 1: 2 tokens, layer 1 has 1"):
        convert_esft(tmp_path, tmp_path / "o.npz")
    with pytest.raises(TraceError, match="no such file"):
        convert_esft(tmp_path / "nope", tmp_path / "o.npz")


def test_converter_names_a_layer_file_that_is_not_text(tmp_path: Path) -> None:
    """A gzipped (or otherwise binary) file under a dump's name: one line naming it, from a folder
    or from a tarball (not 'not a readable tar archive': the archive is fine)."""
    import gzip
    import tarfile

    (tmp_path / "src" / "t").mkdir(parents=True)
    bad = tmp_path / "src" / "t" / "expert_weights_1.txt"
    bad.write_bytes(gzip.compress(b"1\t2\t\t0.5\t0.5\n"))
    with pytest.raises(TraceError, match=r"t/expert_weights_1.txt is not a UTF-8 text file"):
        convert_esft(tmp_path / "src", tmp_path / "o.npz")
    with tarfile.open(tmp_path / "src.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "src" / "t", arcname="t")
    with pytest.raises(TraceError, match=r"t/expert_weights_1.txt is not a UTF-8 text file"):
        convert_esft(tmp_path / "src.tar.gz", tmp_path / "o.npz")


def test_trace_dir_naming_the_file_itself_is_one_line(traces_dir: Path) -> None:
    """trace_dir pointed at the .npz (not the folder holding esft-dsv2lite/): a TraceError
    naming the flag and what its path is, not a NotADirectoryError traceback."""
    npz = traces_dir / TRACE_NAME / TRACE_FILE
    with pytest.raises(TraceError, match=r"trace_dir=.*: a file, where a folder belongs; pass"):
        load_esft(npz)


def test_cli_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from experiments.convert_traces import main

    assert main([f"src={tmp_path / 'nope.tar.gz'}", f"out={tmp_path / 'o.npz'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nope.tar.gz" in err and err.count("\n") == 1


@pytest.mark.slow  # the whole ESFT dump converted: .ci/run's slow suite
def test_converter_reproduces_shipped_npz(traces_dir: Path, tmp_path: Path) -> None:
    """The upstream tarball converts to exactly the shipped arrays (values, dtypes, keys)."""
    tarball = traces_dir / TRACE_NAME / "original" / "esft_expert_scores_original.tar.gz"
    if not tarball.exists():
        pytest.skip("original tarball absent")
    new = np.load(convert_esft(tarball, tmp_path / "esft.npz"))
    old = np.load(traces_dir / TRACE_NAME / TRACE_FILE)
    assert sorted(new.files) == sorted(old.files)
    for key in old.files:
        assert new[key].dtype == old[key].dtype, key
        np.testing.assert_array_equal(new[key], old[key], err_msg=key)


def _dump(root: Path, layers: range, k: int) -> Path:
    """One task, one sequence of 4 tokens per layer file; token t picks experts t..t+k-1."""
    (root / "t").mkdir(parents=True)
    ids = [e for t in range(4) for e in range(t, t + k)]
    line = "\t".join(map(str, ids)) + "\t\t" + "\t".join(["0.1"] * len(ids)) + "\n"
    for layer in layers:
        (root / "t" / f"expert_weights_{layer}.txt").write_text(line)
    return root


def test_converter_rejects_a_dump_that_is_not_top6(tmp_path: Path) -> None:
    """A top-3 dump (2 tokens per 6 ids) parsed as top-6: the groups repeat experts (token 0's
    3..5 vs token 1's 1..3 -> 1,2,3 twice); it converted and loaded silently before."""
    src = _dump(tmp_path / "src", range(1, 27), 3)
    with pytest.raises(TraceError, match=r"expert_weights_1.txt line 1: token 0 repeats an expert"):
        convert_esft(src, tmp_path / "o.npz")


def test_cli_rejects_a_dump_the_loader_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """expert_weights_26.txt missing: the CLI wrote a 25-layer npz that load_esft then called
    corrupt, telling the user to rebuild it with the same CLI."""
    from experiments.convert_traces import main

    src = _dump(tmp_path / "src", range(1, 26), 6)
    assert main([f"src={src}", f"out={tmp_path / TRACE_NAME / TRACE_FILE}"]) == 2
    assert "expert_weights_1..25.txt" in capsys.readouterr().err
    assert not (tmp_path / TRACE_NAME / TRACE_FILE).exists()
    src26 = _dump(tmp_path / "src26", range(1, 27), 6)
    assert main([f"src={src26}", f"out={tmp_path / TRACE_NAME / TRACE_FILE}"]) == 0
    assert load_esft(tmp_path).n_tokens == 4


def _dump_lines(root: Path, lines: dict[int, list[str]], task: str = "t") -> Path:
    """Task `task`'s layer files, layer -> its lines (one a sequence)."""
    (root / task).mkdir(parents=True, exist_ok=True)
    for layer, text in lines.items():
        (root / task / f"expert_weights_{layer}.txt").write_text("\n".join(text) + "\n")
    return root


def _line(ids: list[int], w: list[str]) -> str:
    return "\t".join(map(str, ids)) + "\t\t" + "\t".join(w)


def test_converter_keeps_the_old_trace_when_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C mid-write: the npz was written straight onto the target, so a good trace there
    was left torn. Now a temporary file is renamed over it once complete."""
    import os

    src = _dump(tmp_path / "src", range(1, 3), 6)
    out = tmp_path / "o" / "esft.npz"
    out.parent.mkdir()
    out.write_bytes(b"a good trace")

    def torn(file: object, *args: object, **kwargs: object) -> None:
        if isinstance(file, str | os.PathLike):
            Path(file).write_bytes(b"torn")
        else:
            file.write(b"torn")  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(np, "savez_compressed", torn)
        with pytest.raises(RuntimeError, match="interrupted"):
            try:
                convert_esft(src, out)
            except KeyboardInterrupt:  # (not left to escape: it would stop pytest)
                raise RuntimeError("interrupted") from None
    assert out.read_bytes() == b"a good trace"
    assert [p.name for p in out.parent.iterdir()] == ["esft.npz"]  # no temporary left
    assert convert_esft(src, out) == out
    assert np.load(out)["expert_ids"].shape == (4, 2, 6)
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask  # as a plain write, not mkstemp's 0600


def test_converter_refuses_a_task_in_two_folders(tmp_path: Path) -> None:
    """`law/` and `zz/law/`: the second replaced the first's layer files, silently."""
    import tarfile

    line = [_line(list(range(6)), ["0.1"] * 6)]
    _dump_lines(tmp_path / "src", {1: line}, "law")
    _dump_lines(tmp_path / "src" / "zz", {1: line}, "law")
    msg = r"task law is in two folders, law/ and zz/law/; keep one"
    with pytest.raises(TraceError, match=msg) as e:
        convert_esft(tmp_path / "src", tmp_path / "o.npz")
    assert "\n" not in str(e.value)
    with tarfile.open(tmp_path / "src.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "src" / "law", arcname="law")
        tar.add(tmp_path / "src" / "zz", arcname="zz")
    with pytest.raises(TraceError, match=msg):
        convert_esft(tmp_path / "src.tar.gz", tmp_path / "o.npz")
    assert not (tmp_path / "o.npz").exists()


def test_converter_refuses_weights_summing_past_one_and_an_empty_task(tmp_path: Path) -> None:
    """Each weight in [0, 1] but a token's top-6 summing past 1 is no softmax; a task folder
    left empty beside the others was dropped without a word (3 tasks written of 4)."""
    src = _dump_lines(tmp_path / "a", {1: [_line(list(range(6)), ["0.5"] * 6)]})
    with pytest.raises(TraceError, match=r"token 0 has gate weight 0.5 \(its top-6 sum 3.0000\)"):
        convert_esft(src, tmp_path / "o.npz")
    src = _dump_lines(tmp_path / "b", {1: [_line(list(range(6)), ["0.1"] * 6)]})
    (src / "empty").mkdir()
    with pytest.raises(TraceError, match=r"empty: a task folder without expert_weights"):
        convert_esft(src, tmp_path / "o.npz")
    assert not (tmp_path / "o.npz").exists()


def test_converter_names_the_file_and_line_at_fault(tmp_path: Path) -> None:
    """Out-of-range expert ids and uneven line counts named only the source folder."""
    ok = _line(list(range(6)), ["0.1"] * 6)
    src = _dump_lines(
        tmp_path / "a", {1: [ok, ok], 2: [ok, _line([1, 2, 3, 4, 5, 64], ["0.1"] * 6)]}
    )
    with pytest.raises(
        TraceError, match=r"a/t/expert_weights_2.txt line 2: token 0 has expert id 64, outside"
    ):
        convert_esft(src, tmp_path / "o.npz")
    src = _dump_lines(tmp_path / "b", {1: [ok], 2: [ok, ok, ok]})
    with pytest.raises(
        TraceError, match=r"b/t/expert_weights_2.txt has 3 lines, expert_weights_1.txt has 1"
    ):
        convert_esft(src, tmp_path / "o.npz")


@pytest.mark.parametrize("weight", ["nan", "-0.1", "inf", "7.5"])
def test_converter_refuses_nan_or_negative_gate_weights(tmp_path: Path, weight: str) -> None:
    src = _dump_lines(tmp_path, {1: [_line(list(range(12)), ["0.1"] * 7 + [weight] + ["0.1"] * 4)]})
    with pytest.raises(
        TraceError, match=rf"t/expert_weights_1.txt line 1: token 1 has gate weight {weight}"
    ):
        convert_esft(src, tmp_path / "o.npz")
    assert not (tmp_path / "o.npz").exists()


@pytest.mark.parametrize("value", [np.nan, -0.5, 7.5])
def test_loader_refuses_nan_or_negative_gate_weights(tmp_path: Path, value: float) -> None:
    w = np.full((5, 26, 6), 0.1, np.float32)
    w[2, 3, 1] = value
    d = _write(tmp_path, **(_good() | {"gate_weights": w}))
    with pytest.raises(
        TraceError, match=rf"{TRACE_FILE}: corrupt trace, gate_weights holds {value} at token 2"
    ) as e:
        load_esft(d)
    assert "\n" not in str(e.value)


def test_cli_ctrl_c_keeps_the_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C while converting: one line, exit 130, the trace already there kept."""
    from experiments.convert_traces import main

    out = tmp_path / TRACE_FILE
    src = _dump(tmp_path / "src", range(1, 27), 6)
    assert main([f"src={src}", f"out={out}"]) == 0  # the trace already there: this command's
    before = out.read_bytes()

    def interrupt(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez_compressed", interrupt)
    try:
        main([f"src={src}", f"out={out}"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped as a KeyboardInterrupt traceback")
    except SystemExit as e:
        assert e.code == 130
    else:
        pytest.fail("returned instead of exiting 130")
    assert capsys.readouterr().err.startswith("interrupted: ")
    assert out.read_bytes() == before
