"""Writes the seeded reference checkpoints (run once; the files are committed).

`python tools/make_checkpoints.py` rewrites `switchyard/models/checkpoints/*.safetensors` and
prints their sha256, which `builtin/<name>/model.toml` pins. Bytes can differ across torch builds
(initialisers change), so the committed files, not this script, are the truth.
"""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from switchyard.models import mlp, tiny_lm
from switchyard.models.manifest import file_sha256
from switchyard.models.repository import CHECKPOINTS

MODELS = {"mlp": (mlp.build, 0), "tiny_lm": (tiny_lm.build, 1)}


def main(names: list[str]) -> None:
    """Rewrites the named checkpoints (all when none are named)."""
    CHECKPOINTS.mkdir(exist_ok=True)
    for name in names or list(MODELS):
        build, seed = MODELS[name]
        torch.manual_seed(seed)
        module = build()
        state = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
        path = CHECKPOINTS / f"{name}.safetensors"
        save_file(state, str(path), metadata={"model": name, "seed": str(seed)})
        print(f"{path.name} {path.stat().st_size} bytes sha256 {file_sha256(path)}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
