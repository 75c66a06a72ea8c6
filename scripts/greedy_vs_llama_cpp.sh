#!/usr/bin/env bash
# Greedy agreement with llama.cpp on quantizations llama-quantize makes of the default model.
#
#   scripts/greedy_vs_llama_cpp.sh "Q2_K" "Q2_K --tensor-type ffn_down=q2_k" Q3_K_M
#
# Each argument is a llama-quantize type plus its options. For each: quantize the default
# model (requantizing its Q4_1 weights), print the file's tensor types, run
# `panechat run --raw -t 0 -n 24` and llama-server's /completion at temperature 0 on one
# prompt, and print how many greedy tokens agree. Needs ../shared/tools/build-llama-cpp's
# build (LLAMA_BIN, default ~/.cache/panechat-ref/llama.cpp/bin) and the repo's .venv.
set -u
cd "$(dirname "$0")/.."
BIN=${LLAMA_BIN:-$HOME/.cache/panechat-ref/llama.cpp/bin}
PY=.venv/bin/python
DEF=$($PY -c "from panechat.engine.default_model import resolve_model_path; print(resolve_model_path(None))")
PROMPT="The capital of France is Paris. The capital of Germany is"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PORT=18090
for spec in "$@"; do
  read -r type opts <<<"$spec"
  out="$WORK/model.gguf"
  # shellcheck disable=SC2086
  if ! "$BIN/llama-quantize" --allow-requantize $opts "$DEF" "$out" "$type" 2 >"$WORK/quantize.log" 2>&1; then
    echo "$spec: llama-quantize failed: $(tail -1 "$WORK/quantize.log")"; continue
  fi
  echo "== $spec: $($PY -c "
import sys, collections; from gguf import GGUFReader
print(dict(collections.Counter(t.tensor_type.name for t in GGUFReader(sys.argv[1]).tensors)))" "$out")"
  .venv/bin/panechat run --model "$out" --raw --json -n 24 -t 0 "$PROMPT" >"$WORK/ours.json" 2>"$WORK/ours.err"
  tail -1 "$WORK/ours.err"
  "$BIN/llama-server" -m "$out" --port $PORT -t 2 -c 2048 >"$WORK/server.log" 2>&1 &
  server=$!
  for _ in $(seq 60); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
  curl -s http://127.0.0.1:$PORT/completion -d "{\"prompt\": \"$PROMPT\", \"n_predict\": 24, \"temperature\": 0,
    \"top_k\": 1, \"return_tokens\": true, \"cache_prompt\": false}" >"$WORK/theirs.json"
  kill $server; wait $server 2>/dev/null
  $PY - "$WORK/ours.json" "$WORK/theirs.json" <<'PY'
import json, sys
ours, theirs = json.load(open(sys.argv[1]))["token_ids"], json.load(open(sys.argv[2]))["tokens"]
n = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
print(f"greedy tokens agree for the first {n} of {min(len(ours), len(theirs))}")
PY
done
