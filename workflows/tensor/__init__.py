"""The tensor trial kind: fixed inputs compared by the evaluator, latency measured in blocks
with intervals, answers checked under load."""
