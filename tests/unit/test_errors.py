"""How an entry point ends (sft.errors.run_command)."""

import subprocess
import sys

from helpers import REPO

# A process whose exit aborts after the interpreter's teardown, where the C++ libraries' static
# destructors run: as torch's and gloo's did now and then after a finished 2-rank run (issue #56:
# 'terminate called without an active exception', exit -6).
ABORTS_AT_EXIT = """
import atexit, ctypes, sys
from sft.errors import run_command

libc = ctypes.CDLL(None)
libc.__cxa_atexit(libc.abort, None, None)  # as a C++ static object registers its destructor
atexit.register(lambda: open(sys.argv[2], "w").write("ran"))
run_command(lambda: 3, end_process=sys.argv[1] == "end")
"""


def test_a_command_that_returned_ends_with_its_status_before_the_interpreter_s_teardown(tmp_path):
    """run_command ends the process once main has returned: its status, Python's atexit handlers run
    (the run directory's lock is released there), and no teardown that could turn it into an abort."""
    def launch(mode: str) -> tuple[int, bool]:
        marker = tmp_path / mode
        proc = subprocess.run([sys.executable, "-c", ABORTS_AT_EXIT, mode, str(marker)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        return proc.returncode, marker.exists()

    assert launch("teardown") == (-6, True)  # the hazard is real: SystemExit, then the teardown aborts
    assert launch("end") == (3, True)
