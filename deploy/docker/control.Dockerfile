# syntax=docker/dockerfile:1
# Control services image: router, metering, evaluator and the trial worker (one image, the
# command picks the service). Also carries the Alembic migrations, run as a Kubernetes Job.
# Build from the repository root:  docker build -f deploy/docker/control.Dockerfile -t switchyard/control .
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY requirements/ requirements/
# torch is a core dependency (tensor helpers in the evaluator and trial inputs): CPU wheel.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY switchyard/ switchyard/
COPY services/ services/
COPY clients/ clients/
COPY workflows/ workflows/
RUN pip install --no-cache-dir -c requirements/main.txt ".[server,control]" \
    && pip uninstall --yes switchyard

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH PYTHONPATH=/opt/switchyard PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
COPY --from=build /opt/venv /opt/venv
RUN useradd --system --uid 10001 --home-dir /var/lib/switchyard --create-home switchyard
# The source tree itself runs (PYTHONPATH), as in a checkout: migrations, alembic.ini and the
# model checkpoints are found next to the code, and the XLA image needs no project install.
WORKDIR /opt/switchyard
COPY switchyard/ switchyard/
COPY services/ services/
COPY clients/ clients/
COPY workflows/ workflows/
COPY alembic.ini ./
COPY migrations/ migrations/
USER 10001:10001
EXPOSE 8001 8201 8301 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s \
  CMD ["python", "-m", "clients.cli", "health", "127.0.0.1:8001"]
ENTRYPOINT ["python", "-m", "clients.cli"]
CMD ["router", "serve", "--host", "0.0.0.0", "--port", "8001"]
