"""switchyard: hardware-neutral serving and trial layer for PyTorch."""

__version__ = "0.1.0"
