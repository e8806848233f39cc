"""Packing: documents in one row never see each other, and the loss is unchanged (CPU, sdpa)."""

import copy
import importlib
import importlib.util
import inspect
import math
import random
import re
import sys

import pytest
import torch

from helpers import DEMO_MODEL, synthetic_global_batch
from sft.data.collate import collate, collate_packed
from sft.config import ModelConfig
from sft.data.batches import pack_best_fit
from sft.training.loss import SFTLoss, loss_inputs
from sft.models.build import build_meta_model, materialize, real_buffers
from sft.hub.weights import initial_weights, load_weights


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(name_or_path=str(DEMO_MODEL), init="random")
    m = build_meta_model(cfg)
    materialize(m, real_buffers(m), torch.device("cpu"))
    load_weights(m, initial_weights(cfg, 0, m), torch.device("cpu"))
    m.eval()
    return m, SFTLoss(m)


def test_document_inside_a_pack_sees_only_itself(model):
    model, _ = model
    a, b = synthetic_global_batch(2, seed=1)
    packed = collate_packed([[a, b]], pad_token_id=0, row_len=128)
    alone = collate([b], pad_token_id=0, max_seq_len=128)
    with torch.no_grad():
        logits_packed = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits
        logits_alone = model(input_ids=alone["input_ids"], position_ids=alone["position_ids"]).logits
    n_a, n_b = len(a["input_ids"]), len(b["input_ids"])
    torch.testing.assert_close(logits_packed[0, n_a : n_a + n_b], logits_alone[0, :n_b], rtol=1e-5, atol=1e-5)
    # Without position ids restarting at B, B would attend to A: the check above can fail.
    shifted = model(input_ids=packed["input_ids"]).logits[0, n_a : n_a + n_b].detach()
    assert (shifted - logits_alone[0, :n_b]).abs().max() > 1e-2


def test_packed_loss_equals_padded_loss(model):
    _, loss = model
    samples = synthetic_global_batch(12, seed=2)
    rows = pack_best_fit([len(s["input_ids"]) for s in samples], 96)
    assert len(rows) < len(samples)  # several documents share rows
    packed = collate_packed([[samples[i] for i in row] for row in rows], pad_token_id=0, row_len=96)
    padded = collate(samples, pad_token_id=0, max_seq_len=96)
    def count(batch: dict) -> int:
        return int((batch["labels"][:, 1:] != -100).sum())

    assert count(packed) == count(padded)  # no label predicts across a document boundary
    with torch.no_grad():
        assert loss(**loss_inputs(packed)).item() == pytest.approx(loss(**loss_inputs(padded)).item(), rel=1e-5)


def test_gpt_oss_packs_with_the_masks_the_loss_builds_from_the_positions(tmp_path):
    """gpt-oss builds its masks (windowed and full) without the position ids, but takes masks built
    beforehand: the loss builds them with transformers' builders from the packed positions, and a
    packed batch's loss equals the padded one's (without them its documents see each other)."""
    from helpers import gpt_oss_model_dir
    from sft.models.packing import Packing, check_packing

    cfg = ModelConfig(name_or_path=str(gpt_oss_model_dir(tmp_path)), init="random")
    model = build_meta_model(cfg)
    packing = check_packing(model, packing=True)
    assert packing == Packing(document_ends=False, masks=("full_attention", "sliding_attention"))
    materialize(model, real_buffers(model), torch.device("cpu"))
    load_weights(model, initial_weights(cfg, 0, model), torch.device("cpu"))
    model.eval()
    samples = synthetic_global_batch(12, seed=2)
    rows = pack_best_fit([len(s["input_ids"]) for s in samples], 96)
    packed = collate_packed([[samples[i] for i in row] for row in rows], pad_token_id=0, row_len=96)
    padded = collate(samples, pad_token_id=0, max_seq_len=96)
    with torch.no_grad():
        expected = SFTLoss(model)(**loss_inputs(padded)).item()
        assert SFTLoss(model, packing=packing)(**loss_inputs(packed)).item() == pytest.approx(expected, rel=1e-6)
        assert SFTLoss(model)(**loss_inputs(packed)).item() != pytest.approx(expected, rel=1e-4)


def test_best_fit_decreasing_places_every_sample_once():
    rng = random.Random(0)
    lengths = [rng.randint(1, 300) for _ in range(2000)]
    rows = pack_best_fit(lengths, 512)
    assert sorted(i for row in rows for i in row) == list(range(2000))
    assert max(sum(lengths[i] for i in row) for row in rows) <= 512
    assert sum(lengths) / (512 * len(rows)) > 0.98  # rows are nearly full


def skip_without_fla_kernels(device: str) -> None:
    """Skip a GPU case where this machine cannot run flash-linear-attention's kernels, decided by the
    machine alone: no GPU, fla not installed, or fla's own refusal (Hopper with Triton 3.4.0 to 3.7.0
    and no tilelang: one of its backward kernels computes wrongly there)."""
    if device == "cpu":
        return
    if not torch.cuda.is_available():
        pytest.skip("no GPU here (on one, the packed rows take flash-linear-attention's varlen kernels)")
    if importlib.util.find_spec("fla") is None:
        pytest.skip("flash-linear-attention is not installed (pip install flash-linear-attention)")
    from packaging.version import Version

    triton = Version(importlib.import_module("triton").__version__)
    if (torch.cuda.get_device_capability()[0] == 9 and Version("3.4.0") <= triton < Version("3.7.1")
            and importlib.util.find_spec("tilelang") is None):
        pytest.skip(f"flash-linear-attention refuses Triton {triton} on Hopper without tilelang")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_gated_deltanet_documents_restart_in_a_packed_row(tmp_path, device):
    """Qwen3.5's Gated DeltaNet layers (a recurrent state and a short convolution along the row): a
    packed row of three documents, its document ends passed on, gives each document the hidden
    states and gradients it gets alone; without them (what packing did before) the later documents
    see the earlier ones. Attention keeps them apart by their restarting positions. On a GPU the
    delta rule and the convolution are flash-linear-attention's varlen kernels (its chunked kernels
    for each document alone, which match transformers' torch reference on the CPU); on the CPU
    transformers' torch reference, one document at a time, and the convolution masked."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from helpers import gated_deltanet_model_dir
    from sft.models.gated_deltanet import DOCUMENT_ENDS, DocumentEnds, document_ends, fla_kernels
    from sft.models.gated_deltanet import use_gated_deltanet_kernels
    from sft.models.packing import check_packing

    skip_without_fla_kernels(device)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(gated_deltanet_model_dir(tmp_path)))
    check_packing(model, packing=True)  # puts the document-aware functions in place (fla's on a GPU)
    use_gated_deltanet_kernels(model, torch.device(device))
    assert device == "cpu" or fla_kernels() is not None  # installed and importable (a broken fla is a KernelError)
    lengths = [7, 70, 5]  # the middle one spans two of the delta rule's 64-token chunks
    documents = [torch.randint(3, 800, (n,), device=device) for n in lengths]
    decoder = model.get_decoder()
    alone = [decoder(input_ids=d[None], position_ids=torch.arange(len(d), device=device)[None],
                     use_cache=False).last_hidden_state[0] for d in documents]
    row = torch.cat(documents)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    host = document_ends(positions.cpu())  # from the collate's position ids, on the host
    assert host.tolist() == [0, 7, 77, 82]
    ends = DocumentEnds(host, host.to(device))
    packed = decoder(input_ids=row, position_ids=positions, use_cache=False,
                     **{DOCUMENT_ENDS: ends}).last_hidden_state[0]
    close = 1e-5 if device == "cpu" else 1e-3  # flash-linear-attention's kernels multiply in TF32
    torch.testing.assert_close(packed, torch.cat(alone), rtol=close, atol=close)
    if device == "cuda":  # fla's kernels (also for rows of one document) compute what transformers' reference does
        on_cpu = copy.deepcopy(model).cpu().get_decoder()  # (TF32 products against float32 ones: 1e-2)
        reference = [on_cpu(input_ids=d[None].cpu(), position_ids=torch.arange(len(d))[None],
                            use_cache=False).last_hidden_state[0] for d in documents]
        torch.testing.assert_close(torch.cat(alone).cpu(), torch.cat(reference), rtol=1e-2, atol=1e-2)
    mixed = decoder(input_ids=row, position_ids=positions, use_cache=False).last_hidden_state[0]
    assert (mixed[7:] - torch.cat(alone)[7:]).abs().max() > 1e-3  # the state crossed into the next document
    # gradients of the packed row equal the sum over the documents alone
    model.zero_grad()
    sum(h.square().sum() for h in alone).backward()
    alone_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    decoder(input_ids=row, position_ids=positions, use_cache=False,
            **{DOCUMENT_ENDS: ends}).last_hidden_state.square().sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    decoder(input_ids=row, position_ids=positions, use_cache=False).last_hidden_state.square().sum().backward()

    def worst(grads) -> tuple[float, str]:  # the largest difference from the documents alone, relative to
        errors = {n: ((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()  # the tensor's
                  for n, g in alone_grads.items()}  # largest entry; a NaN counts as the worst
        name = max(errors, key=lambda n: (math.isnan(errors[n]), errors[n]))
        return errors[name], name
    # float32 sums in another order: within 1e-3 of a tensor's largest entry; fla's TF32 products within
    # 1e-2 (on an H200 the first tensor compared, a Gated DeltaNet layer's dt_bias, was off by 1.2e-3)
    error, name = worst(packed_grads)
    assert error <= (1e-3 if device == "cpu" else 1e-2), (name, error)
    error, name = worst({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert error > 0.1, (name, error)  # without the document ends: far off (1.49 on the CPU)
    assert document_ends(torch.arange(8).expand(3, 8)) is None  # rows of one document each: nothing to keep apart


# Other layers that restart per document when packed: (model type, its tiny config, the layers named)
RESTARTING_LAYERS = {
    # LFM2: short convolutions (a causal depthwise convolution over the row) between attention layers
    "short convolutions": ("lfm2", dict(layer_types=["conv", "full_attention", "conv"]),
                           "Lfm2ForCausalLM's conv layers (Lfm2ShortConv)"),
    # Kimi-Linear: Kimi delta attention (a short convolution, then a recurrent state with a decay per
    # channel) between attention layers, mixture-of-experts MLPs
    "kimi delta attention": ("kimi_linear", dict(layer_types=["linear_attention", "full_attention", "linear_attention"],
                                                 linear_num_heads=2, linear_head_dim=16, num_key_value_heads=4),
                             "KimiLinearForCausalLM's linear_attention layers (KimiLinearDeltaAttention)"),
    # Ling's hybrids (bailing_hybrid): the same delta attention between attention layers
    "bailing delta attention": ("bailing_hybrid", dict(layer_types=["linear_attention", "full_attention",
                                                                    "linear_attention"], mlp_layer_types=["dense"] * 3,
                                                       linear_num_heads=2, linear_head_dim=16, num_key_value_heads=4),
                                "BailingHybridForCausalLM's linear_attention layers (BailingHybridDeltaAttention)"),
}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("kind", RESTARTING_LAYERS)
def test_other_stateful_layers_restart_in_a_packed_row(kind, device):
    """Packing puts these layers' document-aware functions in place (on a CPU: the convolution's taps
    masked at document edges, Kimi's delta rule one document at a time through transformers' torch
    function; on a GPU flash-linear-attention's varlen convolution and chunked Kimi delta attention),
    and a packed row of three documents, its document ends passed on, gives each document the hidden
    states and gradients it gets alone; without them the state reaches into the next document.
    Context parallelism runs them over the whole rows (sft/models/gated_deltanet.py: RowParts)."""
    import transformers
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from helpers import tiny_config
    from sft.models.gated_deltanet import DOCUMENT_ENDS, DocumentEnds, document_ends, restarting_modules
    from sft.models.packing import check_packing, cp_unsupported

    skip_without_fla_kernels(device)
    model_type, overrides, layers = RESTARTING_LAYERS[kind]
    if model_type not in CONFIG_MAPPING:  # the GPU machine's transformers 5.17 has no bailing_hybrid
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(tiny_config(model_type, num_hidden_layers=3, **overrides))
    # the layer class, found in the model itself (not by the lookup under test)
    layer = next(type(m) for m in model.modules() if type(m).__name__ == re.search(r"\((\w+)\)$", layers).group(1))
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(layer.forward).parameters.values()):
        pytest.skip(f"transformers {transformers.__version__}'s {layers} pass no keyword arguments on (refused, "
                    "as tested below)")  # LFM2's in transformers 5.17
    assert sys.modules[layer.__module__] in [m for found in restarting_modules(model).values() for m in found]
    assert check_packing(model, packing=True).document_ends  # the loss passes packed rows' ends to these layers
    assert cp_unsupported(model) is None
    documents = [torch.randint(3, 800, (n,), device=device) for n in (5, 70, 1)]  # shorter than the taps, over a
    decoder = model.get_decoder()  # 64-token chunk
    alone = [decoder(input_ids=d[None], position_ids=torch.arange(len(d), device=device)[None],
                     use_cache=False).last_hidden_state[0] for d in documents]
    row = torch.cat(documents)[None]
    positions = torch.cat([torch.arange(len(d)) for d in documents])[None]
    host = document_ends(positions)
    ends = DocumentEnds(host, host.to(device))
    positions = positions.to(device)
    packed = decoder(input_ids=row, position_ids=positions, use_cache=False, **{DOCUMENT_ENDS: ends}).last_hidden_state
    close = 1e-5 if device == "cpu" else 1e-3  # flash-linear-attention's kernels multiply in TF32
    torch.testing.assert_close(packed[0], torch.cat(alone), rtol=close, atol=close)
    mixed = decoder(input_ids=row, position_ids=positions, use_cache=False).last_hidden_state[0]
    assert (mixed[5:] - torch.cat(alone)[5:]).abs().max() > 1e-3  # the state reached the next document
    model.zero_grad()
    sum(h.square().sum() for h in alone).backward()
    alone_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    decoder(input_ids=row, position_ids=positions, use_cache=False,
            **{DOCUMENT_ENDS: ends}).last_hidden_state.square().sum().backward()
    bound = 1e-3 if device == "cpu" else 1e-2  # float32 sums in another order, TF32: as for Gated DeltaNet above
    for name, grad in alone_grads.items():
        assert (model.get_parameter(name).grad - grad).abs().max() <= bound * grad.abs().max(), name


def test_packing_a_model_whose_layers_carry_state_is_refused_in_one_line(tmp_path):
    """Layers that carry state along the row other than Gated DeltaNet, Kimi delta attention and short
    convolutions (Mamba: Falcon-H1, Nemotron-H, Granite-4 hybrids; MiniMax's lightning attention) are
    refused for packing, naming the layers, and so for context parallelism; Gated DeltaNet packs and
    splits. An attention-only model packs."""
    from transformers import AutoModelForCausalLM

    from helpers import FALCON_H1, gated_deltanet_model_dir, tiny_config
    from sft.config import ModelConfig
    from sft.models.build import build_meta_model
    from sft.models.packing import cp_unsupported
    from sft.models.packing import PackingError, check_packing

    mamba = AutoModelForCausalLM.from_config(tiny_config("falcon_h1", **FALCON_H1))
    with pytest.raises(PackingError) as err:
        check_packing(mamba, packing=True)
    assert str(err.value).startswith("data.packing=true: FalconH1ForCausalLM's hybrid layers (FalconH1Mixer)")
    assert ("only Gated DeltaNet, Kimi delta attention and short convolution layers that pass on their call's "
            "keyword arguments (transformers 5.24's do) restart per document yet; set data.packing=false"
            ) in str(err.value)
    check_packing(mamba, packing=False)
    # LFM2's short convolutions as transformers 5.17 writes them: their forward takes no keyword arguments,
    # so the documents' ends would never reach their convolution
    lfm2 = AutoModelForCausalLM.from_config(tiny_config("lfm2", layer_types=["conv", "full_attention"]))
    shipped = type(lfm2.model.layers[0].conv)
    older = type(shipped.__name__, (shipped,), {"__module__": shipped.__module__, "forward": lambda self, hidden_states,
                 past_key_values=None, attention_mask=None: shipped.forward(self, hidden_states, past_key_values,
                                                                             attention_mask)})
    lfm2.model.layers[0].conv.__class__ = older
    with pytest.raises(PackingError, match="^data.packing=true: Lfm2ForCausalLM's conv layers \\(Lfm2ShortConv\\)"):
        check_packing(lfm2, packing=True)
    hybrid = build_meta_model(ModelConfig(name_or_path=str(gated_deltanet_model_dir(tmp_path))))
    check_packing(hybrid, packing=True)
    assert cp_unsupported(hybrid) is None
    assert cp_unsupported(mamba) == "FalconH1ForCausalLM's hybrid layers (FalconH1Mixer) carry state along the row"
    check_packing(build_meta_model(ModelConfig(name_or_path=str(DEMO_MODEL))), packing=True)


def test_a_hybrid_takes_causal_sdpa_and_its_mask_probe_runs_no_layer(tmp_path, monkeypatch):
    """Qwen3.5 in transformers has SDPA but no flex attention: a config asking for flex gets SDPA (not
    eager); unpacked rows take the causal kernel without a mask (its Gated DeltaNet layers take none);
    and the probe of whether its masks keep packed documents apart stops at the masks: no layer runs
    on its meta tensors (on a GPU, flash-linear-attention's kernels would read meta pointers and
    fault the device)."""
    import sys

    from transformers import AutoConfig

    from helpers import gated_deltanet_model_dir
    from sft.config import ModelConfig
    from sft.models.build import build_meta_model, runnable_attention, use_causal_sdpa
    from sft.models.packing import builds_document_masks

    assert runnable_attention(AutoConfig.from_pretrained(gated_deltanet_model_dir(tmp_path)), "flex_attention") == "sdpa"
    hybrid = build_meta_model(ModelConfig(name_or_path=str(gated_deltanet_model_dir(tmp_path))))
    modeling = sys.modules[type(hybrid).__module__]
    ran = []
    monkeypatch.setattr(modeling, "causal_conv1d_fn", lambda *a, **k: ran.append("conv"))
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", lambda *a, **k: ran.append("delta rule"))
    # what runs after the masks and before the first layer (the probe used to run on until it failed here)
    hybrid.model.rotary_emb.register_forward_pre_hook(lambda *a: ran.append("rotary embedding"))
    assert builds_document_masks(hybrid) and ran == []
    assert use_causal_sdpa(hybrid, packing=False)


@pytest.mark.parametrize("capability, triton, tilelang, expected", [
    ((9, 0), None, False, ("run transformers' torch reference", False)),         # no fla: slow, a warning
    ((9, 0), "3.6.0", False, ("refuses Triton 3.6.0 on Hopper", True)),          # the H100/H200 image of today
    ((9, 0), "3.6.0", True, None),                                               # tilelang takes that kernel
    ((9, 0), "3.7.1", False, None),
    ((8, 0), "3.6.0", False, None),                                              # not Hopper: fla's kernels run
    ((9, 0), "3.3.1", False, None),
], ids=str)
def test_gated_deltanet_on_a_gpu_without_fla_s_kernels_is_one_line(capability, triton, tilelang, expected):
    """On a GPU, a Gated DeltaNet model whose layers cannot take flash-linear-attention's kernels gets
    one line before anything is allocated: a warning without fla, an error where fla would refuse
    Triton at the first backward (Hopper, Triton 3.4.0 to 3.7.0, no tilelang), naming the fix."""
    from sft.models.gated_deltanet import kernel_problem

    problem = kernel_problem("Qwen3_5ForCausalLM", capability, triton, tilelang)
    if expected is None:
        assert problem is None
    else:
        assert expected[0] in problem[0] and problem[1] == expected[1]
        assert problem[0].startswith("Qwen3_5ForCausalLM's Gated DeltaNet layers")
        assert problem[0].endswith("pip install flash-linear-attention" if triton is None else "triton>=3.7.1")


def test_an_installed_but_broken_fla_beside_a_gpu_is_one_error_not_the_slow_reference(monkeypatch):
    """fla_kernels: None where flash-linear-attention is not installed (transformers' torch reference
    runs), a KernelError naming why where it is installed but cannot be imported beside a GPU."""
    from sft.models import gated_deltanet
    from sft.models.gated_deltanet import KernelError, fla_kernels

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fla" else real_find_spec(name, *a))
    assert fla_kernels.__wrapped__() is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "fla" else real_find_spec(name, *a))

    def broken(name, *args):
        raise ImportError(f"libcuda.so.1: cannot open shared object file ({name})")

    monkeypatch.setattr(gated_deltanet.importlib, "import_module", broken)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(KernelError, match=r"^flash-linear-attention is installed but cannot be imported \(ImportError: "
                                          r"libcuda.so.1: .*\): reinstall it"):
        fla_kernels.__wrapped__()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fla_kernels.__wrapped__() is None  # no GPU: its kernels would not run anyway
