"""The hub's file layout (sft/hub/layout.py): checkpoints as transformers saves them (`save_pretrained`,
the layout they are published in) load into the model, whole or any slice, and an export writes what
`save_pretrained` writes. The families of the table store tensors otherwise than the model holds them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from helpers import VISION_LANGUAGE, tiny_config, vision_language_model_dir
from sft.config import ModelConfig
from sft.models.build import build_meta_model
from sft.hub.layout import to_hub_tensors
from sft.hub.weights import SafetensorsWeights

# (family, config overrides, a tensor of its files that the model names otherwise)
LAYOUTS = [
    # q/k/v convolutions the model concatenates; the sparse block renamed; experts one tensor each
    ("kimi_linear", dict(layer_types=["linear_attention", "full_attention"], num_key_value_heads=4,
                         linear_num_heads=2, linear_head_dim=16), "model.layers.0.self_attn.q_conv1d.weight"),
    ("olmo_hybrid", {}, "model.layers.0.attention_layer_norm.weight"),  # renamed norms, q/k/v convolutions
    ("sarvam_moe", {}, "model.layers.0.attention.query_key_value.weight"),  # one q/k/v projection the model splits
    ("gpt_neox", {}, "embed_out.weight"),  # a renaming transformers keys by class name
    ("nemotron_h", {}, "backbone.embeddings.weight"),  # another prefix; experts without a gate
    ("phimoe", {"router_jitter_noise": 0.0}, "model.layers.0.block_sparse_moe.experts.3.w1.weight"),
    ("granitemoe", {}, "model.layers.0.block_sparse_moe.input_linear.weight"),
]
IDS = [row[0] for row in LAYOUTS]


def _saved(tmp_path, family, overrides):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    with torch.no_grad():  # every tensor off its init, so that a tensor read from the wrong place is seen
        for tensor in model.state_dict().values():
            tensor.copy_(torch.randn_like(tensor) if tensor.is_floating_point() else tensor)
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("family, overrides, stored", LAYOUTS, ids=IDS)
def test_the_published_layout_loads_and_exports_as_transformers_saves_it(tmp_path, family, overrides, stored):
    if family not in CONFIG_MAPPING:  # the GPU machine's transformers 5.17 lacks some
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    model = _saved(tmp_path, family, overrides)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        files = {name: f.get_tensor(name) for name in f.keys()}
    assert stored in files and stored not in model.state_dict()
    meta = build_meta_model(ModelConfig(name_or_path=str(tmp_path), attn_implementation="eager"))
    weights = SafetensorsWeights(str(tmp_path), meta)
    weights.check()
    assert weights.kept() == []  # every tensor of the files is one of the model's
    for name, tensor in model.named_parameters():
        whole = weights.read(name, (), torch.device("cpu"))
        assert torch.equal(whole, tensor.detach()), name
        part = tuple(slice(size // 3, size - size // 4) for size in tensor.shape)  # what a rank's shard asks for
        assert torch.equal(weights.read(name, part, torch.device("cpu")), tensor.detach()[part]), name
        # a rank whose shard is empty (experts sharded on their rows, fewer rows than ranks)
        empty = (slice(0, 1),) * (tensor.dim() - 1) + (slice(1, 1),) if tensor.dim() < 3 else (
            slice(0, 2), slice(3, 3), slice(None))
        assert weights.read(name, empty, torch.device("cpu")).shape == tensor[empty].shape, name
    exported = dict(to_hub_tensors(model, model.state_dict().items()))
    assert exported.keys() == files.keys()
    assert all(torch.equal(exported[name], files[name]) for name in files)


def test_a_sharded_model_finds_the_renamings_transformers_keys_by_class_name(tmp_path):
    """FSDP2 gives each module it shards a subclass of its own (FSDPGPTNeoXForCausalLM): its files'
    embed_out is still read as lm_head, and the class is left as it was."""
    from torch.distributed.fsdp import FSDPModule

    model = _saved(tmp_path, "gpt_neox", {})
    meta = build_meta_model(ModelConfig(name_or_path=str(tmp_path)))
    sharded = type(f"FSDP{type(meta).__name__}", (FSDPModule, type(meta)), {})
    meta.__class__ = sharded
    weights = SafetensorsWeights(str(tmp_path), meta)
    weights.check()
    assert type(meta) is sharded
    assert torch.equal(weights.read("lm_head.weight", (), torch.device("cpu")), model.lm_head.weight.detach())


def test_a_second_tensor_for_a_name_counts_as_transformers_counts_it(tmp_path):
    """Files holding gpt-neox's head twice (embed_out, and lm_head beside it): the first in the files'
    natural order is read, as from_pretrained reads it, and nothing fails."""
    model = _saved(tmp_path, "gpt_neox", {})
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        files = {name: f.get_tensor(name) for name in f.keys()}
    save_file({**files, "lm_head.weight": torch.zeros_like(files["embed_out.weight"])}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    weights = SafetensorsWeights(str(tmp_path), build_meta_model(ModelConfig(name_or_path=str(tmp_path))))
    weights.check()
    head = AutoModelForCausalLM.from_pretrained(tmp_path).lm_head.weight
    assert torch.equal(weights.read("lm_head.weight", (), torch.device("cpu")), head)
    assert torch.equal(head, model.lm_head.weight)


def test_qwen3_vl_moe_experts_as_published_transposed_load(tmp_path):
    """Qwen3-VL-MoE's published files hold its experts transposed ([experts, hidden, 2 x intermediate]),
    which its vision-language class's conversions turn into the model's layout: read so, any slice."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from helpers import DEMO_MODEL, VISION_LANGUAGE

    shutil.copytree(DEMO_MODEL, tmp_path, dirs_exist_ok=True)
    (tmp_path / "config.json").unlink()
    layout = VISION_LANGUAGE["qwen3_vl_moe"]
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_vl_moe", **{**layout, "text_config": {**layout["text_config"],
                                                                               "moe_intermediate_size": 16}})
    AutoModelForImageTextToText.from_config(config).save_pretrained(tmp_path)
    files = {}
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            files.update({name: f.get_tensor(name) for name in f.keys()})
    for file in tmp_path.glob("model*.safetensors*"):
        file.unlink()
    published = {name: t.transpose(1, 2).contiguous() if ".experts." in name else t for name, t in files.items()}
    save_file(published, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert published["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 32)
    reference = AutoModelForImageTextToText.from_pretrained(tmp_path).model.language_model
    meta = build_meta_model(ModelConfig(name_or_path=str(tmp_path)))
    weights = SafetensorsWeights(str(tmp_path), meta)
    weights.check()
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        expected = reference.get_parameter(name.removeprefix("model.")).detach()
        assert torch.equal(weights.read(name, (), torch.device("cpu")), expected)
        part = (slice(1, 3), slice(5, 20), slice(2, 9))
        assert torch.equal(weights.read(name, part, torch.device("cpu")), expected[part])


@pytest.mark.parametrize("family", list(VISION_LANGUAGE))
def test_a_vision_tower_missing_or_misshapen_in_the_files_is_one_error_naming_it(tmp_path, family):
    """A vision-language checkpoint's tensors outside its language model (the vision tower, the
    projector) are checked against its class as the language model's are: intact, the check passes;
    without them, without one, or with one of another shape, one error names the first."""
    from sft.models.build import ModelError

    directory = vision_language_model_dir(tmp_path, family)
    (file,) = directory.glob("*.safetensors")
    with safe_open(file, "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    model = build_meta_model(ModelConfig(name_or_path=str(directory)))
    SafetensorsWeights(str(directory), model).check()  # as saved: nothing missing
    tower = sorted(name for name in tensors if "vision" in name or "visual" in name)
    assert tower, sorted(tensors)
    first = tower[0]
    damaged = {"no tower": ({n: t for n, t in tensors.items() if n not in tower}, rf"{len(tower)} tensors", "absent"),
               "one missing": ({n: t for n, t in tensors.items() if n != first}, "1 tensors", "absent"),
               "one misshapen": ({**tensors, first: torch.zeros(7, 3)}, "1 tensors", r"\(7, 3\)")}
    for files, count, found in damaged.values():
        save_file(files, file, metadata={"format": "pt"})
        with pytest.raises(ModelError, match=rf"its vision tower does not match its config.json \({count} differ, e.g. "
                                             rf"\S+: \(.*\) in the model of config.json, {found} in the files\)"):
            SafetensorsWeights(str(directory), model).check()


def test_a_load_opens_each_file_a_few_times_however_many_tensors_it_holds(tmp_path, monkeypatch):
    """A checkpoint of thousands of per-expert tensors (Qwen3-MoE as saved: 3 x 512 experts a block)
    in two files: the load opens each file twice, its header once and then one descriptor for every
    read (an open per tensor, as safe_open parses the file's whole header at every open, was minutes
    for a published MoE checkpoint), and reads what transformers reads."""
    import os

    from sft.hub import safetensors_files
    from sft.models.build import materialize, real_buffers
    from sft.hub.weights import load_weights

    config = tiny_config("qwen3_moe", num_experts=512, num_local_experts=512, moe_intermediate_size=8, num_hidden_layers=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, max_shard_size="4MB")
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) >= 2
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert sum(".experts." in name for name in weight_map) == 2 * 3 * 512
    (tmp_path / "config.json").write_text(config.to_json_string())
    model = build_meta_model(ModelConfig(name_or_path=str(tmp_path)))
    materialize(model, real_buffers(model), torch.device("cpu"))
    opened = []
    real_open, real_path_open = os.open, Path.open
    monkeypatch.setattr(safetensors_files.os, "open", lambda path, *a: opened.append(Path(path)) or real_open(path, *a))
    monkeypatch.setattr(Path, "open", lambda path, *a, **k: opened.append(path) or real_path_open(path, *a, **k))
    weights = SafetensorsWeights(str(tmp_path), model)
    load_weights(model, weights, torch.device("cpu"))
    assert sorted(path for path in opened if path.suffix == ".safetensors") == sorted(files * 2), opened
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)


def test_random_init_sets_what_an_enclosing_modules_init_sets(tmp_path):
    """Qwen3.5-MoE's sparse block initialises its router's weight; the router's own _init_weights
    does not. At Qwen3.5-35B-A3B's router width (256 experts; above CONSTRUCTED_BELOW, so no
    constructor value stands in) random init refused the model before; now the weight is drawn as
    from_config draws it (normal, initializer_range), the same on every call, and nothing else moves."""
    from helpers import tiny_model_dir
    from sft.hub.weights import CONSTRUCTED_BELOW, RandomWeights

    directory = tiny_model_dir(tmp_path, "qwen3_5_moe_text", hidden_size=512, num_experts=256)
    cfg = ModelConfig(name_or_path=str(directory), init="random")
    router, experts = "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj"
    reads = []
    for _ in range(2):
        weights = RandomWeights(cfg, seed=0)
        assert weights.reference.get_parameter(router).numel() > CONSTRUCTED_BELOW
        reads.append({name: weights.read(name, (slice(None),), torch.device("cpu")).clone()
                      for name in (router, experts, "model.layers.0.mlp.shared_expert.up_proj.weight")})
    std = weights.reference.config.initializer_range
    assert reads[0][router].std().item() == pytest.approx(std, rel=0.05) and not reads[0][router].isnan().any()
    assert all(torch.equal(reads[0][name], reads[1][name]) for name in reads[0])
    assert reads[0][experts].std().item() == pytest.approx(std, rel=0.05)


def test_the_file_reader_slices_as_safetensors_does(tmp_path):
    """sft/hub/safetensors_files.py reads a shard's rows itself: every index form the loader may pass
    gives what safetensors' own get_slice gives, bit for bit, for the dtypes of published checkpoints."""
    from safetensors.torch import save_file

    from sft.hub.safetensors_files import SafetensorsFiles

    torch.manual_seed(0)
    tensors = {"w": torch.randn(6, 5).to(torch.bfloat16), "v": torch.arange(7, dtype=torch.int64),
               "s": torch.tensor(3.5), "f8": torch.randn(4, 3).to(torch.float8_e4m3fn), "c": torch.randn(2, 2, 3),
               "b": torch.rand(5) > 0.5}
    save_file(tensors, tmp_path / "model.safetensors")
    files = SafetensorsFiles(tmp_path, ["model.safetensors"])
    indices = [..., (), (slice(None),), (slice(1, 4),), (slice(2, 2),), (slice(0, 6, 2),), (slice(1, 5), slice(1, 3)),
               (slice(None), slice(2, None)), (slice(0, 2), slice(None), slice(1, 2)), (slice(5, 100),)]
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f, files.reading():
        for name in tensors:
            for index in indices:
                if not isinstance(index, type(...)) and len(index) > tensors[name].dim():
                    continue
                expected = f.get_slice(name)[index] if index != () else f.get_tensor(name)
                got = files.read(name, index, torch.device("cpu"))
                assert got.dtype == expected.dtype and torch.equal(got.contiguous().view(-1).view(torch.uint8),
                                                                   expected.contiguous().view(-1).view(torch.uint8)), (name, index)


@pytest.mark.parametrize("damage, says", [
    ("a header length past the file", "header of"),
    ("a negative offset", "outside the file"),
    ("a tensor past the end", "outside the file"),
    ("a dtype torch lacks", "stored as F4, which this torch cannot read"),
])
def test_a_damaged_safetensors_header_is_one_error_naming_the_file(tmp_path, damage, says):
    from safetensors.torch import save_file

    from sft.hub.safetensors_files import DamagedFile, SafetensorsFiles

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(4), "b": torch.zeros(2)}, path)
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    if damage == "a header length past the file":
        raw = (10**15).to_bytes(8, "little") + raw[8:]
    else:
        if damage == "a negative offset":
            header["a"]["data_offsets"] = [-8, 8]
        elif damage == "a tensor past the end":
            header["b"]["shape"], header["b"]["data_offsets"] = [200], [header["b"]["data_offsets"][0], 800]
        else:
            header["b"]["dtype"] = "F4"
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        raw = len(text).to_bytes(8, "little") + text + raw[8 + length:]
    path.write_bytes(raw)
    with pytest.raises(DamagedFile, match=says) as error:
        SafetensorsFiles(tmp_path, ["model.safetensors"]).read("b", ..., torch.device("cpu"))
    assert error.value.file == "model.safetensors"
