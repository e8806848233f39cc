import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    """The demo's synthetic chat data (small), generated once per test session."""
    out = tmp_path_factory.mktemp("demo_data")
    subprocess.run([sys.executable, str(REPO / "scripts" / "demo_data.py"), "--out", str(out),
                    "--train", "200", "--eval", "40"], check=True, capture_output=True)
    return out
