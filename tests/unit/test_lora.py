"""LoRA in process: target and module names that match nothing, what trains and what the layers are called.
End to end: tests/integration/test_lora.py."""

from __future__ import annotations


import pytest
import torch

from helpers import REPO


# lora.* -> the one error apply_lora gives for the demo model
BAD_TARGETS = {
    ("target_modules", ("qproj",)): "lora.target_modules=['qproj']: qproj names no Linear layer of the decoder blocks; "
                                   "they have down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj",
    ("modules_to_save", ("embeddings",)): "lora.modules_to_save=['embeddings']: embeddings names no module of "
                                         "Qwen2ForCausalLM",
}


@pytest.mark.parametrize("key, value", list(BAD_TARGETS), ids=[key for key, _ in BAD_TARGETS])
def test_names_that_match_nothing_are_one_error_listing_what_there_is(key, value):
    from sft.config import LoRAConfig, ModelConfig
    from sft.models.architecture import decoder_blocks
    from sft.models.build import build_meta_model
    from sft.adapters.lora import LoRAError, apply_lora

    model = build_meta_model(ModelConfig(name_or_path=str(REPO / "configs" / "demo" / "model")))
    with pytest.raises(LoRAError) as err:
        apply_lora(model, decoder_blocks(model), LoRAConfig(rank=4, **{key: list(value)}), torch.float32)
    assert str(err.value).startswith(BAD_TARGETS[key, value])


def test_only_the_adapters_and_the_modules_to_save_train_and_the_names_stay():
    from sft.config import LoRAConfig, ModelConfig
    from sft.models.architecture import decoder_blocks
    from sft.models.build import build_meta_model
    from sft.adapters.lora import LoRALinear, apply_lora

    model = build_meta_model(ModelConfig(name_or_path=str(REPO / "configs" / "demo" / "model")))
    names = [name for name, _ in model.named_parameters()]
    apply_lora(model, decoder_blocks(model), LoRAConfig(rank=4, target_modules=["q_proj", "v_proj"],
                                                        modules_to_save=["embed_tokens"]), torch.bfloat16)
    params = dict(model.named_parameters())
    assert [name for name in params if ".lora_" not in name] == names  # the base loads by its own names
    trained = sorted(name for name, p in params.items() if p.requires_grad)
    assert trained == sorted([f"model.layers.{i}.self_attn.{m}.lora_{ab}.weight" for i in range(4)
                              for m in ("q_proj", "v_proj") for ab in "AB"] + ["model.embed_tokens.weight"])
    assert {p.dtype for name, p in params.items() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in params.values() if p.requires_grad} == {torch.float32}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert sum(isinstance(m, LoRALinear) for m in model.modules()) == 8


def _moe_families() -> dict[str, bool]:
    """The MoE families of the zoo that train (docs/models.md) -> whether their experts run our path
    (else the general path, whose experts are Linear layers that all-linear adapts)."""
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in (REPO / "docs" / "models.md").read_text().splitlines() if line.startswith("| ")]
    column = {name: i for i, name in enumerate(rows[0])}  # the header, by name: the table may gain columns
    families = {row[column["family"]]: "general path" not in row[column["kind"]] for row in rows[1:]
                if row[column["kind"]].startswith("MoE") and row[column["status"]] == "trains, exports"}
    assert families, "docs/models.md lists no MoE family that trains: its table changed shape"
    return families


MOE_FAMILIES = _moe_families()


@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_adapters_in_peft_format_load_with_peft_as_the_merged_model(tmp_path, model_type):
    """Adapters on every Linear layer and the routed experts of each MoE family of the zoo, written as
    PEFT's adapter (target_parameters for the experts, the names save_pretrained writes): PEFT loads
    them onto the saved base and computes the logits of the base with each W + s B A merged in
    (sft.export --merge, sft.chat); read back, they are the tensors written."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from helpers import saved_model_dir
    from sft.config import LoRAConfig
    from sft.models.architecture import decoder_blocks
    from sft.adapters.lora import apply_lora
    from sft.adapters.peft_format import in_model, merged, read_adapter, unmatched, write_adapter
    from zoo import OVERRIDES

    assert len(MOE_FAMILIES) >= 50
    base_dir = saved_model_dir(tmp_path, model_type, **OVERRIDES.get(model_type, {}))
    shapes = AutoModelForCausalLM.from_pretrained(base_dir)  # the model names and shapes LoRA adapts
    targets = ["all-linear", "experts"] if MOE_FAMILIES[model_type] else ["all-linear"]
    lora = LoRAConfig(rank=4, alpha=8, target_modules=targets, dropout=0.1)
    apply_lora(shapes, decoder_blocks(shapes), lora, torch.float32)
    ids = torch.randint(3, 800, (2, 12), generator=torch.Generator().manual_seed(1))
    # layers whose forward transformers never calls (Jamba's dt_proj, LongCat's router read their weight): their
    # adapters get no gradient and keep B = 0, as here
    called = set()
    hooks = [m.register_forward_hook(lambda m, *_: called.add(m)) for m in shapes.modules()]
    with torch.no_grad():
        shapes(input_ids=ids)
    for hook in hooks:
        hook.remove()
    generator = torch.Generator().manual_seed(0)
    trained = {name: torch.randn(p.shape, generator=generator) * 0.1 for name, p in shapes.named_parameters()
               if p.requires_grad}
    for name in trained:
        if name.endswith("lora_B.weight") and shapes.get_submodule(name.rsplit(".lora_B", 1)[0]) not in called:
            trained[name].zero_()

    out = tmp_path / "adapter"
    out.mkdir()
    write_adapter(out, trained, lora, str(base_dir), "weights-sha256:0", tied=False, model=shapes)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    config, tensors, scaling = read_adapter(out)
    read = in_model(tensors, config, model)
    assert config["sft_base_weights"] == "weights-sha256:0"
    if "experts" in lora.target_modules:
        assert {"experts.gate_up_proj", "experts.down_proj"} <= set(config["target_parameters"])
        assert config["lora_dropout"] == 0.0
    assert read.keys() == trained.keys() and all(torch.equal(read[n], trained[n]) for n in trained)
    assert unmatched(read, model) == []  # sft.chat refuses an adapter with tensors of another model
    assert unmatched({"model.layers.9.self_attn.o_proj.lora_A.weight": torch.zeros(1)}, model) == [
        "model.layers.9.self_attn.o_proj.lora_A.weight"]
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(merged(name, param, trained, scaling, model))
        peft_logits = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out)(input_ids=ids).logits
        merged_logits = model(input_ids=ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(base_dir)(input_ids=ids).logits
    torch.testing.assert_close(peft_logits, merged_logits, rtol=1e-4, atol=1e-4)
    assert (merged_logits - base_logits).abs().max() > 1e-2  # the adapters count, 100 times the tolerance


def test_experts_name_routed_experts_only_where_there_are_some():
    from helpers import tiny_config
    from transformers import AutoModelForCausalLM

    from sft.config import LoRAConfig
    from sft.models.architecture import decoder_blocks
    from sft.adapters.lora import LoRAError, apply_lora

    with torch.device("meta"):
        dense = AutoModelForCausalLM.from_config(tiny_config("qwen3"))
    with pytest.raises(LoRAError, match=r"^lora.target_modules=\['experts'\]: experts names no Linear layer or routed "
                                        "experts of the decoder blocks; they have down_proj, gate_proj"):
        apply_lora(dense, decoder_blocks(dense), LoRAConfig(rank=4, target_modules=["experts"]), torch.float32)
    with torch.device("meta"):
        moe = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    lora = apply_lora(moe, decoder_blocks(moe), LoRAConfig(rank=4, target_modules=["experts"]), torch.float32)
    assert lora.targets == ["experts"] and lora.layers == []
    assert sorted({n.split("experts.")[1] for n, p in moe.named_parameters() if p.requires_grad}) == [
        "down_proj_lora.lora_A", "down_proj_lora.lora_B", "gate_up_proj_lora.lora_A", "gate_up_proj_lora.lora_B"]
    assert moe.model.layers[0].mlp.experts.gate_up_proj_lora.lora_A.shape == (8, 4, 64)  # [E, r, in]
    assert moe.model.layers[0].mlp.experts.down_proj_lora.lora_B.shape == (8, 64, 4)  # [E, out, r]
    # MFU's count: a token runs through 2 of each block's 8 experts, their adapters as their weights
    from sft.models.moe import parameters_per_token

    # per block: gate_up A 8x4x64 + B 8x64x4, down A 8x4x32 + B 8x64x4 = 7,168 adapters, 2 blocks, a quarter each
    # token; of the frozen experts (8 x 64 x 64 + 8 x 64 x 32 a block) three quarters are not run
    base = sum(p.numel() for p in moe.parameters() if not p.requires_grad)
    assert parameters_per_token(moe) == (2 * 7168 // 4, base - 2 * (8 * 64 * 64 + 8 * 64 * 32) * 3 // 4)


@pytest.mark.parametrize("rank", [4, 16], ids=["rank 4, padded to 8", "rank 16"])
def test_expert_adapters_run_grouped_gemms_and_equal_each_experts_own_matmuls(rank):
    """bf16 rows through ExpertLoRA take the grouped GEMM (a rank not a multiple of 8 padded with
    zeros for its 16-byte rows) and equal s B_e A_e x expert by expert, forward and gradients."""
    from sft.models.experts import _grouped_mm_runs
    from sft.adapters.lora import ExpertLoRA

    torch.manual_seed(0)
    experts, fan_in, fan_out = 4, 64, 32
    lora = ExpertLoRA(experts, fan_in, fan_out, rank, scaling=2.0, dropout=0.0, device=torch.device("cpu"))
    with torch.no_grad():
        lora.lora_A.normal_()
        lora.lora_B.normal_()
    lora.to(torch.bfloat16)
    assert _grouped_mm_runs(torch.zeros(1, fan_in, dtype=torch.bfloat16), lora.lora_A.transpose(1, 2), 8)
    ends = torch.tensor([5, 5, 12, 16], dtype=torch.int32)  # expert 1 gets no row
    rows = torch.randn(16, fan_in, dtype=torch.bfloat16, requires_grad=True)
    out = lora(rows, ends)
    out.float().square().sum().backward()
    grads = {name: p.grad.float() for name, p in lora.named_parameters()}

    a, b = (p.detach().float().requires_grad_() for p in (lora.lora_A, lora.lora_B))
    x = rows.detach().float().requires_grad_()
    start, expected = 0, []
    for e, end in enumerate(ends.tolist()):
        expected.append(2.0 * x[start:end] @ a[e].T @ b[e].T)
        start = end
    torch.cat(expected).square().sum().backward()
    for ours, reference in ((out.float(), torch.cat(expected)), (rows.grad.float(), x.grad),
                            (grads["lora_A"], a.grad), (grads["lora_B"], b.grad)):
        # bf16 (8 bits of mantissa) products of sums: within 2% of the largest value
        torch.testing.assert_close(ours, reference, rtol=0, atol=2e-2 * reference.abs().max().item())
    assert grads["lora_A"][1].abs().max() == 0  # no row, no gradient


def test_a_fused_expert_weight_reads_whole_from_the_hubs_per_expert_tensors(tmp_path):
    """The merged export (`read(name, ())`) and QLoRA's NF4 load (`slice(None)` per dim) read a fused
    expert weight whole from a checkpoint saved by transformers (one tensor per expert), and the files
    are said to hold it: both the layout publishers ship."""
    from helpers import saved_model_dir
    from transformers import AutoModelForCausalLM

    from sft.hub.weights import SafetensorsWeights

    base = saved_model_dir(tmp_path, "qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(base)
    weights = SafetensorsWeights(str(base), model)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert weights.holds(name)
    for index in ((), (slice(None),) * 3):
        torch.testing.assert_close(weights.read(name, index, torch.device("cpu")), model.get_parameter(name).detach())


# (GPUs sharding the model, fsdp.cpu_offload) -> whether FSDP leaves the frozen bf16 base alone
WHOLE_FROZEN = {(1, False): True, (2, False): False, (1, True): False}


@pytest.mark.parametrize("shard_ranks, cpu_offload", list(WHOLE_FROZEN), ids=["1-gpu", "2-gpus", "1-gpu-offload"])
def test_fsdp_leaves_the_frozen_base_alone_only_where_it_has_nothing_to_shard(shard_ranks, cpu_offload):
    """On one GPU (shards of one rank, on the GPU) FSDP would only copy the frozen bf16 base into its
    all-gather buffer at every forward and backward: it leaves it alone. The adapters (trained), and a
    frozen weight it must cast (not in fsdp.param_dtype), stay its own."""
    from sft.config import FSDPConfig, LoRAConfig, ModelConfig
    from sft.models.architecture import decoder_blocks
    from sft.models.build import build_meta_model
    from sft.adapters.lora import apply_lora
    from sft.parallel.fsdp import whole_frozen

    model = build_meta_model(ModelConfig(name_or_path=str(REPO / "configs" / "demo" / "model")))
    apply_lora(model, decoder_blocks(model), LoRAConfig(rank=4), torch.bfloat16)
    model.model.norm.weight.data = model.model.norm.weight.data.float()  # frozen, but FSDP casts it
    left = whole_frozen(model, shard_ranks, FSDPConfig(cpu_offload=cpu_offload))
    names = {name for name, param in model.named_parameters() if any(param is p for p in left)}
    frozen_bf16 = {name for name, param in model.named_parameters()
                   if not param.requires_grad and param.dtype == torch.bfloat16}
    assert "model.layers.0.self_attn.q_proj.weight" in frozen_bf16 and "model.norm.weight" not in frozen_bf16
    assert names == (frozen_bf16 if WHOLE_FROZEN[shard_ranks, cpu_offload] else set())
