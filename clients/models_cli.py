"""`switchyard models add|remove|list|show|validate`: the model repository from a shell.

The repository is `--repository DIR`, else `[models] repository` of the configuration
(`SWITCHYARD_MODELS_REPOSITORY`, default var/models). Registration is cheap; torch is
imported inside the commands. docs/model-repository.md has the walk-through.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser("models", help="the model repository: add, list, show, validate, remove")
    commands = parser.add_subparsers(dest="models_command", required=True, metavar="SUBCOMMAND")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--repository", default="", help="repository folder (default: [models] repository)")
        p.add_argument("--config", default="", help="switchyard configuration file")

    add = commands.add_parser(
        "add", help="copy an artifact in, hash it, write model.toml, validate on the CPU"
    )
    add.add_argument("name")
    add.add_argument("path", help="a save_pretrained folder, a .pt2 file, or a folder with model.toml")
    add.add_argument("--version", default="", help="default: 1, or the next integer")
    add.add_argument("--format", default="", choices=["", "hf", "torch_export", "factory"])
    add.add_argument("--replace", action="store_true", help="overwrite an existing version")
    add.add_argument("--description", default="")
    add.add_argument(
        "--generation",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve a Hugging Face causal LM by the generation engine (default: when the folder is a "
        "Llama-family causal LM with a tokenizer.json); [generation] is filled from its config",
    )
    _generation_sizes(add)
    add.add_argument("--allow-factory", action="append", default=[], metavar="PACKAGE")
    add.add_argument("--metering", default="", help="also audit to metering at this address")
    common(add)
    add.set_defaults(func=_add)

    remove = commands.add_parser("remove", help="remove a version (or the whole model)")
    remove.add_argument("name")
    remove.add_argument("--version", default="")
    remove.add_argument("--metering", default="", help="also audit to metering at this address")
    common(remove)
    remove.set_defaults(func=_remove)

    listing = commands.add_parser("list", help="models, versions and formats")
    listing.add_argument("--json", action="store_true")
    common(listing)
    listing.set_defaults(func=_list)

    show = commands.add_parser("show", help="one model's declaration and versions with their sha256")
    show.add_argument("name")
    common(show)
    show.set_defaults(func=_show)

    validate = commands.add_parser(
        "validate", help="load on a backend, run the example inputs, print compatibility findings"
    )
    # Several names share one interpreter: on xla the command re-runs itself once, and the XLA
    # environment's start-up (importing torch_xla) is paid once, not per model.
    validate.add_argument(
        "names", nargs="+", metavar="NAME", help="one or more repository models, validated in order"
    )
    validate.add_argument("--version", default="", help="the version of each NAME (default: its default)")
    validate.add_argument("--backend", default="cpu", help="cpu | xla | cuda | tpu (default cpu)")
    validate.add_argument("--mode", default="", help="execution mode (default: the backend's first)")
    validate.add_argument("--precision", default="", help="default: model.toml's for the backend")
    validate.add_argument("--allow-factory", action="append", default=[], metavar="PACKAGE")
    validate.add_argument("--json", action="store_true")
    common(validate)
    validate.set_defaults(func=_validate)


def _generation_sizes(add: argparse.ArgumentParser) -> None:
    """Options that size an inferred [generation] table (docs/generation.md), named as vLLM's
    `serve` names them where it has them."""
    sizes = add.add_argument_group("generation sizes (default: from config.json)")
    sizes.add_argument(
        "--max-context",
        "--max-model-len",
        type=int,
        default=0,
        metavar="N",
        help="tokens per request, prompt plus generated: the KV cache's length (at most the model's "
        "max_position_embeddings; default that, at most 2048)",
    )
    sizes.add_argument(
        "--max-new-tokens",
        type=int,
        default=0,
        metavar="N",
        help="the most tokens one request may generate (default: max context less the largest "
        "prompt bucket, else half the max context)",
    )
    sizes.add_argument(
        "--prompt-buckets",
        type=_sizes,
        default=(),
        metavar="N,N,...",
        help="prefill lengths in tokens, increasing, the largest under the max context: a compiled "
        "graph per bucket, the largest is the longest prompt (default: powers of two from 8)",
    )
    sizes.add_argument(
        "--decode-slots",
        "--max-num-seqs",
        type=int,
        default=0,
        metavar="N",
        help="requests decoding at once, the KV cache's rows (default: the largest decode bucket, else 8)",
    )
    sizes.add_argument(
        "--decode-buckets",
        type=_sizes,
        default=(),
        metavar="N,N,...",
        help="decode-step widths in requests, increasing, ending at the decode slots: a compiled graph "
        "per width (default: powers of two up to the decode slots)",
    )


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 16,32") from None


def _settings(args: argparse.Namespace) -> tuple[Path, tuple[str, ...]]:
    from clients.local_cluster.cluster_config import load_config

    config = load_config(args.config or None)
    root = Path(args.repository) if args.repository else config.model_repository
    allowed = (*config.allowed_factories, *getattr(args, "allow_factory", []))
    return root.resolve(), tuple(allowed)


def _audit_metering(address: str, action: str, resource: str, detail: dict[str, Any]) -> None:
    import grpc

    from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
    from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc

    with grpc.insecure_channel(address) as channel:
        mgrpc.MeteringStub(channel).AppendAudit(
            mpb.AppendAuditRequest(
                actor=mpb.Actor(principal=detail.get("by", ""), source="switchyard models"),
                action=action,
                resource=resource,
                outcome="ok",
                detail_json=json.dumps(detail, sort_keys=True),
            ),
            timeout=10,
        )


def _add(args: argparse.Namespace) -> int:
    from clients.model_admin import add_model
    from clients.model_generation import GenerationSizes

    root, allowed = _settings(args)
    sizes = GenerationSizes(
        args.max_context, args.max_new_tokens, args.prompt_buckets, args.decode_slots, args.decode_buckets
    )
    spec, checked = add_model(
        root,
        args.name,
        Path(args.path),
        args.version,
        args.format,
        args.replace,
        allowed,
        args.description,
        args.generation,
        sizes,
    )
    print(f"added {spec.name}:{spec.version} ({spec.manifest.format}) to {root}")
    print(f"  sha256 {spec.sha256}")
    for name, shape in checked.input_shapes:
        print(f"  validated: input {name} {list(shape)}")
    for name, shape in checked.output_shapes:
        print(f"  validated: output {name} {list(shape)} (matches model.toml)")
    if checked.generated is not None:
        print(f"  generation {dict(spec.manifest.generation)}")
        print(f"  validated: greedy generation {checked.generated!r} equals the model's own")
    if args.metering:
        detail = {"model": spec.name, "version": spec.version, "sha256": spec.sha256, "by": _user()}
        _audit_metering(args.metering, "model.add", f"model/{spec.name}:{spec.version}", detail)
    return 0


def _user() -> str:
    from clients.model_admin import _user

    return _user()


def _remove(args: argparse.Namespace) -> int:
    from clients.model_admin import remove_model

    root, _ = _settings(args)
    removed = remove_model(root, args.name, args.version)
    print(f"removed {args.name} version(s) {', '.join(removed)} from {root}")
    if args.metering:
        detail = {"model": args.name, "versions": removed, "by": _user()}
        _audit_metering(args.metering, "model.remove", f"model/{args.name}", detail)
    return 0


def _list(args: argparse.Namespace) -> int:
    from switchyard.errors import SwitchyardError
    from switchyard.models.repository import Repository

    root, _ = _settings(args)
    repo = Repository(root)
    rows = []
    for name in repo.names():
        try:
            m = repo.manifest(name)
            rows.append(
                {
                    "name": name,
                    "format": m.format,
                    "versions": sorted(v.name for v in m.versions),
                    "description": m.description,
                }
            )
        except SwitchyardError as exc:
            rows.append({"name": name, "format": "?", "versions": [], "description": f"BROKEN: {exc}"})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'model':<20} {'format':<13} {'versions':<20} description")
    for r in rows:
        print(f"{r['name']:<20} {r['format']:<13} {','.join(r['versions']):<20} {r['description']}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from switchyard.models.repository import Repository

    root, _ = _settings(args)
    repo = Repository(root)
    m = repo.manifest(args.name)
    print(f"{m.name}: {m.format} ({m.platform}) in {root / m.name}")
    if m.description:
        print(f"  {m.description}")
    for kind, specs in (("input", m.inputs), ("output", m.outputs)):
        for s in specs:
            bound = f" max {list(s.max_dims)}" if s.max_dims else ""
            print(f"  {kind:<6} {s.name} {s.datatype} [batch, {', '.join(map(str, s.dims))}]{bound}")
    print(f"  default version {repo.default_version(m.name)}")
    for v in m.versions:
        print(f"  version {v.name}: sha256 {v.sha256}" + (f" ({v.description})" if v.description else ""))
        for path, sha in v.files:
            print(f"    {path} {sha}")
    if m.generation:
        print(f"  generation {dict(m.generation)}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    """Each NAME in turn, stopping at the first that fails; --json prints one report object for
    one NAME and a list of them, in order, for several (the failing one's included, where it has
    one: a generation that disagrees with its reference)."""
    if args.backend in ("xla", "tpu") and not _has_torch_xla():
        return _reexec(args)
    reports: list[dict[str, Any]] = []
    try:
        for name in args.names:
            _validate_one(name, args, reports)
    finally:
        if args.json and reports:
            print(json.dumps(reports[0] if len(args.names) == 1 else reports, indent=2))
    return 0


def _validate_one(name: str, args: argparse.Namespace, reports: list[dict[str, Any]]) -> None:
    import torch

    from clients.model_admin import check_outputs
    from services.executor.backends.base import PRECISIONS
    from services.executor.device import select_backend
    from services.executor.load_phases import LoadOptions
    from services.executor.loaded_model import LoadedModel
    from switchyard.models.repository import Repository

    root, allowed = _settings(args)
    spec = Repository(root, allowed).get(name, args.version)
    if spec.generation is not None:
        _validate_generation(spec, args, reports)
        return
    backend = select_backend(args.backend, 0)
    precision = args.precision or spec.manifest.precision_for(backend.name)
    if precision not in backend.precisions or precision not in PRECISIONS:
        precision = "fp32"
    options = LoadOptions(
        mode=args.mode or backend.modes[0],
        precision=precision,
        batch_buckets=(1, 2),
        max_queue_delay_us=0,
        max_queue_size=8,
        dynamic_batching=False,
    )
    model = LoadedModel(spec, backend, options)
    model.load()
    outputs = model._run_tensors(spec.example_inputs(2, torch.Generator().manual_seed(0)))
    shapes = check_outputs(spec, outputs, 2, dtypes=precision == "fp32")
    f = model.findings.during_load
    report = {
        "model": spec.name,
        "version": spec.version,
        "sha256": spec.sha256,
        "backend": backend.name,
        "mode": options.mode,
        "precision": precision,
        "outputs": {name: list(shape) for name, shape in shapes},
        "fallback_ops": dict(f.fallback_ops),
        "graph_breaks": f.graph_breaks,
        "graph_break_reasons": list(f.graph_break_reasons),
        "compilations": f.compilations,
        "compile_time_s": round(f.compile_time_s, 3),
        "adaptations": model.findings.adaptations,
        "notes": list(f.notes),
        "load_s": round(model.times.total_s, 3),
    }
    reports.append(report)
    if args.json:
        return
    print(f"{spec.name}:{spec.version} on {backend.name} ({options.mode}, {precision}): OK")
    print(f"  sha256 {spec.sha256}")
    for name, shape in shapes:
        print(f"  output {name} {list(shape)} matches model.toml")
    ops = ", ".join(f"{op} x{n}" for op, n in f.fallback_ops) or "none"
    print(f"  fallback ops: {ops}")
    print(
        f"  graph breaks: {f.graph_breaks}"
        + (f" ({'; '.join(f.graph_break_reasons)})" if f.graph_breaks else "")
    )
    print(f"  compilations: {f.compilations} ({f.compile_time_s:.2f} s)")
    for line in model.findings.adaptations + list(f.notes):
        print(f"  note: {line}")


def _validate_generation(spec: Any, args: argparse.Namespace, reports: list[dict[str, Any]]) -> None:
    """A generative model: a short greedy generation on the backend, against the model's own."""
    from clients.model_generation import validate_generation
    from switchyard.errors import InvalidArgument

    check = validate_generation(spec, args.backend, args.mode)
    report = {
        "model": spec.name,
        "version": spec.version,
        "sha256": spec.sha256,
        "backend": check.backend,
        "mode": check.mode,
        "precision": "fp32",
        "prompt_tokens": check.prompt_tokens,
        "generated_ids": list(check.tokens),
        "reference_ids": list(check.reference),
        "reference": check.reference_name,
        "text": check.text,
        "agrees": check.agrees,
        "load_s": round(check.load_s, 3),
    }
    reports.append(report)
    if not check.agrees:
        raise InvalidArgument(
            f"{spec.name}:{spec.version} on {check.backend} generates {list(check.tokens)} greedily, but "
            f"its {check.reference_name} gives {list(check.reference)}"
        )
    if not args.json:
        print(f"{spec.name}:{spec.version} on {check.backend} ({check.mode}, fp32): OK")
        print(f"  sha256 {spec.sha256}")
        print(
            f"  greedy generation of {len(check.tokens)} tokens from a {check.prompt_tokens}-token prompt "
            f"equals the model's {check.reference_name}: {check.text!r}"
        )


def _has_torch_xla() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch_xla") is not None


def _reexec(args: argparse.Namespace) -> int:
    """The XLA backend runs under its own environment's interpreter ([executors.xla] python)."""
    from clients.local_cluster.cluster_config import load_config
    from switchyard.errors import FailedPrecondition

    config = load_config(args.config or None)
    python = config.executor(args.backend).python
    if not python or not Path(python).exists():
        raise FailedPrecondition(
            f"validating on {args.backend} needs its environment: set executors.{args.backend}.python "
            f"(SWITCHYARD_{args.backend.upper()}_PYTHON); this interpreter has no torch_xla"
        )
    root, allowed = _settings(args)
    argv = [python, "-m", "clients.cli", "models", "validate", *args.names, "--backend", args.backend]
    argv += ["--repository", str(root), *(f"--allow-factory={p}" for p in allowed)]
    argv += [*(["--version", args.version] if args.version else [])]
    argv += [
        *(["--mode", args.mode] if args.mode else []),
        *(["--precision", args.precision] if args.precision else []),
    ]
    argv += ["--json"] if args.json else []
    from switchyard.layout import checkout_root

    checkout = str(checkout_root() or "")  # an installed wheel needs no path
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (checkout, os.environ.get("PYTHONPATH", "")) if p),
    }
    env.setdefault("PJRT_DEVICE", "CPU")
    return subprocess.run(argv, env=env, check=False, stdout=sys.stdout, stderr=sys.stderr).returncode
