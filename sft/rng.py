"""This process's random generators (python's, numpy's, torch's and the GPU's): seeded at a run's
start, saved with each checkpoint (a file per rank) and restored at resume. Not transformers'
`set_seed`, whose module imports peft where it is installed (9.6 s of a start-up on an H200 host)."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed(value: int) -> None:
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)  # every GPU's too


def state() -> dict:
    generators = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        generators["cuda"] = torch.cuda.get_rng_state()
    return generators


def set_state(generators: dict) -> None:
    random.setstate(generators["python"])
    np.random.set_state(generators["numpy"])
    torch.set_rng_state(generators["torch"])
    if "cuda" in generators and torch.cuda.is_available():
        torch.cuda.set_rng_state(generators["cuda"])
