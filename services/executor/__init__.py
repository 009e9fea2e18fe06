"""Executor service: serves models on one accelerator path over OIP gRPC."""
