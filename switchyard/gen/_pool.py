"""The private descriptor pool all generated switchyard modules register in."""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
