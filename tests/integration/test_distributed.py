"""FSDP2 on 2 gloo ranks against a single-process Hugging Face reference (fp32, tight tolerance)."""

import json
from pathlib import Path

import pytest
import torch

from helpers import (gated_deltanet_model_dir, gpt_oss_model_dir, model_dir, moe_model_dir, run_demo, run_torchrun,
                     saved_model_dir, short_convolution_model_dir, tiny_model_dir)
from sft.training.metrics import read_metrics


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("models")
    return {"tied": model_dir(tmp, tied=True), "untied": model_dir(tmp, tied=False), "moe": moe_model_dir(tmp),
            # fewer experts than ranks: expert weights sharded on their rows (Shard(1))
            "moe, 1 expert": moe_model_dir(tmp, num_experts=1, num_experts_per_tok=1), "gpt-oss": gpt_oss_model_dir(tmp),
            # Qwen3.5's Gated DeltaNet layers (state along the row) and attention: packed rows restart it per document
            "hybrid": gated_deltanet_model_dir(tmp),
            # LFM2's short convolutions between attention layers: packed rows restart them per document
            "short conv": short_convolution_model_dir(tmp),
            # a sliding window of 8 tokens (shorter than the rows) beside full attention; Gemma-2's logits soft-capped
            **{family: tiny_model_dir(tmp, f"{family}_text" if family == "gemma3" else family, sliding_window=8,
                                      layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)
               for family in ("gemma3", "gemma2")}}


def launch(out: Path, nproc: int, runs: dict[str, list[str]]) -> None:
    """One torchrun launch of tests/dist_worker.py for all `runs` (name -> flags); results in out/<name>.pt."""
    (out / f"runs-{nproc}.json").write_text(json.dumps(runs))
    run_torchrun(["tests/dist_worker.py", "--runs", str(out / f"runs-{nproc}.json"), "--out", str(out)], nproc)


def assert_grads_close(a: dict, b: dict, rtol: float, atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


# Layouts and switches that must not change the result: (name, embeddings, ranks, dist_worker
# flags, rtol and atol of the gradients), each against HF's own loss on one process for the same global
# batch with uneven supervised-token counts. fp32 everywhere except where a row says otherwise.
EQUIVALENT = [
    ("1 rank, grad-acc 4", "tied", 1, ["--grad-accum", "4"], 1e-5, 1e-7),
    ("2 ranks, grad-acc 2", "tied", 2, ["--grad-accum", "2"], 1e-5, 1e-7),
    ("2 ranks, grad-acc 2, untied", "untied", 2, ["--grad-accum", "2"], 1e-5, 1e-7),
    ("deferred gradient sync", "untied", 2, ["--grad-accum", "2", "--deferred-sync"], 1e-5, 1e-7),
    ("ZeRO-2 (reshard_after_forward=false)", "untied", 2, ["--grad-accum", "2", "--zero2"], 1e-5, 1e-7),
    ("HSDP, 2 replicas x 1 shard", "untied", 2, ["--grad-accum", "2", "--replicate", "2"], 1e-5, 1e-7),
    # MLPs 8 tokens at a time (rows of 12-47 tokens), inside checkpointed blocks: each tile rerun in backward
    ("tiled MLPs, ac 1", "untied", 2, ["--grad-accum", "2", "--mlp-tile", "8", "--ac-ratio", "1"], 1e-5, 1e-7),
    # bf16 reduce-scatter: each gradient is rounded to bf16 (8 bits of mantissa) once per reduction
    # (relative error ~2**-8; gradients near zero get the absolute tolerance).
    ("bf16 gradient reduce", "untied", 2, ["--grad-accum", "2", "--reduce-dtype", "bfloat16"], 2e-2, 1e-3),
    # Context parallelism: each row split over the cp ranks (lengths 12-47 tokens, padded to what
    # the split needs), K/V all-gathered, documents of packed rows isolated by the mask.
    ("cp 2, padded rows", "untied", 2, ["--cp", "2", "--grad-accum", "2"], 1e-5, 1e-7),
    ("cp 2, packed rows", "untied", 2, ["--cp", "2", "--grad-accum", "4", "--packed"], 1e-5, 1e-7),
    ("cp 2, tied, checkpointed and compiled blocks", "tied", 2,
     ["--cp", "2", "--grad-accum", "2", "--ac-ratio", "1", "--compile"], 1e-5, 1e-7),
    # checkpointed as plan.auto does for long rows: attention's output kept
    ("cp 2, compiled blocks, ac 1 attention", "untied", 2,
     ["--cp", "2", "--grad-accum", "2", "--ac-ratio", "1", "--ac-mode", "attention", "--compile"], 1e-5, 1e-7),
    ("cp 4, packed rows", "untied", 4, ["--cp", "4", "--grad-accum", "4", "--packed"], 1e-5, 1e-7),
    ("cp 2 x dp 2 (HSDP 2 x 2)", "untied", 4, ["--cp", "2", "--grad-accum", "2", "--replicate", "2"], 1e-5, 1e-7),
    # Gated DeltaNet packed exactly: every document restarts the recurrent state and the short convolution
    ("gated deltanet, 2 ranks, padded rows", "hybrid", 2, ["--grad-accum", "2"], 1e-5, 1e-7),
    ("gated deltanet, 2 ranks, packed rows", "hybrid", 2, ["--grad-accum", "4", "--packed"], 1e-5, 1e-7),
    ("gated deltanet, packed, checkpointed and compiled", "hybrid", 2,
     ["--grad-accum", "4", "--packed", "--ac-ratio", "1", "--compile"], 1e-5, 1e-7),
    ("short convolutions, 2 ranks, packed rows", "short conv", 2, ["--grad-accum", "4", "--packed"], 1e-5, 1e-7),
    # Context parallelism honours each layer's sliding window and soft cap across the ranks' chunks
    ("cp 2, sliding window (Gemma-3), packed rows", "gemma3", 2, ["--cp", "2", "--grad-accum", "4", "--packed"],
     1e-5, 1e-7),
    ("cp 2, sliding window and soft cap (Gemma-2)", "gemma2", 2, ["--cp", "2", "--grad-accum", "2"], 1e-5, 1e-7),
    # ... and the layers that carry state run the whole rows (their inputs gathered), restarting per document
    ("cp 2, Gated DeltaNet, packed rows", "hybrid", 2, ["--cp", "2", "--grad-accum", "4", "--packed"], 1e-5, 1e-7),
    ("cp 2, short convolutions", "short conv", 2, ["--cp", "2", "--grad-accum", "2"], 1e-5, 1e-7),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, tie, nproc, flags, rtol, atol", EQUIVALENT, ids=[row[0] for row in EQUIVALENT])
def test_fsdp_equals_single_process_reference(runs, name, tie, nproc, flags, rtol, atol):
    ref, run = runs(f"reference {tie}"), runs(name)
    assert run["loss"] == pytest.approx(ref["loss"], rel=1e-6)  # the forward is fp32 in every row
    assert run["supervised_tokens"] == ref["supervised_tokens"]  # each counted once, whatever the layout
    assert_grads_close(run["grads"], ref["grads"], rtol=rtol, atol=atol)
    ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref["grads"].values()])).item()
    assert run["grad_norm"] == pytest.approx(ref_norm, rel=rtol)
    assert run["shard_dtypes"] == ["torch.float32"] and run["moment_dtypes"] == ["torch.float32"]
    assert run["tied_after_step"] is (tie == "tied")
    assert run["tiled_mlps"] == (4 if "--mlp-tile" in flags else 0)  # the demo model's four blocks


@pytest.mark.slow
def test_logged_loss_is_layout_invariant(tmp_path, demo_data):
    """train.py end to end: (1 rank, micro 2, grad-acc 4) and (2 ranks, micro 2, grad-acc 2) log the
    same token-weighted loss and grad norm at every step, since they see the same global batches."""
    runs = {}
    for nproc, ga in ((1, 4), (2, 2)):
        name = f"r{nproc}"
        run_demo(demo_data, tmp_path, name, "train.micro_batch_size=2", f"train.grad_accum_steps={ga}",
                 "train.max_steps=4", "eval.every_steps=2", nproc=nproc)
        runs[nproc] = read_metrics(tmp_path / name)
    (train1, evals1), (train2, evals2) = runs[1], runs[2]
    assert sorted(train1) == sorted(train2) == [1, 2, 3, 4]
    for step, a in train1.items():
        b = train2[step]
        assert a["supervised_tokens"] == b["supervised_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert list(evals1) == list(evals2) == [0, 2, 4]
    assert list(evals2.values()) == pytest.approx(list(evals1.values()), rel=1e-5)


@pytest.mark.slow
def test_context_parallel_documents_do_not_see_each_other(runs):
    """cp 2, one packed row of three documents: replacing every token of the first two leaves the
    last one's loss exactly as it was; replacing one of its own input tokens changes it."""
    probe = runs("cp leakage probe")
    assert probe["earlier_changed"] == probe["base"]
    assert abs(probe["own_changed"] - probe["base"]) > 1e-3


@pytest.mark.slow
def test_bf16_mixed_precision_keeps_fp32_master_state(runs):
    ref, fp32, bf16 = runs("reference untied"), runs("baseline"), runs("bf16 compute")
    assert fp32["forward_weight_dtype"] == "torch.float32"
    assert bf16["forward_weight_dtype"] == "torch.bfloat16"  # blocks compute with bf16 weights...
    assert bf16["shard_dtypes"] == ["torch.float32"]  # ...while master weights
    assert bf16["moment_dtypes"] == ["torch.float32"]  # and both Adam moments stay fp32
    # bf16 compute on a random tiny model: loss within 1% of fp32 (measured ~1e-3).
    assert bf16["loss"] == pytest.approx(ref["loss"], rel=1e-2)
    assert bf16["loss"] != fp32["loss"]


# Activation checkpointing must not change a single bit: (name, the AC flags, the flags of the run
# and of its baseline without AC). Recomputed ops run the same kernels on the same inputs.
AC_EQUAL_TO_NONE = [
    ("blocks, ratio 0.5", ["--ac-ratio", "0.5"], []),
    ("blocks, ratio 0.5, inputs in host memory", ["--ac-ratio", "0.5", "--ac-offload"], []),
    ("blocks, ratio 1", ["--ac-ratio", "1"], []),
    ("ops, ratio 0.5", ["--ac-ratio", "0.5", "--ac-mode", "ops"], []),
    ("ops, ratio 1", ["--ac-ratio", "1", "--ac-mode", "ops"], []),
    ("ops_half, ratio 1", ["--ac-ratio", "1", "--ac-mode", "ops_half"], []),
    ("attention, ratio 1", ["--ac-ratio", "1", "--ac-mode", "attention"], []),
    ("ops, ratio 1, float8 tensorwise", ["--ac-ratio", "1", "--ac-mode", "ops"],
     ["--float8", "tensorwise", "--param-dtype", "bfloat16"]),
    ("ops_half, ratio 1, float8 tensorwise", ["--ac-ratio", "1", "--ac-mode", "ops_half"],
     ["--float8", "tensorwise", "--param-dtype", "bfloat16"]),
    # Compiled, a checkpointed block's backward is fused with its recomputation, so its float32 sums
    # differ from the unchecked block's in the last bits (~1e-7; test_compiled_blocks_match_eager
    # bounds that); whether the matmuls were kept or recomputed, or the inputs waited in host memory
    # (ac.offload), must not change a bit.
    ("compiled: ops as blocks", ["--ac-mode", "ops"], ["--compile", "--ac-ratio", "1"]),
    ("compiled: ops_half as blocks", ["--ac-mode", "ops_half"], ["--compile", "--ac-ratio", "1"]),
    ("compiled: attention as blocks, inputs in host memory", ["--ac-mode", "attention", "--ac-offload"],
     ["--compile", "--ac-ratio", "1"]),
    ("compiled float8: ops as blocks", ["--ac-mode", "ops"],
     ["--compile", "--ac-ratio", "1", "--float8", "tensorwise", "--param-dtype", "bfloat16"]),
]


def baseline(flags: list[str]) -> str:
    """The run a row of AC_EQUAL_TO_NONE is compared with: its flags, without the row's AC flags."""
    return "baseline" + "".join(f" {flag}" for flag in flags)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, models):
    """Every run of this module's tables, in one launch per world size (a table of assertions over
    their outputs): the single-process references, the layouts of EQUIVALENT, each row of
    AC_EQUAL_TO_NONE and its baseline, bf16 compute, and compiled blocks. Fresh
    state per run (seed, compile caches); every run uses the same global batch."""
    out = tmp_path_factory.mktemp("runs")
    model = {tie: ["--model", str(path)] for tie, path in models.items()}
    launches = {1: {f"reference {tie}": [*model[tie], "--reference", *(["--attn", "eager"] if "gemma" in tie else [])]
                    for tie in ("tied", "untied", "hybrid", "short conv", "gemma3", "gemma2")}, 4: {},
                2: {"bf16 compute": [*model["untied"], "--param-dtype", "bfloat16"],
                    "compiled, ratio 0.5": [*model["untied"], "--ac-ratio", "0.5", "--compile"],
                    "cp leakage probe": [*model["untied"], "--cp", "2", "--leakage-probe"]}}
    for name, tie, nproc, flags, *_ in EQUIVALENT:
        launches[nproc][name] = [*model[tie], *flags]
    for name, moe, nproc, flags in MOE_RUNS:
        launches[nproc][name] = [*model[moe], *(flag.replace("{out}", str(out)) for flag in flags)]
    for name, nproc, flags, *_ in LORA_RUNS + QLORA_RUNS + FLOAT8_LORA_RUNS:
        launches[nproc][name] = [*model["untied"], *flags]
    for name, moe, nproc, flags in EXPERT_LORA_RUNS:
        launches[nproc][name] = [*model[moe], *flags]
    for name, ac_flags, flags in AC_EQUAL_TO_NONE:
        launches[2][baseline(flags)] = [*model["untied"], *flags]
        launches[2][name] = [*model["untied"], *flags, *ac_flags]
    for nproc, runs_of_launch in launches.items():
        launch(out, nproc, runs_of_launch)
    return lambda name: torch.load(out / f"{name}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("name, ac_flags, flags", AC_EQUAL_TO_NONE, ids=[row[0] for row in AC_EQUAL_TO_NONE])
def test_activation_checkpointing_gradients_are_bitwise_equal(runs, name, ac_flags, flags):
    plain, ac = runs(baseline(flags)), runs(name)
    # ac.offload: every checkpointed block wrapped (the tiny model has 4; ratio 0.5 checkpoints 2)
    offloaded = 0 if "--ac-offload" not in ac_flags else 2 if "0.5" in ac_flags else 4
    assert ac["host_offloaded_blocks"] == offloaded
    assert ac["loss"] == plain["loss"]
    for param in plain["grads"]:
        assert torch.equal(ac["grads"][param], plain["grads"][param]), param


@pytest.mark.slow
def test_expert_parallel_rank_whose_experts_get_no_row_takes_part(runs):
    """Every row of both ranks routed to rank 0's experts: rank 1 receives nothing yet takes part in
    both all-to-alls; outputs and expert gradients equal the experts computed where the rows are
    (rank 1's gradients are zeros, not missing)."""
    probe = runs("ep: one rank's experts get no row")
    assert probe["received_rows"] == [24, 0]
    assert probe["max_output_error"] < 1e-6 and probe["max_grad_error"] < 1e-5
    assert probe["rank1_grad_abs_sum"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("saver, loader", [("ep 2 saves its state", "ep 1 loads it"),
                                           ("cp 2 x ep 2 saves its state", "cp 1 loads it")], ids=["ep", "cp x ep"])
def test_state_saved_at_ep_2_loads_bit_exact_at_ep_1(runs, saver, loader):
    """Checkpoints are not tied to the ep or cp degree: the model and optimizer state a run at ep 2
    (or cp 2 x ep 2) saves (experts sharded over ep and again by FSDP) is, loaded by a run without
    expert or context parallelism, every tensor bit for bit."""
    saved, loaded = runs(saver)["state"], runs(loader)["state"]
    assert saved.keys() == loaded.keys() and any(".experts." in key for key in saved)
    assert any(key.endswith("exp_avg_sq") for key in saved)
    for key in saved:
        assert torch.equal(saved[key], loaded[key]), key


# Mixture of experts (tiny Qwen3-MoE, 8 experts, top 2): (name, model, ranks, dist_worker flags). The
# references are Hugging Face's model (its per-expert loop, its load_balancing_loss_func with padding
# masked) on the same micro-batches of 2 samples (tests/dist_worker.py:moe_reference).
MOE_RUNS = [
    ("moe reference", "moe", 1, ["--reference", "--micro-batch", "2"]),
    ("moe 1 rank, grad-acc 4", "moe", 1, ["--grad-accum", "4"]),
    ("moe 2 ranks, grad-acc 2", "moe", 2, ["--grad-accum", "2"]),
    ("moe packed rows", "moe", 2, ["--grad-accum", "2", "--packed"]),
    ("moe blocks, ratio 1", "moe", 2, ["--grad-accum", "2", "--ac-ratio", "1"]),
    ("moe ops_half, ratio 1", "moe", 2, ["--grad-accum", "2", "--ac-ratio", "1", "--ac-mode", "ops_half"]),
    ("moe 1 expert reference", "moe, 1 expert", 1, ["--reference", "--micro-batch", "2"]),
    ("moe 1 expert, 2 ranks", "moe, 1 expert", 2, ["--grad-accum", "2"]),
    # gpt-oss: transposed experts, interleaved gate/up, biases, attention sinks (eager attention)
    ("gpt-oss reference", "gpt-oss", 1, ["--reference", "--micro-batch", "2", "--attn", "eager"]),
    ("gpt-oss 2 ranks, grad-acc 2", "gpt-oss", 2, ["--grad-accum", "2", "--attn", "eager"]),
    # its masks (window, full) built by the loss from the packed positions (sft/models/packing.py: Packing.masks)
    ("gpt-oss packed rows", "gpt-oss", 2, ["--grad-accum", "2", "--attn", "eager", "--packed"]),
    # Expert parallelism: 4 of the 8 experts per rank, rows sent across (sft/parallel/expert_parallel.py)
    ("moe ep 2", "moe", 2, ["--grad-accum", "2", "--ep", "2"]),
    ("moe ep 2, packed rows", "moe", 2, ["--grad-accum", "2", "--ep", "2", "--packed"]),
    ("moe ep 2, ops_half, ratio 1", "moe", 2, ["--grad-accum", "2", "--ep", "2", "--ac-ratio", "1",
                                               "--ac-mode", "ops_half"]),
    ("moe ep 2, blocks, ratio 1", "moe", 2, ["--grad-accum", "2", "--ep", "2", "--ac-ratio", "1"]),
    # each ep rank's 4 experts FSDP-sharded over 2 ranks; checkpointed: the dispatch as one op (its
    # backward accumulates into FSDP's gathered weights)
    ("moe ep 2 x fsdp 2", "moe", 4, ["--ep", "2", "--ac-ratio", "1"]),
    ("moe ep 4", "moe", 4, ["--ep", "4"]),
    ("gpt-oss ep 2", "gpt-oss", 2, ["--grad-accum", "2", "--attn", "eager", "--ep", "2"]),
    # Context parallelism: each row split over the cp ranks; the aux term counts the whole rows
    ("moe cp 2", "moe", 2, ["--grad-accum", "4", "--cp", "2"]),
    ("moe cp 2 x ep 2, packed rows", "moe", 2, ["--grad-accum", "4", "--cp", "2", "--ep", "2", "--packed"]),
    ("moe cp 4, packed rows", "moe", 4, ["--grad-accum", "4", "--cp", "4", "--packed"]),
    ("gpt-oss cp 2", "gpt-oss", 2, ["--grad-accum", "4", "--attn", "eager", "--cp", "2"]),  # the window, the sinks
    ("ep: one rank's experts get no row", "moe", 2, ["--empty-experts-probe"]),
    # The state after a step at ep 2, saved with DCP, then loaded by a run at ep 1 (after its own step)
    ("ep 2 saves its state", "moe", 2, ["--grad-accum", "2", "--ep", "2", "--save-state", "{out}/ep2-state"]),
    ("ep 1 loads it", "moe", 2, ["--grad-accum", "2", "--load-state", "{out}/ep2-state"]),
    # ... and by a run at cp 2 x ep 2 (each row split, its experts spread), loaded by one at cp 1, ep 1
    ("cp 2 x ep 2 saves its state", "moe", 2, ["--grad-accum", "4", "--cp", "2", "--ep", "2",
                                               "--save-state", "{out}/cp2-state"]),
    ("cp 1 loads it", "moe", 2, ["--grad-accum", "2", "--load-state", "{out}/cp2-state"]),
]


# (reference, run). The gradients' atol is 1e-6, not the dense rows' 1e-7: gradients summed over every
# token (embeddings, biases) reach their sums in another order than Hugging Face's per-expert loop and
# differ by up to ~2e-7 in float32 (seen on an embedding row and a gpt-oss attention bias); rtol stays 1e-5.
MOE_EQUIVALENT = [("moe reference", "moe 1 rank, grad-acc 4"), ("moe reference", "moe 2 ranks, grad-acc 2"),
                  ("moe reference", "moe packed rows"), ("moe 1 expert reference", "moe 1 expert, 2 ranks"),
                  ("gpt-oss reference", "gpt-oss 2 ranks, grad-acc 2"), ("gpt-oss reference", "gpt-oss packed rows"),
                  ("moe reference", "moe ep 2"),
                  ("moe reference", "moe ep 2, packed rows"), ("moe reference", "moe ep 2 x fsdp 2"),
                  ("moe reference", "moe ep 4"), ("gpt-oss reference", "gpt-oss ep 2"), ("moe reference", "moe cp 2"),
                  ("moe reference", "moe cp 2 x ep 2, packed rows"), ("moe reference", "moe cp 4, packed rows"),
                  ("gpt-oss reference", "gpt-oss cp 2")]


@pytest.mark.slow
@pytest.mark.parametrize("reference, name", MOE_EQUIVALENT, ids=[row[1] for row in MOE_EQUIVALENT])
def test_moe_equals_hf_reference(runs, reference, name):
    """Loss, load-balancing loss, gradients and grad norm of FSDP2 with our grouped experts equal
    Hugging Face's eager MoE: padding is not in the aux term, packed rows count each document's
    tokens as padded rows do, and the aux term's gradient flows (the router's gradient has it)."""
    ref, run = runs(reference), runs(name)
    assert run["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert run["aux_loss"] == pytest.approx(ref["aux_loss"], rel=1e-5)
    assert_grads_close(run["grads"], ref["grads"], rtol=1e-5, atol=1e-6)
    ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref["grads"].values()])).item()
    assert run["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)


@pytest.mark.slow
def test_expert_weights_shard_over_experts_or_their_rows(runs):
    """8 experts on 2 ranks: 4 experts each (Shard(0)); 1 expert on 2 ranks: half its rows each
    (Shard(1)). Expert parallelism: sharded by expert over the ep ranks (the second axis), each ep
    rank's experts sharded again over the ranks orthogonal to it (the first); where ep spans every
    rank, whole on their ep ranks, outside FSDP (the ep mesh alone)."""
    assert runs("moe 2 ranks, grad-acc 2")["expert_placements"] == ["('dp_shard_cp',): (Shard(dim=0),)"]
    assert runs("moe 1 expert, 2 ranks")["expert_placements"] == ["('dp_shard_cp',): (Shard(dim=1),)"]
    assert runs("moe ep 2 x fsdp 2")["expert_placements"] == [
        "('efsdp', 'ep'): (_StridedShard(dim=0, sf=2), Shard(dim=0))"]
    for ep in ("moe ep 2", "moe ep 4"):
        assert runs(ep)["expert_placements"] == ["('ep',): (Shard(dim=0),)"], ep


@pytest.mark.slow
def test_moe_aux_loss_is_layout_invariant(runs):
    """(1 rank, grad-acc 4), (2 ranks, grad-acc 2), the ep degrees 2 and 4 and the cp degrees 2 and 4 on
    one global batch: the same aux loss and grad norm (no factor of world size, grad-accum steps, ep
    or cp degree)."""
    one = runs("moe 1 rank, grad-acc 4")
    assert one["aux_loss"] > 0
    for name in ("moe 2 ranks, grad-acc 2", "moe ep 2", "moe ep 2 x fsdp 2", "moe ep 4", "moe cp 2",
                 "moe cp 2 x ep 2, packed rows", "moe cp 4, packed rows"):
        assert runs(name)["aux_loss"] == pytest.approx(one["aux_loss"], rel=1e-6), name
        assert runs(name)["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5), name  # float32 sums in another order


@pytest.mark.slow
@pytest.mark.parametrize("plain, name", [("moe 2 ranks, grad-acc 2", "moe blocks, ratio 1"),
                                         ("moe 2 ranks, grad-acc 2", "moe ops_half, ratio 1"),
                                         ("moe ep 2", "moe ep 2, blocks, ratio 1"),
                                         ("moe ep 2", "moe ep 2, ops_half, ratio 1")])
def test_moe_recompute_routes_as_forward(runs, plain, name):
    """Checkpointed blocks reuse the forward's routing (under expert parallelism too, where
    recomputation sends the rows again through an FSDP unit of experts inside the block): bitwise
    the gradients without checkpointing."""
    plain, ac = runs(plain), runs(name)
    assert ac["loss"] == plain["loss"] and ac["aux_loss"] == plain["aux_loss"]
    for param in plain["grads"]:
        assert torch.equal(ac["grads"][param], plain["grads"][param]), param


# LoRA (rank 4 on every Linear of the blocks, the adapters set to non-zero values) against Hugging
# Face's model with each target weight replaced by the merged W + alpha/r B A, A and B leaves of
# autograd (tests/dist_worker.py:lora_reference): (name, ranks, dist_worker flags, rtol of the loss and
# the adapters' gradients). fp32.
LORA_RUNS = [
    ("lora reference", 1, ["--reference", "--lora-rank", "4"], None),
    ("lora 1 rank, grad-acc 4", 1, ["--lora-rank", "4", "--grad-accum", "4"], 1e-5),
    ("lora 2 ranks, grad-acc 2", 2, ["--lora-rank", "4", "--grad-accum", "2"], 1e-5),
    ("lora 2 ranks, blocks checkpointed at op level", 2,
     ["--lora-rank", "4", "--grad-accum", "2", "--ac-ratio", "1", "--ac-mode", "ops_half"], 1e-5),
    ("lora cp 2, packed rows", 2, ["--lora-rank", "4", "--cp", "2", "--grad-accum", "4", "--packed"], 1e-5),
    ("lora HSDP, 2 replicas", 2, ["--lora-rank", "4", "--grad-accum", "2", "--replicate", "2"], 1e-5),
]


# LoRA on the routed experts too (their fused weights, one adapter per expert, on grouped GEMMs), against
# the reference merging each expert's weight and running Hugging Face's per-expert loop: (name, model,
# ranks, flags). The load-balancing loss off: Hugging Face's loss is the cross-entropy alone.
EXPERT_LORA = ["--lora-rank", "4", "--lora-targets", "all-linear,experts", "--aux-coef", "0"]
EXPERT_LORA_RUNS = [
    ("expert lora reference", "moe", 1, ["--reference", *EXPERT_LORA]),
    ("expert lora 2 ranks, grad-acc 2", "moe", 2, [*EXPERT_LORA, "--grad-accum", "2"]),
    ("expert lora 2 ranks, packed, ops_half", "moe", 2,
     [*EXPERT_LORA, "--grad-accum", "2", "--packed", "--ac-ratio", "1", "--ac-mode", "ops_half"]),
    ("expert lora, 1 expert reference", "moe, 1 expert", 1, ["--reference", *EXPERT_LORA]),
    ("expert lora, 1 expert, 2 ranks", "moe, 1 expert", 2, [*EXPERT_LORA, "--grad-accum", "2"]),
    ("gpt-oss expert lora reference", "gpt-oss", 1, ["--reference", *EXPERT_LORA, "--attn", "eager"]),
    ("gpt-oss expert lora 2 ranks", "gpt-oss", 2, [*EXPERT_LORA, "--grad-accum", "2", "--attn", "eager"]),
    # expert parallelism: the adapters sharded by expert with their weights
    ("expert lora ep 2", "moe", 2, [*EXPERT_LORA, "--grad-accum", "2", "--ep", "2", "--ac-ratio", "1"]),  # one op
    # ... on the experts alone: nothing before the first block's experts needs a gradient
    ("experts-only lora ep 2", "moe", 2, [*EXPERT_LORA[:2], "--lora-targets", "experts", *EXPERT_LORA[4:], "--ep", "2"]),
    ("experts-only lora ep 2, ratio 1", "moe", 2,
     [*EXPERT_LORA[:2], "--lora-targets", "experts", *EXPERT_LORA[4:], "--ep", "2", "--ac-ratio", "1"]),
    # QLoRA: the experts' base in NF4 too, whole on every rank, dequantised in forward and backward
    ("expert qlora reference", "moe", 1, ["--reference", *EXPERT_LORA, "--lora-base", "nf4"]),
    ("expert qlora 2 ranks, blocks checkpointed", "moe", 2,
     [*EXPERT_LORA, "--lora-base", "nf4", "--grad-accum", "2", "--ac-ratio", "1"]),
]
EXPERT_LORA_EQUIVALENT = [("expert lora reference", "expert lora 2 ranks, grad-acc 2"),
                          ("expert lora reference", "expert lora 2 ranks, packed, ops_half"),
                          ("expert lora, 1 expert reference", "expert lora, 1 expert, 2 ranks"),
                          ("gpt-oss expert lora reference", "gpt-oss expert lora 2 ranks"),
                          ("expert lora reference", "expert lora ep 2"),
                          ("expert qlora reference", "expert qlora 2 ranks, blocks checkpointed")]


@pytest.mark.slow
def test_adapters_on_the_experts_alone_train_in_checkpointed_blocks_under_expert_parallelism(runs):
    """LoRA on the experts alone (router and attention frozen): the first block's experts get no
    input that needs a gradient, so there the one op, which carries gradients through its inputs,
    gives way to the eager dispatch; every adapter's gradient, the first block's too, is bitwise the
    uncheckpointed run's."""
    plain, checkpointed = runs("experts-only lora ep 2"), runs("experts-only lora ep 2, ratio 1")
    assert checkpointed["loss"] == plain["loss"]
    first = [name for name in plain["grads"] if "layers.0." in name]
    assert first and all(plain["grads"][name].abs().sum() > 0 for name in first)
    assert plain["grads"].keys() == checkpointed["grads"].keys()
    for name, grad in plain["grads"].items():
        assert torch.equal(checkpointed["grads"][name], grad), name


@pytest.mark.slow
@pytest.mark.parametrize("reference, name", EXPERT_LORA_EQUIVALENT, ids=[row[1] for row in EXPERT_LORA_EQUIVALENT])
def test_lora_on_routed_experts_equals_the_merged_weight_reference(runs, reference, name):
    """Adapters on every Linear and on each expert of the fused expert weights (gpt-oss: transposed,
    biased; one expert: sharded on its rows): loss and every adapter's gradient those of the merged
    weights through Hugging Face's per-expert loop; only adapters train."""
    ref, run = runs(reference), runs(name)
    assert run["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert {n for n in ref["grads"] if "_lora." in n} and run["grads"].keys() == ref["grads"].keys()
    assert_grads_close(run["grads"], ref["grads"], rtol=1e-5, atol=1e-6)  # atol: MOE_EQUIVALENT's
    assert run["frozen_with_grads"] == [] and run["optimizer_state_of_frozen"] == []
    if "ep 2" in name:  # each ep rank holds its experts whole: FSDP leaves their frozen weights on the ep mesh
        assert "('ep',): (Shard(dim=0),)" in run["expert_placements"], run["expert_placements"]
    if "qlora" in name:  # every expert weight in NF4 (the attention's too, where it splits into NF4 groups)
        assert sorted({n for n in run["nf4_weights"] if ".experts." in n}) == sorted(
            f"model.layers.{i}.mlp.experts.{w}" for i in range(4) for w in ("gate_up_proj", "down_proj"))
        assert run["loss"] != pytest.approx(runs("expert lora reference")["loss"], rel=1e-4)  # NF4 changed the base


QLORA = ["--lora-rank", "4", "--lora-base", "nf4"]


QLORA_RUNS = [
    ("qlora reference", 1, ["--reference", *QLORA], None),
    ("qlora 1 rank", 1, [*QLORA, "--grad-accum", "2"], 1e-5),
    ("qlora 2 ranks, blocks checkpointed", 2, [*QLORA, "--grad-accum", "2", "--ac-ratio", "1"], 1e-5),
    # half the blocks at op level, half not: the compiled NF4 layer dequantises again in the backward
    ("qlora 2 ranks, compiled", 2,
     [*QLORA, "--grad-accum", "2", "--compile", "--exact-casts", "--ac-ratio", "0.5", "--ac-mode", "ops_half"], 1e-5),
]


# LoRA in bf16, and with its frozen base's matmuls in float8 (precision.float8; CPUs run float8
# matmuls too): (name, ranks, flags). Every run has the same micro-batches.
LORA_BF16 = ["--lora-rank", "4", "--param-dtype", "bfloat16"]


FLOAT8_LORA_RUNS = [
    ("lora bf16", 2, [*LORA_BF16, "--grad-accum", "2"]),
    ("lora float8 tensorwise, 1 rank", 1, [*LORA_BF16, "--grad-accum", "4", "--float8", "tensorwise"]),
    ("lora float8 tensorwise, 2 ranks", 2, [*LORA_BF16, "--grad-accum", "2", "--float8", "tensorwise"]),
] + ([  # before torch 2.13 the CPU's float8 matmul takes one scale per tensor only
    ("lora float8 rowwise, 2 ranks, half the blocks at op level", 2,
     [*LORA_BF16, "--grad-accum", "2", "--float8", "rowwise", "--ac-ratio", "0.5", "--ac-mode", "ops_half"]),
] if torch.__version__ >= "2.13" else [])


@pytest.mark.slow
@pytest.mark.parametrize("name, rtol", [(row[0], row[3]) for row in LORA_RUNS[1:]], ids=[row[0] for row in LORA_RUNS[1:]])
def test_lora_equals_the_merged_weight_reference(runs, name, rtol):
    """The adapters' forward and gradients are those of the merged weights, in every layout: only the
    adapters get gradients, each counted once."""
    ref, run = runs("lora reference"), runs(name)
    assert run["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert run["supervised_tokens"] == ref["supervised_tokens"]
    assert_grads_close(run["grads"], ref["grads"], rtol=rtol, atol=1e-7)  # the merge sums in another order
    assert run["frozen_with_grads"] == [] and run["optimizer_state_of_frozen"] == []


@pytest.mark.slow
@pytest.mark.parametrize("name, rtol", [(row[0], row[3]) for row in QLORA_RUNS[1:]], ids=[row[0] for row in QLORA_RUNS[1:]])
def test_qlora_equals_the_reference_on_nf4_weights(runs, name, rtol):
    """QLoRA: the adapters train as on the NF4 round trip of the base weights (every rank holds the
    NF4 weights whole; FSDP shards the rest), with one rank or two."""
    ref, run = runs("qlora reference"), runs(name)
    # the demo model's q/o/gate/up/down weights split into NF4 groups; k/v (64 x 128) do not
    assert sorted({n.split(".")[-2] for n in run["nf4_weights"]}) == ["down_proj", "gate_proj", "o_proj", "q_proj", "up_proj"]
    assert len(run["nf4_weights"]) == 5 * 4
    assert run["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert run["loss"] != pytest.approx(runs("lora reference")["loss"], rel=1e-4)  # NF4 changed the base
    assert_grads_close(run["grads"], ref["grads"], rtol=rtol, atol=1e-7)
    assert run["frozen_with_grads"] == [] and run["optimizer_state_of_frozen"] == []


@pytest.mark.slow
def test_lora_keeps_the_frozen_base_in_bf16_without_gradients_or_state(runs):
    """bf16 compute: the frozen base is stored in bf16 (no float32 copy), gets no gradient and no
    AdamW state; the adapters keep float32 masters and moments."""
    run = runs("lora bf16")
    assert run["frozen_shard_dtypes"] == ["torch.bfloat16"]
    assert run["shard_dtypes"] == ["torch.float32"] and run["moment_dtypes"] == ["torch.float32"]
    assert run["frozen_with_grads"] == [] and run["optimizer_state_of_frozen"] == []
    assert run["grads"] and all(".lora_" in name for name in run["grads"])


@pytest.mark.slow
@pytest.mark.parametrize("name", [row[0] for row in FLOAT8_LORA_RUNS[1:]])
def test_lora_with_float8_base_matmuls_is_close_to_bf16_and_layout_free(runs, name):
    """Float8 base matmuls change the numbers a little (the loss by 4e-4 here; the adapters' gradients,
    which pass the float8 backward of every block above, by 11% on average: e4m3 keeps 3 bits of
    mantissa, e5m2 2), the same on 1 and 2 ranks; the adapters alone still get gradients."""
    bf16, run = runs("lora bf16"), runs(name)
    assert run["loss"] == pytest.approx(bf16["loss"], rel=1e-3) and run["loss"] != bf16["loss"]
    assert run["grads"].keys() == bf16["grads"].keys() and all(".lora_" in key for key in run["grads"])
    errors = {key: float((run["grads"][key] - bf16["grads"][key]).norm() / bf16["grads"][key].norm())
              for key in bf16["grads"]}
    assert 0 < max(errors.values()) < 0.2 and sum(errors.values()) / len(errors) < 0.13, errors
    assert run["frozen_with_grads"] == [] and run["optimizer_state_of_frozen"] == []
    if name.startswith("lora float8 tensorwise, 2"):  # the scales of a micro-batch do not depend on the layout
        one_rank = runs("lora float8 tensorwise, 1 rank")
        assert run["loss"] == pytest.approx(one_rank["loss"], rel=1e-6)
        assert_grads_close(run["grads"], one_rank["grads"], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_compiled_blocks_match_eager(runs):
    eager, compiled = runs("blocks, ratio 0.5"), runs("compiled, ratio 0.5")
    assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-5)
    assert_grads_close(compiled["grads"], eager["grads"], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_loading_an_hf_checkpoint_is_exact_and_sharded(tmp_path):
    """A checkpoint written by transformers' own save_pretrained (fp32, ~500 MB) loads through the
    sharded path: every gathered tensor equals the file, the tie survives, and each rank's host
    memory grows by about its half of the model, not a full copy."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = model_dir(tmp_path, tied=True, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source)).save_pretrained(source)
    full_gib = sum(f.stat().st_size for f in source.glob("*.safetensors")) / 2**30
    launch(tmp_path, 2, {"load": ["--model", str(source), "--load", str(source)]})
    run = torch.load(tmp_path / "load.pt")
    assert run["load_mismatches"] == []
    assert run["tied_after_load"] and run["tied_after_step"]
    assert full_gib > 0.4
    for increase in run["load_rss_increase_gib"]:
        assert increase < 0.7 * full_gib, (run["load_rss_increase_gib"], full_gib)


def test_a_published_layout_loads_sharded_as_transformers_loads_it(tmp_path):
    """Kimi-Linear as transformers saves it (its q/k/v convolutions apart, its sparse blocks under
    block_sparse_moe, one tensor per expert) loads on 2 ranks, each reading its slices through
    transformers' conversions (a rank's half of the concatenated convolution spans two of the files'
    tensors): every gathered parameter equals transformers' own from_pretrained."""
    directory = saved_model_dir(tmp_path, "kimi_linear", layer_types=["linear_attention", "full_attention"],
                                num_key_value_heads=4, linear_num_heads=2, linear_head_dim=16)
    launch(tmp_path, 2, {"load": ["--model", str(directory), "--load", str(directory)]})
    assert torch.load(tmp_path / "load.pt")["load_mismatches"] == []
