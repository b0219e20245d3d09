#!/usr/bin/env bash
# Several `kiln compile` runs of dense models in sequence on one GPU host, each with its own
# budget, each written as one row of the issue-10 results file (benchmarks/dense_row.py: model,
# batch, context, trace, reference / hf_compile / gpt_fast / kiln best tokens/s, the bandwidth
# limit counting weights + KV, experiments, time to 95 %, best candidate, command, date).
#
#   benchmarks/h200_dense.sh OUT [RUN ...]
#   RUN = MODEL,TRACE,BATCH,BUDGET   e.g. llama-3.2-1b,azure_llm_2023_conv.csv,1,4m
#         (MODEL: a config under $KILN_SHARED_DATA/models without .json; TRACE: a file under
#         $KILN_SHARED_DATA/traces; BATCH 0: the trace's concurrency; BUDGET: kiln's --budget)
#
# Default runs: Llama-3.2-1B on the Azure conversation trace at batch 1 and at the trace's batch,
# 3 minutes each. Writes to OUT (few files, so that a lent machine sends them all back):
# h200_dense.json (the rows; RESULTS=path to update another file, e.g. a copy of
# benchmarks/results/h200_dense.json), dense.log (every compile's output and its table) and
# up.log. A run that fails still writes its row when the compilation exists.
#
# Python packages: what python3 imports, plus wheels under .whl (if any) installed into
# /tmp/site first, as on a lent GPU machine (carry .whl); kiln itself from services/.
# Env: KILN_SHARED_DATA (default ../shared/data), HW (default h200; cpu to try the script),
# KILN_STATE_DIR (default /tmp/kiln-state), BASELINES (kiln compile --baselines, default: the
# hardware's). A lent machine runs one command for at most 10 minutes: size the budgets to fit
# (each run takes its budget plus a minute or two of engine builds and baselines).
set -uo pipefail
out=${1:?usage: benchmarks/h200_dense.sh OUT [MODEL,TRACE,BATCH,BUDGET ...]}
shift
runs=("$@")
if [ ${#runs[@]} -eq 0 ]; then
  runs=(llama-3.2-1b,azure_llm_2023_conv.csv,1,3m llama-3.2-1b,azure_llm_2023_conv.csv,0,3m)
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
data=${KILN_SHARED_DATA:-$repo/../shared/data}
hw=${HW:-h200}
export KILN_STATE_DIR=${KILN_STATE_DIR:-/tmp/kiln-state}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
results=${RESULTS:-$out/h200_dense.json}
log=$out/dense.log

if compgen -G "$repo/.whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$repo"/.whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  # A --target install leaves console scripts and binaries (nats-server) in /tmp/site/bin.
  if [ -d /tmp/site/bin ]; then
    chmod +x /tmp/site/bin/* && export PATH=/tmp/site/bin:$PATH
  fi
fi
export PYTHONPATH=$repo/services${PYTHONPATH:+:$PYTHONPATH}

python3 -m kiln up >"$out/up.log" 2>&1 || { tail -40 "$out/up.log"; exit 1; }
trap 'python3 -m kiln down >/dev/null 2>&1' EXIT
stamp=$(date -u +%Y%m%d%H%M%S)
failed=0
for run in "${runs[@]}"; do
  IFS=, read -r model trace batch budget <<<"$run"
  if [ -z "$model" ] || [ -z "$trace" ] || [ -z "$batch" ] || [ -z "$budget" ]; then
    echo "bad run '$run': want MODEL,TRACE,BATCH,BUDGET" | tee -a "$log"
    failed=1
    continue
  fi
  id=dense-${model//./_}-${trace%%.*}-b$batch-$stamp
  cmd=(python3 -m kiln compile --model "$data/models/$model.json" --traffic "$data/traces/$trace"
    --hardware "$hw" --batch "$batch" --budget "$budget" --id "$id")
  [ -n "${BASELINES:-}" ] && cmd+=(--baselines "$BASELINES")
  echo "=== $model $trace batch $batch budget $budget: ${cmd[*]}" | tee -a "$log"
  "${cmd[@]}" >>"$log" 2>&1
  echo "kiln compile exit $?" | tee -a "$log"
  shown="kiln compile --model models/$model.json --traffic traces/$trace --hardware $hw"
  shown+=" --batch $batch --budget $budget${BASELINES:+ --baselines $BASELINES}"
  python3 "$repo/benchmarks/dense_row.py" "$id" --trace "$trace" --command "$shown" \
    --out "$results" 2>&1 | tee -a "$log" || failed=1
done
exit $failed
