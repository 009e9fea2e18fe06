# syntax=docker/dockerfile:1
# CUDA executor image: PyPI's torch wheel carries its CUDA runtime (nvidia-* wheels), so a
# slim Python base is enough; the node provides the driver (NVIDIA device plugin / toolkit).
# Build from the repository root:  docker build -f deploy/docker/cuda.Dockerfile -t switchyard/executor-cuda .
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY requirements/ requirements/
RUN pip install --no-cache-dir torch==2.13.0
COPY pyproject.toml README.md ./
COPY switchyard/ switchyard/
COPY services/ services/
COPY clients/ clients/
COPY workflows/ workflows/
RUN pip install --no-cache-dir -c requirements/main.txt ".[server,executor]" \
    && pip uninstall --yes switchyard

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH PYTHONPATH=/opt/switchyard PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
COPY --from=build /opt/venv /opt/venv
RUN useradd --system --uid 10001 --home-dir /var/lib/switchyard --create-home switchyard
# The source tree itself runs (PYTHONPATH), as in a checkout: migrations, alembic.ini and the
# model checkpoints are found next to the code, and the XLA image needs no project install.
WORKDIR /opt/switchyard
COPY switchyard/ switchyard/
COPY services/ services/
COPY clients/ clients/
COPY workflows/ workflows/
USER 10001:10001
EXPOSE 8103 8113 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s \
  CMD ["python", "-m", "clients.cli", "health", "127.0.0.1:8103"]
ENTRYPOINT ["python", "-m", "clients.cli"]
CMD ["executor", "serve", "--backend", "cuda", "--host", "0.0.0.0", "--port", "8103", "--frames-port", "8113", "--models", "mlp,tiny-lm,minilm-l6"]
