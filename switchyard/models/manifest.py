"""`model.toml`: what a repository model declares, parsed once into frozen dataclasses.

A repository is a folder `<repo>/<model>/model.toml` plus `<repo>/<model>/<version>/` holding
the artifact files. `parse_model_toml` checks every field and raises `ManifestError` naming it
(`inputs[1].dims`, `versions.2.files`) with what to write instead; `dump_model_toml` writes
the same document back (used by `switchyard models add`). Pure: no torch, no I/O beyond the
one file read by `read_model_toml`. docs/model-repository.md documents every field.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from switchyard.errors import FailedPrecondition

FORMATS = ("hf", "torch_export", "factory")
DATATYPES = ("BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "FP16", "BF16", "FP32", "FP64", "BYTES")
PRECISIONS = ("fp32", "bf16", "fp16", "fp64")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
FACTORY_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
PLATFORMS = {"hf": "pytorch_hf", "torch_export": "pytorch_export", "factory": "pytorch_factory"}


class ManifestError(FailedPrecondition):
    """model.toml is missing, is not TOML, or a field is wrong (the message names it)."""


@dataclass(frozen=True)
class TensorSpec:
    """One input or output. `dims` excludes the batch dimension; -1 = any length up to max_dims.

    `example_range` bounds the example values validation and warm-up send: integers are drawn
    from [low, high), floats from normal(low, high) (mean, standard deviation).
    """

    name: str
    datatype: str
    dims: tuple[int, ...]
    max_dims: tuple[int, ...] = ()
    example_range: tuple[float, float] = ()  # type: ignore[assignment]

    @property
    def floating(self) -> bool:
        return self.datatype in ("FP16", "BF16", "FP32", "FP64")


@dataclass(frozen=True)
class Batching:
    """Defaults for LoadModel requests that leave them unset; () / -1 = the executor's."""

    buckets: tuple[int, ...] = ()
    max_queue_delay_us: int = -1


@dataclass(frozen=True)
class FactoryEntry:
    """`package.module:function` paths, each importable only from allowed packages."""

    function: str
    examples: str = ""  # (batch, torch.Generator) -> list[Tensor]
    train_loss: str = ""  # (module, batch, generator, dtype, device) -> loss
    convert_state: str = ""  # state dict as saved -> state dict the module loads
    weights: str = "model.safetensors"


@dataclass(frozen=True)
class HFEntry:
    model_class: str = "AutoModel"  # a transformers class name: AutoModel*, BertModel, ...
    outputs: tuple[str, ...] = ()  # attribute of the model output per declared output
    attn_implementation: str = "eager"


@dataclass(frozen=True)
class ExportEntry:
    file: str = "model.pt2"


@dataclass(frozen=True)
class Version:
    name: str
    files: tuple[tuple[str, str], ...]  # (relative path, sha256), sorted by path
    description: str = ""
    perturb_seed: int | None = None  # add seeded noise to the weights (planted defects)

    @property
    def sha256(self) -> str:
        return artifact_sha256(self.files)


@dataclass(frozen=True)
class ModelToml:
    name: str
    format: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    versions: tuple[Version, ...]
    description: str = ""
    default_version: str = ""
    batching: Batching = field(default_factory=Batching)
    precision: tuple[tuple[str, str], ...] = ()  # (backend or "default", precision)
    factory: FactoryEntry | None = None
    hf: HFEntry | None = None
    torch_export: ExportEntry | None = None
    generation: tuple[tuple[str, Any], ...] = ()  # the [generation] table as written

    @property
    def platform(self) -> str:
        return PLATFORMS[self.format]

    def version(self, name: str) -> Version | None:
        return next((v for v in self.versions if v.name == name), None)

    def precision_for(self, backend: str) -> str:
        table = dict(self.precision)
        return table.get(backend) or table.get("default") or "fp32"

    def generation_table(self) -> dict[str, Any]:
        return dict(self.generation)


def artifact_sha256(files: tuple[tuple[str, str], ...]) -> str:
    """One digest for a version: a single file's own sha256 (what `sha256sum` prints), or for
    several the sha256 of their `sha256sum` lines sorted by path."""
    if len(files) == 1:
        return files[0][1]
    lines = "".join(f"{sha}  {path}\n" for path, sha in sorted(files))
    return hashlib.sha256(lines.encode()).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---- parsing --------------------------------------------------------------------------------
class _Table:
    """A TOML table with the path used in error messages, and the keys read from it."""

    def __init__(self, data: Any, where: str, model: str) -> None:
        if not isinstance(data, Mapping):
            raise ManifestError(f"model.toml of {model}: `{where}` must be a table")
        self.data, self.where, self.model, self.seen = data, where, model, set[str]()

    def at(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, why: str) -> ManifestError:
        return ManifestError(f"model.toml of {self.model}: `{self.at(key)}` {why}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        self.seen.add(key)
        if key not in self.data:
            if default is None:
                raise self.fail(key, "is missing")
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            raise self.fail(key, f"must be a {_kind_name(kind)}, got {value!r}")
        if not isinstance(value, kind):
            raise self.fail(key, f"must be a {_kind_name(kind)}, got {value!r}")
        return value

    def text(self, key: str, default: str | None = None) -> str:
        return str(self.get(key, str, default))

    def ints(self, key: str, default: list[int] | None = None) -> tuple[int, ...]:
        values = self.get(key, list, default)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise self.fail(key, f"must be a list of integers, got {values!r}")
        return tuple(values)

    def table(self, key: str) -> _Table | None:
        self.seen.add(key)
        if key not in self.data:
            return None
        return _Table(self.data[key], self.at(key), self.model)

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            raise self.fail(unknown[0], "is not a known field; see docs/model-repository.md")


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {"str": "string", "int": "integer", "list": "list", "dict": "table", "bool": "boolean"}
    return " or ".join(names.get(k.__name__, k.__name__) for k in kinds)


def _tensor(t: _Table) -> TensorSpec:
    name = t.text("name")
    if not NAME.match(name):
        raise t.fail("name", f"{name!r} must be letters, digits, '.', '_' or '-'")
    datatype = t.text("datatype")
    if datatype not in DATATYPES:
        raise t.fail("datatype", f"is {datatype!r}; use one of {', '.join(DATATYPES)}")
    dims = t.ints("dims")
    if any(d == 0 or d < -1 for d in dims):
        raise t.fail("dims", f"{list(dims)}: each dimension is a positive size or -1 (variable)")
    max_dims = t.ints("max_dims", [])
    if max_dims and (len(max_dims) != len(dims) or any(m < 1 for m in max_dims)):
        raise t.fail("max_dims", f"{list(max_dims)} must give a positive bound for each of dims {list(dims)}")
    if max_dims and any(d > 0 and m != d for d, m in zip(dims, max_dims, strict=True)):
        raise t.fail("max_dims", f"{list(max_dims)} must equal dims {list(dims)} where dims are fixed")
    rng = t.get("example_range", list, [])
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in rng)
    if rng and (len(rng) != 2 or not numbers):
        raise t.fail("example_range", f"{rng!r} must be [low, high]")
    if rng and datatype not in ("FP16", "BF16", "FP32", "FP64") and rng[1] <= rng[0]:
        raise t.fail("example_range", f"{rng!r}: integers are drawn from [low, high), so high > low")
    t.done()
    return TensorSpec(name, datatype, dims, max_dims, (float(rng[0]), float(rng[1])) if rng else ())  # type: ignore[arg-type]


def _tensors(top: _Table, key: str, partial: bool = False) -> tuple[TensorSpec, ...]:
    raw = top.get(key, list, [] if partial else None)
    if not raw and partial:
        return ()
    if not raw:
        raise top.fail(key, "needs at least one tensor ([[" + key + "]] name, datatype, dims)")
    tensors = tuple(_tensor(_Table(item, f"{key}[{i}]", top.model)) for i, item in enumerate(raw))
    names = [s.name for s in tensors]
    if len(set(names)) != len(names):
        raise top.fail(key, f"names repeat: {names}")
    return tensors


def _factory_path(t: _Table, key: str, default: str | None = None) -> str:
    path = t.text(key, default)
    if path and not FACTORY_PATH.match(path):
        raise t.fail(key, f"{path!r} must look like 'package.module:function'")
    return path


def _version(name: str, t: _Table) -> Version:
    if not NAME.match(name):
        raise t.fail("", f"version name {name!r} must be letters, digits, '.', '_' or '-'")
    files_table = t.table("files")
    if files_table is None:
        raise t.fail("files", "is missing: give the sha256 of every artifact file (models add writes it)")
    files = []
    for path, sha in files_table.data.items():
        if not isinstance(sha, str) or not SHA256.match(sha):
            raise files_table.fail(path, "must be the file's sha256 (64 lowercase hex digits)")
        if path.startswith("/") or ".." in Path(path).parts or path == "model.toml":
            raise files_table.fail(path, "must be a path inside the version folder")
        files.append((path, sha))
    if not files:
        raise t.fail("files", "is empty: a version needs at least one artifact file")
    seed = t.get("perturb_seed", int, -1)
    version = Version(name, tuple(sorted(files)), t.text("description", ""), seed if seed >= 0 else None)
    t.done()
    return version


def parse_model_toml(data: Mapping[str, Any], model: str, partial: bool = False) -> ModelToml:
    """Checks a parsed model.toml document; `model` (the folder name) names it in errors.

    `partial`: a model.toml a user hands to `models add`, which may leave out the versions
    (add writes them), the inputs and outputs (completed from the artifact) and the format."""
    top = _Table(data, "", model)
    fmt = _format(top, data, partial)
    inputs, outputs = _tensors(top, "inputs", partial), _tensors(top, "outputs", partial)
    factory, hf, export = _format_entry(top, fmt, model, len(outputs))
    batching = _batching(top)
    precision = _precision(top)
    generation: tuple[tuple[str, Any], ...] = ()
    if (g := top.table("generation")) is not None:
        generation = tuple(sorted(g.data.items()))
    versions = _versions(top, model, partial)
    default = top.text("default_version", "")
    if default and not partial and default not in {v.name for v in versions}:
        raise top.fail("default_version", f"{default!r} is not one of the versions")
    parsed = ModelToml(
        name=model,
        format=fmt,
        inputs=inputs,
        outputs=outputs,
        versions=tuple(versions),
        description=top.text("description", ""),
        default_version=default,
        batching=batching,
        precision=precision,
        factory=factory,
        hf=hf,
        torch_export=export,
        generation=generation,
    )
    top.done()
    return parsed


def _format(top: _Table, data: Mapping[str, Any], partial: bool) -> str:
    fmt = top.text("format", "" if partial else None)
    if partial and not fmt:
        fmt = next((f for f in FORMATS if f in data), "")
        if not fmt:
            raise top.fail("format", f"is missing; use one of {', '.join(FORMATS)}")
    if fmt not in FORMATS:
        raise top.fail("format", f"is {fmt!r}; use one of {', '.join(FORMATS)}")
    return fmt


def _format_entry(
    top: _Table, fmt: str, model: str, n_outputs: int
) -> tuple[FactoryEntry | None, HFEntry | None, ExportEntry | None]:
    """The table of the model's format ([factory], [hf] or [torch_export]); no other's."""
    section = top.table(fmt)
    for other in FORMATS:
        if other != fmt and top.table(other) is not None:
            raise top.fail(other, f"is a table for format {other!r}, but format is {fmt!r}")
    if fmt == "factory":
        if section is None:
            raise top.fail("factory", "is missing: format factory needs [factory] function = 'pkg.mod:fn'")
        factory = FactoryEntry(
            function=_factory_path(section, "function"),
            examples=_factory_path(section, "examples", ""),
            train_loss=_factory_path(section, "train_loss", ""),
            convert_state=_factory_path(section, "convert_state", ""),
            weights=section.text("weights", "model.safetensors"),
        )
        section.done()
        return factory, None, None
    if fmt == "hf":
        section = section or _Table({}, "hf", model)
        hf = HFEntry(
            model_class=section.text("class", "AutoModel"),
            outputs=tuple(section.get("outputs", list, [])),
            attn_implementation=section.text("attn_implementation", "eager"),
        )
        if not re.match(r"^[A-Za-z_]\w*$", hf.model_class):
            raise section.fail("class", f"{hf.model_class!r} must be a transformers class name")
        if hf.outputs and len(hf.outputs) != n_outputs:
            raise section.fail("outputs", f"names {len(hf.outputs)} attributes for {n_outputs} outputs")
        section.done()
        return None, hf, None
    section = section or _Table({}, "torch_export", model)
    export = ExportEntry(section.text("file", "model.pt2"))
    section.done()
    return None, None, export


def _batching(top: _Table) -> Batching:
    if (b := top.table("batching")) is None:
        return Batching()
    batching = Batching(b.ints("buckets", []), int(b.get("max_queue_delay_us", int, -1)))
    if any(x < 1 or x > 1024 for x in batching.buckets):
        raise b.fail("buckets", f"{list(batching.buckets)} must be batch sizes from 1 to 1024")
    b.done()
    return batching


def _precision(top: _Table) -> tuple[tuple[str, str], ...]:
    precision: list[tuple[str, str]] = []
    if (p := top.table("precision")) is not None:
        for backend in list(p.data):
            value = p.text(backend)
            if value not in PRECISIONS:
                raise p.fail(backend, f"is {value!r}; use one of {', '.join(PRECISIONS)}")
            precision.append((backend, value))
    return tuple(precision)


def _versions(top: _Table, model: str, partial: bool) -> list[Version]:
    versions_table = top.table("versions")
    if partial and versions_table is None:
        versions_table = _Table({}, "versions", model)
    elif versions_table is None or not versions_table.data:
        raise top.fail("versions", "is missing: add a version with `switchyard models add`")
    versions = []
    for name in versions_table.data:
        sub = versions_table.table(name)
        assert sub is not None
        versions.append(_version(str(name), sub))
    return versions


def read_model_toml(folder: Path, partial: bool = False, name: str = "") -> ModelToml:
    path = folder / "model.toml"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(
            f"model {folder.name} has no model.toml at {path}; add the model with `switchyard models add`"
        ) from None
    except OSError as exc:
        raise ManifestError(f"cannot read {path}: {exc.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"model.toml of {name or folder.name} is not valid TOML: {exc}") from None
    return parse_model_toml(data, name or folder.name, partial)


# ---- writing --------------------------------------------------------------------------------
def to_document(m: ModelToml) -> dict[str, Any]:
    """The TOML document of `m` (parse_model_toml(to_document(m), m.name) == m)."""
    doc: dict[str, Any] = {"format": m.format}
    if m.description:
        doc["description"] = m.description
    if m.default_version:
        doc["default_version"] = m.default_version
    doc["inputs"] = [_tensor_doc(s) for s in m.inputs]
    doc["outputs"] = [_tensor_doc(s) for s in m.outputs]
    doc.update(_format_doc(m))
    if m.batching != Batching():
        doc["batching"] = {}
        if m.batching.buckets:
            doc["batching"]["buckets"] = list(m.batching.buckets)
        if m.batching.max_queue_delay_us >= 0:
            doc["batching"]["max_queue_delay_us"] = m.batching.max_queue_delay_us
    if m.precision:
        doc["precision"] = dict(m.precision)
    if m.generation:
        doc["generation"] = dict(m.generation)
    doc["versions"] = {v.name: _version_doc(v) for v in m.versions}
    return doc


def _tensor_doc(s: TensorSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": s.name, "datatype": s.datatype, "dims": list(s.dims)}
    if s.max_dims:
        out["max_dims"] = list(s.max_dims)
    if s.example_range:
        out["example_range"] = list(s.example_range)
    return out


def _format_doc(m: ModelToml) -> dict[str, Any]:
    """The format's table: [factory], [hf] or [torch_export]."""
    doc: dict[str, Any] = {}
    if m.factory is not None:
        f = m.factory
        doc["factory"] = {"function": f.function}
        for key in ("examples", "train_loss", "convert_state"):
            if getattr(f, key):
                doc["factory"][key] = getattr(f, key)
        if f.weights != "model.safetensors":
            doc["factory"]["weights"] = f.weights
    if m.hf is not None:
        doc["hf"] = {"class": m.hf.model_class, "attn_implementation": m.hf.attn_implementation}
        if m.hf.outputs:
            doc["hf"]["outputs"] = list(m.hf.outputs)
    if m.torch_export is not None:
        doc["torch_export"] = {"file": m.torch_export.file}
    return doc


def _version_doc(v: Version) -> dict[str, Any]:
    entry: dict[str, Any] = {}
    if v.description:
        entry["description"] = v.description
    if v.perturb_seed is not None:
        entry["perturb_seed"] = v.perturb_seed
    entry["files"] = dict(v.files)
    return entry


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _key(k: str) -> str:
    return k if re.match(r"^[A-Za-z0-9_-]+$", k) else _value(k)


def dumps(doc: Mapping[str, Any], prefix: str = "") -> str:
    """A TOML writer for model.toml documents (tables, arrays of tables, scalars, lists)."""
    lines: list[str] = []
    tables: list[tuple[str, Mapping[str, Any]]] = []
    arrays: list[tuple[str, list[Mapping[str, Any]]]] = []
    for key, value in doc.items():
        if isinstance(value, Mapping):
            tables.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(x, Mapping) for x in value):
            arrays.append((key, value))
        else:
            lines.append(f"{_key(key)} = {_value(value)}")
    out = "\n".join(lines) + ("\n" if lines else "")
    for key, items in arrays:
        for item in items:
            out += f"\n[[{prefix}{_key(key)}]]\n" + dumps(item, f"{prefix}{_key(key)}.")
    for key, table in tables:
        name = f"{prefix}{_key(key)}"
        scalars = {k: v for k, v in table.items() if not isinstance(v, Mapping)}
        nested = {k: v for k, v in table.items() if isinstance(v, Mapping)}
        if scalars or not nested:
            out += f"\n[{name}]\n" + dumps(scalars, f"{name}.")
        if nested:
            out += dumps(nested, f"{name}.")
    return out


def write_model_toml(folder: Path, m: ModelToml) -> None:
    """Writes folder/model.toml atomically (a reader sees the old or the new file)."""
    text = "# written by `switchyard models add`; see docs/model-repository.md\n" + dumps(to_document(m))
    parse_model_toml(tomllib.loads(text), m.name)  # what we write must read back
    tmp = folder / f".model.toml.{id(m)}.tmp"
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(folder / "model.toml")
