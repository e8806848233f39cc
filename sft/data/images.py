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
    value = part.get(part["type"]) if part["type"] == "image" else part.get("image_url")
    if part["type"] == "image" and value is None:
        value = part.get("url") or part.get("path")
    if isinstance(value, dict):  # {"type": "image_url", "image_url": {"url": ...}}
        value = value.get("url")
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
