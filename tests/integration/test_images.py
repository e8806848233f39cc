"""Images in conversations (sft/data/images.py, sft/models/vision.py): tiny Qwen3.5, Qwen3-VL-MoE, Qwen2.5-VL
and GLM-4.5V train on questions about pictures, their losses transformers' own vision-language class's on the
same rows and pixels, on 1 and 2 ranks; the export is the original checkpoint, tower unchanged;
packed rows with images give the loss and gradients of padded ones."""

from __future__ import annotations

import pytest
import torch

from helpers import eval_losses, image_model_dir, run_demo


def hf_image_eval_loss(model, data, model_dir) -> float:
    """transformers' own loss of the vision-language `model` on the eval set of `data` (tokenised as
    the run tokenises it; pixels from the checkpoint's image processor, as its processor gives
    them), averaged over supervised tokens: what a run's eval reports."""
    from transformers import AutoImageProcessor

    from sft.config import ModelConfig, load_config
    from sft.data.collate import collate
    from sft.data.images import image_tokens, open_image
    from sft.data.prepare import load_sft_data
    from sft.hub.tokenizer import load_tokenizer

    cfg = load_config("configs/demo.yaml", [f"data.path={data / 'train.jsonl'}", f"data.eval_path={data / 'eval.jsonl'}"])
    model_cfg = ModelConfig(name_or_path=str(model_dir))
    tokenizer = load_tokenizer(model_cfg)
    _, evals = load_sft_data(cfg.data, tokenizer, 0, image_tokens(model_cfg, tokenizer))
    processor = AutoImageProcessor.from_pretrained(model_dir)
    ce, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(evals), 8):
            rows = [evals[i] for i in range(start, min(start + 8, len(evals)))]
            batch = collate(rows, 0, 256)
            pixels = processor(images=[open_image(s) for row in rows for s in row["images"]], return_tensors="pt")
            n = int((batch["labels"][:, 1:] != -100).sum())
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False,
                         mm_token_type_ids=(batch["input_ids"] == model.config.image_token_id).int(), **pixels).loss
            ce += loss.item() * n
            count += n
    return ce / count


@pytest.mark.slow
@pytest.mark.parametrize("model_type,nproc", [("qwen3_5", 2), ("qwen3_vl_moe", 1), ("qwen2_5_vl", 1), ("glm4v_moe", 2)])
def test_images_train_as_the_vision_language_class_computes_them(tmp_path, image_data, model_type, nproc):
    """Qwen3.5 (Gated DeltaNet, multimodal rotary positions) and GLM-4.5V (routed experts, 14-pixel
    patches) on 2 ranks, Qwen3-VL-MoE (the tower's deepstack features added in the first block) and
    Qwen2.5-VL (files as it was published: the tower under visual.) on 1: the run's first eval equals
    transformers' vision-language class on the original files, its last eval that class loaded from
    the export; the export's vision tower is the original's. (Qwen3-VL and GLM-4.1V are these
    families' dense models, of the same towers and positions.)"""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    def tensors(directory):
        return {name: t for file in sorted(directory.glob("*.safetensors")) for name, t in load_file(file).items()}

    source = image_model_dir(tmp_path, model_type)
    run = run_demo(image_data, tmp_path, "images", "model.init=pretrained", f"model.name_or_path={source}",
                   "train.max_steps=3", "eval.every_steps=3", nproc=nproc)
    assert "64 train samples (64 with images)" in run.stdout
    first, last = eval_losses(tmp_path / "images")[0], eval_losses(tmp_path / "images")[-1]
    assert last < first
    original = AutoModelForImageTextToText.from_pretrained(source)
    assert hf_image_eval_loss(original, image_data, source) == pytest.approx(first, rel=1e-5)
    export = tmp_path / "images" / "export"
    exported = AutoModelForImageTextToText.from_pretrained(export)
    assert hf_image_eval_loss(exported, image_data, export) == pytest.approx(last, rel=1e-5)  # its own processor
    before, after = tensors(source), tensors(export)
    tower = [name for name in before if "visual." in name]  # model.visual. as saved, visual. as Qwen2.5-VL was published
    assert tower and all(torch.equal(before[name], after[name]) for name in tower)


@pytest.fixture
def world_of_one():
    """A process group of one for an in-process build (tests/zoo.py: `_one_rank`), gone after the test."""
    from zoo import _one_rank

    yield _one_rank()
    import torch.distributed as dist

    dist.destroy_process_group()


def test_packed_rows_with_images_equal_padded_ones(tmp_path, world_of_one):
    """Qwen3.5-MoE (our routed experts and gated shared expert; Gated DeltaNet layers restart at each
    document; each document's multimodal positions start afresh): four conversations about pictures
    of different sizes and colours (one with two pictures) packed two to a row, in another order,
    give the loss and every gradient of the same four padded, as a run builds the model (packing on,
    one rank): each picture reaches its own placeholders."""
    import dataclasses
    import json

    from PIL import Image

    from sft.checkpoint.model_weights import load_model_weights
    from sft.config import Config, DataConfig, FSDPConfig, ModelConfig
    from sft.data.batches import MicroBatches
    from sft.data.images import image_tokens
    from sft.data.prepare import load_sft_data
    from sft.hub.tokenizer import load_tokenizer
    from sft.parallel.mesh import ParallelDims
    from sft.training.loss import forward_backward
    from sft.training.model import build_training_model

    def ask(*pictures):
        for name, size, colour in pictures:
            Image.new("RGB", size, colour).save(tmp_path / name)
        parts = [{"type": "image", "image": name} for name, _, _ in pictures]
        return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Colours?"}]},
                             {"role": "assistant", "content": " and ".join(c for _, _, c in pictures) + "."}]}

    conversations = [ask(("a.png", (64, 32), "red")), ask(("b.png", (96, 96), "blue")),
                     ask(("c.png", (64, 64), "green"), ("d.png", (32, 64), "yellow")), ask(("e.png", (64, 64), "black"))]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations))
    data = DataConfig(path=str(tmp_path / "data.jsonl"), packing=True, cache_dir=str(tmp_path / "cache"))
    run = Config(model=ModelConfig(name_or_path=str(image_model_dir(tmp_path, "qwen3_5_moe")), init="pretrained"),
                 data=data, fsdp=FSDPConfig(param_dtype="float32"))
    tokenizer = load_tokenizer(run.model)
    images = image_tokens(run.model, tokenizer)
    rows, _ = load_sft_data(data, tokenizer, 0, images)
    built = build_training_model(run, ParallelDims(1).build("cpu"), world_of_one.device, images)
    load_model_weights(run, built.model, world_of_one)
    padded, _ = MicroBatches(rows, 0, dataclasses.replace(data, packing=False))([0, 1, 2, 3])
    packed, _ = MicroBatches(rows, 0, data, packed_rows=[[2, 0], [3, 1]])([0, 1])
    assert packed["images"] == [source for i in (2, 0, 3, 1) for source in rows[i]["images"]]
    assert sorted(map(len, rows["images"])) == [1, 1, 1, 2]

    def loss_and_grads(batch):
        built.model.zero_grad()
        ce, _ = forward_backward(built, [batch], world_of_one.device)
        return ce.item(), {name: p.grad.full_tensor().clone() for name, p in built.model.named_parameters()}

    (as_padded, padded_grads), (as_packed, packed_grads) = loss_and_grads(padded), loss_and_grads(packed)
    assert as_packed == pytest.approx(as_padded, rel=1e-6)
    for name, grad in padded_grads.items():  # the zoo's bound: within 1e-4 of the tensor's largest entry
        assert (packed_grads[name] - grad).abs().max() <= 1e-4 * grad.abs().max(), name
