#!/usr/bin/env bash
# The same serving workload straight to the router driver (`tgi-vlm bench`) and over HTTP to a running
# `tgi-vlm launch` (`tgi-vlm bench --url`), alternated ROUNDS times. Greedy with ignore_eos off on both
# sides (TGI's API has none), so both send the same requests and get the same outputs.
#   bash benchmarks/http_overhead_serving.sh [MODEL_DIR]      (default models/tiny-qwen2_vl; make run builds it)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MODEL=${1:-models/tiny-qwen2_vl}
OUT=${OUT:-benchmarks/results/http_overhead}
PORT=${PORT:-3021}
ROUNDS=${ROUNDS:-2}
TAG=$(basename "$MODEL")
WORK="--num-requests 64 --concurrency 16 --image-min 64 --image-max 112 --prompt-max 64 --output-min 16 --output-max 32
      --no-ignore-eos --no-hf"
LIMITS="--max-input-tokens 1024 --max-total-tokens 2048 --max-batch-prefill-tokens 2048"
mkdir -p "$OUT"
for round in $(seq "$ROUNDS"); do
  $PY -m tgi_vlm.cli bench "$MODEL" $WORK $LIMITS --out-dir "$OUT" --name "serving-$TAG-direct-$round"
  $PY -m tgi_vlm.cli launch "$MODEL" --port "$PORT" $LIMITS > "$OUT/launch-$round.log" 2>&1 &
  launch=$!
  until grep -q "Try it" "$OUT/launch-$round.log"; do kill -0 $launch; sleep 1; done
  $PY -m tgi_vlm.cli bench "$MODEL" $WORK --url "http://127.0.0.1:$PORT" --out-dir "$OUT" --name "serving-$TAG-http-$round"
  kill -TERM $launch
  wait $launch
done
