"""The names every service imports for models; the models themselves live in a repository.

`ModelRegistry` is the repository (`switchyard.models.repository.Repository`): a folder of
`<model>/model.toml` plus `<model>/<version>/` artifacts. `ModelRegistry.with_builtins()` is
the default repository seeded with the built-ins (`mlp`, `tiny-lm`, `minilm-l6`, at "1" and
"perturbed"). A user's factory returns `UserModel` (or a bare `nn.Module`), a record of the
factory format (`switchyard.models.formats`) that the repository and the formats both use.
"""

from __future__ import annotations

from switchyard.models.formats import UserModel
from switchyard.models.manifest import TensorSpec, file_sha256
from switchyard.models.repository import (
    CHECKPOINTS,
    DEFAULT_VERSION,
    PERTURB_SCALE,
    PERTURB_SEED,
    PERTURBED_VERSION,
    CheckpointMismatch,
    ExampleInputs,
    ModelNotFound,
    ModelSpec,
    TrainLoss,
    load_module,
    perturb,
)
from switchyard.models.repository import Repository as ModelRegistry

MLP_SHA256 = "4644e1f6a1735cb60afbe0146b4437493cd688f18228eedabe3ee6090d70226c"
TINY_LM_SHA256 = "09cbd2b95a5bad0823859e53148c9f7782a4e7ad7475cfaffb8b1124dd8cec5c"
MINILM_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"


__all__ = [
    "CHECKPOINTS",
    "DEFAULT_VERSION",
    "MINILM_SHA256",
    "MLP_SHA256",
    "PERTURBED_VERSION",
    "PERTURB_SCALE",
    "PERTURB_SEED",
    "TINY_LM_SHA256",
    "CheckpointMismatch",
    "ExampleInputs",
    "ModelNotFound",
    "ModelRegistry",
    "ModelSpec",
    "TensorSpec",
    "TrainLoss",
    "UserModel",
    "file_sha256",
    "load_module",
    "perturb",
]
