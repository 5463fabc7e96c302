"""Arrays from .npy files and .npz archives, read by numpy's format rules with each header
checked before its data is: a header that is no .npy header (np.load's parser raised
tokenize's and EOFError's tracebacks), a member that is not .npy at all (np.load hands back its
raw bytes), a size the header promises that the file does not hold (np.load first allocates
it: a petabyte header read as "out of memory"), or pickled objects are one `NpyError`.
"""

from __future__ import annotations

import math
import os
import zipfile
import zlib
from collections.abc import Iterable
from pathlib import Path
from tokenize import TokenError
from typing import IO

import numpy as np
from numpy.lib import format as npy_format

_HEADERS = {(1, 0): npy_format.read_array_header_1_0, (2, 0): npy_format.read_array_header_2_0}


class NpyError(ValueError):
    """What is wrong with a .npy array or an .npz archive (without its path: callers name the
    file, and the fix, in their own error)."""


def npy_array(f: IO[bytes], size: int) -> np.ndarray:
    """The array of the .npy bytes `f` holds (`size` bytes from its current position): its
    header np.save's, of a dtype of plain values, its data exactly the bytes the header says."""
    start = f.tell()
    try:
        version = npy_format.read_magic(f)
        read = _HEADERS.get(version)
        if read is None:
            raise NpyError(f".npy format version {version}, which np.save writes for no numbers")
        shape, fortran, dtype = read(f)
    except NpyError:
        raise
    except (ValueError, EOFError, SyntaxError, TypeError, TokenError) as e:
        raise NpyError(f"no .npy header ({type(e).__name__}: {str(e)[:80]})") from None
    if dtype.hasobject:
        raise NpyError("an array of Python objects (pickled), which is never unpickled")
    nbytes = math.prod(shape) * dtype.itemsize
    have = size - (f.tell() - start)
    if nbytes != have:
        raise NpyError(
            f"its header says shape {shape} of {dtype} ({nbytes} bytes), but {have} bytes follow"
        )
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if nbytes > ram // 2:  # a zip member can claim it and hold a few bytes
        raise NpyError(
            f"shape {shape} of {dtype} takes {nbytes / 2**30:.0f} GiB, over half the RAM"
        )
    data = bytearray(nbytes)
    if f.readinto(data) != nbytes:  # type: ignore[attr-defined]
        raise NpyError(f"cut short: fewer than the {nbytes} bytes of shape {shape}")
    flat = np.frombuffer(data, dtype=dtype)
    return flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)


def npz_names(path: str | Path) -> list[str]:
    """The names of the arrays an .npz archive holds."""
    try:
        with zipfile.ZipFile(path) as z:
            names = [n.removesuffix(".npy") for n in z.namelist()]
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError) as e:
        raise NpyError(f"not a readable .npz ({type(e).__name__}: {str(e)[:80]})") from None
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # np.load reads the last, as a JSON key given twice: the other is lost
        raise NpyError(f"holds array {twice[0]} twice (np.savez writes each once)")
    return names


def npz_arrays(path: str | Path, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The arrays `names` of an .npz archive (each must be there: see `npz_names`), each read
    by `npy_array`; an NpyError naming the array for a bad one."""
    out = {}
    try:
        with zipfile.ZipFile(path) as z:
            for name in names:
                # np.savez names each member NAME.npy; a member without the suffix (a zip of
                # raw bytes) is read as .npy too, and refused as none
                have = set(z.namelist())
                if f"{name}.npy" not in have and name not in have:
                    raise NpyError(f"lacks array {name}")
                info = z.getinfo(f"{name}.npy" if f"{name}.npy" in have else name)
                with z.open(info) as member:
                    try:
                        out[name] = npy_array(member, info.file_size)
                    except NpyError as e:
                        raise NpyError(f"array {name}: {e}") from None
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError) as e:
        # a CRC that fails, a compression zipfile lacks, an encrypted member
        raise NpyError(f"not a readable .npz ({type(e).__name__}: {str(e)[:80]})") from None
    return out


def npy_file(path: str | Path) -> np.ndarray:
    """The array of a .npy file (the caller has checked it is a regular file)."""
    with open(path, "rb") as f:
        return npy_array(f, os.fstat(f.fileno()).st_size)
