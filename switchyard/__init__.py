"""switchyard: hardware-neutral serving and trial layer for PyTorch."""

__version__ = "0.1.0"

from switchyard.layout import install_aliases as _install_aliases

_install_aliases()  # an installed wheel: `services.…` etc. (see switchyard/layout.py)
