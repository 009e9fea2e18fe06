"""The trial spec: its parser, its field reader, and the workflow's typed input and output."""
