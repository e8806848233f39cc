"""slurm/train.slurm in a fake Slurm: the exact torchrun command, the requeue path, loopback refusal.

Slow tier: each sbatch runs the script, which starts a Python to resolve the run directory."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.slow

SHIMS = {
    "scontrol": """#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then printf 'node1\\nnode2\\n'; else echo "scontrol $*" >> "$SHIM_LOG"; fi
""",
    "getent": """#!/bin/bash
[ -n "$FAKE_HEAD_ADDR" ] || exit 2  # unknown host: no output, exit 2, as getent does
echo "${FAKE_HEAD_ADDR} $2"
""",
    # Records its arguments. In a "preemption" it makes Slurm's USR1 reach the batch script, then
    # plays the workers: once the script has written the stop request, they commit a checkpoint and
    # write the `stopped` marker (FAKE_COMMIT=1) or crash; torchrun exits 1 either way.
    "srun": """#!/bin/bash
echo "srun $*" >> "$SHIM_LOG"
if [ -n "${FAKE_PREEMPT:-}" ]; then
  kill -USR1 "$PPID"
  for i in $(seq 100); do [ -f "$FAKE_RUN_DIR/stop-request" ] && break; sleep 0.1; done
  [ -f "$FAKE_RUN_DIR/stop-request" ] && echo "workers saw the stop request" >> "$SHIM_LOG"
  [ -n "${FAKE_COMMIT:-}" ] && echo '{"step": 7}' > "$FAKE_RUN_DIR/stopped"
  exit 1
fi
exit "${FAKE_EXIT:-0}"
""",
}


@pytest.fixture
def fake_slurm(tmp_path, demo_data):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in SHIMS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    # `python` on the PATH is the one running the tests (the script resolves the run directory with it).
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SHIM_LOG": str(log), "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[1-2]",
           "SLURM_JOB_ID": "12345", "SLURM_GPUS_ON_NODE": "4", "FAKE_HEAD_ADDR": "10.0.0.1",
           "FAKE_RUN_DIR": str(tmp_path / "demo"), "DEMO_DATA": str(demo_data)}
    return env, log, tmp_path


def overrides(env: dict, out) -> list[str]:
    data = Path(env["DEMO_DATA"])
    return [f"data.path={data / 'train.jsonl'}", f"data.eval_path={data / 'eval.jsonl'}", f"train.output_dir={out}"]


def sbatch(env: dict, out, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "slurm/train.slurm", "configs/demo.yaml", *overrides(env, out), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def expected(env: dict, out) -> str:
    return ("srun --ntasks-per-node=1 --kill-on-bad-exit=1 torchrun --nnodes 2 --nproc_per_node 4 "
            "--rdzv_backend c10d --rdzv_endpoint 10.0.0.1:32345 --rdzv_id 12345 "
            f"--signals-to-handle SIGTERM,SIGINT,SIGUSR1 train.py --config configs/demo.yaml "
            f"{' '.join(overrides(env, out))} optim.lr=2e-3")


def test_one_torchrun_per_node_with_c10d_rendezvous_on_the_head(fake_slurm):
    env, log, out = fake_slurm
    proc = sbatch(env, out, "optim.lr=2e-3")
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines() == [expected(env, out)]
    assert f"run {out / 'demo'}" in proc.stdout
    dry = sbatch({**env, "SFT_DRY_RUN": "1"}, out, "optim.lr=2e-3")
    assert dry.stdout.strip().splitlines()[-1] == expected(env, out)
    shared = sbatch({**env, "SFT_DRY_RUN": "1", "SFT_COMPILE_CACHE": "/shared/compile"}, out, "optim.lr=2e-3")
    # before the command line's overrides, which win over it
    assert shared.stdout.strip().splitlines()[-1] == expected(env, out).replace(
        "--config configs/demo.yaml ", "--config configs/demo.yaml compile.cache_dir=/shared/compile ")


def test_container_prefix_goes_between_srun_and_torchrun(fake_slurm):
    env, log, out = fake_slurm
    sbatch({**env, "SFT_PREFIX": "env"}, out)  # `env` runs its argument, like a container would
    assert "--kill-on-bad-exit=1 env torchrun --nnodes 2" in log.read_text()


def test_signal_then_committed_stop_is_requeued(fake_slurm):
    env, log, out = fake_slurm
    proc = sbatch({**env, "FAKE_PREEMPT": "1", "FAKE_COMMIT": "1"}, out)
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines()[1:] == ["workers saw the stop request", "scontrol requeue 12345"]
    assert "received SIGUSR1" in proc.stdout and "requeueing job 12345" in proc.stdout


def test_signal_then_crash_is_not_requeued(fake_slurm):
    """A run that fails after the signal (a full disk during the stop-save, say) must not loop."""
    env, log, out = fake_slurm
    (out / "demo").mkdir()
    (out / "demo" / "stopped").write_text('{"step": 3}')  # an earlier job's marker: older than this job
    proc = sbatch({**env, "FAKE_PREEMPT": "1"}, out)
    assert proc.returncode == 1
    assert "requeue" not in log.read_text()


def test_failure_without_a_signal_is_not_requeued(fake_slurm):
    env, log, out = fake_slurm
    proc = sbatch({**env, "FAKE_EXIT": "3"}, out)
    assert proc.returncode == 3
    assert "requeue" not in log.read_text()


def test_a_bad_config_fails_before_anything_is_launched(fake_slurm):
    env, log, out = fake_slurm
    proc = sbatch(env, out, "ac.ratio=2")
    assert proc.returncode == 2 and "ac.ratio=2.0: must be in [0, 1]" in proc.stderr
    assert not log.exists()


@pytest.mark.parametrize("addr", ["127.0.1.1", ""])
def test_loopback_or_unresolved_head_fails_fast(fake_slurm, addr):
    env, log, out = fake_slurm
    proc = sbatch({**env, "FAKE_HEAD_ADDR": addr}, out)
    assert proc.returncode == 2
    assert "head node 'node1' resolves to" in proc.stderr
    assert not log.exists()  # nothing was launched


TWO_NODE_SRUN = """#!/bin/bash
# srun --ntasks-per-node=1 on a 2-node allocation: the command once per node, here twice on this host.
while [[ "$1" == --* ]]; do shift; done
"$@" > "$SHIM_LOG.node0" 2>&1 &
first=$!
"$@" > "$SHIM_LOG.node1" 2>&1 &
second=$!
wait $first; a=$?; wait $second; b=$?
exit $(( a > b ? a : b ))
"""


def test_two_nodes_on_one_host_train_like_two_local_ranks(fake_slurm):
    """slurm/train.slurm really launching two torchrun "nodes" (one rank each) with the c10d
    rendezvous on the first: the losses equal a single-node 2-rank run's."""
    import socket

    from helpers import run_demo, train_losses

    env, log, out = fake_slurm
    (out / "bin" / "srun").write_text(TWO_NODE_SRUN)
    host = socket.gethostname()  # what getent answers: the script accepts it, torchrun knows it as itself
    two_nodes = {**env, "FAKE_HEAD_ADDR": host, "SLURM_GPUS_ON_NODE": "1", "OMP_NUM_THREADS": "1",
                 "HF_HUB_OFFLINE": "1", "SLURM_JOB_ID": str(10000 + os.getpid() % 10000)}
    steps = ["train.max_steps=4", "eval.every_steps=0", "checkpoint.enabled=false", "checkpoint.export_hf=false"]
    proc = sbatch(two_nodes, out, *steps)
    logs = "".join(p.read_text() for p in out.glob("log.node*"))
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    assert "2 nodes x 1 GPUs" in proc.stdout
    data = Path(env["DEMO_DATA"])
    run_demo(data, out / "local", "demo", *steps, nproc=2)
    assert train_losses(out / "demo") == train_losses(out / "local" / "demo")
