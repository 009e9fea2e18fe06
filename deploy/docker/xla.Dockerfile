# syntax=docker/dockerfile:1
# XLA executor image: the XLA environment exactly as requirements/xla.txt pins it (torch 2.9.0 +
# torch_xla 2.9.0, which pins its torch) and nothing else; the project's source runs from
# /opt/switchyard. PJRT_DEVICE=CPU by default; TPU hosts set
# PJRT_DEVICE=TPU and build with --build-arg LIBTPU_VERSION=0.0.52.
# Build from the repository root:  docker build -f deploy/docker/xla.Dockerfile -t switchyard/executor-xla .
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG LIBTPU_VERSION=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY requirements/ requirements/
RUN pip install --no-cache-dir -r requirements/xla.txt \
    && if [ -n "${LIBTPU_VERSION}" ]; then pip install --no-cache-dir "libtpu==${LIBTPU_VERSION}"; fi

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH PYTHONPATH=/opt/switchyard PYTHONUNBUFFERED=1 PJRT_DEVICE=CPU
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
EXPOSE 8102 8112 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s \
  CMD ["python", "-m", "clients.cli", "health", "127.0.0.1:8102"]
ENTRYPOINT ["python", "-m", "clients.cli"]
CMD ["executor", "serve", "--backend", "xla", "--host", "0.0.0.0", "--port", "8102", "--frames-port", "8112", "--models", "mlp,tiny-lm"]
