"""The training loop's parts: the loss, the optimizer, evaluation, step metrics, preemption and the run
directory."""
