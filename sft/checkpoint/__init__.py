"""Checkpoints: what a committed checkpoint is (layout and integrity: the light part tools import), the
all-ranks commit, host staging for asynchronous saves, and the manager that owns resume, restore and
saves."""
