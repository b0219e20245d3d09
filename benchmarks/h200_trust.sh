#!/usr/bin/env bash
# Issue 13 on a lent GPU: the red team, the state guard, the sandbox and the isolation tests on
# a CUDA engine (code modules in the sandbox over weights shared by CUDA IPC), then the hot
# reload benchmark (fast and full tier, Llama-3.2-1B at the Azure conversation trace) with the
# sandbox's cost on the code-module candidates.
#
#   benchmarks/h200_trust.sh OUT          # carry .whl (benchmarks/fetch_wheels.sh) and .data
#
# Env: KILN_SHARED_DATA (default .data in the checkout, else ../shared/data). Writes OUT/tests.log,
# OUT/hot_reload.json, OUT/hot_reload.log.
set -uo pipefail
out=${1:?usage: benchmarks/h200_trust.sh OUT}
repo=$(cd "$(dirname "$0")/.." && pwd)
data=${KILN_SHARED_DATA:-$repo/.data}
[ -d "$data" ] || data=$repo/../shared/data
export KILN_SHARED_DATA=$data PYTHONUNBUFFERED=1
if compgen -G "$repo/.whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$repo"/.whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  [ -d /tmp/site/bin ] && chmod +x /tmp/site/bin/* && export PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=$repo/services:$repo${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
id
cd "$repo"
timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -p no:cacheprovider -o addopts="" -q -rfE \
  --timeout 240 -n 3 --dist loadfile \
  tests/unit/test_red_team.py tests/unit/test_state_guard.py tests/unit/test_gate_defenses.py \
  tests/unit/test_engine_isolation.py tests/unit/test_sandbox_user.py \
  tests/unit/test_sandbox_residue.py tests/unit/test_sandbox_share_failure.py \
  tests/gpu/test_cuda_engine.py 2>&1 | tail -60 >"$out/tests.log"
echo "=== tests"; tail -40 "$out/tests.log"
echo "=== hot reload"
timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/engine_hot_reload.py --device cuda:0 \
  --tiers fast,full --batch 1 --dtype bfloat16 --json "$out/hot_reload.json" \
  >"$out/hot_reload.log" 2>&1
echo "rc=$?"; tail -45 "$out/hot_reload.log"
