"""Generative serving in the executor: a continuous-batching engine over a static KV cache."""
