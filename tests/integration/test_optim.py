"""The lean optimizer state end to end: trains, checkpoints bf16 and resumes exactly."""


import pytest

from helpers import run_demo, train_losses


@pytest.mark.slow
def test_lean_state_trains_checkpoints_bf16_and_resumes_exactly(tmp_path, demo_data):
    """The demo on 2 ranks with bf16 moments and bf16 master weights: the loss falls; the checkpoint
    holds bf16 weights and moments (8 bytes of state per parameter, not 16), and its export loads in
    transformers; a run resumed from step 3 repeats steps 4-6 bit for bit (the stochastic
    rounding's draws are seeded by step)."""
    from transformers import AutoModelForCausalLM
    from torch.distributed.checkpoint import FileSystemReader

    lean = ("fsdp.param_dtype=bfloat16", "fsdp.reduce_dtype=bfloat16", "optim.state_dtype=bfloat16",
            "optim.master_dtype=bfloat16", "eval.every_steps=0", "train.max_steps=6", "data.eval_path=null")
    run_demo(demo_data, tmp_path, "whole", *lean, "checkpoint.every_steps=3", nproc=2)
    run_demo(demo_data, tmp_path, "resumed", *lean, f"checkpoint.resume={tmp_path / 'whole' / 'checkpoints' / 'step-3'}",
             nproc=2)
    whole, resumed = train_losses(tmp_path / "whole"), train_losses(tmp_path / "resumed")
    assert whole[6][0] < 0.9 * whole[1][0]
    assert {step: resumed[step] for step in (4, 5, 6)} == {step: whole[step] for step in (4, 5, 6)}
    stored = FileSystemReader(tmp_path / "whole" / "checkpoints" / "step-6").read_metadata().state_dict_metadata
    dtypes: dict[str, set] = {}
    for key, meta in stored.items():
        if key.startswith(("model.", "optimizer.state.")) and hasattr(meta, "properties"):
            kind = key.split(".")[-1] if key.startswith("optimizer.") else "weight"
            dtypes.setdefault(kind, set()).add(str(meta.properties.dtype))
    assert dtypes == {"weight": {"torch.bfloat16"}, "exp_avg": {"torch.bfloat16"}, "exp_avg_sq": {"torch.bfloat16"},
                      "step": {"torch.float32"}}
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "whole" / "export")
    assert sum(p.numel() for p in exported.parameters()) > 0 and not any(p.isnan().any() for p in exported.parameters())
