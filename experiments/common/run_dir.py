"""A run directory as a result: its files replaced only by a whole new result
(`replace_run`, `staged_outputs`), a swap a kill cut short undone (`restore_previous`), hydra's
record of the result kept through a failed rerun, the code and files a result is of
(`code_version`, `stamp`, a manifest of each file's hash), and whether a dir already holds this
run's result (`finished`)."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from core.args import not_a_folder
from core.errors import MoepipeError, without_fix
from core.files import (
    broken_link,
    no_file_words,
    not_regular,
    read_small,
    read_summary_json,
    staging_dir,
    staging_file,
)
from experiments.common.cli import result_written
from experiments.common.deferred import interrupt_deferred
from experiments.common.dir_lock import LOCK, dir_locked

log = logging.getLogger(__name__)

TOKENS_FILE = "tokens.safetensors"

MANIFEST = "files.sha256"  # in a run dir: each result file's sha256, as sha256sum writes them
# write_run's, but the summary
RUN_FILES = (MANIFEST, "trace.parquet", "trace.json", "balance.csv", TOKENS_FILE)

PREVIOUS = ".previous"  # in a run dir: the earlier result while a new one moves in


def replace_run(out_dir: Path, summary: Mapping[str, Any], files: Callable[[Path], None]) -> None:
    """Replace a run directory's result with a new one, on success only: `files(tmp)` writes the
    new files into a hidden folder inside `out_dir` (a full disk or a kill leaves the old result
    whole, and the folder is removed); then the old result moves aside into `.previous`, the new
    files move in, the new summary.json is written last and `.previous` goes. A kill -9 in that
    swap leaves `.previous`, which the next run into the dir puts back (`restore_previous`).
    The result's files, summary.json included, are listed with their hashes in `files.sha256`
    (`sha256sum -c` reads it), which `finished` checks before reusing the result."""
    top = topmost_missing(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file or a dangling link where the run's folder goes
        raise MoepipeError(
            f"{out_dir}: cannot make the run's folder ({not_a_folder(out_dir, e)}); move that "
            "away and run again"
        ) from None
    restore_previous(out_dir)
    # what a failed write leaves: an earlier result only where there was one
    had = (out_dir / "summary.json").exists()
    kept = "the earlier result there is kept" if had else "no result is left there"
    # named before it exists, so that a Ctrl-C at any moment of making it finds it removed
    tmp = staging_dir(out_dir)
    record: Path | None = None
    try:
        tmp.mkdir()
        text = json.dumps(summary, indent=2, default=str)  # before the old summary goes
        try:
            files(tmp)
            write_manifest(tmp, {"summary.json": text.encode()})
            record = staged_hydra_record(out_dir)  # a full disk fails here, not once swapped
        except OSError as e:  # a full disk: the write's error names no file
            raise OSError(
                e.errno,
                f"cannot write the run's files ({e.strerror or e}); {kept}",
                str(out_dir),
            ) from None
        with interrupt_deferred():  # Ctrl-C now would leave neither result
            _swap(out_dir, tmp, text, kept)
            _put_hydra_record(out_dir, record)
            result_written()  # a stop deferred till now says the result is whole
    except BaseException:  # no folder made for a result that is not there
        shutil.rmtree(tmp, ignore_errors=True)
        if record is not None:
            shutil.rmtree(record, ignore_errors=True)
        remove_empty(out_dir, top)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def topmost_missing(folder: Path) -> Path | None:
    """The topmost of `folder` and its parents that is not there (None: `folder` is, or is no
    path this system can hold: a name too long)."""
    try:
        missing = [p for p in (folder, *folder.parents) if not p.exists()]
    except OSError:
        return None
    return missing[-1] if missing else None


def remove_empty(folder: Path, top: Path | None) -> None:
    """`folder` and its parents up to `top` (`topmost_missing` before they were made), each
    while empty: a command that failed leaves no empty folder that looks like a result. Where
    `folder` is not there, or is a file's path (an output never written), its parents."""
    if top is None or not folder.is_relative_to(top):
        return
    for p in (folder, *folder.parents):
        if p.exists() or p.is_symlink():
            try:
                p.rmdir()
            except OSError:  # not empty, or a file (an output written)
                return
        if p == top:
            return


# hydra's record of a run (.hydra/: config, hydra.yaml, overrides) is rewritten when any run
# starts in the dir, before the run can act; the record of the run whose result the dir holds
# is kept beside it, so that a rerun that fails or is stopped puts it back
HYDRA = ".hydra"
HYDRA_KEPT = ".result"  # inside .hydra/
# a run dir as a single run starts: the dir, the topmost folder made for it (None: the dir was
# there), the names it held
Made = tuple[Path, Path | None, frozenset[str]]


def keep_hydra_record(out_dir: Path) -> None:
    """Copy hydra's record of the run just finished into `.hydra/.result/` (nothing where the
    run was written without hydra's record)."""
    _put_hydra_record(out_dir, staged_hydra_record(out_dir))


def staged_hydra_record(out_dir: Path) -> Path | None:
    """hydra's record of the run copied into a hidden folder of `.hydra/` (None: no record),
    before the run's result goes in: a full disk there failed the run after its result was in
    place, its staging folder left in `.hydra/`."""
    rec = out_dir / HYDRA
    files = [p for p in rec.glob("*.yaml") if p.is_file()] if rec.is_dir() else []
    if not files:
        return None
    tmp = staging_dir(rec)
    try:
        tmp.mkdir()
        for p in files:
            shutil.copy2(p, tmp / p.name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _put_hydra_record(out_dir: Path, staged: Path | None) -> None:
    """The staged record (`staged_hydra_record`) as `.hydra/.result/`."""
    if staged is None:
        return
    kept = out_dir / HYDRA / HYDRA_KEPT
    if kept.is_symlink() or (kept.exists() and not kept.is_dir()):  # a file in its place
        kept.unlink()  # (rmtree leaves it, and the replace failed naming .kept-PID)
    shutil.rmtree(kept, ignore_errors=True)
    os.replace(staged, kept)


def restore_hydra_record(out_dir: Path) -> None:
    """After a run that did not finish: where the dir holds an earlier result, hydra's record
    of that result comes back over the one the failed run's start wrote."""
    rec = out_dir / HYDRA
    kept = rec / HYDRA_KEPT
    if not (kept.is_dir() and (out_dir / "summary.json").is_file()):
        return
    for p in rec.glob("*.yaml"):
        if not (kept / p.name).exists():
            p.unlink(missing_ok=True)
    for p in kept.iterdir():
        shutil.copy2(p, rec / p.name)


OUTPUTS_BUSY = "another command is moving its outputs into this folder"


@contextmanager
def staged_outputs(
    out: Path,
    stale: Callable[[Path], set[str]] = lambda _: set(),
    last: str = "",
    made: bool | None = None,
) -> Iterator[Path]:
    """A hidden folder inside `out` to write a command's outputs into. When the block ends they
    replace those of the same names in `out`, with the names `stale(out)` gives (an earlier
    run's outputs the new ones do not overwrite), all under one deferred interrupt, `last`
    moved in last; when it fails (an error, a full disk, Ctrl-C) the folder goes and `out`
    keeps what it had, or goes too where it was made for this (`made`: it was, by the caller;
    default: where it does not exist yet)."""
    made = not out.exists() if made is None else made
    out.mkdir(parents=True, exist_ok=True)
    tmp = staging_dir(out)
    aside = out / f"{tmp.name}-earlier"  # the outputs replaced, until the new ones are in
    try:
        tmp.mkdir()
        try:
            yield tmp
        except OSError as e:  # named where the file goes, not in the hidden folder
            raise _named_in(e, tmp, out) from None
        new = sorted((p.name for p in tmp.iterdir()), key=lambda name: name == last)
        # one writer's outputs move in at a time: two reports at once left a page of one
        # beside the other's figures, and one set the other's new files aside and removed them
        with dir_locked(out, OUTPUTS_BUSY), interrupt_deferred():
            moved_in: list[str] = []
            try:
                _move_aside(out, aside, (set(new) | stale(out)) - {tmp.name, aside.name})
                for name in new:
                    os.replace(tmp / name, out / name)
                    moved_in.append(name)
            except BaseException:  # the earlier outputs back, as they were
                _put_back(out, aside, moved_in)
                raise
            shutil.rmtree(aside, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if made and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _named_in(e: OSError, tmp: Path, out: Path) -> OSError:
    """`e` naming the path in `out` where a file staged in `tmp` goes: a full disk named
    `out/.partial-123-ab12/flexgen/sim/trace.parquet`, a folder the user never sees. A write
    that named no file (matplotlib's savefig, pandas' to_csv on a full disk) names `out`."""
    if not e.filename:
        return type(e)(e.errno, e.strerror, str(out))
    names = []
    for name in (e.filename, e.filename2):
        try:
            names.append(out / Path(os.fsdecode(name)).relative_to(tmp) if name else name)
        except ValueError:  # not in the staging folder
            names.append(name)
    if names == [e.filename, e.filename2]:
        return e
    first, second = (str(n) if n else n for n in names)
    # OSError's 4th argument is winerror: filename2 goes 5th
    return type(e)(e.errno, e.strerror, first, *((None, second) if second else ()))


def _swap(out_dir: Path, tmp: Path, summary: str, kept: str) -> None:
    """The new result in `tmp` into `out_dir`, its summary.json (`summary`) written last, the old
    one's files set aside in `.previous` meanwhile. An OSError on the way (a summary.json that
    cannot be moved: immutable, on a read-only mount) undoes what was done, and the earlier
    result stays as it was, with no `.previous` beside it."""
    new = sorted(p.name for p in tmp.iterdir())
    moved_in: list[str] = []
    try:
        _move_aside(out_dir, out_dir / PREVIOUS, {"summary.json", *new, *RUN_FILES})
        for name in new:
            os.replace(tmp / name, out_dir / name)
            moved_in.append(name)
        atomic_write_text(out_dir / "summary.json", summary)
    except OSError as e:
        _put_back(out_dir, out_dir / PREVIOUS, moved_in)
        raise OSError(
            e.errno,
            f"cannot replace the run's result ({e.strerror or e}); {kept}",
            e.filename or str(out_dir),
        ) from None
    shutil.rmtree(out_dir / PREVIOUS, ignore_errors=True)


def _move_aside(out_dir: Path, aside: Path, names: set[str]) -> None:
    """The old result's files into `aside`, summary.json first (a dir without it holds no
    result, so no mix of two runs is ever read as one). Only `names` move: a command's outputs
    written into a run dir (report out=RUN_DIR) took its summary.json, the run's result, too."""
    aside.mkdir(exist_ok=True)
    for name in sorted(names, key=lambda n: (n != "summary.json", n)):
        if (out_dir / name).exists() or (out_dir / name).is_symlink():
            os.replace(out_dir / name, aside / name)


def _put_back(out_dir: Path, aside: Path, moved_in: list[str]) -> None:
    """Undo a swap that failed part way: the new files that moved in go, the old ones come back
    from `aside` (summary.json last), and `aside` goes."""
    for name in moved_in:
        old = out_dir / name
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    try:
        for p in sorted(aside.iterdir(), key=lambda p: p.name == "summary.json"):
            os.replace(p, out_dir / p.name)
        aside.rmdir()
    except OSError:  # (or aside was never made) what is left, the next run puts back
        pass


def restore_previous(out_dir: Path) -> None:
    """Undo a swap a kill cut short (`replace_run`): where summary.json is missing and
    `.previous` holds one, the new run's files that had moved in go and the earlier result comes
    back; where the new summary.json was written, `.previous` only had to go."""
    prev = out_dir / PREVIOUS
    if not prev.is_dir():
        return
    if not (out_dir / "summary.json").exists() and (prev / "summary.json").exists():
        for name in RUN_FILES:
            if not (prev / name).exists():
                (out_dir / name).unlink(missing_ok=True)
        for p in sorted(prev.iterdir(), key=lambda p: p.name == "summary.json"):
            os.replace(p, out_dir / p.name)  # summary.json last
    shutil.rmtree(prev, ignore_errors=True)


def code_version() -> str:
    """A fingerprint of the code a run depends on (core, planners, sim, real, the experiments
    that build its inputs, the configs): commands that resume reuse a finished run only under
    the same code. Hardware profiles (conf/hardware) are left out: `experiments.calibrate` adds
    one, which must not make every finished run count as another code's. Each command compares
    the profile a run used itself: experiments.run its resolved config.yaml, reproduce_klotski
    the profile's text."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha1()
    for folder in ("core", "planners", "sim", "real", "experiments", "conf"):
        for f in sorted((root / folder).rglob("*")):
            if f.suffix in (".py", ".yaml") and f.parent != root / "conf" / "hardware":
                h.update(f.relative_to(root).as_posix().encode() + f.read_bytes())
    return h.hexdigest()[:16]


CODE = "code_version.txt"  # in a run dir: the code (code_version) it ran with


def stamp(config_yaml: str) -> dict[str, str]:
    """The files that record what a run dir's summary is of: the config and the code."""
    return {"config.yaml": config_yaml, CODE: code_version()}


def finished(out_dir: Path, config_yaml: str) -> bool:
    """A run directory is finished when its summary.json exists (written last, atomically), its
    config.yaml and code version are this run's (a changed config or code runs again), it holds
    what this version's summary does (`routing_fields`), and its files are those the run wrote
    (files.sha256: one deleted or edited since runs again)."""
    summary, config, code = out_dir / "summary.json", out_dir / "config.yaml", out_dir / CODE
    if not summary.exists():
        return False
    if _text(config) != config_yaml:
        log.warning("%s holds a run of another config; running again", out_dir)
        return False
    if _text(code) != code_version():
        log.warning("%s holds a run of other code; running again", out_dir)
        return False
    try:
        got = read_summary_json(summary)
    except (OSError, ValueError, RecursionError, MoepipeError):  # not JSON, a key twice, ...
        got = None
    if not isinstance(got, dict):
        log.warning("%s: summary.json is not a readable JSON object; running again", out_dir)
        return False
    from experiments.common.tables import check_metrics, routing_lacks  # (it imports us)

    try:  # a metric that no run writes (NaN, a negative rate, a string): not a result to reuse
        check_metrics(got, summary)
    except MoepipeError as e:
        log.warning("%s; running again", without_fix(e))  # its fix (run it again) is this
        return False
    lacking = routing_lacks(got)  # an older version's, as collect skips it: no result to reuse
    if lacking:
        log.warning("%s: summary.json %s; running again", out_dir, lacking)
        return False
    changed = changed_file(out_dir)
    if changed is not None:
        log.warning("%s: %s is missing or not what the run wrote; running again", out_dir, changed)
        return False
    return True


def _sha256(path: Path) -> str:
    """`path`'s sha256; an OSError where it is no regular file (opened without blocking: a FIFO
    in a run file's place hung trace_json until killed, /dev/zero would never end)."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise OSError(errno.EINVAL, no_file_words(mode))
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path, more: Mapping[str, bytes]) -> None:
    """`folder/files.sha256`: the sha256 of each file in `folder` and of `more` (name -> the
    bytes a file of that name will hold), one `<hash>  <name>` line each."""
    digests = {p.name: _sha256(p) for p in folder.iterdir() if p.is_file()}
    digests |= {name: hashlib.sha256(data).hexdigest() for name, data in more.items()}
    digests.pop(MANIFEST, None)
    (folder / MANIFEST).write_text("".join(f"{h}  {n}\n" for n, h in sorted(digests.items())))


def changed_file(out_dir: Path) -> str | None:
    """The first file of the result in `out_dir` that is missing or not the one the run wrote
    (by its hash in files.sha256); `files.sha256` itself where it is missing or unreadable."""
    text = _text(out_dir / MANIFEST)
    lines = [line.split("  ", 1) for line in (text or "").splitlines()]
    if not lines or any(len(parts) != 2 for parts in lines):
        return MANIFEST
    for digest, name in lines:
        try:
            if _sha256(out_dir / name) != digest:
                return name
        except OSError:
            return name
    return None


# the files of a run that collect, report and trace_json read back
READ_BACK = ("summary.json", "config.yaml", "trace.parquet")


def edited_since_run(out_dir: Path, names: tuple[str, ...] = READ_BACK) -> str | None:
    """What is wrong where one of `names` in `out_dir` is not the file the run wrote (its hash in
    files.sha256 differs: edited, cut short or replaced since); None where each is the run's or
    the dir has no files.sha256 (a run dir made by hand: nothing to check it against)."""
    manifest = out_dir / MANIFEST
    if not manifest.exists():
        return None
    text = _text(manifest)
    lines = [line.split("  ", 1) for line in (text or "").splitlines()]
    if not lines or any(len(parts) != 2 for parts in lines):
        what = not_regular(manifest) or "not sha256sum's list of the run's files"
        return f"{manifest}: {what}"
    for digest, name in lines:
        path = out_dir / name  # a dead link there too: not a file deleted, one the run wrote
        if name in names and (path.exists() or path.is_symlink()):
            try:
                same = _sha256(path) == digest
            except OSError as e:
                return f"{path} unreadable{broken_link(path) or f' ({e.strerror})'}"
            if not same:
                return f"{out_dir / name} is not the file the run wrote (its hash in {MANIFEST})"
    return None


def _text(path: Path) -> str | None:
    """`path`'s text; None where it is missing, not a file or not UTF-8 (then not this run's)."""
    try:
        return read_small(path).decode("utf-8")
    except (OSError, ValueError):  # ConfigError (not a regular file, too big) is a ValueError
        return None


def write_texts(folder: Path, texts: Mapping[str, str]) -> None:
    for name, text in texts.items():
        (folder / name).write_text(text)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=str))


def atomic_write_text(path: Path, text: str) -> None:
    """Write `path` whole or not at all (a hidden file beside it, `staging_file`, renamed over
    it), with the permissions a plain write gives. A write's OSError (a full disk) names `path`."""
    tmp = staging_file(path)
    try:
        with open(tmp, "x") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:  # a full disk, `path` immutable: no hidden half-file is left
        Path(tmp).unlink(missing_ok=True)
        if e.filename:
            raise
        raise type(e)(e.errno, e.strerror, str(path)) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def run_dirs_made() -> Iterator[list[Made]]:
    """Inside: each single run's dir, listed as the run starts, with the topmost of its folders
    made for it (None where it was there before) and the names it held then. A command whose
    input is refused or whose run stops before its result (`remove_unused`) then takes away a dir
    hydra made, or in a dir that was there the record and log hydra added: hydra makes the dir
    before it configures logging and before the command reads its options, so an interpolation
    that fails in either left an empty folder. Each single run's dir is locked (`dir_lock`)
    before hydra makes it, until the block ends (a command that writes no run dir of hydra's
    own, `app.PLAIN`, takes no lock on the folder it runs in), so a second run into it waits
    before it writes anything there. Sweeps' points keep theirs (callbacks.remove_if_no_runs).
    A torchrun rank past 0, whose results rank 0 writes, takes away at its end a dir hydra made
    for it alone (its `${now:}` a second past rank 0's), unless a run holds its lock."""
    import hydra._internal.hydra as hydra_run
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    run_job = hydra_run.run_job
    made: list[Made] = []
    OPEN_RUN_DIRS.append(made)
    locks = ExitStack()

    def noted(*args: Any, **kwargs: Any) -> Any:
        config, key = kwargs.get("config"), kwargs.get("job_dir_key")
        if config is not None and key and kwargs.get("job_subdir_key") is None:
            try:  # as run_job reads it (hydra's `now` caches its time: the same folder)
                HydraConfig.instance().set_config(config)
                out = Path(str(OmegaConf.select(config, key))).absolute()
            except Exception:  # run_job fails on it next, before it makes a folder
                out = None
            own = OmegaConf.select(config, "hydra.output_subdir") is not None  # not `.` (app)
            top = out and next((p for p in (out, *out.parents) if p.parent.exists()), None)
            new = top is not None and not top.exists()
            if out is not None and own and _writes_run_dir():
                locks.enter_context(dir_locked(out))  # makes the dir: `top` was before
                new = new and {p.name for p in _listed(out)} <= {LOCK}  # not another's since
            if out is not None and top is not None and new:
                made.append((out, top, frozenset()))
            elif out is not None and own and out.is_dir():
                made.append((out, None, frozenset(p.name for p in _listed(out))))
        return run_job(*args, **kwargs)

    hydra_run.run_job = noted  # type: ignore[assignment]
    try:
        with locks:
            yield made
    finally:
        hydra_run.run_job = run_job  # type: ignore[assignment]
        OPEN_RUN_DIRS.remove(made)
        if not _writes_run_dir():  # a torchrun rank past 0, which writes into rank 0's dir
            remove_unused([m for m in made if m[1] is not None and not (m[0] / LOCK).exists()])


# the lists of `run_dirs_made` blocks not left yet: what a process that ends at once
# (`os._exit`: a torchrun rank stopped while its main thread is blocked in C++) takes away first
OPEN_RUN_DIRS: list[list[Made]] = []


def remove_unused_now() -> None:
    """`remove_unused` of every run dir listed so far, for a process about to end at once
    without unwinding (`os._exit`): a torchrun rank stopped (SIGTERM) or ended by its watch
    thread left its run dir holding only hydra's .hydra and run.log."""
    for made in list(OPEN_RUN_DIRS):
        remove_unused(made)


def _writes_run_dir() -> bool:
    """Does this process write its run dir? Under torchrun only rank 0 does; the other ranks
    run the command into the same dir and must not wait on rank 0's lock (rank 0 would wait
    for them to join its process group)."""
    if "RANK" not in os.environ:
        return True
    from experiments.common.launch_line import launch_ranks

    ranks = launch_ranks()
    return ranks is None or ranks[0] == 0


def remove_unused(made: list[Made]) -> None:
    """The run dirs `run_dirs_made` listed, gone where hydra made them and they hold only what
    hydra put there (.hydra, a log file), with their folders made for them that are empty then;
    in a dir that was there before, the .hydra and log files that were not."""
    for out, top, before in made:
        hydras = [p for p in _listed(out) if p.name == HYDRA or p.suffix == ".log"]
        if top is None:
            for p in hydras:
                if p.name in before:
                    continue
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
            continue
        if out.is_dir() and len(hydras) == len([p for p in _listed(out) if p.name != LOCK]):
            shutil.rmtree(out, ignore_errors=True)
        for folder in (out, *out.parents):
            try:
                folder.rmdir()
            except OSError:  # not empty, or not there
                if folder.exists():
                    break
            if folder == top:
                break


def _listed(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:  # not there (any more), or not a folder
        return []
