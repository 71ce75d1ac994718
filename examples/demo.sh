#!/usr/bin/env bash
# `make demo`: the SGLang simulator + the gateway on 127.0.0.1, a multi-turn agent rollout through the SDK
# (tool turns, routing + top-p replay), the curl view of the session, then everything is shut down.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
LOGS=.demo
mkdir -p "$LOGS"
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
SIM_PORT=$(free_port)
GW_PORT=$(free_port)
SIM=http://127.0.0.1:$SIM_PORT
GW=http://127.0.0.1:$GW_PORT
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  echo "==> stopped simulator and gateway (logs in $LOGS/)"
}
trap cleanup EXIT

wait_healthy() {  # url name logfile
  for _ in $(seq 1 100); do
    if curl -fsS "$1/health" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  echo "!! $2 did not become healthy; its log:" >&2
  cat "$3" >&2
  exit 1
}

echo "==> starting the SGLang simulator on $SIM (48-layer-like routing scaled down: 4 layers, top-2 of 8 experts)"
"$PY" -m gateway.simulator --port "$SIM_PORT" --num-layers 4 --topk 2 --num-experts 8 --seed 0 \
  >"$LOGS/simulator.log" 2>&1 &
pids+=($!)
wait_healthy "$SIM" simulator "$LOGS/simulator.log"

echo "==> starting the gateway on $GW (upstream $SIM)"
"$PY" -m gateway --upstream-url "$SIM" --port "$GW_PORT" >"$LOGS/gateway.log" 2>&1 &
pids+=($!)
wait_healthy "$GW" gateway "$LOGS/gateway.log"
curl -fsS "$GW/health"; echo

SESSION=demo-$(date +%s)
echo "==> running examples/agent_loop.py (session $SESSION)"
"$PY" examples/agent_loop.py --gateway-url "$GW" --session-id "$SESSION" --keep-session

echo "==> the curl view: curl -s $GW/v1/sessions/$SESSION"
curl -fsS "$GW/v1/sessions/$SESSION" | "$PY" -m json.tool
echo "==> the compact sample: curl -s $GW/v1/sessions/$SESSION/sample -o sample.safetensors"
curl -fsS "$GW/v1/sessions/$SESSION/sample" -o "$LOGS/sample.safetensors"
echo "    $(wc -c <"$LOGS/sample.safetensors") bytes of safetensors"
