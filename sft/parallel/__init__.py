"""Parallelism: the one device mesh, and what is applied to a meta-device model in a fixed order
(context parallelism -> expert parallelism -> float8 -> activation checkpointing -> compile ->
FSDP2; sft/parallel/parallelize.py)."""
