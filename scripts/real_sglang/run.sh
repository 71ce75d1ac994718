#!/usr/bin/env bash
# Serves the engine that setup.sh installed into DIR on 127.0.0.1:PORT; extra arguments go to SGLang's
# launch_server. Ready after ~35 s on an idle 2-core machine: wait for GET /health to answer 200 (503 while it
# warms up) and poll it slowly, since each call runs a one-token generation.
#
#   scripts/real_sglang/run.sh DIR PORT [launch_server args]
#   e.g. scripts/real_sglang/run.sh .sglang-cpu 18300 --enable-return-routed-experts
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
dir=$(cd "${1:?usage: run.sh DIR PORT [launch_server args]}" && pwd)
port=${2:?usage: run.sh DIR PORT [launch_server args]}
shift 2
[ -x "$dir/venv/bin/python" ] && [ -f "$dir/model/config.json" ] || {
  echo "!! real_sglang/run: no engine in $dir: run scripts/real_sglang/setup.sh $dir first" >&2
  exit 1
}

# Offline: the model and its tokenizer are local; nothing may try the model hub. SGLANG_USE_CPU_ENGINE selects
# SGLang's CPU code paths; the stub folder provides the import-only sgl_kernel (stub/sgl_kernel/__init__.py).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 SGLANG_USE_CPU_ENGINE=1
export PYTHONPATH="$here/stub${PYTHONPATH:+:$PYTHONPATH}"
# torch-native attention and sampling need no custom kernels; no CUDA graphs on a CPU; float32 because the tiny
# model is float32 and CPUs are slow at bf16; 4096 tokens of KV cache are plenty for the tests and keep RSS small.
exec "$dir/venv/bin/python" -m sglang.launch_server --model-path "$dir/model" --device cpu \
  --host 127.0.0.1 --port "$port" --attention-backend torch_native --sampling-backend pytorch \
  --disable-cuda-graph --dtype float32 --max-total-tokens 4096 "$@"
