"""What the training state costs per trained parameter as the config sets it (optim.master_dtype,
optim.state_dtype): the planner, the checkpoint size warnings and the host staging count with it."""

from __future__ import annotations

from dataclasses import dataclass

from sft.config.schema import DTYPES, OptimConfig


@dataclass(frozen=True)
class StateBytes:
    """Bytes per trained parameter of each part of the training state; the planner, the checkpoint
    size warnings and the host staging all count with these."""
    master: int = 4
    """the master weight (float32; bf16 with optim.master_dtype)"""
    grad: int = 4
    """its gradient, from backward to the optimizer step (in the master's dtype)"""
    optimizer: int = 8
    """AdamW's two moments (float32; bf16 with optim.state_dtype)"""

    @property
    def checkpoint(self) -> int:
        """What a checkpoint holds of it: the weight and the optimizer state."""
        return self.master + self.optimizer

    @property
    def total(self) -> int:
        return self.master + self.grad + self.optimizer


STATE_BYTES = StateBytes()


def state_bytes(cfg: OptimConfig) -> StateBytes:
    """The state a trained parameter costs under `cfg` (the gradient has the master's dtype: FSDP
    casts the reduced gradient to it)."""
    master = DTYPES[cfg.master_dtype].itemsize
    return StateBytes(master=master, grad=master, optimizer=2 * DTYPES[cfg.state_dtype].itemsize)
