"""Chat with an exported model, the quick sanity check after fine-tuning.

    python -m sft.chat runs/demo/export --prompt "What is 12 + 30?"     # one answer
    python -m sft.chat runs/demo/export                                 # interactive, multi-turn
    python -m sft.chat runs/demo_lora/export --prompt "..."             # a LoRA adapter, on its base
    python -m sft.chat runs/demo_vlm/export --image pic.png --prompt "What colour is the shape?"

Uses the model's own chat template; greedy decoding by default. For real evaluation use
lm-evaluation-harness (https://github.com/EleutherAI/lm-evaluation-harness) on the export.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from sft.adapters.peft_format import BASE_WEIGHTS, CONFIG_FILE, in_model, merged, read_adapter, unmatched
from sft.config import ModelConfig, is_local_path
from sft.data.images import ImageTokens, image_tokens
from sft.data.masking import IMAGE_PART
from sft.data.rows import expand_images
from sft.errors import UserError, run_command
from sft.hub.identity import WEIGHTS_DIGEST, base_changed, weights_digest
from sft.hub.weights import SafetensorsWeights
from sft.models.vision_language import causal_class, is_vision_language


def reply(model, tokenizer, messages: list[dict], max_new_tokens: int, temperature: float,
          images: ImageTokens | None = None, sources: tuple[str, ...] = ()) -> str:
    """The model's answer to `messages`; with `images`, their image parts are `sources` in order
    (rows as training makes them: sft/data/rows.py)."""
    if sources:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids, _ = expand_images(ids, ids, images.token_id, [images.count(s) for s in sources])
        ids = torch.tensor([ids])
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                  "mm_token_type_ids": (ids == images.token_id).int(), **images.pixels(list(sources))}
        inputs = {name: value.to(model.device) for name, value in inputs.items()}
    else:
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                               return_tensors="pt").to(model.device)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, **sampling)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def _check_base(adapter: Path, recorded: str, base: str, model, allowed: bool) -> None:
    """Refuse (UserError) a base whose weights are not those the adapter was trained on (as its
    adapter_config.json `recorded` them), unless `allowed`."""
    if not recorded.startswith(WEIGHTS_DIGEST):  # a base of random init, or an adapter from before the record
        return
    current = weights_digest(SafetensorsWeights(base, model))
    if not base_changed(recorded, current):
        return
    if not allowed:
        raise UserError(f"{adapter}: its adapters were trained on other weights than {base} holds now "
                        f"({recorded} -> {current}): point base_model_name_or_path at the base it was trained on, "
                        "or pass --allow-base-change to use this one anyway")
    print(f"warning: {base} is not the base {adapter.parent} was trained on (--allow-base-change)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", help="an export directory (or any Hugging Face chat model)")
    parser.add_argument("--prompt", help="answer this one prompt and exit")
    parser.add_argument("--system", help="an optional system prompt")
    parser.add_argument("--image", help="a picture (path) the first prompt asks about: a vision-language export")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--allow-base-change", action="store_true",
                        help="a LoRA adapter: use its base even if the base's weights changed since training")
    args = parser.parse_args(argv)
    model_dir = Path(args.model_dir).expanduser()
    adapter = model_dir / CONFIG_FILE
    if ((model_dir.exists() or is_local_path(args.model_dir)) and not (model_dir / "config.json").is_file()
            and not adapter.is_file()):
        raise UserError(f"{args.model_dir}: not a model directory (no config.json or adapter_config.json there); give "
                        "an export, e.g. runs/demo/export (checkpoint.export_hf: true or python -m sft.export)")
    if args.image and not Path(args.image).is_file():
        raise UserError(f"--image {args.image}: no such file")
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if adapter.is_file():  # a LoRA adapter: its base, with the adapter merged in
        config, tensors, scaling = read_adapter(model_dir)
        base = config["base_model_name_or_path"]
        try:
            if is_vision_language(AutoConfig.from_pretrained(base)):
                raise UserError(f"{adapter}: an adapter of a vision-language base ({base}) is of its language model "
                                "alone: export the checkpoint with --merge (python -m sft.export CHECKPOINT OUT "
                                "--merge) and chat with that")
            model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
        except OSError as e:  # not there (moved, deleted, a hub id not in the cache offline)
            raise UserError(f"{adapter}: its base_model_name_or_path {base!r} cannot be loaded "
                            f"({' '.join(str(e).split())[:200]}); put the base model there, or write its new place "
                            "into base_model_name_or_path") from None
        _check_base(adapter, config.get(BASE_WEIGHTS, ""), base, model, args.allow_base_change)
        trained = in_model(tensors, config, model)
        if unknown := unmatched(trained, model):
            raise UserError(f"{adapter}: {len(unknown)} of its tensors match no parameter of {base} (e.g. "
                            f"{unknown[0]}): it was trained on another model; give that model as "
                            "base_model_name_or_path")
        with torch.no_grad():
            for name, param in model.named_parameters(remove_duplicate=False):  # a tied lm_head by its name too
                param.copy_(merged(name, param, trained, scaling, model))
    else:  # a vision-language export whose text model has no causal class (Qwen3-VL), or for images: the original
        config = AutoConfig.from_pretrained(args.model_dir)
        vision_only = is_vision_language(config) and (causal_class(config) is None or args.image)
        model = (AutoModelForImageTextToText if vision_only else AutoModelForCausalLM).from_pretrained(
            args.model_dir, dtype="auto")
    images = image_tokens(ModelConfig(name_or_path=args.model_dir), tokenizer) if args.image else None
    if args.image and images is None:
        raise UserError(f"--image: {args.model_dir} takes no images (docs/data.md: Images says which models do)")
    model = model.to(device).train(False)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    prompts = [args.prompt] if args.prompt else iter(lambda: input("you> "), "")
    try:
        for prompt in prompts:
            picture = args.image and not any(m["role"] == "user" for m in messages)
            messages.append({"role": "user", "content": [IMAGE_PART, {"type": "text", "text": prompt}]
                             if picture else prompt})
            answer = reply(model, tokenizer, messages, args.max_new_tokens, args.temperature, images,
                           (str(Path(args.image).resolve()),) if args.image else ())
            messages.append({"role": "assistant", "content": answer})
            print(answer if args.prompt else f"model> {answer}", flush=True)
    except (EOFError, KeyboardInterrupt):  # Ctrl-D, Ctrl-C: the end of the chat
        pass


if __name__ == "__main__":
    run_command(main)
