"""Build the demo's tokenizer and model config into configs/demo/model, the MoE demo's config
into configs/demo_moe/model and the vision-language demo's files into configs/demo_vlm/model
(committed; rerun to refresh).

    python scripts/build_demo_model.py

A byte-level BPE tokenizer trained with the `tokenizers` library on the demo's own synthetic
chats (digits split one by one), a ChatML chat template that marks assistant tokens with
`{% generation %}` and renders tools / tool calls, and a tiny Qwen2 config (random init).
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen3MoeConfig

sys.path.insert(0, str(Path(__file__).parent))
from demo_data import generate  # noqa: E402

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- set ns = namespace(start=0) -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\\n\\n' -}}"
    "{%- set ns.start = 1 -%}{%- endif -%}"
    "{{- '# Tools\\n' -}}{%- for tool in tools -%}{{- (tool | tojson) + '\\n' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages[ns.start:] -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}"
    "{%- if message.get('content') -%}{{- message['content'] -}}{%- endif -%}"
    "{%- for call in message.get('tool_calls', []) -%}"
    "{{- '<tool_call>' + (call['function'] | tojson) + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>' -}}"
    "{% endgeneration %}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def corpus(n: int) -> list[str]:
    rows, rng = generate(n, seed=1234), random.Random(0)
    texts = [m["content"] for r in rows for m in r["messages"]]
    texts += ["system", "user", "assistant", "tool", "# Tools", "<tool_call>", "</tool_call>",
              '{"name": "get_weather", "arguments": {"city": "Paris"}}', "The weather is sunny."]
    rng.shuffle(texts)
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).parent.parent / "configs" / "demo" / "model"))
    parser.add_argument("--vocab-size", type=int, default=1024)
    args = parser.parse_args()

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(5000), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        chat_template=CHAT_TEMPLATE)
    tokenizer.save_pretrained(args.out)

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None)
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(args.out)
    print(f"wrote tokenizer ({len(tokenizer)} tokens) and config to {args.out}")
    moe_out = Path(args.out).parent.parent / "demo_moe" / "model"
    moe_config(tokenizer).save_pretrained(moe_out)
    print(f"wrote the MoE demo's config to {moe_out} (its tokenizer is the demo's)")
    vlm_out = Path(args.out).parent.parent / "demo_vlm" / "model"
    write_vlm_files(tokenizer, vlm_out)
    print(f"wrote the vision-language demo's tokenizer, image processor and config to {vlm_out}")


IMAGE_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# The demo's ChatML, an image part rendered as Qwen's placeholder between its markers
VLM_CHAT_TEMPLATE = (
    "{%- macro render(content) -%}{%- if content is string -%}{{- content -}}{%- else -%}"
    "{%- for part in content -%}{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}{% generation %}{{- render(message['content']) + '<|im_end|>' -}}"
    "{% endgeneration %}{{- '\\n' -}}"
    "{%- else -%}{{- render(message['content']) + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def write_vlm_files(tokenizer, out: Path) -> None:
    """A tiny Qwen3.5 as published (the vision-language class): the demo's tokenizer with Qwen's image
    tokens and a template rendering image parts, Qwen's image processor (16-pixel patches merged
    2 x 2: a 96 x 96 picture is 9 tokens) and the config (random init: scripts/save_random_checkpoint.py)."""
    from transformers import AutoConfig
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(IMAGE_TOKENS)))
    text = dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, layer_types=["full_attention"] * 4,
                max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128)
    config = AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    config.save_pretrained(out)
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                             size={"shortest_edge": 32 * 32, "longest_edge": 96 * 96}).save_pretrained(out)


def moe_config(tokenizer) -> Qwen3MoeConfig:
    """A tiny Qwen3-MoE: 8 experts, 2 per token, every layer sparse; widths multiples of 8 so that
    bf16 rows meet the grouped GEMM's 16-byte alignment."""
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, intermediate_size=384, moe_intermediate_size=96,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.01,
                            max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
                            tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    config.architectures = ["Qwen3MoeForCausalLM"]
    return config


if __name__ == "__main__":
    main()
