#!/usr/bin/env bash
# `make demo`: the SGLang simulator + the gateway on 127.0.0.1, a multi-turn agent rollout through the SDK
# (tool turns, routing + top-p replay), the curl view of the session; then an agent on the OpenAI chat API: a tiny
# real tokenizer, a simulator and a gateway that both use it (--tokenizer), examples/chat_agent.py with scripted
# answers (two tool calls, then the answer), the session with curl; then agent RL rollouts as slime runs them
# (examples/agent_rl.py: slime_client.agent.generate, samples checked as slime's trainer checks them). Then everything
# is shut down.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
LOGS=.demo
mkdir -p "$LOGS"
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
SIM_PORT=$(free_port)
GW_PORT=$(free_port)
CHAT_SIM_PORT=$(free_port)
CHAT_GW_PORT=$(free_port)
SIM=http://127.0.0.1:$SIM_PORT
GW=http://127.0.0.1:$GW_PORT
CHAT_SIM=http://127.0.0.1:$CHAT_SIM_PORT
CHAT_GW=http://127.0.0.1:$CHAT_GW_PORT
TOKENIZER_DIR=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$TOKENIZER_DIR"
  echo "==> stopped the simulators and gateways (logs in $LOGS/)"
}
trap cleanup EXIT

wait_healthy() {  # url name logfile [seconds]
  for _ in $(seq 1 $((${4:-10} * 10))); do
    if curl -fsS "$1/health" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  echo "!! $2 did not become healthy; its log:" >&2
  cat "$3" >&2
  exit 1
}

# The chat pair starts first, in the background: loading transformers takes a few seconds.
echo "==> building a tiny chat tokenizer (byte-level BPE + a ChatML template with tools) into $TOKENIZER_DIR"
"$PY" -m sglang_sim.tiny_tokenizer "$TOKENIZER_DIR" >/dev/null
echo "==> starting a simulator ($CHAT_SIM) and a gateway ($CHAT_GW) with --tokenizer, for the chat routes"
"$PY" -m sglang_sim --port "$CHAT_SIM_PORT" --num-layers 4 --topk 2 --num-experts 8 --seed 0 \
  --tokenizer "$TOKENIZER_DIR" >"$LOGS/chat-simulator.log" 2>&1 &
pids+=($!)
"$PY" -m gateway --upstream-url "$CHAT_SIM" --port "$CHAT_GW_PORT" --tokenizer "$TOKENIZER_DIR" \
  >"$LOGS/chat-gateway.log" 2>&1 &
pids+=($!)

echo "==> starting the SGLang simulator on $SIM (48-layer-like routing scaled down: 4 layers, top-2 of 8 experts)"
"$PY" -m sglang_sim --port "$SIM_PORT" --num-layers 4 --topk 2 --num-experts 8 --seed 0 \
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
echo "==> the session inspector: $GW/ui/sessions/$SESSION (every session: $GW/ui/)"

# ---- agents on the chat API ----------------------------------------------------------------------------------------
wait_healthy "$CHAT_SIM" "chat simulator" "$LOGS/chat-simulator.log" 60
wait_healthy "$CHAT_GW" "chat gateway" "$LOGS/chat-gateway.log" 60
CHAT_SESSION=chat-demo-$(date +%s)
echo "==> running examples/chat_agent.py (session $CHAT_SESSION: OpenAI client, base_url $CHAT_GW/v1/sessions/ID)"
"$PY" examples/chat_agent.py --gateway "$CHAT_GW" --script-simulator "$CHAT_SIM" --session-id "$CHAT_SESSION" \
  --fetch-sample --keep-session

echo "==> the chat session: curl -s $CHAT_GW/v1/sessions/$CHAT_SESSION (turn log, replay, the chat record)"
curl -fsS "$CHAT_GW/v1/sessions/$CHAT_SESSION" | "$PY" -m json.tool
echo "==> the session inspector: $CHAT_GW/ui/sessions/$CHAT_SESSION (token texts from --tokenizer)"

echo "==> a chat completion with curl alone: a session without prompt_ids, a scripted answer, the OpenAI request"
curl -fsS "$CHAT_GW/v1/sessions" -d '{"session_id": "curl-chat"}'; echo
curl -fsS "$CHAT_SIM/sim/script" -d '{"rid_prefix": "curl-chat-", "answers": [{"text": "Hello from the simulator."}]}' \
  >/dev/null
curl -fsS "$CHAT_GW/v1/sessions/curl-chat/chat/completions" \
  -d '{"model": "tiny", "max_tokens": 32, "messages": [{"role": "user", "content": "Say hello."}]}' | "$PY" -m json.tool

echo "==> agent RL as slime runs it: examples/agent_rl.py calls slime_client.agent.generate for two samples of a task"
echo "    (a git repo whose test fails; the agent fixes it with a shell tool; the reward is the task's test)"
"$PY" examples/agent_rl.py --gateway "$CHAT_GW" --script-simulator "$CHAT_SIM" --samples 2

# DEMO_KEEP=1 make demo: the processes stay up (for the inspector links above) until Ctrl-C.
if [ -n "${DEMO_KEEP:-}" ]; then
  echo "==> DEMO_KEEP is set: open the inspector links above; Ctrl-C stops everything"
  wait
fi
