"""Parallelism: the one device mesh, and what is applied to a meta-device model in a fixed order
(context parallelism -> expert parallelism -> float8 -> tiled MLPs -> activation checkpointing ->
compile -> host offload -> FSDP2; sft/parallel/parallelize.py)."""
