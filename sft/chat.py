"""Chat with an exported model, the quick sanity check after fine-tuning.

    python -m sft.chat runs/demo/export --prompt "What is 12 + 30?"     # one answer
    python -m sft.chat runs/demo/export                                 # interactive, multi-turn
    python -m sft.chat runs/demo_lora/export --prompt "..."             # a LoRA adapter, on its base

Uses the model's own chat template; greedy decoding by default. For real evaluation use
lm-evaluation-harness (https://github.com/EleutherAI/lm-evaluation-harness) on the export.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from sft.config import is_local_path
from sft.errors import UserError, run_command
from sft.models.lora import adapter_delta


def reply(model, tokenizer, messages: list[dict], max_new_tokens: int, temperature: float) -> str:
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                           return_tensors="pt").to(model.device)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, **sampling)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def read_adapter(adapter_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT LoRA adapter as sft.export writes it: (adapter_config.json, its tensors by name); a
    damaged file is one UserError, before the base is loaded."""
    try:
        return (json.loads((adapter_dir / "adapter_config.json").read_text()),
                load_file(adapter_dir / "adapter_model.safetensors"))
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{adapter_dir}: the adapter cannot be read ({' '.join(str(e).split())}): export it again "
                        "(python -m sft.export CHECKPOINT NEW_DIR)") from None


def merge_adapter(model: torch.nn.Module, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Fold a PEFT LoRA adapter (`read_adapter`) into `model`: W += alpha / r * B A on each adapted
    layer, and the modules trained in full replaced."""
    scaling = config["lora_alpha"] / config["r"]
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied lm_head by its own name too
    with torch.no_grad():
        for key, tensor in tensors.items():
            name = key.removeprefix("base_model.model.")
            if ".lora_A." in name:
                stem = name.split(".lora_A.")[0]
                update = adapter_delta(tensor, tensors[key.replace(".lora_A.", ".lora_B.")], scaling)
                params[f"{stem}.weight"].add_(update.to(params[f"{stem}.weight"].dtype))
            elif ".lora_B." not in name:
                params[name].copy_(tensor)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", help="an export directory (or any Hugging Face chat model)")
    parser.add_argument("--prompt", help="answer this one prompt and exit")
    parser.add_argument("--system", help="an optional system prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    args = parser.parse_args(argv)
    model_dir = Path(args.model_dir).expanduser()
    adapter = model_dir / "adapter_config.json"
    if ((model_dir.exists() or is_local_path(args.model_dir)) and not (model_dir / "config.json").is_file()
            and not adapter.is_file()):
        raise UserError(f"{args.model_dir}: not a model directory (no config.json or adapter_config.json there); give "
                        "an export, e.g. runs/demo/export (checkpoint.export_hf: true or python -m sft.export)")
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if adapter.is_file():  # a LoRA adapter: its base, with the adapter merged in
        config, tensors = read_adapter(model_dir)
        base = config["base_model_name_or_path"]
        try:
            model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
        except OSError as e:  # not there (moved, deleted, a hub id not in the cache offline)
            raise UserError(f"{adapter}: its base_model_name_or_path {base!r} cannot be loaded "
                            f"({' '.join(str(e).split())[:200]}); put the base model there, or write its new place "
                            "into base_model_name_or_path") from None
        merge_adapter(model, config, tensors)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype="auto")
    model = model.to(device).train(False)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    prompts = [args.prompt] if args.prompt else iter(lambda: input("you> "), "")
    try:
        for prompt in prompts:
            messages.append({"role": "user", "content": prompt})
            answer = reply(model, tokenizer, messages, args.max_new_tokens, args.temperature)
            messages.append({"role": "assistant", "content": answer})
            print(answer if args.prompt else f"model> {answer}", flush=True)
    except (EOFError, KeyboardInterrupt):  # Ctrl-D, Ctrl-C: the end of the chat
        pass


if __name__ == "__main__":
    run_command(main)
