"""The training trial kind: single-process and distributed training on each path, judged on
the loss curves."""
