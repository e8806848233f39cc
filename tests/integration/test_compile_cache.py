"""An interrupted run never poisons the next one's compile cache (tests/compile_cache.py, which
conftest.py applies to every test session)."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.slow

# One session as conftest.py runs it: begin, compile (graph `scale`), commit.
SESSION = f"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, {str(REPO / "tests")!r})
from compile_cache import SessionCache

cache = SessionCache(Path(sys.argv[1]))
cache.begin()
print("compiling into", cache.work, flush=True)
scale = float(sys.argv[2])
assert torch.compile(lambda x: torch.sin(x) * scale + x.cos())(torch.ones(64)).allclose(
    torch.sin(torch.ones(64)) * scale + torch.ones(64).cos())
cache.commit()
print("committed", flush=True)
"""


def session(cache, scale: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SESSION, str(cache), str(scale)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def written_since(root, since: float) -> bool:
    """Whether inductor has written generated code or a library into `root` after `since`."""
    for path in root.rglob("*"):
        try:
            if path.suffix in (".so", ".cpp") and path.stat().st_mtime > since:
                return True
        except OSError:  # a temporary file renamed while we looked
            pass
    return False


def test_a_session_killed_while_compiling_leaves_the_cache_as_it_was(tmp_path):
    cache = tmp_path / "inductor"
    first = session(cache, 2.0)
    assert "committed" in first.communicate(timeout=300)[0]
    before, first_done = files(cache), time.time()
    assert any(name.endswith(".so") for name in before)  # a compiled library, as make test leaves

    killed = session(cache, 3.0)
    work = next(Path(line.split("compiling into ")[1].strip()) for line in killed.stdout if "compiling into" in line)
    while not written_since(work, first_done):
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)  # mid-compile: inductor is writing into the session's copy
    killed.wait(timeout=60)
    assert files(cache) == before
    for library in work.rglob("*.so"):  # the worst a kill can leave behind: truncated libraries
        library.write_bytes(library.read_bytes()[:100])

    again = session(cache, 3.0)  # the same graph again, as the rerun of the killed run would
    out = again.communicate(timeout=300)[0]
    assert again.returncode == 0 and "committed" in out, out
    assert not work.exists()  # the dead session's copy is gone
