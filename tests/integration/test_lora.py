"""LoRA end to end on the CPU (configs/demo_lora.yaml on the demo data, a saved random base): the
checkpoints hold only what trains and a resumed run reproduces the uninterrupted one bit for bit,
also on another number of ranks; the exported adapter is PEFT's format, loads onto its base with
nothing else, merges into a plain model with the same logits, and chats. The math against a
plain-torch reference in every layout: tests/integration/test_distributed.py (LORA_RUNS); the settings that do
not fit: tests/unit/test_config.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from helpers import REPO, eval_losses, run_cli, run_demo, train_losses


CONFIG = "configs/demo_lora.yaml"


def lora(data, out, name, *overrides, nproc=2):
    """6 steps of configs/demo_lora.yaml on `out`/base; half the blocks checkpointed (wrapped), half not."""
    return run_demo(data, out, name, f"model.name_or_path={out / 'base'}", "train.max_steps=6", "ac.ratio=0.5",
                    "checkpoint.every_steps=2", "eval.every_steps=0", "train.micro_batch_size=4", *overrides,
                    nproc=nproc, config=CONFIG)


def peft_loads_the_merged_model(checkpoint, adapter, merged, base, capsys) -> None:
    """`checkpoint` exported merged into `merged` (float32) gives the logits PEFT gives with the exported
    `adapter` on its base (nothing else named), and not the base's: the adapter changed the model."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    from sft.export import main as export

    status, _, err = run_cli(export, [str(checkpoint), str(merged), "--merge", "--dtype", "float32"], capsys)
    assert status == 0, err
    ids = torch.randint(3, 800, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        peft_logits = AutoPeftModelForCausalLM.from_pretrained(adapter)(input_ids=ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(merged)(input_ids=ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(base)(input_ids=ids).logits
    torch.testing.assert_close(merged_logits, peft_logits, rtol=1e-4, atol=1e-4)
    assert (merged_logits - base_logits).abs().max() > 0.1


@pytest.fixture(scope="module")
def continuous(tmp_path_factory, demo_data):
    """The frozen base as `make demo-lora` writes it, and 6 uninterrupted steps on 2 ranks with a
    checkpoint every 2 and the adapter exported in float32."""
    out = tmp_path_factory.mktemp("lora")
    subprocess.run([sys.executable, "scripts/save_random_checkpoint.py", "configs/demo/model", str(out / "base"),
                    "--dtype", "float32", "--device", "cpu"], cwd=REPO, check=True, capture_output=True)
    lora(demo_data, out, "continuous", "eval.every_steps=3")
    return out


@pytest.mark.slow
def test_checkpoints_hold_only_what_trains_and_resume_bit_for_bit(continuous, demo_data):
    step4 = continuous / "continuous" / "checkpoints" / "step-4"
    saved = {key for key in dcp.FileSystemReader(str(step4)).read_metadata().state_dict_metadata
             if key.startswith("model.")}
    assert saved and all(".lora_A." in key or ".lora_B." in key or key == "model.model.embed_tokens.weight"
                         for key in saved), sorted(saved)[:5]
    # every adapter, of the checkpointed blocks too
    layers = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
    assert saved == {f"model.model.layers.{i}.{part}.{name}.lora_{ab}.weight" for i in range(4)
                     for part, names in layers.items() for name in names for ab in "AB"} | {"model.model.embed_tokens.weight"}
    assert sum(f.stat().st_size for f in step4.glob("*.distcp")) < 4 * 2**20  # the 0.9M-parameter base is not there
    target = continuous / "resumed" / "checkpoints"
    target.mkdir(parents=True)
    shutil.copytree(step4, target / "step-4")
    proc = lora(demo_data, continuous, "resumed")
    assert "loaded weights from" in proc.stdout and f"resumed from {target / 'step-4'} (step 4" in proc.stdout
    reference = train_losses(continuous / "continuous")
    assert train_losses(continuous / "resumed") == {5: reference[5], 6: reference[6]}


@pytest.mark.slow
def test_a_lora_checkpoint_resumes_on_another_number_of_ranks(continuous, demo_data):
    target = continuous / "one_rank" / "checkpoints"
    target.mkdir(parents=True)
    shutil.copytree(continuous / "continuous" / "checkpoints" / "step-4", target / "step-4")
    lora(demo_data, continuous, "one_rank", "train.grad_accum_steps=2", nproc=1)  # the same global batch
    reference = train_losses(continuous / "continuous")
    for step, (loss, norm) in train_losses(continuous / "one_rank").items():
        assert loss == pytest.approx(reference[step][0], rel=1e-5)
        assert norm == pytest.approx(reference[step][1], rel=1e-4)


@pytest.mark.slow
def test_the_adapter_loads_with_peft_onto_its_base_and_merges(continuous, demo_data, capsys):
    """PEFT reads the adapter with nothing but its directory (the base is the one adapter_config.json
    names); its logits are the merged export's; the model learnt (its eval loss is the run's)."""
    from sft.chat import main as chat

    adapter = continuous / "continuous" / "export"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(continuous / "base")
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 16, 32.0)
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                "v_proj"]
    merged = continuous / "merged"
    peft_loads_the_merged_model(continuous / "continuous" / "checkpoints" / "step-6", adapter, merged,
                                continuous / "base", capsys)

    assert eval_losses(continuous / "continuous")[-1] < 0.9 * eval_losses(continuous / "continuous")[0]
    status, answer, err = run_cli(chat, [str(adapter), "--prompt", "Spell the word 'rocket'.", "--max-new-tokens", "8"],
                                  capsys)
    status2, merged_answer, _ = run_cli(chat, [str(merged), "--prompt", "Spell the word 'rocket'.",
                                               "--max-new-tokens", "8"], capsys)
    assert status == status2 == 0 and answer == merged_answer and answer.strip(), err


@pytest.mark.slow
def test_qlora_trains_on_nf4_weights_and_resumes_bit_for_bit(continuous, demo_data):
    """lora.base=nf4 through train.py: the adapted layers' weights that split into NF4 groups are
    4-bit (k/v of the demo model, 64 x 128, stay bfloat16), and a run resumed from its checkpoint,
    which reloads and re-quantises the base, continues exactly."""
    nf4 = ["lora.base=nf4", "train.max_steps=4"]
    proc = lora(demo_data, continuous, "qlora", *nf4)
    assert "base weights of the adapted layers in NF4 but k_proj, v_proj, which do not split" in proc.stdout
    target = continuous / "qlora_resumed" / "checkpoints"
    target.mkdir(parents=True)
    shutil.copytree(continuous / "qlora" / "checkpoints" / "step-2", target / "step-2")
    lora(demo_data, continuous, "qlora_resumed", *nf4)
    reference = train_losses(continuous / "qlora")
    assert train_losses(continuous / "qlora_resumed") == {3: reference[3], 4: reference[4]}
    assert reference[1][0] != pytest.approx(train_losses(continuous / "continuous")[1][0], rel=1e-4)  # NF4, not bf16


@pytest.mark.slow  # compiles (no process of its own)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_nf4_layer_keeps_no_bf16_weight_for_its_backward(compiled):
    """QLoRA's point is that the base is 4-bit: what a layer saves for its backward holds no
    dequantised bf16 weight (compiled, the partitioner would keep one unless it is recomputed)."""
    from torch import nn

    from sft.adapters.lora import LoRALinear
    from sft.models.nf4 import quantized

    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(512, 1024, bias=False, dtype=torch.bfloat16), rank=4, scaling=2.0, dropout=0.0)
    layer.weight = quantized(layer.weight.detach())
    layer.to(torch.bfloat16)
    forward = torch.compile(layer) if compiled else layer
    saved = []

    def keep(tensor):
        saved.append(tensor)
        return tensor

    x = torch.randn(2, 8, 512, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        forward(x).sum().backward()
    dense = [tuple(t.shape) for t in saved if type(t) is torch.Tensor and t.numel() >= 1024 * 512]
    assert dense == [], dense
    assert x.grad is not None and layer.lora_A.weight.grad is not None and layer.weight.grad is None


@pytest.mark.slow
def test_a_resume_onto_another_base_or_scale_is_refused_unless_asked(continuous, demo_data, tmp_path, monkeypatch,
                                                                      capsys):
    """Each checkpoint records the base it was trained on (its absolute path, a fingerprint of its
    weights) and the adapters' rank and alpha. Another base (the same files with other weights) or
    another lora.alpha is one line naming both and the override; the override resumes, with a word."""
    step4 = continuous / "continuous" / "checkpoints" / "step-4"
    recorded = json.loads((step4 / "train_state.json").read_text())["lora"]
    assert recorded["base"] == str(continuous / "base") and recorded["weights"].startswith("weights-sha256:")
    assert (recorded["rank"], recorded["alpha"]) == (16, 32.0)
    other = tmp_path / "base"
    subprocess.run([sys.executable, "scripts/save_random_checkpoint.py", "configs/demo/model", str(other),
                    "--dtype", "float32", "--device", "cpu", "--seed", "1"], cwd=REPO, check=True, capture_output=True)
    cases = {
        "another base": ([f"model.name_or_path={other}"],
                         f"base {continuous / 'base'} ({recorded['weights']}) -> {other} (weights-sha256:"),
        "another alpha": (["lora.alpha=8"], "lora.alpha 32.0 -> 8.0): resume with the base and lora.alpha it was "
                                            "trained with, start fresh with checkpoint.resume=none, or set "
                                            "lora.allow_resume_change=true"),
        "another rank": (["lora.rank=8"], "holds rank-16 adapters on down_proj, gate_proj, k_proj, o_proj, q_proj, "
                                          "up_proj, v_proj, this run asks for rank 8 on down_proj, gate_proj, k_proj, "
                                          "o_proj, q_proj, up_proj, v_proj: set lora.rank and lora.target_modules"),
    }
    for case, (overrides, said) in cases.items():
        proc = run_demo(demo_data, tmp_path, case.replace(" ", "_"), f"model.name_or_path={continuous / 'base'}",
                        f"checkpoint.resume={step4}", "train.max_steps=6", *overrides, nproc=2, config=CONFIG,
                        check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
        assert proc.returncode != 0 and len(errors) == 1 and said in errors[0], (case, proc.stderr[-3000:])
        assert 'train.py", line' not in proc.stderr  # no traceback through train.py (torchrun's own says it failed)
    proc = run_demo(demo_data, tmp_path, "allowed", f"model.name_or_path={other}", f"checkpoint.resume={step4}",
                    "train.max_steps=5", "lora.allow_resume_change=true", "eval.every_steps=0", nproc=1, config=CONFIG)
    assert f"warning: resuming {step4} with base {continuous / 'base'}" in proc.stdout
    # The export names its base absolutely, from any directory; --merge works from there too.
    from sft.export import main as export

    saved = tmp_path / "allowed" / "checkpoints" / "step-5"
    assert json.loads((saved / "train_state.json").read_text())["lora"]["base"] == str(other)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for argv in ([str(saved), "adapter"], [str(saved), "merged", "--merge"]):
        status, _, err = run_cli(export, argv, capsys)
        assert status == 0, err
    written = json.loads((elsewhere / "adapter" / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == str(other)
    assert written["sft_base_weights"] == json.loads((saved / "train_state.json").read_text())["lora"]["weights"]
    assert (elsewhere / "merged" / "config.json").is_file()
    # The same weights sharded otherwise are the same base; other weights under its name are refused by
    # --merge and by sft.chat on the adapter, in one line, unless asked
    from safetensors.torch import load_file, save_file

    from sft.chat import main as chat

    tensors = {}
    for file in sorted(other.glob("*.safetensors")):
        tensors.update(load_file(file))
        file.unlink()
    halves = [dict(list(tensors.items())[:len(tensors) // 2]), dict(list(tensors.items())[len(tensors) // 2:])]
    for i, half in enumerate(halves):
        save_file(half, other / f"model-0000{i + 1}-of-00002.safetensors", metadata={"format": "pt"})
    (other / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        name: f"model-0000{i + 1}-of-00002.safetensors" for i, half in enumerate(halves) for name in half}}))
    status, _, err = run_cli(export, [str(saved), "resharded", "--merge"], capsys)
    assert status == 0, err
    for name in halves[0]:
        halves[0][name] = halves[0][name] + 0.01
    save_file(halves[0], other / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    said = "were trained on other weights than"
    for tool, argv in ((export, [str(saved), "changed", "--merge"]),
                       (chat, ["adapter", "--prompt", "hi", "--max-new-tokens", "2"])):
        status, _, err = run_cli(tool, argv, capsys)
        errors = [line for line in err.splitlines() if line.startswith("error")]
        assert status == 2 and len(errors) == 1 and "--allow-base-change" in errors[0], err
        assert f"{said} {other} holds now ({written['sft_base_weights']} -> weights-sha256:" in errors[0]
        status, out, err = run_cli(tool, [*argv, "--allow-base-change"], capsys)
        assert status == 0 and f"warning: {other} is not the base" in out, err


@pytest.mark.slow
def test_lora_on_routed_experts_resumes_exports_for_peft_and_merges(tmp_path, demo_data, capsys):
    """The MoE demo's base (8 experts a block) with adapters on the attention and on every expert
    (lora.target_modules: [q_proj, v_proj, experts]), 2 ranks, the base in the hub's per-expert
    layout: the checkpoint holds the adapters alone and resumes bit for bit; the exported adapter
    loads with PEFT (target_parameters) onto the base and gives the merged export's logits (merged
    into the per-expert tensors); the eval loss falls."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # the base as transformers saves it (and publishers ship it): one tensor per expert
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "configs/demo_moe/model")).save_pretrained(
        tmp_path / "base")
    experts = ["model.tokenizer=configs/demo/model", "lora.target_modules=[q_proj, v_proj, experts]",
               "lora.modules_to_save=[]", "moe.aux_loss_coef=0.1"]
    proc = lora(demo_data, tmp_path, "whole", *experts, "eval.every_steps=3")
    assert "applied LoRA (rank 16, alpha 32) to 8 layers and the routed experts of 4 blocks (experts, q_proj, " \
           "v_proj)" in proc.stdout
    step4 = tmp_path / "whole" / "checkpoints" / "step-4"
    saved = {key for key in dcp.FileSystemReader(str(step4)).read_metadata().state_dict_metadata if key.startswith("model.")}
    assert saved == {f"model.model.layers.{i}.{name}.lora_{ab}" + (".weight" if "self_attn" in name else "")
                     for i in range(4) for ab in "AB"
                     for name in ("self_attn.q_proj", "self_attn.v_proj", "mlp.experts.gate_up_proj_lora",
                                  "mlp.experts.down_proj_lora")}
    target = tmp_path / "resumed" / "checkpoints"
    target.mkdir(parents=True)
    shutil.copytree(step4, target / "step-4")
    lora(demo_data, tmp_path, "resumed", *experts)
    reference = train_losses(tmp_path / "whole")
    assert train_losses(tmp_path / "resumed") == {5: reference[5], 6: reference[6]}
    assert eval_losses(tmp_path / "whole")[-1] < eval_losses(tmp_path / "whole")[0]

    adapter, merged = tmp_path / "whole" / "export", tmp_path / "merged"
    assert json.loads((adapter / "adapter_config.json").read_text())["target_parameters"] == [
        "experts.gate_up_proj", "experts.down_proj"]
    # every expert adapter trained (q/v alone would move the merged logits too): each block's B off zero
    from safetensors.torch import load_file

    written = load_file(adapter / "adapter_model.safetensors")
    expert_b = {name: tensor for name, tensor in written.items() if ".experts." in name and "lora_B" in name}
    assert len(expert_b) == 8 and all(tensor.abs().max() > 0 for tensor in expert_b.values()), sorted(expert_b)
    peft_loads_the_merged_model(tmp_path / "whole" / "checkpoints" / "step-6", adapter, merged, tmp_path / "base", capsys)


@pytest.mark.slow  # compiles (no process of its own)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_nf4_experts_keep_no_bf16_weight_and_match_their_dequantised_weights(compiled):
    """QLoRA on the routed experts: the experts' fused weights in NF4 (2-D rows of the 3-D weight),
    dequantised in the forward and again in the backward; the output and the rows' gradient are those
    of the dequantised weights, and nothing saved for the backward is a dense expert weight."""
    from helpers import tiny_config
    from transformers import AutoModelForCausalLM

    from sft.config import LoRAConfig, MoEConfig
    from sft.models.architecture import decoder_blocks
    from sft.adapters.lora import apply_lora
    from sft.models.moe import apply_moe
    from sft.models.nf4 import is_nf4

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", hidden_size=128, moe_intermediate_size=128))
    apply_moe(model, MoEConfig())
    experts = model.model.layers[0].mlp.experts
    dense = {name: getattr(experts, name).detach().to(torch.bfloat16) for name in ("gate_up_proj", "down_proj")}
    apply_lora(model, decoder_blocks(model), LoRAConfig(rank=8, target_modules=["experts"], base="nf4"), torch.bfloat16)
    assert is_nf4(experts.gate_up_proj) and experts.gate_up_proj.shape == (8 * 256, 128)
    assert experts.full_shapes == {"gate_up_proj": (8, 256, 128), "down_proj": (8, 128, 128)}
    experts.to(torch.bfloat16)
    with torch.no_grad():  # the adapters as they start: B at zero, so the output is the base's
        for name in experts.full_shapes:
            getattr(experts, f"{name}_lora").lora_A.normal_()
            getattr(experts, f"{name}_lora").lora_B.zero_()
    rows = torch.randn(24, 128, dtype=torch.bfloat16, requires_grad=True)
    ends = torch.tensor([3, 3, 9, 12, 15, 20, 22, 24], dtype=torch.int32)
    compute = torch.compile(experts.compute) if compiled else experts.compute
    saved = []

    def keep(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = compute(rows, torch.repeat_interleave(torch.arange(8), torch.diff(ends, prepend=torch.zeros(1, dtype=torch.int32))), ends)
        out.float().square().sum().backward()
    # (compiled, the NF4 tensor is saved as its parts: 4-bit values packed in uint8, and scales)
    assert [tuple(t.shape) for t in saved if type(t) is torch.Tensor and t.is_floating_point()
            and t.numel() >= 8 * 128 * 128] == []
    # the same with the NF4 weights dequantised by hand
    reference = rows.detach().clone().requires_grad_()
    round_trip = {name: getattr(experts, name).to(torch.bfloat16).view(shape) for name, shape in experts.full_shapes.items()}
    start, expected = 0, []
    for e, end in enumerate(ends.tolist()):
        gate_up = reference[start:end] @ round_trip["gate_up_proj"][e].T
        expected.append(experts._apply_gate(gate_up) @ round_trip["down_proj"][e].T)
        start = end
    torch.cat(expected).float().square().sum().backward()
    torch.testing.assert_close(out, torch.cat(expected), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(rows.grad, reference.grad, rtol=2e-2, atol=2e-2)
    assert (dense["gate_up_proj"] - round_trip["gate_up_proj"]).abs().max() > 0  # NF4, not the bf16 weight


def _kept_for_backward(mode: str, lora: bool, dynamic: bool = False, attention: str = "sdpa") -> list[tuple]:
    """Shapes of the float tensors a compiled MoE block checkpointed in op-level `mode` keeps for its
    backward, with or without LoRA on every Linear and expert (rank 16)."""
    from helpers import tiny_config
    from transformers import AutoModelForCausalLM

    from sft.config import ACConfig, LoRAConfig, MoEConfig
    from sft.models.architecture import decoder_blocks
    from sft.adapters.lora import apply_lora
    from sft.models.moe import MoE, apply_moe
    from sft.parallel.activation_checkpointing import apply_ac

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", hidden_size=256, moe_intermediate_size=128,
                                                         num_hidden_layers=1, head_dim=64),
                                             attn_implementation=attention)
    moe = apply_moe(model, MoEConfig(aux_loss_coef=0.0))
    adapters = apply_lora(model, decoder_blocks(model), LoRAConfig(rank=16, target_modules=["all-linear", "experts"]),
                          torch.bfloat16) if lora else None
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.normal_(0, 0.02)
    model.to(torch.bfloat16)
    block = apply_ac(model, decoder_blocks(model), ACConfig(1.0, mode), always_kept=MoE.kept_ops,
                     adapter_widths=adapters.widths if adapters else frozenset())[0]
    forward = torch.compile(block, dynamic=dynamic)
    kept = []
    for length in (512, 384) if dynamic else (512,):
        x = torch.randn(1, length, 256, dtype=torch.bfloat16, requires_grad=True)
        positions = torch.arange(length)[None]
        moe.begin_step(torch.tensor(float(length)))
        moe.begin_micro_batch(torch.ones(length))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            out = forward(x, position_embeddings=model.model.rotary_emb(x, positions), attention_mask=None,
                          position_ids=positions)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
        kept = sorted(tuple(t.shape) for t in saved if type(t) is torch.Tensor and t.is_floating_point()
                      and t.numel() >= length * 64)
    return kept


@pytest.mark.slow  # compiles (no process of its own)
@pytest.mark.parametrize("mode", ["ops", "ops_half"])
def test_op_level_checkpointing_keeps_the_same_outputs_with_lora_as_without(mode):
    """A LoRA block checkpointed at op level keeps its base matmuls' outputs, as the planner counts
    them, and no adapter's (each as wide as its base matmul's output): with adapters on every Linear
    and every expert it keeps exactly what the block without them keeps."""
    assert _kept_for_backward(mode, lora=True) == _kept_for_backward(mode, lora=False)


@pytest.mark.slow  # compiles (no process of its own)
def test_op_level_checkpointing_takes_symbolic_widths():
    """Compiled with dynamic shapes, eager attention's matmuls have the row length as a width: the
    policy that tells adapters' matmuls by width takes it (a symbolic size cannot be hashed)."""
    assert _kept_for_backward("ops", lora=True, dynamic=True, attention="eager")
