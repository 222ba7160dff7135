"""Output files: checked at start-up, written whole or not at all.

``check_output_file`` / ``check_output_dir`` run before any work, so a typo in a path fails in a
second, naming the flag, instead of after a long replay. ``write_lines`` writes a regular file
through a temporary file in the same directory and renames it into place at the end: a full disk,
a crash or a kill never leaves a torn line or a half-written file under the final name. Special
files (``/dev/stdout``, a pipe, a device) cannot be renamed onto; they get whole lines, in order,
and an error says how many lines are complete. Torch-free.
"""
from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import Iterable


class OutputError(ValueError):
    """An output path is unusable or a write failed; the message names the flag and the path."""


def _reason(exc: OSError) -> str:
    return exc.strerror or errno.errorcode.get(exc.errno or 0, type(exc).__name__)


def _is_special(p: Path) -> bool:
    try:
        mode = os.stat(p).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def check_output_file(path: str, flag: str) -> None:
    """Refuse, naming ``flag``, an output file path that cannot be written at the end: a missing
    parent directory, a directory, an unwritable file, or a directory where no file can be
    created. Probes for real (creates and removes a temporary file), so it holds for root too."""
    if not path:
        raise OutputError(f"{flag}: empty path")
    p = Path(path)
    parent = p.parent
    if p.is_dir():
        raise OutputError(f"{flag} {path!r} is a directory; give the path of a file")
    if not parent.exists():
        raise OutputError(f"{flag} {path!r}: directory {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise OutputError(f"{flag} {path!r}: {str(parent)!r} is not a directory")
    if _is_special(p):
        try:
            os.close(os.open(p, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # a pipe nobody reads yet is fine
                raise OutputError(f"{flag} {path!r} cannot be written: {_reason(exc)}") from None
        return
    if p.exists():
        try:
            os.close(os.open(p, os.O_WRONLY | os.O_APPEND))  # no truncation, no write
        except OSError as exc:
            raise OutputError(f"{flag} {path!r} is not writable: {_reason(exc)}") from None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=parent)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise OutputError(f"{flag} {path!r}: cannot create files in {str(parent)!r}: "
                          f"{_reason(exc)}") from None


def check_output_dir(path: str, flag: str) -> None:
    """Refuse, naming ``flag``, a path that is a file or where files cannot be created; create
    the directory (and its parents) when it does not exist yet."""
    if not path:
        raise OutputError(f"{flag}: empty path")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputError(f"{flag} {path!r} is a file, not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{flag} {path!r}: cannot create the directory: {_reason(exc)}") from None
    check_output_file(str(p / "probe"), flag)


def write_lines(path: str, lines: Iterable[str], flag: str) -> int:
    """Write ``lines`` (each without its newline) to ``path``; return how many were written.

    A regular file (or a new one) is replaced atomically: on any error it is left as it was and
    the temporary file is removed. A special file gets whole lines. Errors are ``OutputError``
    naming ``flag``, the path, the reason and how many lines are complete.
    """
    data = [line + "\n" for line in lines]
    p = Path(path)
    if _is_special(p):
        return _write_special(p, data, flag)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    except OSError as exc:
        raise OutputError(f"{flag} {path!r}: cannot create a file in {str(p.parent)!r} "
                          f"({_reason(exc)}); nothing was written") from None
    done = 0
    try:
        try:
            done = _write_all(fd, data)
            os.fsync(fd)
            os.fchmod(fd, _mode_for(p))
        finally:
            os.close(fd)
        os.replace(tmp, p)
    except _PartialWrite as exc:
        _remove(tmp)
        raise OutputError(f"{flag} {path!r}: write failed with {exc.done} of {len(data)} lines "
                          f"complete ({_reason(exc.cause)}); {path!r} was left as it was (no "
                          f"partial file)") from None
    except OSError as exc:
        _remove(tmp)
        raise OutputError(f"{flag} {path!r}: write failed with {done} of {len(data)} lines "
                          f"complete ({_reason(exc)}); {path!r} was left as it was (no partial "
                          f"file)") from None
    except BaseException:  # interrupted: the final name keeps its old content, the temp goes
        _remove(tmp)
        raise
    _sync_dir(p.parent)
    return done


class _PartialWrite(Exception):
    def __init__(self, done: int, cause: OSError) -> None:
        super().__init__(str(cause))
        self.done = done
        self.cause = cause


def _write_all(fd: int, data: list[str], chunk_bytes: int = 1 << 16) -> int:
    """Write whole lines in chunks through ``os.write``; return the lines written, or raise
    ``_PartialWrite`` with the number of lines that are complete."""
    encoded = [line.encode() for line in data]
    i = 0
    while i < len(encoded):
        j, size = i, 0
        while j < len(encoded) and (j == i or size + len(encoded[j]) <= chunk_bytes):
            size += len(encoded[j])
            j += 1
        buf = b"".join(encoded[i:j])
        written = 0
        try:
            while written < len(buf):
                written += os.write(fd, buf[written:])
        except OSError as exc:
            raise _PartialWrite(i + _lines_in(encoded[i:j], written), exc) from None
        i = j
    return len(encoded)


def _lines_in(lines: list[bytes], nbytes: int) -> int:
    """How many of ``lines`` fit completely in the first ``nbytes`` bytes."""
    n = 0
    for line in lines:
        if len(line) > nbytes:
            break
        nbytes -= len(line)
        n += 1
    return n


def _write_special(p: Path, data: list[str], flag: str) -> int:
    try:
        fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    except OSError as exc:
        raise OutputError(f"{flag} {str(p)!r} cannot be opened: {_reason(exc)}") from None
    try:
        return _write_all(fd, data)
    except _PartialWrite as exc:
        raise OutputError(f"{flag} {str(p)!r}: write failed with {exc.done} of {len(data)} "
                          f"lines complete ({_reason(exc.cause)})") from None
    finally:
        os.close(fd)


def _mode_for(p: Path) -> int:
    """The mode an ordinary ``open(p, 'w')`` would give: the old file's, or 0o666 less umask."""
    try:
        return stat.S_IMODE(os.stat(p).st_mode)
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def _remove(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except OSError:
        pass


def _sync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
