"""Images in conversations: where a content part's image comes from, how many tokens it takes in
the row, and its pixels for the vision tower.

A model takes images when its checkpoint is a vision-language one whose family trains them here
(sft/models/vision.py: `IMAGE_FAMILIES`) and its files hold an image processor
(preprocessor_config.json). The chat template renders each image part as the family's placeholder
token (Qwen's `<|image_pad|>`); the row then holds that token once per vision embedding of the
image: (grid t x h x w) / merge_size², the image processor's grid for the image's size, as the
family's processor expands it. The image processor's own keys (`size`: min and max pixels) bound
the tokens per image. Images are read when the data is tokenised (a row whose image cannot be read
is dropped, naming it) and again, for their pixels, when a batch is built.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from sft.config import ModelConfig
from sft.data.masking import IMAGE_PART, IMAGE_PARTS, DropSample
from sft.data.sources import DataError
from sft.distributed import log0
from sft.models.build import ModelError, model_config
from sft.models.vision import IMAGE_FAMILIES
from sft.models.vision_language import is_vision_language

UNSUPPORTED_PARTS = ("video", "video_url", "audio", "input_audio")
IMAGE_COLUMNS = ("images", "image")  # a row's pictures beside its conversation (LLaVA, TRL, hub datasets)
PLACEHOLDER = "<image>"  # where LLaVA-style text puts a picture of the images column


def with_image_column(messages: Any, row: dict) -> Any:
    """The messages with the pictures of the row's `images` (or `image`) column as image parts: in
    place of each `<image>` in the text (LLaVA, ShareGPT), or of each image part without a picture
    (TRL's format), in order; with neither, before the first user message's text (as TRL puts
    them). A picture is a path, a URL, a decoded image (hub datasets) or {"bytes", "path"}."""
    column = next((row[name] for name in IMAGE_COLUMNS if row.get(name) is not None), None)
    pictures = [_as_source(value) for value in (column if isinstance(column, list) else [column])] if column else []
    if not pictures or not isinstance(messages, list):
        return messages
    filled, slots = iter(pictures), 0

    def picture() -> dict:  # the next picture, in a placeholder's place
        nonlocal slots
        slots += 1
        return {"type": "image", "image": next(filled, None)}

    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str) and PLACEHOLDER in content:
            first, *rest = content.split(PLACEHOLDER)
            m = {**m, "content": [{"type": "text", "text": first}] * bool(first) + [
                part for piece in rest for part in [picture()] + [{"type": "text", "text": piece}] * bool(piece)]}
        elif isinstance(content, list):
            m = {**m, "content": [picture() if isinstance(part, dict) and part.get("type") == "image"
                                  and not _has_picture(part) else part for part in content]}
        out.append(m)
    if not slots and any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS for m in out
                         if isinstance(m, dict) and isinstance(m.get("content"), list) for p in m["content"]):
        raise DropSample("the conversation's image parts hold their pictures and the row has an images column too: "
                         "keep one of the two")
    if not slots:  # no placeholder anywhere: the pictures open the first user turn
        first = next((i for i, m in enumerate(out) if isinstance(m, dict) and m.get("role") == "user"), None)
        if first is None:
            raise DropSample("the row has pictures (its images column) but no user turn to put them in")
        text = out[first].get("content")
        out[first] = {**out[first], "content": [{"type": "image", "image": p} for p in pictures] +
                      ([{"type": "text", "text": text}] if isinstance(text, str) else list(text or []))}
    elif slots != len(pictures):
        raise DropSample(f"the row's images column holds {len(pictures)} pictures and its conversation "
                         f"{slots} places for them ({PLACEHOLDER} or image parts without a picture)")
    return out


def _has_picture(part: dict) -> bool:
    return any(part.get(key) is not None for key in ("image", "url", "path"))


def _as_source(value: Any) -> str:
    """A picture of an images column as a source string: a path or URL as it is, a decoded image or
    its bytes as a data URL."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, bytes):
        return "data:image;base64," + base64.b64encode(value).decode()
    if hasattr(value, "save"):  # a PIL image (a hub dataset's decoded Image column)
        buffer = io.BytesIO()
        try:
            value.convert("RGB").save(buffer, format="PNG")
        except (OSError, ValueError) as e:
            raise DropSample(f"a picture of the images column cannot be stored ({type(e).__name__}: {e})") from None
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    if not isinstance(value, str):
        raise DropSample(f"the images column holds a {type(value).__name__}, expected paths, URLs or images")
    return value


def image_parts(messages: Any, image_dir: str, token: str) -> tuple[Any, list[str]]:
    """The messages with each image part as the chat template takes it (`IMAGE_PART`), and the
    images' sources in the order the template renders them. Video and audio parts drop the row, and
    so does text holding the placeholder `token` itself (it would take the place of a picture)."""
    if not isinstance(messages, list):
        return messages, []
    out, sources = [], []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if any(token in text for text in _texts(content)):
            raise DropSample(f"{m.get('role')} text holds the image placeholder {token} itself")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in UNSUPPORTED_PARTS:
                    raise DropSample(f"{m.get('role')} content has a {kind!r} part: only text and image parts train "
                                     "(video and audio are not supported yet)")
                if kind in IMAGE_PARTS:
                    sources.append(part_source(part, image_dir))
                    part = IMAGE_PART
                parts.append(part)
            m = {**m, "content": parts}
        out.append(m)
    return out, sources


def _texts(content: Any) -> list[str]:
    """The text of a message's content: the string, or its text parts'."""
    if isinstance(content, str):
        return [content]
    return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)] \
        if isinstance(content, list) else []


def part_source(part: dict, image_dir: str) -> str:
    """Where an image content part's image is: a data URL as written, else an absolute path
    (`file://` URLs and paths; relative ones from `image_dir`, the data file's directory)."""
    if part["type"] == "image_url":  # {"type": "image_url", "image_url": {"url": ...}} or the URL itself
        value = part.get("image_url")
        value = value.get("url") if isinstance(value, dict) else value
    else:  # {"type": "image", "image": a path, URL, decoded image or its bytes}
        value = next((part[key] for key in ("image", "url", "path") if part.get(key) is not None), None)
        value = value if value is None or isinstance(value, str) else _as_source(value)
    if not isinstance(value, str) or not value:
        raise DropSample(f"an {part['type']} part without an image: write {{\"type\": \"image_url\", \"image_url\": "
                         "{\"url\": \"path, file:// or data: URL\"}} or {\"type\": \"image\", \"image\": \"path\"}")
    if value.startswith("data:"):
        return value
    if value.startswith(("http://", "https://")):
        raise DropSample(f"image {value[:80]!r} is a web address: training reads no network; download the images "
                         "and give their paths")
    path = Path(value.removeprefix("file://"))
    return str(path if path.is_absolute() else Path(image_dir) / path)


def shown(source: str) -> str:
    """`source` as a line shows it (a data URL's first characters)."""
    return source[:60] + "..." if source.startswith("data:") else source


def open_image(source: str):
    """The RGB image at `source` (a path or a data URL), turned upright as its EXIF orientation says
    (as transformers' load_image does); DropSample naming it if it cannot be read."""
    from PIL import Image, ImageOps

    try:
        if source.startswith("data:"):
            file: Any = io.BytesIO(base64.b64decode(source.partition(",")[2], validate=True))
        else:
            file = source
        with Image.open(file) as image:
            return ImageOps.exif_transpose(image).convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:  # unreadable, not an image, too large
        raise DropSample(f"image {shown(source)!r} cannot be read ({type(e).__name__}: {e})") from None


def rows_with_images(split) -> int:
    """How many rows of a tokenised split hold an image, counted in its Arrow table without reading
    the pictures (data URLs can be megabytes each). The table under the split's row selection is the
    whole tokenised split, the dropped rows too, which hold no images: the count is the kept rows'."""
    import pyarrow.compute as pc

    if "images" not in split.column_names:
        return 0
    return pc.sum(pc.greater(pc.list_value_length(split.data.column("images")), 0)).as_py() or 0


def holds_images(*splits) -> bool:
    """Whether any row of the tokenised `splits` (None: no such split) holds an image."""
    return any(split is not None and rows_with_images(split) for split in splits)


@dataclass
class ImageTokens:
    """A model's image processor and the placeholder its chat template renders for an image."""
    processor: Any  # transformers' image processor of the checkpoint (AutoImageProcessor)
    token: str  # the placeholder as text (Qwen: <|image_pad|>)
    token_id: int
    merge_size: int  # vision embeddings merge merge_size x merge_size patches

    def count(self, source: str) -> int:
        """How many placeholder tokens (vision embeddings) the image at `source` takes; DropSample
        for one the image processor refuses (an aspect ratio over 200)."""
        width, height = open_image(source).size
        try:
            return self.processor.get_number_of_image_patches(height, width, {}) // self.merge_size**2
        except ValueError as e:
            raise DropSample(f"image {shown(source)!r} ({width} x {height}): {e}") from None

    def pixels(self, sources: list[str]) -> dict:
        """The vision tower's inputs for `sources` in order: pixel_values and image_grid_thw."""
        try:
            pictures = [open_image(s) for s in sources]
        except DropSample as e:  # read when the data was tokenised: moved or changed since
            raise DataError(f"{e}, though it was read when the data was tokenised: put it back (or clear "
                            "data.cache_dir to tokenise the data again)") from None
        return dict(self.processor(images=pictures, return_tensors="pt"))


def image_tokens(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> ImageTokens | None:
    """What image parts become for `cfg`'s model: its image processor and placeholder, or None for
    a model that takes no images here (a text model; a vision-language one is named in the log)."""
    config = model_config(cfg)
    if not is_vision_language(config):
        return None
    name = (config.architectures or [type(config).__name__])[0]
    if config.model_type not in IMAGE_FAMILIES:
        log0(f"images: {name} trains on text here; rows with images are dropped (images train for "
             f"{', '.join(IMAGE_FAMILIES.values())})")
        return None
    try:
        from transformers import AutoImageProcessor
        processor = AutoImageProcessor.from_pretrained(cfg.name_or_path)  # its preprocessor_config.json alone
    except ImportError as e:
        raise ModelError(f"images: {name}'s image processor needs a package that is missing ({e}); "
                         "pip install pillow") from None
    except OSError:
        log0(f"images: {cfg.name_or_path} has no image processor (preprocessor_config.json); rows with images are "
             "dropped")
        return None
    return ImageTokens(processor, tokenizer.convert_ids_to_tokens(config.image_token_id), config.image_token_id,
                       config.vision_config.spatial_merge_size)
