# syntax=docker/dockerfile:1
# TorchTPU executor image (TPU VMs only): the TorchTPU environment exactly as
# requirements/tpu.txt pins it (torch 2.13 with torch_tpu and libtpu); the CPU wheel of torch
# is enough, the TPU runtime comes from libtpu. The project's source runs from /opt/switchyard.
# Build from the repository root:  docker build -f deploy/docker/tpu.Dockerfile -t switchyard/executor-tpu .
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY requirements/ requirements/
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && pip install --no-cache-dir -r requirements/tpu.txt

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH PYTHONPATH=/opt/switchyard PYTHONUNBUFFERED=1
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
EXPOSE 8104 8114 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s \
  CMD ["python", "-m", "clients.cli", "health", "127.0.0.1:8104"]
ENTRYPOINT ["python", "-m", "clients.cli"]
CMD ["executor", "serve", "--backend", "tpu", "--host", "0.0.0.0", "--port", "8104", "--frames-port", "8114", "--models", "mlp,tiny-lm"]
