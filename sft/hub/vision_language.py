"""A vision-language checkpoint's files: where they keep the language model that is trained, and
the tensors beyond it (the vision tower, its projector...) that each checkpoint's hf/ keeps as the
files hold them (`KEPT`), so that an export is the original checkpoint (sft/models/vision_language.py).

The files name the language model's tensors under a prefix of their own: "model.language_model."
as transformers 5 saves Qwen3.5 and Qwen3-VL, "language_model.model." as Gemma-3, Mistral-3 and
Llama-4 were published; the head is `lm_head.weight` or `language_model.lm_head.weight`. Both are
found in the files (by the embedding's name and shape), not from a list of families.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# The kept tensors in a checkpoint's hf/; its metadata records the language model's names in the files.
KEPT = "kept.safetensors"
# The processor's files beside the tokenizer's: kept in hf/ and exported, so the export takes images as the original
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def copy_processor_files(source: Path, out: Path) -> None:
    """The processor files (`PROCESSOR_FILES`) `source` holds, copied into `out`."""
    for name in PROCESSOR_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)


@dataclass(frozen=True)
class FileNames:
    """How a checkpoint's files name the parameters of the language model that is trained:
    `<base>.X` as `prefix + X`, the head `lm_head.weight` as `head`. The identity for a text model."""
    base: str = "model."
    prefix: str = "model."
    head: str = "lm_head.weight"

    def of(self, name: str) -> str:
        """The files' name of parameter (or hub tensor) `name` of the language model."""
        if name == "lm_head.weight":
            return self.head
        return self.prefix + name.removeprefix(self.base) if name.startswith(self.base) else name

    def in_model(self, file_name: str) -> str | None:
        """The language model's name of the files' tensor `file_name`; None for a tensor outside it
        (the vision tower), as `of` in reverse."""
        if file_name == self.head:
            return "lm_head.weight"
        if file_name.startswith(self.prefix):
            return self.base + file_name.removeprefix(self.prefix)
        return file_name if self.prefix == self.base else None

    def metadata(self) -> dict[str, str]:
        return {"sft.base": self.base, "sft.prefix": self.prefix, "sft.head": self.head}

    @classmethod
    def from_metadata(cls, metadata: dict[str, str]) -> FileNames:
        return cls(metadata["sft.base"], metadata["sft.prefix"], metadata["sft.head"])


def checkpoint_class(directory: Path) -> tuple[str, str] | None:
    """The class and model type that a vision-language checkpoint's config.json names (by which
    transformers finds its conversions of the files' tensors); None for a text model's."""
    config = json.loads((directory / "config.json").read_text())
    if "text_config" not in config:
        return None
    return (config.get("architectures") or [""])[0], config.get("model_type", "")


def file_names(file_shapes: dict[str, tuple[int, ...]], base: str, embedding: tuple[int, ...]) -> FileNames:
    """Where the files keep the language model whose parameters are `<base>.X`: found by its token
    embedding (`<base>.embed_tokens.weight`, of shape `embedding`), the only tensor of that name
    and shape among the files' (`file_shapes`); the identity where the files use the model's names
    (or none or several match: check() then names what is missing)."""
    identity = FileNames(f"{base}.", f"{base}.", "lm_head.weight")
    found = [name for name, shape in file_shapes.items()
             if name.endswith(".embed_tokens.weight") and tuple(shape) == tuple(embedding)]
    if f"{base}.embed_tokens.weight" in file_shapes or len(found) != 1:
        return identity
    heads = [name for name in file_shapes if name.endswith("lm_head.weight")]
    return FileNames(f"{base}.", found[0].removesuffix("embed_tokens.weight"),
                     heads[0] if len(heads) == 1 else "lm_head.weight")


def kept_names(file_names_: Iterable[str], trained: Iterable[str]) -> list[str]:
    """The files' tensors that the trained model does not hold (its parameters, by their names in
    the files: `trained`): the vision tower and the rest, kept as they are."""
    trained = set(trained)
    return sorted(name for name in file_names_ if name not in trained)
