# One image for every kiln service: `kiln serve <name>` picks which one runs.
#   docker build -t kiln:dev .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KILN_LOG_FORMAT=json

WORKDIR /app

# Only what the install needs (the build context may hold a .venv and other local files).
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY services ./services
RUN pip install . && rm -rf /app/services/*.egg-info

RUN useradd --system --uid 10001 --home-dir /app kiln \
    && mkdir -p /pki && chown kiln /pki  # a new `pki` volume takes this owner (docker-compose.yml)
USER kiln

# ledger, engine-pool, agent-runner, cost-model; Prometheus metrics.
EXPOSE 50051 50052 50053 50054 9400

ENTRYPOINT ["kiln"]
CMD ["--help"]
