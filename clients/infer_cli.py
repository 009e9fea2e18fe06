"""`switchyard infer`: send one .npy (or .npz) file to an executor or the router and print the result.

A .npy file is sent as the model's single input (its name from ModelMetadata); a .npz sends
each array under its own name. Outputs go to `--output` (.npz) or are summarised on stdout.
Through the router, the API key comes from SWITCHYARD_API_KEY (never a flag: flags show in
`ps` and shell history).
"""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser("infer", help="run one inference from a .npy/.npz file")
    parser.add_argument("--model", required=True)
    parser.add_argument("--version", default="")
    parser.add_argument("--input", required=True, help=".npy (single input) or .npz (named inputs)")
    parser.add_argument(
        "--address", default="127.0.0.1:8101", help="executor or router (default 127.0.0.1:8101)"
    )
    parser.add_argument("--output", default="", help="write outputs to this .npz")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.set_defaults(func=_infer)


def _infer(args: argparse.Namespace) -> int:
    import json
    import os

    import numpy as np

    from clients.executor_client import ExecutorClient
    from switchyard.gen.inference import grpc_service_pb2 as oip

    loaded = np.load(args.input)
    api_key = os.environ.get("SWITCHYARD_API_KEY", "")
    with ExecutorClient(args.address, timeout_s=args.timeout, api_key=api_key) as client:
        if isinstance(loaded, np.ndarray):
            meta = client.oip.ModelMetadata(
                oip.ModelMetadataRequest(name=args.model, version=args.version), metadata=client.metadata
            )
            if len(meta.inputs) != 1:
                names = [i.name for i in meta.inputs]
                raise SystemExit(f"{args.model} takes inputs {names}; pass an .npz with those names")
            inputs = {meta.inputs[0].name: loaded}
        else:
            inputs = {name: loaded[name] for name in loaded.files}
        result = client.infer(args.model, inputs, version=args.version)
    if args.output:
        np.savez(args.output, **result.outputs)  # type: ignore[arg-type]
    summary = {
        "model": args.model,
        "version": result.model_version,
        "outputs": {
            name: {"shape": list(a.shape), "dtype": str(a.dtype), "head": a.reshape(-1)[:8].tolist()}
            for name, a in result.outputs.items()
        },
        "parameters": result.parameters,
    }
    print(json.dumps(summary, indent=2))
    return 0
