"""Context parallelism: the split and the attention of one cp rank against plain causal attention
(in process), and end to end (train.py on 2 gloo ranks): cp 2 trains as cp 1 on the same global
batches, and a checkpoint resumes at another degree. The gradient tables (cp 2 and 4 vs the
single-process Hugging Face reference, packed and padded) and the leakage probe are in
test_distributed.py; the planner's cp rows in test_plan.py."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from helpers import eval_losses, run_demo, train_losses
from sft.context_parallel import ContextParallel, _HeadTailCausalAttention, _whole_row_order
from sft.metrics import read_metrics


@pytest.mark.parametrize("degree", [2, 4])
def test_each_rank_attends_causally_over_the_whole_row(degree):
    """Every cp rank's two chunks, attending to the row's keys in whole-row order (one document per
    row: blocks merged by log-sum-exp), give the rows of plain causal attention, gradients too."""
    torch.manual_seed(0)
    rows, heads, kv_heads, length, dim = 2, 4, 2, 16 * degree, 8
    q, k, v = (torch.randn(rows, h, length, dim, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(rows, heads, length, dim)
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(grad)
    reference = [t.grad.clone() for t in (q, k, v)]
    with torch.no_grad():
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    q_grad, k_grad, v_grad = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(degree):
        cp = ContextParallel(degree=degree, rank=rank)
        mine = cp._chunks(rank, length // (2 * degree))
        q_local = q.detach()[:, :, mine].requires_grad_()
        k_whole, v_whole = k.detach().requires_grad_(), v.detach().requires_grad_()
        out = _HeadTailCausalAttention.apply(q_local, k_whole, v_whole, (rank, 2 * degree - 1 - rank), None)
        torch.testing.assert_close(out, expected[:, :, mine], rtol=1e-5, atol=1e-6)  # float32 sums reordered
        out.backward(grad[:, :, mine])
        q_grad[:, :, mine] += q_local.grad
        k_grad += k_whole.grad
        v_grad += v_whole.grad
    for got, want in zip((q_grad, k_grad, v_grad), reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gathered_chunks_return_to_whole_row_order():
    degree, size = 3, 2
    cp = ContextParallel(degree=degree)
    gathered = torch.cat([cp._chunks(r, size) for r in range(degree)])  # what rank r holds, in rank order
    whole = _whole_row_order(gathered.view(1, 1, -1, 1).float(), degree).flatten()
    assert whole.tolist() == list(range(2 * degree * size))


def test_rows_are_split_head_tail_with_targets_shifted_on_the_whole_row():
    """Row of 10 tokens, cp 2: padded to 12, rank 1 keeps chunks 1 and 2 (tokens 3-5 and 6-8); token
    5's target is token 6's label though token 6 sits in the other chunk; the padding is never a
    target; one document per row needs no mask, packed rows get the layout."""
    labels = torch.arange(100, 110).view(1, 10)
    rows = {"input_ids": torch.arange(10).view(1, 10), "position_ids": torch.arange(10).view(1, 10),
            "targets": F.pad(labels[:, 1:], (0, 1), value=-100)}
    local, layout = ContextParallel(degree=2, rank=1).shard_rows(rows)
    assert local["input_ids"].tolist() == [[3, 4, 5, 6, 7, 8]]
    assert local["position_ids"].tolist() == [[3, 4, 5, 6, 7, 8]]
    assert local["targets"].tolist() == [[104, 105, 106, 107, 108, 109]]
    assert layout == {}
    rows["position_ids"] = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])  # two packed documents
    _, layout = ContextParallel(degree=2, rank=0).shard_rows(rows)
    assert layout["query_index"].tolist() == [0, 1, 2, 9, 10, 11]
    assert layout["query_doc"].tolist() == [[1, 1, 1, 2, 2, 2]]

# (run, ranks, cp.degree): the same global batch of 8 packed rows (micro-batch 2 x grad-accum 4 x
# ranks / cp.degree = 1 data-parallel rank).
LAYOUTS = [("cp1", 1, 1), ("cp2", 2, 2)]


def demo_cp(data, out, name, nproc, cp):
    return run_demo(data, out, name, "data.packing=true", "train.max_steps=20", "train.micro_batch_size=2",
                    "train.grad_accum_steps=4", f"cp.degree={cp}", "eval.every_steps=10",
                    "checkpoint.every_steps=10", "checkpoint.export_hf=false", nproc=nproc)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, demo_data):
    out = tmp_path_factory.mktemp("cp")
    for name, nproc, cp in LAYOUTS:
        demo_cp(demo_data, out, name, nproc, cp)
    return out


@pytest.mark.slow
def test_cp2_trains_as_cp1(layouts):
    """20 steps of packed rows: every step's loss and grad norm agree (only summation orders differ),
    and each token is counted once (tokens, supervised tokens, eval)."""
    one, two = train_losses(layouts / "cp1"), train_losses(layouts / "cp2")
    assert sorted(one) == sorted(two) == list(range(1, 21))
    for step, (loss, norm) in one.items():
        assert two[step][0] == pytest.approx(loss, rel=1e-5)
        assert two[step][1] == pytest.approx(norm, rel=1e-4)
    assert eval_losses(layouts / "cp2") == pytest.approx(eval_losses(layouts / "cp1"), rel=1e-5)
    (steps1, _), (steps2, _) = read_metrics(layouts / "cp1"), read_metrics(layouts / "cp2")
    for step, entry in steps1.items():
        assert (steps2[step]["tokens"], steps2[step]["supervised_tokens"]) == (entry["tokens"], entry["supervised_tokens"])


@pytest.mark.slow
@pytest.mark.parametrize("source, nproc, cp", [("cp1", 2, 2), ("cp2", 1, 1)], ids=["cp1 -> cp2", "cp2 -> cp1"])
def test_checkpoint_resumes_at_another_cp_degree(layouts, demo_data, source, nproc, cp):
    name = f"{source}-resumed-at-cp{cp}"
    target = layouts / name / "checkpoints"
    target.mkdir(parents=True)
    shutil.copytree(layouts / source / "checkpoints" / "step-10", target / "step-10")
    proc = demo_cp(demo_data, layouts, name, nproc, cp)
    assert f"resumed from {target / 'step-10'} (step 10" in proc.stdout
    resumed, reference = train_losses(layouts / name), train_losses(layouts / source)
    assert sorted(resumed) == list(range(11, 21))
    for step, (loss, norm) in resumed.items():
        assert loss == pytest.approx(reference[step][0], rel=1e-5)
        assert norm == pytest.approx(reference[step][1], rel=1e-4)
