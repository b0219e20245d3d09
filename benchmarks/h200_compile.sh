#!/usr/bin/env bash
# `kiln compile` of Llama-3.2-1B on a GPU host with the baselines side by side, then the winner
# exported and reproduced in a fresh process. Prints the compile's summary, the best-so-far curve
# and the reproduction; logs and the artifact (tar.gz) go to OUT.
#
#   benchmarks/h200_compile.sh OUT [BUDGET=6m] [BATCH=1] [ID=h200-b1] [TRACE=azure_llm_2023_conv.csv]
#
# Needs kiln's dependencies importable (python3 -m kiln) and the shared data (KILN_SHARED_DATA,
# default ../shared/data). HW=cpu runs the same on a CPU (for trying the script).
set -uo pipefail
out=$1
budget=${2:-6m}
batch=${3:-1}
id=${4:-h200-b1}
trace=${5:-azure_llm_2023_conv.csv}
data=${KILN_SHARED_DATA:-../shared/data}
export KILN_STATE_DIR=${KILN_STATE_DIR:-/tmp/kiln-state}
mkdir -p "$out"
python3 -m kiln up >"$out/up.log" 2>&1 || { tail -40 "$out/up.log"; exit 1; }
python3 -m kiln compile --model "$data/models/llama-3.2-1b.json" \
  --traffic "$data/traces/$trace" --hardware "${HW:-h200}" --batch "$batch" \
  --budget "$budget" --id "$id" 2>&1 | tee "$out/compile.log" | tail -80
python3 -m kiln compilations curve "$id" >"$out/curve.txt" 2>&1
tail -25 "$out/curve.txt"
python3 -m kiln export "$id" --out "$out/artifact" 2>&1 | tail -3
timeout 300 python3 -m kiln.export.reproduce "$out/artifact" --device "${REPRODUCE_DEVICE:-cuda:0}" \
  --json "$out/reproduce.json" 2>&1 | tail -15
python3 -m kiln down >/dev/null 2>&1
tar czf "$out/artifact.tgz" -C "$out" artifact && rm -rf "$out/artifact"
