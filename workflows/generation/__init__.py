"""The generation trial kind: its steps in the workflow, its activities (load generator,
metrics, divergence), its verdict and its report sections."""
