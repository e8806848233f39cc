"""The model zoo: every causal-LM family of the installed transformers (and the vision-language ones
whose language model has a causal class), as a tiny random model from its own config class, through
our path: built as train.py builds it (`build_training_model`, on a world of one: attention it can
run, the language model of a vision-language checkpoint, our MoE blocks, exact packing where it
packs, FSDP) and filled as a run fills it (`load_model_weights`) from its random weights saved by
transformers (`save_pretrained`: experts one tensor each, renamed, q/k/v apart, as published), its
loss then equal to the model transformers loads from the same files; a few steps of AdamW on one
batch (the loss falls), packed against padded rows (the loss within 1e-6, every gradient within
1e-4 of its tensor's largest entry, or refused in one line), the export as sft.export writes it
loaded back by transformers (the same class, the next-token loss of its logits equal to ours,
causal; a vision-language checkpoint's: the original class, its language model's tensors as
trained, its vision tower as the source's), and whether context parallelism (the model built with
it, its loss equal to its own), expert parallelism and LoRA take it. A row whose reference cannot
run says so in its status.

    python tests/zoo.py            # writes docs/models.md from the results (make models-doc)

tests/integration/test_model_zoo.py runs each family and checks its row of docs/models.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from helpers import REPO, VISION_LANGUAGE, synthetic_global_batch, tiny_model_dir, vision_language_model_dir

# Families whose tiny config needs more than helpers.TINY: multi-head latent attention (the rotary
# part of a head is head_dim; as many key/value heads as query heads), rotary widths of their own.
OVERRIDES = {
    **{mt: {"head_dim": 8, "num_key_value_heads": 4} for mt in (
        "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "longcat_flash", "youtu",
        "axk1", "axk2", "kimi_k2", "minicpm3", "sarvam_mla")},
    "codegen": {"rotary_dim": 8}, "gptj": {"rotary_dim": 8},
    "phimoe": {"router_jitter_noise": 0.0},
    # Inkling-2's files pad the head to vocab_size from the unpadded_vocab_size rows the model has
    **{mt: {"unpadded_vocab_size": 899} for mt in ("inkling2_text", "inkling2_loop_text")},
    "falcon_h1": {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 16},
    # Mamba-2 mixers of 128 heads x 64 and a state of 256 (the defaults) take minutes a row in the torch path
    **{mt: {"mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_chunk_size": 64}
       for mt in ("bamba", "granitemoehybrid")},
    # Two generic tiny layers of these hybrids would both be Gated DeltaNet: one attends, as in their checkpoints
    **{mt: {"layer_types": ["linear_attention", "full_attention"]}
       for mt in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")},
    # transformers' default LFM2 config attends in every layer; its checkpoints interleave short convolutions
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # Kimi-Linear's checkpoints interleave its full attention (multi-head latent: as many key/value heads
    # as query heads) with Kimi delta attention; two generic tiny layers would both be the latter
    "kimi_linear": {"layer_types": ["linear_attention", "full_attention"], "num_key_value_heads": 4,
                    "linear_num_heads": 2, "linear_head_dim": 16},
}
STEPS = 4
MAX_PARAMETERS = 30e6  # a family whose config ignores the tiny widths is listed, not built
COLUMNS = ("family", "class", "kind", "packing", "context parallelism", "expert parallelism", "LoRA", "images",
           "status")


@dataclasses.dataclass
class Row:
    family: str
    cls: str = ""
    kind: str = ""
    packing: str = ""
    cp: str = ""
    ep: str = ""
    lora: str = ""
    images: str = ""
    status: str = ""

    def markdown(self) -> str:
        return "| " + " | ".join(c.replace("|", "/") for c in dataclasses.astuple(self)) + " |"


def families() -> list[str]:
    """Every model type of transformers' causal-LM mapping, and the vision-language ones we build tiny."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(VISION_LANGUAGE)) + [f"{mt} (vision-language)"
                                                                                   for mt in sorted(VISION_LANGUAGE)]


def _reason(error: BaseException) -> str:
    """The error's text, short, without the temporary directory it names."""
    text = re.sub(r"model\.name_or_path='[^']*': ", "", " ".join(str(error).split())) or type(error).__name__
    return text[:140] + ("…" if len(text) > 140 else "")


def check_family(family: str, tmp: Path) -> Row:
    """The row of `family`: what our path does with its tiny model (see the module's docstring)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from sft.adapters.lora import apply_lora
    from sft.checkpoint.model_weights import load_model_weights
    from sft.config import Config, DataConfig, FSDPConfig, LoRAConfig, ModelConfig, MoEConfig
    from sft.data.collate import collate, collate_packed
    from sft.export import write_model
    from sft.hub.weights import write_model_files
    from sft.models.architecture import decoder_blocks
    from sft.models.build import build_meta_model, model_config
    from sft.models.moe import apply_moe
    from sft.models.packing import check_packing, cp_unsupported, stateful_layers
    from sft.models.vision import IMAGE_FAMILIES
    from sft.models.vision_language import is_vision_language
    from sft.parallel.mesh import ParallelDims
    from sft.training.model import build_training_model

    row = Row(family)
    model_type = family.removesuffix(" (vision-language)")
    vision_language = model_type != family
    try:
        directory = (vision_language_model_dir(tmp, model_type) if vision_language
                     else tiny_model_dir(tmp, model_type, **OVERRIDES.get(model_type, {})))
        cfg = ModelConfig(name_or_path=str(directory), init="pretrained")
        if not vision_language and is_vision_language(model_config(cfg)):
            row.status = "not built: a vision-language config without a tiny checkpoint in the zoo (tests/helpers.py)"
            return row
        model = build_meta_model(cfg)
    except Exception as e:  # noqa: BLE001 -- the zoo lists what does not build, with its reason
        row.status = f"not built: {_reason(e)}"
        return row
    row.cls = type(model).__name__
    if (size := sum(p.numel() for p in model.parameters())) > MAX_PARAMETERS:
        row.status = f"not built: its config class makes {size / 1e6:.0f}M parameters of the generic tiny widths"
        return row
    moe = apply_moe(model, MoEConfig())
    stateful = stateful_layers(model)
    row.kind = ("vision-language, " if vision_language else "") + (
        "MoE" + (" (general path)" if moe.general else "") if moe else "dense") + (", hybrid" if stateful else "")
    try:
        check_packing(model, packing=True)
        row.packing = "exact" if stateful else "yes"
    except Exception as e:  # noqa: BLE001
        row.packing = f"refused: {_reason(e).split(': ', 1)[-1].split(' carry')[0]}"
    row.cp = "no: " + why if (why := cp_unsupported(model)) else "yes"
    row.ep = ("yes" if moe and not moe.general else "no (general path)") if moe else "—"
    row.images = ("yes" if model_type in IMAGE_FAMILIES else "no: its text only") if vision_language else "—"
    try:
        fresh = build_meta_model(cfg)
        lora = apply_lora(fresh, decoder_blocks(fresh), LoRAConfig(rank=4), torch.float32)
        row.lora = f"yes ({', '.join(lora.targets)})"
    except Exception as e:  # noqa: BLE001
        row.lora = f"no: {_reason(e)}"
    try:
        if not vision_language:
            directory = _saved_by_transformers(cfg, tmp / f"saved_{model_type}")
        # As a run builds it (sft/training/model.py: packed rows where the family packs), on one rank,
        # in float32, and fills it (sft/checkpoint/model_weights.py) from the files transformers saved
        packs = row.packing in ("yes", "exact")
        run = Config(model=dataclasses.replace(cfg, name_or_path=str(directory)), data=DataConfig(packing=packs),
                     fsdp=FSDPConfig(param_dtype="float32"))
        env = _one_rank()
        built = build_training_model(run, ParallelDims(1).build("cpu"), env.device)
        model, moe, loss = built.model, built.moe, built.loss
        # before any forward, as train.py: FSDP leaves the root and last block unsharded after a no_grad forward
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        load_model_weights(run, model, env)
        samples = synthetic_global_batch(4)
        padded, packed = collate(samples, 0, 256), collate_packed([samples[:2], samples[2:]], 0, 256)
        with torch.no_grad():  # before training: the loss of the model transformers loads from the same files
            model.eval()  # (transformers' is in eval mode: no dropout)
            ours = _loss(loss, padded)
            model.train()
            try:
                reference = _next_token_loss((AutoModelForImageTextToText if vision_language else AutoModelForCausalLM)
                                             .from_pretrained(directory, attn_implementation="eager"), padded)
            except AttributeError:  # Llama-4's cannot run on text alone in transformers 5.24 (no image_outputs)
                if model_type != "llama4":
                    raise
                reference = None  # no reference: the row says so
        if reference is not None and not abs(ours - reference) <= 1e-4 * abs(reference):
            row.status = f"loads otherwise than transformers ({ours:.5f} here, {reference:.5f} there)"
            return row
        if row.cp == "yes" and abs((split := _context_parallel_loss(run, env, padded)) - ours) > 1e-5 * abs(ours):
            row.cp = "differs from cp 1"
            row.status = f"its attention under context parallelism differs ({split:.6f} there, {ours:.6f} here)"
            return row
        losses = []
        for _ in range(STEPS):
            losses.append(_backward(loss, moe, padded))
            optimizer.step()
            optimizer.zero_grad()
        if not losses[-1] < losses[0]:
            row.status = "loss did not fall"
            return row
        model.eval()
        if row.packing in ("yes", "exact"):
            # losses equal within 1e-6 (every family is within 1e-7 here): a little mixing shows (the issue's
            # Qwen3.5 example, one step over 48 conversations, was off by 2e-5 of its loss); every gradient
            # within 1e-4 of its tensor's largest entry
            (as_padded, padded_grads), (as_packed, packed_grads) = (_loss_and_grads(model, loss, moe, b) for b in (padded, packed))
            worst = max(((packed_grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
                        for n, g in padded_grads.items())
            if abs(as_packed - as_padded) > 1e-6 * abs(as_padded) or not worst <= 1e-4:
                row.packing = "differs from padded rows"
                row.status = (f"packed rows differ from padded ones (loss {as_packed:.7f} / {as_padded:.7f}, "
                              f"gradients {worst:.1e})")
                return row
        with torch.no_grad():
            # the export, as sft.export writes it (a vision-language checkpoint's: the original), loaded back by
            # transformers: the same class, the language model's tensors as trained, a vision tower's as the files
            # held them, the same loss where the class runs on text, causal
            model_files, export = tmp / f"hf_{model_type}", tmp / f"export_{model_type}"
            model_files.mkdir()
            export.mkdir()
            write_model_files(cfg, model, model_files)
            tensors = _trained(model)  # what an export writes
            write_model(((n, t.detach()) for n, t in tensors.items()), model, model_files, export, "float32")
            if vision_language:
                loaded = AutoModelForImageTextToText.from_pretrained(export, attn_implementation="eager")
                if problem := _vision_language_export_problem(loaded, model, tensors, directory, export):
                    row.status = problem
                    return row
            else:
                loaded = AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager")
                if type(loaded).__name__ != row.cls:
                    row.status = f"exports as {type(loaded).__name__}"
                    return row
            if reference is not None:
                ours, theirs = _loss(loss, padded), _next_token_loss(loaded, padded)
                logits = loaded(input_ids=padded["input_ids"], use_cache=False).logits.float()
                # causal without a mask, as rows of one sequence run: a prefix's logits do not see what follows
                prefix = loaded(input_ids=padded["input_ids"][:1, :8], use_cache=False).logits.float()
                if not torch.allclose(prefix, logits[:1, :8], atol=1e-4):
                    row.status = "not causal: without an attention mask its tokens see the later ones"
                    return row
                if abs(ours - theirs) > 1e-4 * abs(theirs):
                    row.status = f"differs from transformers' loss ({ours:.5f} here, {theirs:.5f} there)"
                    return row
        row.status = "trains, exports" if reference is not None else (
            "trains, exports; its load is not compared (transformers' class cannot run on text alone)")
    except Exception as e:  # noqa: BLE001
        row.status = f"fails: {_reason(e)}"
    return row


def _one_rank():
    """This process's world of one (gloo), made once: the zoo builds every family as a run does."""
    import torch.distributed as dist

    from sft.distributed import DistEnv, init_distributed

    return init_distributed() if not dist.is_initialized() else DistEnv(0, 0, 1, torch.device("cpu"))


def _trained(model) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers, whole, by their Hugging Face names."""
    from torch.distributed.tensor import DTensor

    from sft.models.build import clean_name, persistent_buffers

    whole = {clean_name(n): p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
             for n, p in model.named_parameters()}
    return {**whole, **persistent_buffers(model)}


def _vision_language_export_problem(loaded, model, trained: dict, source: Path, export: Path) -> str | None:
    """What is wrong with the export of a vision-language checkpoint's language model `model`
    (trained), from the checkpoint `source`, as transformers `loaded` it from `export`; None if nothing: the
    original class, every tensor of its language model equal to ours, and every other (the vision
    tower, the projector) as transformers loads it from the source, dtype and all."""
    original = json.loads((source / "config.json").read_text())["architectures"][0]
    if type(loaded).__name__ != original:
        return f"exports as {type(loaded).__name__}, not {original}"
    # the language model: transformers' (a causal class for Llama-4, a text model elsewhere) against ours
    from sft.models.architecture import decoder

    language_model = loaded.get_decoder()
    prefix = "" if isinstance(model, type(language_model)) else decoder(model)[0] + "."
    theirs = language_model.state_dict()
    ours = {name.removeprefix(prefix): tensor for name, tensor in trained.items() if name.startswith(prefix)}
    wrong = [name for name, tensor in ours.items() if not torch.equal(theirs.get(name), tensor)]
    if wrong or not torch.equal(loaded.get_output_embeddings().weight, model.get_output_embeddings().weight.full_tensor()):
        return f"its export loads another language model ({len(wrong)} tensors differ, e.g. {(wrong or ['lm_head'])[0]})"

    # the rest (vision tower, projector): as transformers loads it from the source checkpoint
    from transformers import AutoModelForImageTextToText

    source_tensors = dict(AutoModelForImageTextToText.from_pretrained(source).named_parameters())
    in_language_model = {id(p) for module in (language_model, loaded.get_output_embeddings()) for p in module.parameters()}
    kept = {name: p for name, p in loaded.named_parameters() if id(p) not in in_language_model}
    changed = [name for name, p in kept.items() if p.dtype != source_tensors[name].dtype
               or not torch.equal(p, source_tensors[name])]
    if not kept or changed:
        return f"its export changes the vision tower ({len(changed)} of {len(kept)} tensors, e.g. {changed[:1]})"
    if (names := _file_tensor_names(export)) != _file_tensor_names(source):  # the original's names, no more or less
        return f"its export names its tensors otherwise ({sorted(names ^ _file_tensor_names(source))[:2]})"
    return None


def _file_tensor_names(directory: Path) -> set[str]:
    from safetensors import safe_open

    names = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    return names


def _saved_by_transformers(cfg, out: Path) -> Path:
    """`cfg`'s tiny model as transformers saves it (`save_pretrained`: the layout checkpoints are
    published in), its weights our random init (`model.init: random`, the architecture's own
    init), correction biases off zero so that loading them is seen."""
    from transformers import AutoModelForCausalLM

    from sft.models.build import model_config
    from sft.hub.weights import RandomWeights

    shutil.copytree(cfg.name_or_path, out)
    model = AutoModelForCausalLM.from_config(model_config(cfg))
    init = RandomWeights(cfg, seed=0)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            tensor.copy_(init.read(name, (...,), torch.device("cpu")))
            if name.endswith("e_score_correction_bias"):
                tensor.uniform_(-0.5, 0.5)
    model.save_pretrained(out)
    return out


def _loss(loss, batch: dict) -> float:
    """Our loss path, head and all: the mean over the batch's supervised tokens."""
    from sft.training.loss import loss_inputs

    inputs = loss_inputs(batch)
    return loss(**inputs).item() / len(inputs["target_ids"])


def _context_parallel_loss(run, env, batch: dict) -> float:
    """`_loss` of the model `run` builds with context parallelism (sft/parallel/context_parallel.py), over
    a group of this one process: the family's attention layers through
    that interface (what they pass it, multi-head latent attention's widths), the whole row on this
    rank. The exchange between ranks is tested on 2 and 4 gloo ranks (tests/integration/test_distributed.py)."""
    from sft.checkpoint.model_weights import load_model_weights
    from sft.parallel.mesh import ParallelDims
    from sft.training.loss import loss_inputs
    from sft.training.model import build_training_model

    import torch.distributed as dist

    class ContextParallelOnOneRank(ParallelDims):
        cp_enabled = True  # a cp group of one: rows whole on this rank, attention through context parallelism's
        cp_group_name = dist.group.WORLD.group_name

    world = ParallelDims(1).build("cpu")
    dims = ContextParallelOnOneRank(**{f.name: getattr(world, f.name) for f in dataclasses.fields(world)})
    built = build_training_model(run, dims, env.device)
    load_model_weights(run, built.model, env)
    built.model.eval()  # as `_loss`'s reference ran: no dropout
    with torch.no_grad():
        inputs = loss_inputs(batch, dims)
        return built.loss(**inputs).item() / len(inputs["target_ids"])


def _backward(loss, moe, batch: dict) -> float:
    """Our loss of `batch`, its gradients accumulated (`moe`: the MoE handle, or None), as a step does."""
    from sft.training.loss import loss_inputs

    if moe:
        moe.begin_step(batch["real_tokens"].sum())
        moe.begin_micro_batch(batch["real_tokens"])
    summed = loss(**loss_inputs(batch))
    if moe:
        moe.end_micro_batch()
    summed.backward()
    return summed.item()


def _loss_and_grads(model, loss, moe, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """Our loss of `batch` and the gradient of every parameter."""
    model.zero_grad()
    value = _backward(loss, moe, batch)
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return value, grads


def _next_token_loss(model, batch: dict) -> float:
    """transformers' logits and the next-token loss on them (the model's own `loss` does not shift
    the labels in BART-era decoders and CPM-Ant: it expects them shifted already)."""
    logits = model(input_ids=batch["input_ids"], use_cache=False).logits.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                             ignore_index=-100).item()


def table(rows: list[Row]) -> str:
    header = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS)
    return header + "\n" + "\n".join(row.markdown() for row in rows)


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "models.md")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in families():
            rows.append(check_family(family, Path(tmp)))
            print(rows[-1].markdown(), flush=True)
    trains = sum(row.status.startswith("trains") for row in rows)
    args.out.write_text(HEADER.format(version=transformers.__version__, trains=trains, total=len(rows)) + table(rows)
                        + "\n")


HEADER = """# Does it take my model?

<!-- generated with transformers {version} -->
Every causal-LM family of transformers {version} (and vision-language checkpoints as transformers
saves them), as a tiny random model built from transformers' own config class, through the
trainer's path on a CPU: built as a run builds it, loaded from the files transformers saves
(`save_pretrained`, the layout checkpoints are published in; a vision-language checkpoint's language
model from the whole checkpoint), its loss equal to the model transformers loads from the same files
(its vision-language class where that class runs on text alone),
{steps} steps of AdamW on one batch (the loss falls), packed rows against padded ones (losses equal
within 1e-6), and the export loaded back by transformers (the same class, or our head on a text model without
one; the next-token loss of its logits equals the trainer's, logit scales and soft caps included;
causal without an attention mask, as rows of one sequence run).
**{trains} of {total} train.** Generated by
`python tests/zoo.py` (`make models-doc`); `tests/integration/test_model_zoo.py` checks every row.
A family that is not built lists transformers' reason (most are encoder-decoder or audio models in
the causal-LM mapping, or need a config this generic tiny one does not give them).

Columns: *kind* — dense, MoE (our path: the model's routing with grouped-GEMM experts and expert
parallelism; general path: transformers' block as it is), hybrid (layers that carry state along
the row), vision-language (the language model trained alone, the original exported:
docs/checkpoints.md); *packing* — yes, exact (Gated DeltaNet, Kimi delta attention, short convolutions: every document
restarts the state),
or refused with the layers named; *context parallelism* and *expert parallelism* — whether
`cp.degree` and `moe.ep_degree` take it (where context parallelism does, the model's loss with its
attention run through context parallelism's equals its own); *LoRA* — the Linear layers `all-linear` adapts;
*images* — whether a vision-language checkpoint trains on conversations with images (docs/data.md:
Images; tests/integration/test_images.py checks each family's loss against its vision-language class).

""".replace("{steps}", str(STEPS))


if __name__ == "__main__":
    main()
