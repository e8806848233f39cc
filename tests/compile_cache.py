"""The compile cache of a test session: a copy of the persistent one, put back only when the
session ends without being interrupted.

inductor writes compiled libraries into its cache in place. A run killed while it writes one (a
Ctrl-C during `make test`) left a truncated `.so` in the persistent cache, and every later compile
of that graph failed (`ImportError: ... file too short`) until someone deleted the cache by hand.
So a session compiles into its own copy, and the copy replaces the persistent cache only once the
session has ended normally (failed tests included: what they compiled is sound); a session that is
interrupted or killed leaves the persistent cache as it found it. The price is copying the cache
(tens of MB) at the start and renaming it at the end; the alternative, looking for truncated
artefacts before each run, would have to know every file format inductor writes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path


class SessionCache:
    def __init__(self, persistent: Path):
        self.persistent = persistent
        self.work = persistent.with_name(f"{persistent.name}.session-{os.getpid()}")

    def begin(self) -> None:
        """Copy the persistent cache for this session and point inductor (and every process the
        session starts) at the copy; drop what sessions that died left behind."""
        with self._locked():  # sessions running side by side copy and commit one at a time
            for leftover in self.persistent.parent.glob(f"{self.persistent.name}.*-*"):
                if leftover.is_dir() and not _alive(int(leftover.name.rsplit("-", 1)[1])):
                    shutil.rmtree(leftover, ignore_errors=True)
            if self.persistent.is_dir():
                shutil.copytree(self.persistent, self.work, symlinks=True)
            else:
                self.work.mkdir(parents=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.work)

    def commit(self) -> None:
        """Make this session's copy the persistent cache (two renames: at every moment one complete
        cache exists under the persistent name or beside it)."""
        with self._locked():
            old = self.persistent.with_name(f"{self.persistent.name}.old-{os.getpid()}")
            if self.persistent.exists():
                os.replace(self.persistent, old)
            os.replace(self.work, self.persistent)
            shutil.rmtree(old, ignore_errors=True)

    @contextlib.contextmanager
    def _locked(self):
        self.persistent.parent.mkdir(parents=True, exist_ok=True)
        with open(self.persistent.with_name(f"{self.persistent.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def discard(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
