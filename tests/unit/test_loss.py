"""The fused chunked lm_head + cross-entropy and the collate, against plain PyTorch."""

import pytest
import torch
import torch.nn.functional as F

import sft.training.loss
from sft.data.collate import collate
from sft.training.loss import LinearCrossEntropy, _chunked_cross_entropy
from sft.data.masking import IGNORE_INDEX


@pytest.mark.parametrize("rows_per_chunk", [1, 7, 1000])
def test_linear_cross_entropy_matches_autograd(monkeypatch, rows_per_chunk):
    vocab, hidden, rows = 97, 16, 23
    monkeypatch.setattr(sft.training.loss, "LOGITS_PER_CHUNK", rows_per_chunk * vocab)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, vocab, (rows,), generator=g)

    ours = LinearCrossEntropy.apply(h, w, t)
    (ours * 0.37).backward()
    grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = F.cross_entropy(h @ w.T, t, reduction="sum")
    (ref * 0.37).backward()

    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(grads[0], h.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[1], w.grad, rtol=1e-10, atol=1e-12)
    no_grad_total = _chunked_cross_entropy(h.detach(), w.detach(), t, grad_hidden=False, grad_weight=False)[0]
    torch.testing.assert_close(no_grad_total.double(), ref.detach(), rtol=1e-6, atol=0)


def test_a_frozen_lm_head_gets_no_gradient_and_the_hidden_states_theirs():
    """LoRA freezes the lm_head: only the hidden states' gradient is formed (no float32 buffer of the
    lm_head's size), and it is the one autograd gives."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(23, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(97, 16, generator=g, dtype=torch.float64)  # frozen
    t = torch.randint(0, 97, (23,), generator=g)
    LinearCrossEntropy.apply(h, w, t).backward()
    ours = h.grad.clone()
    h.grad = None
    F.cross_entropy(h @ w.T, t, reduction="sum").backward()
    torch.testing.assert_close(ours, h.grad, rtol=1e-10, atol=1e-12)
    assert w.grad is None


def test_collate_right_pads_and_keeps_hf_label_convention():
    samples = [{"input_ids": [5, 6, 7], "labels": [IGNORE_INDEX, 6, 7]},
               {"input_ids": [8, 9, 10, 11, 12], "labels": [IGNORE_INDEX, IGNORE_INDEX, 10, 11, 12]}]
    batch = collate(samples, pad_token_id=0, max_seq_len=16, pad_to_multiple_of=4)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0, 0, 0, 0], [8, 9, 10, 11, 12, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, -100, -100, -100, -100],
                                        [-100, -100, 10, 11, 12, -100, -100, -100]]
    assert batch["position_ids"].tolist() == [list(range(8))] * 2
    assert collate(samples, 0, max_seq_len=16, pad_to_max=True)["input_ids"].shape == (2, 16)


def test_rows_of_one_sequence_attend_causally_without_transformers_mask_check(monkeypatch):
    """use_causal_sdpa: the demo model (every layer full attention) on rows of one sequence with pads
    after it gives the loss and gradients it gave before, without transformers' packed-sequence
    check (which reads the GPU's position_ids: a host sync every forward); refused for packed rows,
    other attention and sliding windows."""
    import transformers.masking_utils

    from helpers import REPO
    from sft.config import ModelConfig
    from sft.models.build import CAUSAL_SDPA, build_meta_model, use_causal_sdpa
    from transformers import AutoConfig, AutoModelForCausalLM

    DEMO_MODEL = str(REPO / "configs" / "demo" / "model")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEMO_MODEL), attn_implementation="sdpa")
    batch = collate([{"input_ids": list(range(5, 5 + n)), "labels": list(range(5, 5 + n))} for n in (17, 9)],
                    pad_token_id=0, max_seq_len=64)

    def loss_and_grads():
        model.zero_grad()
        loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                     use_cache=False).loss  # as training runs it (SFTLoss): no KV cache
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    def no_check(position_ids):
        raise AssertionError("transformers looked for packed sequences")

    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", no_check)
    with pytest.raises(AssertionError, match="looked for packed"):  # what sdpa does by itself
        loss_and_grads()
    monkeypatch.undo()
    before, grads_before = loss_and_grads()
    assert use_causal_sdpa(model, packing=False) and model.config._attn_implementation == CAUSAL_SDPA
    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", no_check)
    after, grads_after = loss_and_grads()
    assert torch.equal(after, before)
    assert all(torch.equal(a, b) for a, b in zip(grads_after, grads_before))

    assert not use_causal_sdpa(build_meta_model(ModelConfig(name_or_path=DEMO_MODEL)), packing=True)
    eager = build_meta_model(ModelConfig(name_or_path=DEMO_MODEL, attn_implementation="eager"))
    assert not use_causal_sdpa(eager, packing=False)
    sliding = build_meta_model(ModelConfig(name_or_path=DEMO_MODEL))
    sliding.config.layer_types = ["sliding_attention"] + sliding.config.layer_types[1:]
    assert not use_causal_sdpa(sliding, packing=False) and sliding.config._attn_implementation == "sdpa"


def test_the_head_scales_and_truncates_the_logits_as_the_model_s_forward_does():
    """Inkling's forward divides the hidden states by logits_mup_width_multiplier and takes the softmax
    over its first unpadded_vocab_size logits: our fused loss equals the next-token loss of its logits,
    gradients of lm_head included (its padding rows get none)."""
    from transformers import AutoModelForCausalLM

    from helpers import TINY, tiny_config
    from sft.training.loss import SFTLoss, loss_inputs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("inkling_text", unpadded_vocab_size=TINY["vocab_size"] - 9,
                                                         logits_mup_width_multiplier=3.0))
    loss = SFTLoss(model)
    ids = torch.randint(3, TINY["vocab_size"] - 9, (2, 24))
    batch = {"input_ids": ids, "position_ids": torch.arange(24).expand(2, 24), "labels": ids.clone()}
    inputs = loss_inputs(batch)
    ours = loss(**inputs) / len(inputs["target_ids"])
    ours.backward()
    grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    logits = model(input_ids=ids, use_cache=False).logits.float()
    assert logits.shape[-1] == TINY["vocab_size"] - 9 < model.lm_head.weight.shape[0]
    theirs = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    torch.testing.assert_close(grad, model.lm_head.weight.grad, rtol=1e-4, atol=1e-6)
    assert grad[-9:].abs().max() == 0


def test_the_loss_holds_the_model_children_and_refuses_parameters_outside_them():
    """SFTLoss is FSDP's root unit: it holds the model's children (the same modules, the same parameter
    names); a parameter the model holds itself would be sharded on the loss only, so it is refused."""
    from transformers import AutoModelForCausalLM

    from helpers import TINY, tiny_config
    from sft.errors import UserError
    from sft.training.loss import SFTLoss

    model = AutoModelForCausalLM.from_config(tiny_config("qwen2"))
    loss = SFTLoss(model)
    assert dict(loss.named_children()) == dict(model.named_children())
    assert dict(loss.named_parameters()) == dict(model.named_parameters())
    model.register_parameter("scale", torch.nn.Parameter(torch.ones(TINY["hidden_size"])))
    with pytest.raises(UserError, match=r"Qwen2ForCausalLM: holds parameters outside its modules \(scale\)"):
        SFTLoss(model)
