"""Reference models (mlp, tiny-lm, minilm-l6) and the registry of models an executor can load."""
