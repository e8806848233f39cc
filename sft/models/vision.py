"""Images into the language model: the vision tower of a vision-language checkpoint, frozen.

The trained model is the checkpoint's language model (sft/models/vision_language.py). For rows with
images, the tower (transformers' own modules of the vision-language model, built from its config
and loaded from the checkpoint's files) turns each micro-batch's pixels into one embedding per
image placeholder token; the fused loss puts them in place of those tokens' embeddings and runs the
language model on them (sft/training/loss.py), with the positions the family gives image tokens
(multimodal rotary: t, h, w per token, from transformers' `get_rope_index`) and, for Qwen3-VL, the
tower's features added in the first blocks (deepstack). That is the vision-language class's forward,
piece by piece, so its loss is the class's (tests/integration/test_images.py).

The tower is frozen (its weights as the files hold them; the export keeps them byte for byte) and
runs without autograd, in the run's compute dtype, whole on every rank: Qwen3.5's is ~0.4B parameters.
Packed rows with images keep their documents apart by the text positions, which restart at each
document (the decoder's masks are built from them; rotary attention being relative, each document's
multimodal positions need no restart, but get one: they are as the document alone would have them).
Context parallelism over rows with images is refused (build_training_model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AutoModelForImageTextToText, PretrainedConfig

from sft.distributed import to_device
from sft.errors import UserError
from sft.models.build import parameters_on_meta

# The families whose images train here: mrope positions from get_rope_index, one placeholder token
# per merged patch (their processors expand it so), features in place of the placeholders.
IMAGE_FAMILIES = {"qwen3_5": "Qwen3.5", "qwen3_5_moe": "Qwen3.5-MoE", "qwen3_vl": "Qwen3-VL",
                  "qwen3_vl_moe": "Qwen3-VL-MoE", "qwen2_5_vl": "Qwen2.5-VL", "glm4v": "GLM-4.1V",
                  "glm4v_moe": "GLM-4.5V"}


@dataclass
class ImageInputs:
    """A micro-batch's images as the language model takes them (on the device)."""
    mask: torch.Tensor  # [rows, length]: the image placeholder tokens
    embeddings: torch.Tensor  # [placeholders, hidden]: the tower's, in the mask's order
    position_ids: torch.Tensor  # [4, rows, length]: the text positions, then the multimodal rotary ones
    extra: dict = field(default_factory=dict)  # the family's further decoder inputs (Qwen3-VL's deepstack)

    def decoder_inputs(self, embed: nn.Module, input_ids: torch.Tensor) -> dict:
        """The decoder's inputs: token embeddings with the images' in place of their placeholders."""
        tokens = embed(input_ids)
        inputs_embeds = tokens.masked_scatter(self.mask[..., None], self.embeddings.to(tokens.dtype))
        return {"inputs_embeds": inputs_embeds, "position_ids": self.position_ids, **self.extra}


class VisionTower:
    """The frozen vision tower of the vision-language checkpoint of `config`, on `device` in `dtype`:
    `read(whole)` gives the parameters of `whole`, the class built on the meta device, outside its
    language model, by their names there (SafetensorsWeights.read_outside_language_model)."""

    def __init__(self, config: PretrainedConfig, read: Callable[[nn.Module], dict[str, torch.Tensor]],
                 device: torch.device, dtype: torch.dtype):
        with parameters_on_meta():
            whole = AutoModelForImageTextToText.from_config(config)
        for name, tensor in read(whole).items():
            module, _, leaf = name.rpartition(".")
            setattr(whole.get_submodule(module), leaf, nn.Parameter(tensor.to(device, dtype), requires_grad=False))
        self.model = whole.model  # transformers' vision-language model: tower, projector, language model
        del self.model.language_model  # trained as the run's model
        for name, buffer in list(self.model.named_buffers()):  # real already (rotary frequencies): kept as made
            module, _, leaf = name.rpartition(".")
            setattr(self.model.get_submodule(module), leaf, buffer.to(device))
        self.model.eval()
        self.token_id, self.device = config.image_token_id, device
        self.merge_size = config.vision_config.spatial_merge_size  # merge_size x merge_size patches an embedding

    def host_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor, pixels: dict[str, torch.Tensor]
                    ) -> dict[str, torch.Tensor]:
        """On the host, for a micro-batch of `input_ids` and `position_ids` (restarting at each packed
        document) with its images' `pixels` (the image processor's pixel_values and image_grid_thw):
        those, the placeholder mask and the positions the decoder takes: the text positions, then the
        multimodal ones (t, h, w), each document's from transformers' get_rope_index."""
        mask = input_ids == self.token_id
        if (embeddings := int((pixels["image_grid_thw"].prod(-1) // self.merge_size**2).sum())) != int(mask.sum()):
            raise UserError(f"images: a micro-batch holds {int(mask.sum())} image tokens and its pictures make "
                            f"{embeddings} vision embeddings: a picture changed since the data was tokenised; clear "
                            "data.cache_dir to tokenise it again")
        grids = iter(pixels["image_grid_thw"])
        multimodal = torch.empty((3, *input_ids.shape), dtype=torch.long)
        for row, starts in enumerate(position_ids == 0):
            bounds = [*starts.nonzero().flatten().tolist(), input_ids.shape[1]]
            for start, end in zip(bounds, bounds[1:]):
                document = mask[row, start:end]
                images = int((document & ~torch.cat([document.new_zeros(1), document[:-1]])).sum())
                grid = torch.stack([next(grids) for _ in range(images)]) if images else None
                positions, _ = self.model.get_rope_index(input_ids[None, row, start:end],
                                                         mm_token_type_ids=document[None].int(), image_grid_thw=grid)
                multimodal[:, row, start:end] = positions[:, 0]
        return {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"], "mask": mask,
                "position_ids": torch.cat([position_ids[None], multimodal])}

    @torch.no_grad()
    def inputs(self, host: dict[str, torch.Tensor]) -> ImageInputs:
        """The micro-batch's ImageInputs from `host_inputs`."""
        host = {name: to_device(value, self.device) for name, value in host.items()}
        out = self.model.get_image_features(host["pixel_values"], host["image_grid_thw"], return_dict=True)
        extra = {}
        if (deepstack := getattr(out, "deepstack_features", None)) is not None:
            extra = {"visual_pos_masks": host["mask"],
                     "deepstack_visual_embeds": [f if isinstance(f, torch.Tensor) else torch.cat(f) for f in deepstack]}
        return ImageInputs(host["mask"], torch.cat(list(out.pooler_output)), host["position_ids"], extra)

