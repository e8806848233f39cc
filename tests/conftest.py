import os

# Tests are offline (set before huggingface_hub is imported: it reads the variable once).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import importlib.util
from pathlib import Path

import pytest

from compile_cache import SessionCache
from helpers import REPO

# Compiled blocks are cached across sessions (where the Makefile puts them, also for a plain pytest);
# each session compiles into a copy that replaces the cache only if the session was not interrupted.
_compile_cache = SessionCache(Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or Path(
    os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sft" / "inductor"))


def pytest_collection_modifyitems(items):
    """The integration folder is the slow tier: every test there launches a process of its own."""
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.slow)


def pytest_sessionstart(session):
    _compile_cache.begin()


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        _compile_cache.discard()
    else:
        _compile_cache.commit()


def _demo_data(out: Path, *args: str) -> Path:
    """scripts/demo_data.py run in this process with `args`, into `out`."""
    spec = importlib.util.spec_from_file_location("demo_data", REPO / "scripts" / "demo_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--out", str(out), "--train", "200", "--eval", "40", *args])
    return out


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    """The demo's synthetic chat data (small), generated once per test session (in this process, as
    `python scripts/demo_data.py --train 200 --eval 40` would)."""
    return _demo_data(tmp_path_factory.mktemp("demo_data"))


@pytest.fixture(scope="session")
def image_data(tmp_path_factory) -> Path:
    """The demo's questions about pictures (`scripts/demo_data.py --images`), 64 train and 16 eval
    conversations, once per session."""
    return _demo_data(tmp_path_factory.mktemp("image_data"), "--images", "--train", "64", "--eval", "16")
