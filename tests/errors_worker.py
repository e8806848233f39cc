"""Run train.py's main on a list of bad inputs in one torchrun launch, each case's stderr of each
rank captured in its own file: what a user would see from `torchrun ... train.py` for each input,
at the cost of one launch instead of one per case.

    torchrun --nproc_per_node 2 tests/errors_worker.py CASES.json OUT_DIR PORT

CASES.json maps a case name to train.py's arguments; OUT_DIR gets <case>.rank<r>.txt. Each case
forms its process group on a store of its own (rank 0 serves it on PORT + the case's index): the
groups of a second init_process_group on torchrun's own store would find the first one's keys.
"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train  # noqa: E402  (the repository root, as torchrun runs train.py)
import sft.config  # noqa: E402
from sft.config import run_command  # noqa: E402

# One process runs every case, so no rank's exit can cut rank 0's line short: no grace to wait.
sft.config.SHARED_ERROR_GRACE_S = 0.0


def main() -> None:
    cases, out, port = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]), int(sys.argv[3])
    rank, stderr = os.environ["RANK"], os.dup(2)
    for index, (name, argv) in enumerate(cases.items()):
        os.environ.update(TORCHELASTIC_USE_AGENT_STORE="False", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port + index))
        with open(out / f"{name}.rank{rank}.txt", "w") as capture:
            sys.stderr.flush()
            os.dup2(capture.fileno(), 2)  # the whole fd: Python, the libraries' loggers and C alike
            try:
                run_command(lambda: train.main(argv))
            except SystemExit:
                pass
            finally:
                sys.stderr.flush()
                os.dup2(stderr, 2)
        if dist.is_initialized():  # a failed start leaves its process group; the next case makes its own
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
