"""Run train.py's main on a list of bad inputs in one torchrun launch, each case's stderr of each
rank captured in its own file: what a user would see from `torchrun ... train.py` for each input,
at the cost of one launch instead of one per case.

    torchrun --nproc_per_node 2 tests/errors_worker.py CASES.json OUT_DIR

CASES.json maps a case name to train.py's arguments; OUT_DIR gets <case>.rank<r>.txt. Each case
forms its process group on a store of its own (the groups of a second init_process_group on one
store would find the first one's keys): rank 0 serves it on a port the kernel picks (port 0, so no
other process can take it first) and hands the port to the other ranks through torchrun's store;
every rank of the case then joins it as torchrun's workers join torchrun's.
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train  # noqa: E402  (the repository root, as torchrun runs train.py)
import sft.errors  # noqa: E402
from sft.errors import run_command  # noqa: E402

# One process runs every case, so no rank's exit can cut rank 0's line short: no grace to wait.
sft.errors.SHARED_ERROR_GRACE_S = 0.0


def main() -> None:
    cases, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    rank, world, stderr = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.dup(2)
    launcher = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                             timeout=timedelta(seconds=60))
    for index, (name, argv) in enumerate(cases.items()):
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False) if rank == 0 else None
        if rank == 0:
            launcher.set(f"errors_worker/{index}", str(store.port))
        port = launcher.get(f"errors_worker/{index}").decode()
        os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        with open(out / f"{name}.rank{rank}.txt", "w") as capture:
            sys.stderr.flush()
            os.dup2(capture.fileno(), 2)  # the whole fd: Python, the libraries' loggers and C alike
            try:
                run_command(lambda argv=argv: train.main(argv), end_process=False)
            except SystemExit:
                pass
            finally:
                sys.stderr.flush()
                os.dup2(stderr, 2)
        if dist.is_initialized():  # a failed start leaves its process group; the next case makes its own
            dist.destroy_process_group()
        launcher.set(f"errors_worker/{index}/done/{rank}", "1")  # rank 0's store lives until every rank is done
        for other in range(world):
            launcher.get(f"errors_worker/{index}/done/{other}")


if __name__ == "__main__":
    run_command(main)
