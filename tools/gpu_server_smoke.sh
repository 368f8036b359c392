#!/usr/bin/env bash
# Serve a synthetic model on the GPU and send one chat and one tool request over real HTTP.
#   usage: tools/gpu_server_smoke.sh [preset]   (default: tiny)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
model=/tmp/qat4-smoke-${1:-tiny}
python3 -m qat4.cli synth --preset "${1:-tiny}" --format ct-emb4 --out "$model" --force
python3 -m qat4.cli serve --model "$model" --device cuda --port 8199 --log-level warning > "$OUT/serve.log" 2>&1 &
server=$!
export SERVER_PID=$server
trap 'kill $server 2>/dev/null' EXIT
python3 - <<'PY' 2>&1 | tee "$OUT/server_smoke.log"
import json, os, time, httpx
base = "http://127.0.0.1:8199"
for _ in range(600):
    try:
        if httpx.get(base + "/health", timeout=1).status_code == 200:
            break
    except httpx.HTTPError:
        os.kill(int(os.environ["SERVER_PID"]), 0)  # raises once the server has exited
        time.sleep(0.5)
chat = httpx.post(base + "/v1/chat/completions", timeout=300, json={
    "messages": [{"role": "user", "content": "In one sentence, what is a GPU?"}], "max_tokens": 32, "temperature": 0})
print("chat", chat.status_code, json.dumps(chat.json()["usage"]), json.dumps(chat.json()["timings"]))
tool = httpx.post(base + "/v1/chat/completions", timeout=300, json={
    "messages": [{"role": "user", "content": "What is the weather in Paris right now?"}], "max_tokens": 32,
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
body = tool.json()
print("tool", tool.status_code, body["choices"][0]["finish_reason"], json.dumps(body["choices"][0]["message"])[:300])
print("models", httpx.get(base + "/v1/models").json()["data"][0].get("max_model_len"))
PY
