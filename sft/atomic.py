"""Durable, atomic writes: a file or directory either exists complete or not at all.

Every write that matters (checkpoints, `latest`, the prepared-model cache, exports, markers)
goes through here: write to a temporary name, fsync the data, rename, fsync the parent
directory. Without the fsyncs a node crash shortly after the rename can leave an empty or
truncated file under the final name, which is exactly what a resume must never find.

Permissions follow the process umask (0644-style under the usual 022): some writers
(safetensors since 0.4) create 0600 files, which a colleague in the same cluster group could
not read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_durable(tree: Path) -> None:
    """Give every file and directory under `tree` (and `tree`) umask permissions and fsync them."""
    mask = _umask()
    for root, dirs, files in os.walk(tree):
        for name in files:
            path = Path(root, name)
            path.chmod(0o666 & ~mask)
            _fsync(path)
        for name in dirs:
            Path(root, name).chmod(0o777 & ~mask)
        _fsync(Path(root))
    tree.chmod(0o777 & ~mask)


def commit(tmp: Path, final: Path) -> None:
    """Make `tmp` (a file or a directory) durable and rename it to `final`, replacing a previous
    `final` only at that moment; then fsync the parent so the rename itself survives a crash."""
    if tmp.is_dir():
        make_durable(tmp)
    else:
        tmp.chmod(0o666 & ~_umask())
        _fsync(tmp)
    _rename(tmp, final)


def _rename(tmp: Path, final: Path) -> None:
    """Rename the durable `tmp` to `final` and fsync the parent, so the rename survives a crash."""
    if final.is_dir() and tmp.is_dir():
        # A directory cannot be renamed over a non-empty one: move the old one aside first, so
        # that at every instant one complete version exists under either name.
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync(final.parent)


def write_file(path: Path, data: str | bytes) -> None:
    """Write `path` atomically and durably."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    commit(tmp, path)


# Written first into a directory this module makes: the mark that it made it, so that a later
# write may remove what an interrupted one left (and nothing else).
PARTIAL = ".sft-partial"


class PathInTheWay(OSError):
    """The path a new directory is to take holds something this module did not write."""


@contextlib.contextmanager
def directory(final: Path) -> Iterator[Path]:
    """Yield `<final>.tmp` to write into; commit it as `final` only if the block succeeds, so an
    interrupted write never leaves a complete-looking directory behind.

    Nothing that was there before is removed or overwritten: `final` must not exist (or be an empty
    directory), else PathInTheWay; a `<final>.tmp` is removed only when an interrupted write of
    ours left it (it holds our mark), else PathInTheWay too; so is a symbolic link. A failing block
    removes its `.tmp`; the mark goes only once everything is durable, so a kill at any moment leaves
    a `.tmp` that the next write to `final` removes."""
    if final.is_symlink():
        raise PathInTheWay(f"{final} is a symbolic link")
    final = Path(os.path.abspath(final))  # `.` and `out/..` have a name only absolute
    if final.is_dir() and any(final.iterdir()) or final.exists() and not final.is_dir():
        raise PathInTheWay(f"{final} already exists" + (" and is not empty" if final.is_dir() else " (a file)"))
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists() or tmp.is_symlink():
        if not (tmp.is_dir() and (tmp / PARTIAL).is_file()):
            raise PathInTheWay(f"{tmp} already exists and was not left by an interrupted write of ours")
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / PARTIAL).touch()
    try:
        yield tmp
        make_durable(tmp)  # the slow part (a large export's writeback), while the mark still says ours
        (tmp / PARTIAL).unlink()
        _fsync(tmp)  # the mark's removal
        if final.is_dir():
            final.rmdir()  # empty (checked above): the rename takes its place
        _rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
