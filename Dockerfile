# kiln's images, one target each (`kiln serve <name>` picks the service):
#
#   docker build -t kiln:dev .                                     # services (the default target)
#   docker build --target engine-cpu -t kiln-engine-cpu:dev .      # engine pool on the CPU
#   docker build -f Dockerfile.engine -t kiln-engine:dev .         # engine pool on NVIDIA GPUs
#
# services: ledger, agent runner, cost model (and the CLI, migrations, PKI): no torch.
# engine-cpu: the same plus CPU torch and a C/C++ compiler (torch.compile's Inductor builds C++
# on the CPU); what docker-compose's engine-pool runs on a machine without a GPU.
# The CUDA engine image (torch's CUDA wheels, Triton, gcc) is Dockerfile.engine.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KILN_LOG_FORMAT=json

WORKDIR /app

# Only what the install needs (.dockerignore keeps the rest of the tree out of the context).
COPY pyproject.toml README.md LICENSE* ./
COPY proto ./proto
COPY services ./services
# `server`: the services' and the CLI's dependencies (plain `kiln` is the gRPC client);
# `tracing`: OpenTelemetry, off unless OTEL_EXPORTER_OTLP_ENDPOINT is set.
ARG KILN_EXTRAS=server,tracing
RUN pip install ".[${KILN_EXTRAS}]" && rm -rf /app/services/*.egg-info

RUN useradd --system --uid 10001 --home-dir /app kiln \
    && mkdir -p /pki && chown kiln /pki  # a new `pki` volume takes this owner (docker-compose.yml)

# ledger, engine-pool, agent-runner, cost-model; Prometheus metrics (9400 under compose,
# 9401..9404 by service by default).
EXPOSE 50051 50052 50053 50054 9400 9401 9402 9403 9404

ENTRYPOINT ["kiln"]
CMD ["--help"]


FROM base AS engine-cpu

ARG TORCH_VERSION=2.13.0
ARG KILN_EXTRAS=server,tracing
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ \
    && rm -rf /var/lib/apt/lists/*
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
    && pip install ".[${KILN_EXTRAS},engine]" \
    && rm -rf /app/services/*.egg-info \
    && python -c "import torch; print('torch', torch.__version__)"

USER kiln
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=6 \
    CMD ["kiln", "health", "127.0.0.1:50052"]
CMD ["serve", "engine-pool", "--listen", "0.0.0.0:50052"]


FROM base AS services

USER kiln
