"""Context parallelism on 2 GPUs against one process of transformers: tiny Gemma-3 (a sliding window
of 8 tokens, packed rows), Gemma-2 (and a soft cap) and gpt-oss (and attention sinks), eager and
compiled blocks, through tests/dist_worker.py (NCCL where there are GPUs). Prints each run's loss
beside the reference's and the largest gradient difference relative to its tensor's largest entry.

    python scripts/cp_gpu_check.py        # on a machine with 2 GPUs (carry the .whl wheels, as bench_gpu.sh)
"""

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import gpt_oss_model_dir, run_torchrun, tiny_model_dir  # noqa: E402

out = Path(tempfile.mkdtemp())
gemma = {family: ["--model", str(tiny_model_dir(out, f"{family}_text" if family == "gemma3" else family,
                                                 sliding_window=8, tie_word_embeddings=False,
                                                 layer_types=["sliding_attention", "full_attention"]))]
         for family in ("gemma3", "gemma2")}
oss = ["--model", str(gpt_oss_model_dir(out)), "--attn", "eager"]
RUNS = {1: {"reference gemma3": [*gemma["gemma3"], "--reference", "--attn", "eager"],
            "reference gemma2": [*gemma["gemma2"], "--reference", "--attn", "eager"],
            "reference gpt-oss": [*oss, "--reference", "--micro-batch", "2"]},
        2: {"gemma3 cp 2, packed": [*gemma["gemma3"], "--cp", "2", "--grad-accum", "4", "--packed"],
            "gemma3 cp 2, packed, compiled, ac 1": [*gemma["gemma3"], "--cp", "2", "--grad-accum", "4", "--packed",
                                                    "--compile", "--ac-ratio", "1"],
            "gemma2 cp 2": [*gemma["gemma2"], "--cp", "2", "--grad-accum", "2"],
            "gemma2 cp 2, compiled": [*gemma["gemma2"], "--cp", "2", "--grad-accum", "2", "--compile"],
            "gpt-oss cp 2": [*oss, "--cp", "2", "--grad-accum", "4"],
            "gpt-oss cp 2, compiled": [*oss, "--cp", "2", "--grad-accum", "4", "--compile"]}}
for nproc, runs in RUNS.items():
    (out / f"runs-{nproc}.json").write_text(json.dumps(runs))
    run_torchrun(["tests/dist_worker.py", "--runs", str(out / f"runs-{nproc}.json"), "--out", str(out)], nproc)
for name in RUNS[2]:
    reference = torch.load(out / f"reference {name.split(' cp')[0]}.pt")
    run = torch.load(out / f"{name}.pt")
    assert run["grads"].keys() == reference["grads"].keys()
    worst = max(((run["grads"][k] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
                for k, g in reference["grads"].items())
    print(f"{name}: loss {run['loss']:.7f} (reference {reference['loss']:.7f}), gradients within {worst:.1e}")
