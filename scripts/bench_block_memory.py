"""What one decoder layer of each kind keeps for its backward, per token, measured on a GPU: the
numbers the memory planner's per-layer activation model (sft/plan/memory.py) is fitted on.

    python3 scripts/bench_block_memory.py configs/models/qwen3.5-9b [--set linear_num_value_heads=48 ...]

For every layer kind of the config (config.layer_types: Gated DeltaNet "linear_attention", "full_attention", ...)
it builds the model with only that kind, at 1 and at 3 layers (bf16, random init), runs the decoder forward on
--rows x --seq tokens with gradients enabled, eagerly and with every block compiled (as train.py does), and
takes the memory still allocated after the forward; the difference between 3 and 1 layers, halved, is one
layer's kept bytes (embeddings, the output and the model's own buffers cancel). The backward then runs, so
a layer that cannot train fails here. Prints one JSON line per kind and mode; with --sites, also what the
measured forward of the 3-layer model left allocated, by where it was allocated (sft.profiling.memory_at_peak).
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from sft.models.gated_deltanet import use_gated_deltanet_kernels
from sft.profiling import MEMORY_HISTORY_ENTRIES, memory_at_peak


def kept_bytes(config, kind: str, layers: int, tokens: torch.Tensor, compiled: bool, sites: bool = False) -> int:
    text = config.get_text_config()
    text.num_hidden_layers, text.layer_types = layers, [kind] * layers
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    use_gated_deltanet_kernels(model, torch.device("cuda"))  # the kernels train.py gives its layers
    decoder = model.get_decoder()
    if compiled:
        for block in decoder.layers:
            block.compile()
    positions = torch.arange(tokens.shape[1], device="cuda").expand_as(tokens)
    kept = []
    for attempt in range(2):  # the first compiles; the second is measured
        record = sites and attempt == 1
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        if record:
            requested = torch.cuda.memory_stats()["requested_bytes.all.current"]
            torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python",
                                                     max_entries=MEMORY_HISTORY_ENTRIES)
        hidden = decoder(input_ids=tokens, position_ids=positions, use_cache=False).last_hidden_state
        torch.cuda.synchronize()
        kept.append(torch.cuda.memory_allocated() - before)
        if record:
            print(f"{kind}, {layers} layers, {'compiled' if compiled else 'eager'}: "
                  + memory_at_peak(torch.cuda.memory._snapshot(), requested, top=25), flush=True)
            torch.cuda.memory._record_memory_history(None)
        hidden.float().square().mean().backward()
        model.zero_grad(set_to_none=True)
        del hidden
    del model, decoder
    torch.cuda.empty_cache()
    return kept[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a directory with a config.json")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--modes", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"])
    parser.add_argument("--kinds", nargs="+", help="only these layer kinds (default: every kind of the config)")
    parser.add_argument("--sites", action="store_true",
                        help="also print what the 3-layer forward left allocated, by allocation site")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="text-config overrides (integers), e.g. linear_num_value_heads=48")
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(args.model)
    text = config.get_text_config()
    for item in args.set:
        key, value = item.split("=", 1)
        setattr(text, key, int(value))
    kinds = args.kinds or sorted(set(getattr(text, "layer_types", None) or ["full_attention"]))
    tokens = torch.randint(0, text.vocab_size, (args.rows, args.seq), device="cuda")
    widths = {k: getattr(text, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                             "num_key_value_heads", "head_dim", "linear_num_key_heads",
                                             "linear_num_value_heads", "linear_key_head_dim",
                                             "linear_value_head_dim") if hasattr(text, k)}
    for kind in kinds:
        for compiled in (mode == "compiled" for mode in args.modes):
            one, three = (kept_bytes(config, kind, n, tokens, compiled, args.sites and n == 3) for n in (1, 3))
            print(json.dumps({"model": args.model, "set": args.set, "kind": kind, "compiled": compiled,
                              "bytes_per_token_layer": round((three - one) / 2 / tokens.numel(), 1), **widths}),
                  flush=True)


if __name__ == "__main__":
    main()
