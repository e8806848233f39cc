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


def _rows(model, conversations, max_seq_len=256, takes_images=True, image_dir=".", fmt="messages", **columns):
    from sft.data.rows import tokenize_batch
    from sft.data.sources import SOURCE_ROW

    tokenizer, tokens = model
    return tokenize_batch({SOURCE_ROW: list(range(len(conversations))), fmt: conversations, **columns}, tokenizer,
                          fmt, max_seq_len, False, {}, tokens if takes_images else None, str(image_dir))


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


def test_pictures_of_an_images_column_fill_llava_placeholders_trl_parts_or_open_the_first_turn(model, tmp_path):
    """LLaVA/ShareGPT rows (`<image>` in the text, the picture in an `image` column), TRL's rows (image
    parts without a picture, the pictures decoded in an `images` column, as a hub dataset gives them)
    and an images column with no placeholder at all train the same row as the OpenAI image part."""
    from PIL import Image

    tokenizer, _ = model
    _picture(tmp_path / "square.png", (64, 64))
    openai = _rows(model, [_ask({"type": "image_url", "image_url": {"url": "square.png"}})], image_dir=tmp_path)
    llava = _rows(model, [[{"from": "human", "value": "<image>What colour?"}, {"from": "gpt", "value": "Red."}]],
                  image_dir=tmp_path, fmt="conversations", image=["square.png"])
    decoded = Image.open(tmp_path / "square.png")
    trl = _rows(model, [_ask({"type": "image"})], image_dir=tmp_path, images=[[decoded]])
    unplaced = _rows(model, [[{"role": "user", "content": "What colour?"}, {"role": "assistant", "content": "Red."}]],
                     image_dir=tmp_path, images=[["square.png"]])
    for out in (llava, trl, unplaced):
        assert out["drop_reason"] == [""]
        assert (out["input_ids"], out["labels"]) == (openai["input_ids"], openai["labels"])
    assert llava["images"] == openai["images"] == [[str(tmp_path / "square.png")]]
    assert trl["images"][0][0].startswith("data:image/png;base64,")
    assert tokenizer.decode(llava["input_ids"][0]).startswith("<|im_start|>user\n<|vision_start|><|image_pad|>")
    mismatch = _rows(model, [[{"from": "human", "value": "<image><image>What?"}, {"from": "gpt", "value": "Red."}]],
                     image_dir=tmp_path, fmt="conversations", image=["square.png"])
    assert mismatch["drop_reason"] == ["the row's images column holds 1 pictures and its conversation 2 places for "
                                       "them (<image> or image parts without a picture)"]


def test_a_parquet_file_with_an_image_column_trains_its_decoded_pictures(model, tmp_path):
    """A dataset as the hub stores one (parquet, an Image column of pictures, TRL's image parts): the
    pictures arrive decoded and train as data URLs."""
    import datasets

    from sft.config import DataConfig
    from sft.data.prepare import load_sft_data

    tokenizer, tokens = model
    picture = _picture(tmp_path / "square.png", (64, 64))
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "Red."}]}]
    rows = datasets.Dataset.from_dict({"messages": [conversation] * 2, "images": [[str(picture)]] * 2})
    rows.cast_column("images", datasets.List(datasets.Image())).to_parquet(str(tmp_path / "train.parquet"))
    train, _ = load_sft_data(DataConfig(path=str(tmp_path / "train.parquet"), cache_dir=str(tmp_path / "cache")),
                             tokenizer, 0, tokens)
    assert len(train) == 2 and train[0]["images"][0].startswith("data:image/png;base64,")
    assert train[0]["input_ids"].count(tokens.token_id) == 4


REWRITING_TEMPLATE = (  # ChatML whose earlier assistant turns read "(earlier)": every turn trains in a row of its own
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' and not loop.last -%}{{- '(earlier)<|im_end|>\\n' -}}"
    "{%- elif message['content'] is string -%}{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- else -%}{{- part['text'] -}}{%- endif -%}{%- endfor -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def test_a_template_that_rewrites_history_gives_each_row_the_pictures_it_shows(model, tmp_path):
    """Where the chat template rewrites earlier turns (as Qwen3.5's drops their reasoning), each turn
    trains in its own row: the first row shows the first picture, the second both, in order."""
    import copy

    tokenizer, tokens = model
    rewriting = copy.deepcopy(tokenizer)
    rewriting.chat_template = REWRITING_TEMPLATE
    _picture(tmp_path / "one.png", (64, 64))
    _picture(tmp_path / "two.png", (64, 32))
    conversation = _ask({"type": "image", "image": "one.png"}, "First?", "Red.") + \
        _ask({"type": "image", "image": "two.png"}, "Second?", "Also red.")
    out = _rows((rewriting, tokens), [conversation], image_dir=tmp_path)
    assert out["drop_reason"] == ["", ""]
    assert out["images"] == [[str(tmp_path / "one.png")], [str(tmp_path / "one.png"), str(tmp_path / "two.png")]]
    assert [ids.count(tokens.token_id) for ids in out["input_ids"]] == [4, 6]
