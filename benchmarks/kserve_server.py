"""The issue-19 model served by KServe (its own venv: `make setup-kserve`), gRPC v2 only.

    $(make -s kserve-python) benchmarks/kserve_server.py --pt2 REPO/small-mlp/1/model.pt2 --name small-mlp

Loads the same torch.export program the executor serves, one torch thread, no batching.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer

from switchyard.net import free_port


class Exported(Model):  # type: ignore[misc]
    def __init__(self, name: str, pt2: str) -> None:
        super().__init__(name)
        self.module = torch.export.load(pt2).module()
        self.ready = True

    async def predict(
        self, payload: InferRequest, headers: Any = None, response_headers: Any = None
    ) -> InferResponse:
        x = torch.from_numpy(payload.inputs[0].as_numpy())
        with torch.inference_mode():
            y = self.module(x).numpy()
        out = InferOutput(name="output0", shape=list(y.shape), datatype="FP32")
        out.set_data_from_numpy(y, binary_data=True)
        return InferResponse(model_name=self.name, infer_outputs=[out], response_id=payload.id)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--pt2", required=True)
    parser.add_argument("--name", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    grpc_port = free_port()
    model = Exported(args.name, args.pt2)
    print(f"serving on 127.0.0.1:{grpc_port}", flush=True)  # the caller retries until it answers
    ModelServer(grpc_port=grpc_port, http_port=free_port(), workers=1, enable_docs_url=False).start([model])


if __name__ == "__main__":
    main()
