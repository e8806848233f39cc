"""Image parts into rows (sft/data/images.py, sft/data/rows.py): each image's placeholder expanded
to its number of vision embeddings, never supervised; the supervised text decoded; bad images,
video parts and cuts through an image dropped with the reason."""

from __future__ import annotations

import base64

import pytest

from helpers import image_model_dir


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from sft.config import ModelConfig
    from sft.data.images import image_tokens
    from sft.hub.tokenizer import load_tokenizer

    cfg = ModelConfig(name_or_path=str(image_model_dir(tmp_path_factory.mktemp("images"), "qwen3_5")))
    tokenizer = load_tokenizer(cfg)
    return tokenizer, image_tokens(cfg, tokenizer)


def _picture(path, size):
    from PIL import Image

    Image.new("RGB", size, "red").save(path)
    return path


def _rows(model, conversations, max_seq_len=256, images=True, image_dir="."):
    from sft.data.rows import tokenize_batch
    from sft.data.sources import SOURCE_ROW

    tokenizer, tokens = model
    return tokenize_batch({SOURCE_ROW: list(range(len(conversations))), "messages": conversations}, tokenizer,
                          "messages", max_seq_len, False, {}, tokens if images else None, str(image_dir))


def _ask(image_part, question="What colour?", answer="Red."):
    return [{"role": "user", "content": [image_part, {"type": "text", "text": question}]},
            {"role": "assistant", "content": answer}]


def test_each_image_is_its_tokens_unsupervised_and_the_answers_are_what_trains(model, tmp_path):
    from sft.data.masking import IGNORE_INDEX

    tokenizer, tokens = model
    _picture(tmp_path / "wide.png", (64, 32))  # 4 x 2 patches of 16 pixels, merged 2 x 2: 2 tokens
    square = _picture(tmp_path / "square.png", (64, 64))  # 4 tokens
    encoded = base64.b64encode(square.read_bytes()).decode()
    conversation = _ask({"type": "image_url", "image_url": {"url": "wide.png"}}) + [
        {"role": "user", "content": [{"type": "text", "text": "And this one?"},
                                     {"type": "image", "image": f"data:image/png;base64,{encoded}"}]},
        {"role": "assistant", "content": "Also red."}]
    out = _rows(model, [conversation], image_dir=tmp_path)
    assert out["drop_reason"] == [""]
    ids, labels = out["input_ids"][0], out["labels"][0]
    assert out["images"][0] == [str(tmp_path / "wide.png"), f"data:image/png;base64,{encoded}"]
    runs = tokenizer.decode(ids).split("<|vision_start|>")[1:]
    assert [run.split("<|vision_end|>")[0].count("<|image_pad|>") for run in runs] == [2, 4]
    assert all(label == IGNORE_INDEX for token, label in zip(ids, labels) if token == tokens.token_id)
    supervised = tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE_INDEX])
    assert supervised == "Red.<|im_end|>Also red.<|im_end|>"
    assert tokenizer.decode(ids).startswith("<|im_start|>user\n<|vision_start|><|image_pad|>")


@pytest.mark.parametrize("part,max_seq_len,images,reason", [
    ({"type": "image_url", "image_url": {"url": "missing.png"}}, 256, True, "cannot be read"),
    ({"type": "image", "image": "not_an_image.png"}, 256, True, "cannot be read (UnidentifiedImageError"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, 256, True, "is a web address"),
    ({"type": "video", "video": "clip.mp4"}, 256, True, "'video' part: only text and image parts train"),
    ({"type": "image_url", "image_url": {}}, 256, True, "an image_url part without an image"),
    ({"type": "image", "image": "square.png"}, 256, False, "content has an image: this model takes none"),
    ({"type": "text", "text": "see <|image_pad|>"}, 256, True, "text holds the image placeholder <|image_pad|>"),
])
def test_a_row_whose_image_cannot_train_is_dropped_with_the_reason(model, tmp_path, part, max_seq_len, images,
                                                                     reason):
    _picture(tmp_path / "square.png", (64, 64))
    (tmp_path / "not_an_image.png").write_text("hello")
    out = _rows(model, [_ask(part)], max_seq_len, images, tmp_path)
    assert reason in out["drop_reason"][0]
    assert out["input_ids"] == [[]] and out["images"] == [[]]


def test_a_cut_keeps_the_images_before_it_and_drops_a_row_it_cuts_an_image_of(model, tmp_path):
    _, tokens = model
    _picture(tmp_path / "square.png", (64, 64))
    conversation = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Fine."},
                    *_ask({"type": "image", "image": "square.png"})]
    whole = _rows(model, [conversation], 256, image_dir=tmp_path)
    ids, picture = whole["input_ids"][0], [str(tmp_path / "square.png")]
    first = ids.index(tokens.token_id)
    assert whole["images"] == [picture]
    for cut, reason, images in ((len(ids) - 1, "", picture), (first + 4, "", picture), (first, "", []),
                                (first + 2, "data.max_seq_len cuts through an image", [])):
        out = _rows(model, [conversation], cut, image_dir=tmp_path)
        assert (out["drop_reason"][0].split(":")[0], out["images"][0]) == (reason, images), cut
