"""The unit tests of the judge library (switchyard/judge): no gRPC, no service."""
