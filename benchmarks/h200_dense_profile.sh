#!/usr/bin/env bash
# The fused decode chain on a GPU host for every dense family (issue 10): its CUDA tests, then
# benchmarks/fused_decode_profile.py at each row's operating point with the parameter sets that
# matter there (step in a CUDA graph; tok/s and the fraction of the weights + KV limit), all
# rows in one JSON (few files, so that a lent machine sends them all back).
#
#   benchmarks/h200_dense_profile.sh OUT [ROW ...]
#   ROW = MODEL:BATCH:CONTEXT:FAMILIES:PARAMS_JSON  (FAMILIES 1: per-kernel-family breakdown)
#
# Python packages: what python3 imports, plus wheels under .whl (if any) installed into
# /tmp/site first (carry .whl to a lent GPU machine: the engine imports structlog, pydantic, ...).
# Env: KILN_SHARED_DATA (default ../shared/data), TESTS (0 skips the CUDA tests).
set -uo pipefail
out=${1:?usage: benchmarks/h200_dense_profile.sh OUT [ROW ...]}
shift
rows=("$@")
if [ ${#rows[@]} -eq 0 ]; then
  rows=(
    'qwen3-8b:1:1476:1:[{}, {"projections": "tensor_core"}, {"fused_combine": "1"}]'
    'llama-3.1-8b:1:1085:0:[{}, {"fused_combine": "1"}]'
    'qwen3-0.6b:1:1085:1:[{}, {"fused_combine": "1"}]'
    'llama-3.2-1b:1:1085:0:[{}]'
    'llama-3.2-1b:1:7084:1:[{}, {"split_s": "32"}, {"split_s": "64"}, {"split_s": "256"}, {"fused_combine": "1"}]'
    'llama-3.2-1b:8:1085:0:[{"projections": "gemv"}, {"projections": "tensor_core"}]'
    'llama-3.2-1b:30:1085:0:[{}, {"split_s": "128"}]'
    'qwen3-8b:8:1476:0:[{"projections": "gemv"}, {"projections": "tensor_core"}]'
    'qwen3-8b:30:1085:0:[{}]'
  )
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
data=${KILN_SHARED_DATA:-$repo/../shared/data}
export KILN_SHARED_DATA=$data PYTHONUNBUFFERED=1
if compgen -G "$repo/.whl/*.whl" >/dev/null; then  # kiln's dependencies, on a lent GPU machine
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$repo"/.whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$repo/services${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out"
tmp=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
if [ "${TESTS:-1}" != 0 ]; then
  (cd "$repo" && timeout 300 python3 -m pytest --noconftest -q -x \
    tests/gpu/test_fused_families_gpu.py tests/gpu/test_fused_decode_gpu.py \
    tests/gpu/test_kernels_attention_gpu.py \
    tests/unit/test_kernel_qk_norm_rope.py 2>&1 | tail -15) | tee "$out/tests.log"
fi
i=0
for row in "${rows[@]}"; do
  IFS=: read -r model batch context families params <<<"$row"
  flag=--no-families
  [ "$families" = 1 ] && flag=
  echo "=== $model batch $batch context $context $params"
  timeout 240 python3 "$repo/benchmarks/fused_decode_profile.py" \
    --model "$data/models/$model.json" --batch "$batch" --context "$context" --repeats 50 \
    $flag --params "$params" --json "$tmp/row$i.json" 2>&1 | tail -25
  i=$((i + 1))
done
python3 - "$tmp" "$out/profile.json" "${rows[@]}" <<'EOF'
import json, sys
from pathlib import Path
tmp, dest, rows = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
out = []
for i, row in enumerate(rows):
    f = tmp / f"row{i}.json"
    out.append({"row": row, "results": json.loads(f.read_text()) if f.exists() else None})
dest.write_text(json.dumps(out, indent=1))
print(f"\n=== {dest.name}: {len(out)} rows ===")
for r in out:
    for res in r["results"] or []:
        if "step_us" in res:
            print(f"{r['row'].split(':[')[0]:28s} {res['step_us']:8.0f} us "
                  f"{res['tokens_per_s']:8.0f} tok/s {res['fraction_of_limit']:6.1%}  {res['params']}")
EOF
