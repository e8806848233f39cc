"""slurm/train.slurm in a fake Slurm: the exact torchrun command, the requeue path, loopback refusal."""

import os
import subprocess

import pytest

from helpers import REPO

SHIMS = {
    "scontrol": """#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then printf 'node1\\nnode2\\n'; else echo "scontrol $*" >> "$SHIM_LOG"; fi
""",
    "getent": """#!/bin/bash
[ -n "$FAKE_HEAD_ADDR" ] || exit 2  # unknown host: no output, exit 2, as getent does
echo "${FAKE_HEAD_ADDR} $2"
""",
    # Records its arguments; in a "preemption" it makes Slurm's USR1 reach the batch script,
    # then waits for the script to forward the signal, as the real srun passes it to torchrun.
    "srun": """#!/bin/bash
echo "srun $*" >> "$SHIM_LOG"
if [ -n "${FAKE_PREEMPT:-}" ]; then
  trap 'echo "srun got USR1" >> "$SHIM_LOG"; exit 1' USR1
  kill -USR1 "$PPID"
  for i in $(seq 100); do sleep 0.1; done
  echo "srun was never signalled" >> "$SHIM_LOG"
fi
exit "${FAKE_EXIT:-0}"
""",
}


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in SHIMS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SHIM_LOG": str(log),
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "12345",
           "SLURM_GPUS_ON_NODE": "4", "FAKE_HEAD_ADDR": "10.0.0.1"}
    return env, log


def sbatch(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "slurm/train.slurm", "configs/demo.yaml", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


EXPECTED = ("srun --ntasks-per-node=1 --kill-on-bad-exit=1 torchrun --nnodes 2 --nproc_per_node 4 "
            "--rdzv_backend c10d --rdzv_endpoint 10.0.0.1:32345 --rdzv_id 12345 "
            "--signals-to-handle SIGTERM,SIGINT,SIGUSR1 train.py --config configs/demo.yaml optim.lr=2e-5")


def test_one_torchrun_per_node_with_c10d_rendezvous_on_the_head(fake_slurm):
    env, log = fake_slurm
    proc = sbatch(env, "optim.lr=2e-5")
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines() == [EXPECTED]
    dry = sbatch({**env, "SFT_DRY_RUN": "1"}, "optim.lr=2e-5")
    assert dry.stdout.strip().splitlines()[-1] == EXPECTED


def test_container_prefix_goes_between_srun_and_torchrun(fake_slurm):
    env, log = fake_slurm
    sbatch({**env, "SFT_PREFIX": "apptainer exec --nv sft.sif"})
    assert "--kill-on-bad-exit=1 apptainer exec --nv sft.sif torchrun --nnodes 2" in log.read_text()


def test_time_limit_signal_is_forwarded_and_the_job_requeued(fake_slurm):
    env, log = fake_slurm
    proc = sbatch({**env, "FAKE_PREEMPT": "1"})
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines()[1:] == ["srun got USR1", "scontrol requeue 12345"]
    assert "received SIGUSR1" in proc.stdout


def test_failure_without_a_signal_is_not_requeued(fake_slurm):
    env, log = fake_slurm
    proc = sbatch({**env, "FAKE_EXIT": "3"})
    assert proc.returncode == 3
    assert "requeue" not in log.read_text()


@pytest.mark.parametrize("addr", ["127.0.1.1", ""])
def test_loopback_or_unresolved_head_fails_fast(fake_slurm, addr):
    env, log = fake_slurm
    proc = sbatch({**env, "FAKE_HEAD_ADDR": addr})
    assert proc.returncode == 2
    assert "head node 'node1' resolves to" in proc.stderr
    assert not log.exists()  # nothing was launched
