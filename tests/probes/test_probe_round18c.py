"""Probe round 18c (issue 48): two commands at once on the same files, and parity round 12's
loose ends.

A checkpoint make_checkpoint rewrites (it holds the folder's `.run.lock` while its files move
in one by one) was read as it stood: a run took one checkpoint's config.json with the other's
shards. Every reader (`load_checkpoint`, the weight store's files) now refuses a folder whose
lock a live writer holds, in one line, and one whose files changed while it read them (their
inode, size or mtime); the lock and staging a SIGKILLed writer left are no writer's, and the
earlier checkpoint is read as it was.

Two commands moving their outputs into one folder at once (two reports, two collects, one of
them while a sweep still wrote the sweep dir, trace_json into a run dir a run rewrites) each
staged their files whole and then moved them in together: one's results.parquet was left beside
the other's results.csv, and one's new files could be set aside and removed by the other. The
moves (and trace_json's read of the trace beside it) are done under the folder's lock, so the
second waits, saying so.

The fields that leave no MoE layer were refused naming them; they read as a dense model now
(round 27).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from core.files import WRITE_LOCK, being_written
from core.hf_config import hf_config_to_spec, spec_to_hf_config
from real.checkpoint import load_checkpoint, reduced_spec
from tests.conftest import user_env
from tests.probes.conftest import ROOT, raises_one_line


@contextmanager
def held(folder: Path) -> Iterator[None]:
    """`folder`'s write lock held as another process's writer holds it (its own open file)."""
    fd = os.open(folder / WRITE_LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@pytest.fixture
def ckpt(tiny_ckpt: Path, tmp_path: Path) -> Path:
    """A copy of the probes' tiny checkpoint, to hold the lock of or rewrite."""
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "ck"))


# -- the fields that leave no MoE layer, each combination: a dense model ---------------------

NO_MOE = [
    ("qwen1.5-moe-a2.7b", {"decoder_sparse_step": 9}, ()),
    ("qwen1.5-moe-a2.7b", {"mlp_only_layers": [0, 1]}, ()),
    ("qwen1.5-moe-a2.7b", {"decoder_sparse_step": 2, "mlp_only_layers": [1]}, ()),
    ("qwen3-30b-a3b", {"mlp_only_layers": [0, 1]}, ()),
    ("qwen3-30b-a3b", {"decoder_sparse_step": 3}, ()),
    ("deepseek-v2-lite", {"first_k_dense_replace": 2}, ()),
    ("deepseek-v2-lite", {"first_k_dense_replace": 1, "moe_layer_freq": 3}, ()),
    ("deepseek-v2-lite", {"first_k_dense_replace": 0, "moe_layer_freq": 3}, (0,)),
    ("deepseek-v3", {"first_k_dense_replace": 2}, ()),
    ("deepseek-v3", {"first_k_dense_replace": 5}, ()),
]


@pytest.mark.parametrize(("model", "fields", "moe"), NO_MOE)
def test_no_moe_layer_is_a_dense_model(model, fields, moe):
    """Two layers: fields that leave no layer its experts read as a dense model, as
    transformers runs it (tests/real/test_hf_parity_round27.py runs them against it); round 18c
    had them refused, the verb agreeing with the fields named."""
    cfg = spec_to_hf_config(reduced_spec(model)) | fields | {"num_hidden_layers": 2}
    assert hf_config_to_spec(cfg, "x").moe_layers == moe


# -- a checkpoint make_checkpoint writes now: refused, never read mixed -------------------------


def _store(ckpt: Path) -> object:
    from real.store import TieredStore

    return TieredStore(ckpt, 1 << 30, device="cpu")


def _records(ckpt: Path) -> object:
    from real.disk import unit_records

    return unit_records(ckpt)


READERS = {"load_checkpoint": load_checkpoint, "unit_records": _records, "store": _store}


@pytest.mark.parametrize("reader", list(READERS))
def test_a_checkpoint_being_written_is_refused(ckpt, reader):
    """While a writer holds the folder's lock, each reader refuses in one line naming the
    folder and what to do. Before: read as it stood."""
    with held(ckpt):
        assert being_written(ckpt)
        raises_one_line(lambda: READERS[reader](ckpt), str(ckpt), "make_checkpoint", "ended")
    assert not being_written(ckpt)
    READERS[reader](ckpt)  # and read once it has ended


def test_a_real_run_on_a_checkpoint_being_written_is_one_line(ckpt, tmp_path, cli_here):
    """`experiments.run executor=real` on it: one line, no run dir. Before: the run ran."""
    from tests.probes.conftest import one_line, real_args

    with held(ckpt):
        r = cli_here("experiments.run", *real_args(ckpt, tmp_path / "run"))
    one_line(r, str(ckpt), "writing this checkpoint now")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "left",
    ["lock", "staging", "half file", "lock and staging", "earlier set aside"],
)
def test_what_a_killed_writer_left_is_no_writer(ckpt, left):
    """make_checkpoint SIGKILLed leaves its lock file (its flock gone with it) and its hidden
    staging: the checkpoint there is read as it was, not refused, nor mixed with them."""
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()  # a pid no process has now
    before = load_checkpoint(ckpt)[1]
    staging = ckpt / f".partial-{dead.pid}-0123abcd"
    if "lock" in left:
        (ckpt / WRITE_LOCK).touch()
    if "staging" in left or "aside" in left:
        name = staging.name + ("-earlier" if "aside" in left else "")
        (ckpt / name).mkdir()
        (ckpt / name / "model.safetensors").write_bytes(b"\0" * 100)  # cut short
    if "half" in left:
        (ckpt / f".model.partial-{dead.pid}-0123abcd.safetensors").write_bytes(b"\0" * 8)
    assert not being_written(ckpt)
    assert load_checkpoint(ckpt)[1].keys() == before.keys()


def _replaced(path: Path) -> None:
    """`path` written anew (a new inode, as make_checkpoint's rename over it gives)."""
    tmp = path.with_name(path.name + ".new")
    shutil.copyfile(path, tmp)
    os.replace(tmp, path)


CHANGES = {
    "config.json replaced": lambda d: _replaced(d / "config.json"),
    "shard replaced": lambda d: _replaced(d / "model.safetensors"),
    "shard grown": lambda d: open(d / "model.safetensors", "ab").write(b"\0"),  # noqa: SIM115
    "file added": lambda d: (d / "model-2.safetensors").write_bytes(b""),
    "config.json removed": lambda d: (d / "config.json").unlink(),
}


@pytest.mark.parametrize("reader", ["load_checkpoint", "unit_records"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_checkpoint_changed_while_loaded_is_refused(ckpt, monkeypatch, change, reader):
    """A writer that starts and ends while the checkpoint is read (between config.json and the
    shards' headers): one line, not one checkpoint's config.json with the other's shards."""
    import real.checkpoint as checkpoint

    read = checkpoint._load_checkpoint

    def rewritten_meanwhile(d: Path, dtype: str | None) -> object:
        got = read(d, dtype)
        CHANGES[change](d)
        return got

    monkeypatch.setattr(checkpoint, "_load_checkpoint", rewritten_meanwhile)
    raises_one_line(lambda: READERS[reader](ckpt), str(ckpt), "changed while they were read")


LOCK_FILES = {
    "a folder": lambda p: p.mkdir(),
    "a FIFO": os.mkfifo,
    "a dangling link": lambda p: p.symlink_to(p.with_name("nowhere")),
    "unreadable": lambda p: (p.touch(), p.chmod(0)),
}


@pytest.mark.parametrize("kind", list(LOCK_FILES))
def test_a_lock_no_writer_can_hold_is_no_writer(ckpt, kind):
    """A `.run.lock` that is no lock file (a folder, a FIFO, a dangling link; unreadable, as
    root reads it anyway or not) is no writer's: the checkpoint is read, not refused nor
    blocked on."""
    LOCK_FILES[kind](ckpt / WRITE_LOCK)
    assert not being_written(ckpt)
    load_checkpoint(ckpt)


@pytest.mark.parametrize("change", ["config.json replaced", "shard replaced"])
def test_a_checkpoint_changed_before_its_files_open_is_refused(ckpt, monkeypatch, change):
    """The weight store reads the records, then opens the shards for the run: a rewrite
    between the two is refused, so the files it reads are those the records are of."""
    import real.store as store

    records = store.unit_records

    def rewritten_then(d: Path, dtype: str | None = None) -> object:
        got = records(d, dtype)
        CHANGES[change](Path(d))
        return got

    monkeypatch.setattr(store, "unit_records", rewritten_then)
    raises_one_line(lambda: _store(ckpt), str(ckpt), "changed while they were read")


def test_a_writer_reads_what_it_holds_the_lock_of(ckpt):
    """The process holding the lock (make_checkpoint checking the folder it writes) reads it."""
    from experiments.common.dir_lock import dir_locked

    with dir_locked(ckpt):
        assert not being_written(ckpt)
        load_checkpoint(ckpt)


# -- outputs moved into one folder by two commands at once: one at a time ----------------------


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep dir holding one finished tiny run (`0/`)."""
    from tests.probes.conftest import tiny_run

    root = tmp_path_factory.mktemp("round18c-sweep")
    tiny_run(root / "0")
    return root


def waits_for_the_lock(folder: Path, args: list[str], made: list[Path]) -> None:
    """`args` (python's) started while another writer holds `folder`'s lock: it says it waits
    and writes none of `made` until the lock is let go, then ends well. No timing: the line is
    read before the lock goes (a command that does not wait ends without it)."""
    with held(folder):
        p = subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=user_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert p.stdout is not None
        said = next((ln for ln in iter(p.stdout.readline, "") if "waiting for it" in ln), None)
        assert said, p.communicate()
        assert not any(f.exists() for f in made)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert all(f.exists() for f in made)


def test_collect_waits_for_another_writing_its_results(sweep, tmp_path):
    """Two collects (one while a sweep wrote more runs) left one's results.parquet beside the
    other's results.csv: the second waits for the first's pair."""
    out = tmp_path / "res"
    out.mkdir()
    made = [out / "results.parquet", out / "results.csv"]
    waits_for_the_lock(out, ["-m", "experiments.collect", f"dir={sweep}", f"out={out}"], made)


def test_staged_outputs_move_in_one_writer_at_a_time(tmp_path):
    """report's, replication's and validate's outputs (`staged_outputs`) move in under the
    folder's lock: another's set is never set aside and removed, nor mixed with this one's."""
    out = tmp_path / "report"
    out.mkdir()
    code = (
        "from pathlib import Path; from experiments.common.run_dir import staged_outputs\n"
        f"with staged_outputs(Path({str(out)!r}), last='index.html') as tmp:\n"
        "    (tmp / 'a.png').write_text('a'); (tmp / 'index.html').write_text('i')\n"
    )
    waits_for_the_lock(out, ["-c", code], [out / "a.png", out / "index.html"])


def test_trace_json_waits_for_a_run_rewriting_its_dir(sweep, tmp_path):
    """trace_json of a run dir another run rewrites (it holds the dir's lock) waits, so that
    trace.json is of the trace.parquet beside it. Before: the old trace's JSON beside the new
    run's trace."""
    run = Path(shutil.copytree(sweep / "0", tmp_path / "run"))
    (run / WRITE_LOCK).unlink(missing_ok=True)
    args = ["-m", "experiments.trace_json", f"runs={run}"]
    waits_for_the_lock(run, args, [run / "trace.json"])


def test_two_collects_at_once_both_end_whole(sweep, tmp_path):
    """Started together, without the lock held: each ends well, the pair is one collect's."""
    out = tmp_path / "res"
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "experiments.collect", f"dir={sweep}", f"out={out}"],
            cwd=ROOT,
            env=user_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    assert [p.wait(timeout=120) for p in runs] == [0, 0]
    assert sorted(p.name for p in out.iterdir()) == ["results.csv", "results.parquet"]
