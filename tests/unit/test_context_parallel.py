"""Context parallelism in process: the head-tail split, the GPU block mask against the whole row, the
models whose rows cannot be split (end to end: tests/integration/test_context_parallel.py)."""

import json
import re

import pytest
import torch
import torch.nn.functional as F

from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from helpers import DEMO_MODEL, tiny_model_dir
from sft.config import ConfigError, ModelConfig
from sft.models.packing import cp_unsupported
from sft.parallel.context_parallel import apply_context_parallel, attention_masks, shard_rows, visible_keys
from sft.parallel.mesh import ParallelDims
from sft.models.build import build_meta_model


def test_rows_are_split_head_tail_with_targets_shifted_on_the_whole_row():
    """A row of 10 tokens, cp 2: padded to 12, rank 1 keeps chunks 1 and 2 (tokens 3-5 and 6-8);
    token 5's target is token 6's label though token 6 is in the other chunk; the padding is never a
    target. Rank 0's queries (tokens 0-2, 9-11) see the keys before them in whole-row order, in
    their own document only; within a sliding window of 3, the last 3 of those."""
    labels = torch.arange(100, 110).view(1, 10)
    rows = {"input_ids": torch.arange(10).view(1, 10), "position_ids": torch.arange(10).view(1, 10),
            "targets": F.pad(labels[:, 1:], (0, 1), value=-100)}
    local, _, _ = shard_rows(rows, ParallelDims(2, cp=2, rank=1))
    assert local["input_ids"].tolist() == [[3, 4, 5, 6, 7, 8]]
    assert local["position_ids"].tolist() == [[3, 4, 5, 6, 7, 8]]
    assert local["targets"].tolist() == [[104, 105, 106, 107, 108, 109]]
    rows["position_ids"] = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])  # two packed documents: 0-3, 4-9
    _, layout, _ = shard_rows(rows, ParallelDims(2, cp=2, rank=0))
    assert layout["query_index"].tolist() == [0, 1, 2, 9, 10, 11]
    assert layout["key_index"].tolist() == [0, 1, 2, 9, 10, 11, 3, 4, 5, 6, 7, 8]  # rank 0's chunks, then rank 1's
    masks = attention_masks((None, 3), **layout)
    key_index = layout["key_index"].tolist()

    def seen(window):
        return [sorted(key_index[k] for k in row.nonzero().flatten().tolist()) for row in masks[window][0, 0]]
    assert seen(None) == [[0], [0, 1], [0, 1, 2], list(range(4, 10)), list(range(4, 11)), list(range(4, 12))]
    assert seen(3) == [[0], [0, 1], [0, 1, 2], [7, 8, 9], [8, 9, 10], [9, 10, 11]]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # slow and exact: fine here
def test_the_gpu_block_mask_attends_as_the_whole_row_does():
    """What GPUs run (flex attention with the block mask, forward only: flex has no CPU backward):
    one packed row of three documents (150, 250, 200 tokens: blocks of 128 straddle the document
    and chunk boundaries), cp 2, each rank's queries against the gathered K/V, equal to causal
    attention within each document over the whole row, and to the dense mask the CPU path uses."""
    torch.manual_seed(0)
    lengths, heads, kv_heads, dim = (150, 250, 200), 4, 2, 16
    positions = torch.cat([torch.arange(n) for n in lengths]).view(1, -1)
    length = positions.shape[1]
    q, k, v = (torch.randn(1, h, length, dim) for h in (heads, kv_heads, kv_heads))
    document = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    whole_row = (document[:, None] == document[None, :]) & torch.ones(length, length, dtype=torch.bool).tril()
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=whole_row, enable_gqa=True)
    rows = {"input_ids": torch.zeros(1, length, dtype=torch.long), "position_ids": positions,
            "targets": torch.zeros(1, length, dtype=torch.long)}
    for rank in range(2):
        _, layout, _ = shard_rows(rows, ParallelDims(2, cp=2, rank=rank))
        mine, keys = layout["query_index"], layout["key_index"]
        block_mask = create_block_mask(visible_keys(**layout), 1, None, len(mine), len(keys), device="cpu")
        with torch.no_grad():
            flex = flex_attention(q[:, :, mine], k[:, :, keys], v[:, :, keys], block_mask=block_mask, enable_gqa=True)
        dense = F.scaled_dot_product_attention(q[:, :, mine], k[:, :, keys], v[:, :, keys],
                                               attn_mask=attention_masks((None,), **layout)[None], enable_gqa=True)
        torch.testing.assert_close(flex, expected[:, :, mine], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dense, expected[:, :, mine], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here (flex attention's compiled kernels, "
                    "whose windows, soft caps and sinks the CPU path's plain operations compute here)")
@pytest.mark.parametrize("window, softcap, sinks", [(None, None, False), (64, None, True), (None, 30.0, False),
                                                    (64, 30.0, True)], ids=lambda x: str(x))
def test_gpu_flex_attention_equals_the_plain_path(window, softcap, sinks):
    """On a GPU: the compiled flex attention with its block mask, a sliding window, a soft cap and
    attention sinks (renormalised by its log-sum-exp) against the plain operations the CPU runs (what
    the 2-rank CPU tests compare with transformers), outputs and gradients, on one packed row of three
    documents, cp rank 1 of 2."""
    from sft.parallel.context_parallel import _eager_attention, _flex_attention

    torch.manual_seed(0)
    positions = torch.cat([torch.arange(n) for n in (150, 250, 200)]).view(1, -1)
    rows = {"input_ids": torch.zeros_like(positions), "position_ids": positions, "targets": torch.zeros_like(positions)}
    _, layout, _ = shard_rows(rows, ParallelDims(2, cp=2, rank=1))
    dense = attention_masks((None, 64), **layout)[window].cuda()
    block = attention_masks((None, 64), **{k: v.cuda() for k, v in layout.items()})[window]
    leaves = [torch.randn(1, h, n, 64, device="cuda", requires_grad=True)
              for h, n in ((4, len(layout["query_index"])), (2, len(layout["key_index"])), (2, len(layout["key_index"])))]
    sink = torch.randn(4, device="cuda", requires_grad=True)
    results = []
    for attention, mask in ((_flex_attention, block), (_eager_attention, dense)):
        out = attention(*leaves, mask, 0.125, softcap, sink if sinks else None)
        grads = torch.autograd.grad(out.square().sum(), [*leaves, sink], allow_unused=True)
        results.append([out, *(g for g in grads if g is not None)])
    for flex, plain in zip(*results):
        torch.testing.assert_close(flex, plain, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("model, reason", [
    ("jamba", "linear_attention layers (JambaMambaMixer) carry state along the row"),  # Mamba: no restart
    ({"attention_dropout": 0.1}, "attention dropout is not supported"),
], ids=["Mamba", "attention dropout"])
def test_models_whose_rows_cannot_be_split_are_refused_by_name(model, reason, tmp_path):
    if isinstance(model, dict):  # the demo model with these config keys changed
        (tmp_path / "config.json").write_text(json.dumps({**json.loads((DEMO_MODEL / "config.json").read_text()),
                                                          **model}))
        model = str(tmp_path)
    elif "/" not in model:  # a tiny model of transformers' config class
        model = str(tiny_model_dir(tmp_path, model))
    meta = build_meta_model(ModelConfig(name_or_path=model))
    assert reason in cp_unsupported(meta)
    with pytest.raises(ConfigError, match=f"cp.degree=2: .*{re.escape(reason)}.*; use cp.degree=1"):
        apply_context_parallel(meta, ParallelDims(2, cp=2), None)
    # mixture-of-experts blocks split too, sliding windows (gpt-oss's attention sinks as well), Gated DeltaNet
    for accepted in (DEMO_MODEL, "configs/models/qwen3-30b-a3b", "configs/models/gpt-oss-20b",
                     "configs/models/qwen3.5-9b"):
        assert cp_unsupported(build_meta_model(ModelConfig(name_or_path=str(accepted)))) is None


def test_soft_capped_attention_in_compiled_checkpointed_blocks_is_refused(tmp_path):
    """Gemma-2's soft cap computes otherwise in compiled checkpointed blocks on GPUs (measured): one
    line naming the two switches, before anything is built; its rows split otherwise."""
    meta = build_meta_model(ModelConfig(name_or_path=str(tiny_model_dir(tmp_path, "gemma2"))))
    assert cp_unsupported(meta) is None
    with pytest.raises(ConfigError, match=r"cp.degree=2 with compile.enabled=true and ac.ratio > 0: Gemma2ForCausalLM's "
                                          r"soft-capped attention .*; set ac.ratio=0 or compile.enabled=false"):
        apply_context_parallel(meta, ParallelDims(2, cp=2), None, checkpointed_compiled=True)
