"""Generated from proto/ by tools/gen_proto.py; do not edit."""
