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
from sft.data.masking import IMAGE_PART, DropSample
from sft.distributed import log0
from sft.hub.weights import files_directory
from sft.models.build import ModelError, model_config
from sft.models.vision import IMAGE_FAMILIES
from sft.models.vision_language import is_vision_language

IMAGE_PARTS = ("image", "image_url")
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
        value.save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    if not isinstance(value, str):
        raise DropSample(f"the images column holds a {type(value).__name__}, expected paths, URLs or images")
    return value


def image_parts(messages: Any, image_dir: str) -> tuple[Any, list[str]]:
    """The messages with each image part as the chat template takes it (`IMAGE_PART`), and the
    images' sources in the order the template renders them. Video and audio parts drop the row."""
    if not isinstance(messages, list):
        return messages, []
    out, sources = [], []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
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


def open_image(source: str):
    """The RGB image at `source` (a path or a data URL); DropSample naming it if it cannot be read."""
    from PIL import Image, UnidentifiedImageError

    shown = source[:60] + "..." if source.startswith("data:") else source
    try:
        if source.startswith("data:"):
            file: Any = io.BytesIO(base64.b64decode(source.partition(",")[2], validate=True))
        else:
            file = source
        with Image.open(file) as image:
            return image.convert("RGB")
    except (OSError, ValueError, UnidentifiedImageError) as e:
        raise DropSample(f"image {shown!r} cannot be read ({type(e).__name__}: {e})") from None


def holds_images(*splits) -> bool:
    """Whether any row of the tokenised `splits` (None: no such split) holds an image."""
    return any(split is not None and any(split["images"]) for split in splits)


@dataclass
class ImageTokens:
    """A model's image processor and the placeholder its chat template renders for an image."""
    processor: Any  # transformers' image processor of the checkpoint (AutoImageProcessor)
    token: str  # the placeholder as text (Qwen: <|image_pad|>)
    token_id: int
    merge_size: int  # vision embeddings merge merge_size x merge_size patches

    def count(self, image) -> int:
        """How many placeholder tokens (vision embeddings) `image` takes."""
        width, height = image.size
        return self.processor.get_number_of_image_patches(height, width, {}) // self.merge_size**2

    def pixels(self, sources: list[str]) -> dict:
        """The vision tower's inputs for `sources` in order: pixel_values and image_grid_thw."""
        return dict(self.processor(images=[open_image(s) for s in sources], return_tensors="pt"))


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
    source = files_directory(cfg.name_or_path)
    if not (source / "preprocessor_config.json").is_file():
        log0(f"images: {source} has no image processor (preprocessor_config.json); rows with images are dropped")
        return None
    try:
        from transformers import AutoImageProcessor
        processor = AutoImageProcessor.from_pretrained(source)
    except ImportError as e:
        raise ModelError(f"images: {name}'s image processor needs a package that is missing ({e}); "
                         "pip install pillow") from None
    return ImageTokens(processor, tokenizer.convert_ids_to_tokens(config.image_token_id), config.image_token_id,
                       config.vision_config.spatial_merge_size)
