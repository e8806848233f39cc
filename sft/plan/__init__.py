"""Memory planner: predict per-GPU peak memory and pick the activation checkpointing (ratio and
mode) and micro-batch that fit.

    python -m sft.plan --config configs/qwen72b.yaml --gpus 64 --gpu-mem 80

Four parts: the memory model (`memory`: what a setting needs on a GPU, the model in its docstring),
the host's side (`host`: what offloading holds in a node's memory), the search over layouts
(`search`: what fits, what plan.auto chooses) and the command line (`cli`).
The planner loads the trainer's rules (the config, the mesh, the checkpointing modes, the model's
shapes on the meta device), never its GPU side: FSDP's wrapping, flex attention, float8, the loss.
"""

from sft.plan.cli import main
from sft.plan.host import HOST_PROCESS_GIB, host_bytes_per_rank, host_gib_per_node
from sft.plan.memory import (ALLOCATOR_SLACK, GIB, Machine, Setting, Shapes, peak_bytes, predict_gib,
                             this_machine_mem_gib, usable_fraction)
from sft.plan.search import (AC_SETTINGS, MICRO_BATCHES, MODES, RATIOS, apply_auto_plan, check_fits,
                             explain_out_of_memory, gpu_memory_gib, smallest_cp, suggest)

__all__ = ["AC_SETTINGS", "ALLOCATOR_SLACK", "GIB", "HOST_PROCESS_GIB", "MICRO_BATCHES", "MODES", "RATIOS", "Machine",
           "Setting", "Shapes", "apply_auto_plan", "check_fits", "explain_out_of_memory", "gpu_memory_gib",
           "host_bytes_per_rank", "host_gib_per_node", "main", "peak_bytes", "predict_gib", "smallest_cp", "suggest",
           "this_machine_mem_gib", "usable_fraction"]
