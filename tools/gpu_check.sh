#!/usr/bin/env bash
# On a GPU machine: install the wheels it lacks (carried in .whl/), then run the steps asked for.
# Logs, JSON and plots go to $LOGS (default /tmp/qat4_logs) and leave as one $OUT/logs.tgz (default
# ./out). Compiled kernels stay in $TRITON_CACHE_DIR (default /tmp/qat4_triton_cache); the cache
# also leaves as $OUT/triton_cache.tar.xz.NN (15 MiB parts), and parts found in .triton_cache/ are
# unpacked into it first, so a fresh machine starts with the kernels an earlier one compiled.
#   usage: tools/gpu_check.sh STEP...   steps: setup kernels sweep tests bench cap tune serve rates load overhead turns eval spec specstep mtp grammar profile attention chunks ab all
#     setup    only what every call does first: the wheels and the compiled kernels, for commands of one's own after it
#     kernels  the int4 kernels at E2B decode shapes: GEMV, decode-batch kernel and GEMM at 2, 16, 64 rows;
#              the batch kernel again with one dot a step (ONE_DOT) at 16 and 64
#     sweep    every decode-batch tiling at 4, 16 and 64 rows (tools/bench_w4.py --sweep)
#     tests    pytest -m gpu tests/gpu ($TESTS picks files), then the tally of tools/test_tally.sh, which outlives a timeout
#     bench    qat4 bench: decode by depth, prompt, batched decode at 1, 4, 16, 64 sequences
#     cap      qat4 bench under --memory-cap-mib 3732 with 131,072 tokens held
#     tune     qat4 bench --tune (saves decode tilings to $LOGS/decode_tilings.json, used by later steps)
#     serve    qat4 bench serve at 1, 4, 16, 64 clients (512-token prompts, 128 new tokens); $SERVE_ARGS go to qat4 serve
#     rates    qat4 bench serve in an open loop: Poisson arrivals at each of $RATES (default 20 40 80 inf) requests a
#              second, at most 64 in flight, the same requests
#     load     the same closed-loop load on the engine alone, at 16 and 64 clients (tools/engine_load.py)
#     overhead the server app over a paced engine at the engine's step times, on this host's CPUs (tools/serve_overhead.py)
#     turns    qat4 bench serve --multi-turn: 1, then 8 conversations of 10 turns over an 8,000-word history,
#              $TURNS_ROUNDS rounds each (default 3)
#     eval     qat4 eval: all 1,319 GSM8K problems and the 400 BFCL simple questions against qat4 serve at 64
#              clients, with their wall times (data from $EVAL_DATA, default ../shared/data; EVAL_TASKS picks)
#     spec     qat4 bench speculative: verification cost and speed-up at acceptance 0 .. 0.9, batch 1 and 16, 256 new
#              tokens a sequence ($SPEC_NEW); $SPEC_KS picks the draft counts
#     specstep where a speculating step's period goes, one stream, k = 3, acceptance 0 / 0.7 / 0.9 twice each,
#              then a run under cProfile (tools/spec_step.py --profile 30)
#     mtp      the same as spec with a synthetic E2B MTP drafter: its drafts' cost, paid in every replayed step
#     grammar  the decode step with every row constrained by a JSON schema against unconstrained, at 1 and 16 rows
#              (tools/bench_grammar.py --engine)
#     profile  tools/profile_step.py at 1 and 64 sequences ($PROFILE_BATCHES), and a step reading $PROFILE_PROMPTS (1) prompts
#              that share a chunk of $PROFILE_CHUNK (512) tokens
#     attention the paged attention kernel's decode at 1, 4, 16, 64 sequences over 512 to 131,072 keys
#              (tools/bench_attention.py; $ATTENTION_BATCH, $ATTENTION_LENGTHS and $ATTENTION_ARGS, e.g. --sweep, change it;
#              ATTENTION_ONLY=prefill times prompt chunks instead, e.g. with ATTENTION_ARGS="--prompts 8 --chunk 512")
#     chunks   qat4 bench serve at 16 and 64 clients with each of $CHUNKS (default 4096 1024 512) as the server's
#              --prefill-chunk (the prompt tokens a step reads beside the decoding rows), alternating, $CHUNKS_RUNS rounds
#     ab       the decode step at $AB_BATCH sequences (default 1,4,16,64; 512 tokens held each) and a 512-token
#              prompt, as the tree is and under the setting $AB_SETTING (e.g. QAT4_PAIR_UNPACK=0) and/or with the
#              bench arguments $AB_ARGS (e.g. --no-dense-weights), alternating, $AB_RUNS rounds (default 2): two ways
#              of one tree timed on one machine
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; LOGS=${LOGS:-/tmp/qat4_logs}; mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/qat4_triton_cache} QAT4_TILINGS=${QAT4_TILINGS:-$LOGS/decode_tilings.json}
mkdir -p "$TRITON_CACHE_DIR"
if compgen -G ".triton_cache/triton_cache.tar.xz.*" >/dev/null && [ -z "$(ls -A "$TRITON_CACHE_DIR")" ]; then
    python3 tools/triton_cache.py unpack "$TRITON_CACHE_DIR" .triton_cache/triton_cache.tar.xz.*
fi
[ -f .triton_cache/decode_tilings.json ] && [ ! -f "$QAT4_TILINGS" ] && cp .triton_cache/decode_tilings.json "$QAT4_TILINGS"
pack() {
    tar -czf "$OUT/logs.tgz" -C "$LOGS" .
    [ -f "$QAT4_TILINGS" ] && cp "$QAT4_TILINGS" "$OUT/"
    python3 tools/triton_cache.py pack "$TRITON_CACHE_DIR" "$OUT/triton_cache.tar.xz"
}
trap pack EXIT; trap 'exit 143' TERM
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  git rev-parse --short HEAD 2>/dev/null; } | tee -a "$LOGS/gpu.txt"

want() { for s in "${STEPS[@]}"; do [ "$s" = "$1" ] || [ "$s" = all ] && return 0; done; return 1; }
STEPS=("$@"); [ ${#STEPS[@]} -eq 0 ] && STEPS=(all)
E2B=(--model synthetic:e2b)
SHAPES=2560x1536,2048x1536,1536x2048,12288x1536,24576x1536,1536x6144,1536x12288,256x1536,1536x256,262144x1536

if want kernels; then
    for rows in 2 16 64; do
        timeout 200 python3 tools/bench_w4.py --rows $rows --shapes $SHAPES 2>&1 | tee "$LOGS/bench_w4_rows$rows.log" | grep -E "per token|#"
    done
    for rows in 16 64; do  # the batch kernel with one dot a step
        timeout 200 python3 tools/bench_w4.py --rows $rows --shapes $SHAPES --batch-config '{"ONE_DOT": 1}' 2>&1 \
            | tee "$LOGS/bench_w4_rows${rows}_one_dot.log" | grep -E "per token|#"
    done
fi
if want sweep; then
    for rows in ${SWEEP_ROWS:-4 16 64}; do
        timeout 150 python3 tools/bench_w4.py --rows $rows --sweep --shapes $SHAPES 2>&1 | tee "$LOGS/bench_w4_sweep$rows.log" | grep -E "per token|#|best"
    done
fi
if want tests; then
    timeout ${TESTS_TIMEOUT:-560} python3 -m pytest -m gpu -v -x -p no:cacheprovider -s ${TESTS:-tests/gpu} >"$LOGS/gpu_tests.log" 2>&1
    grep -E "KL|agree|seeded|allocated|tok/s" "$LOGS/gpu_tests.log" | tail -24
    tools/test_tally.sh "$LOGS/gpu_tests.log"  # survives the timeout, which cuts pytest's own summary
fi
if want tune; then
    timeout ${TUNE_TIMEOUT:-300} python3 -m qat4.cli bench "${E2B[@]}" --depths 0 --new 128 --prompt 512 --tune 2>&1 | tee "$LOGS/bench_tune.log" | tail -6
fi
if want bench; then
    timeout 400 python3 -m qat4.cli bench "${E2B[@]}" --depths 0,4096,32768,131072 --new 128 --prompt 4096 \
        --batch 1,4,16,64 --batch-context 512 --json "$LOGS/bench.json" --plot "$LOGS/bench.png" 2>&1 | tee "$LOGS/bench.log" | tail -18
fi
if want cap; then
    timeout 240 python3 -m qat4.cli bench "${E2B[@]}" --depths 131072 --new 64 --prompt 4096 --memory-cap-mib 3732 \
        --batch 8 --batch-context 4096 --json "$LOGS/bench_cap.json" 2>&1 | tee "$LOGS/bench_cap.log" | tail -10
fi
if want serve; then
    timeout 500 python3 -m qat4.cli bench serve "${E2B[@]}" --concurrency 1,4,16,64 --input-len 512 --output-len 128 \
        ${SERVE_ARGS:+--server-args="$SERVE_ARGS"} --json "$LOGS/bench_serve.json" --plot "$LOGS/bench_serve.png" \
        --compare llama.cpp=1:357,4:1177,16:2424,64:5222 2>&1 | tee "$LOGS/bench_serve.log" | tail -14
fi
if want rates; then
    timeout ${RATES_TIMEOUT:-500} python3 -m qat4.cli bench serve "${E2B[@]}" --request-rate "$(echo ${RATES:-20 40 80 inf} | tr ' ' ,)" \
        --max-concurrency 64 --input-len 512 --output-len 128 ${SERVE_ARGS:+--server-args="$SERVE_ARGS"} \
        --json "$LOGS/bench_rates.json" --plot "$LOGS/bench_rates.png" 2>&1 | tee "$LOGS/bench_rates.log" | tail -12
fi
if want load; then
    timeout ${LOAD_TIMEOUT:-300} python3 tools/engine_load.py --concurrency 16,64 2>&1 | tee "$LOGS/engine_load.log" | tail -4
fi
if want turns; then
    for sessions in ${TURNS_SESSIONS:-1 8}; do
        timeout ${TURNS_TIMEOUT:-300} python3 -m qat4.cli bench serve "${E2B[@]}" --multi-turn 10 --sessions $sessions \
            --rounds ${TURNS_ROUNDS:-3} --input-len 8000 \
            --turn-len 64 --output-len 64 --json "$LOGS/bench_turns_$sessions.json" 2>&1 | tee "$LOGS/bench_turns_$sessions.log" | tail -16
    done
fi
if want eval; then
    for task in ${EVAL_TASKS:-gsm8k bfcl}; do
        start=$SECONDS
        timeout ${EVAL_TIMEOUT:-1800} python3 -m qat4.cli eval $task "${E2B[@]}" --concurrency ${EVAL_CONCURRENCY:-64} \
            --data "${EVAL_DATA:-../shared/data}" --jsonl "$LOGS/eval_$task.jsonl" --json "$LOGS/eval_$task.json" 2>&1 \
            | tee "$LOGS/eval_$task.log" | grep -E '"questions"|"accuracy"|"wall_s"|failed|Error'
        echo "eval $task: wall time $((SECONDS - start)) s, server start included" | tee -a "$LOGS/eval_$task.log"
    done
fi
if want spec; then
    timeout ${SPEC_TIMEOUT:-300} python3 -m qat4.cli bench speculative "${E2B[@]}" --batch 1,16 --acceptance 0,0.3,0.5,0.7,0.9 \
        --k ${SPEC_KS:-1,2,3,4,6,8} --new ${SPEC_NEW:-256} --context 512 --json "$LOGS/bench_spec.json" 2>&1 | tee "$LOGS/bench_spec.log" | tail -40
fi
if want specstep; then
    timeout ${SPECSTEP_TIMEOUT:-200} python3 tools/spec_step.py "${E2B[@]}" --profile 30 --json "$LOGS/spec_step.json" 2>&1 \
        | tee "$LOGS/spec_step.log" | tail -44
fi
if want mtp; then
    python3 -m qat4.cli synth --assistant --preset e2b --out /tmp/qat4_mtp_e2b --force >/dev/null
    timeout ${MTP_TIMEOUT:-400} python3 -m qat4.cli bench speculative "${E2B[@]}" --mtp /tmp/qat4_mtp_e2b --batch 1,16 \
        --acceptance ${MTP_AS:-0,0.5,0.7,0.9} --k ${MTP_KS:-2,3,4,8} --spec-tokens 8 --new 128 --context 512 --json "$LOGS/bench_mtp.json" 2>&1 \
        | tee "$LOGS/bench_mtp.log" | tail -40
fi
if want overhead; then  # no GPU: what the server costs beside the engine, with cores to spare for the client
    timeout ${OVERHEAD_TIMEOUT:-300} python3 tools/serve_overhead.py --concurrency 16,64 --host-ms 0,1 --switch-interval-ms 5,0.5 \
        --json "$LOGS/serve_overhead.json" 2>&1 | tee "$LOGS/serve_overhead.log" | tail -9
fi
if want grammar; then
    timeout ${GRAMMAR_TIMEOUT:-240} python3 tools/bench_grammar.py --device cuda --engine --rows 1 16 --json "$LOGS/bench_grammar.json" 2>&1 \
        | tee "$LOGS/bench_grammar.log" | tail -8
fi
if want profile; then
    for batch in ${PROFILE_BATCHES:-1 64}; do
        # the whole table in the log (a `head` on tee's pipe would stop the tool before its prompt chunk)
        timeout ${PROFILE_TIMEOUT:-400} python3 tools/profile_step.py --depth 512 --batch $batch --chunk ${PROFILE_CHUNK:-512} --prompts ${PROFILE_PROMPTS:-1} \
            >"$LOGS/profile_step_$batch.log" 2>&1
        grep -v Warning "$LOGS/profile_step_$batch.log" | grep -v "^  (" | head -60
    done
fi
if want ab; then
    if [ -z "${AB_SETTING:-}${AB_ARGS:-}" ]; then
        echo "ab: name the setting or bench arguments to time against, e.g. AB_SETTING=QAT4_PAIR_UNPACK=0 or AB_ARGS=--no-dense-weights"
    else
        for round in $(seq ${AB_RUNS:-2}); do
            for arm in tree other; do
                setting=""; args=""
                [ $arm = other ] && { setting="${AB_SETTING:-}"; args="${AB_ARGS:-}"; }
                label="$setting $args"; label="${label# }"; label="${label% }"
                echo "== round $round, ${label:-as the tree is}: batch, context, decode tok/s, ms a step"
                env $setting timeout 200 python3 -m qat4.cli bench "${E2B[@]}" --depths 0 --new 128 --prompt 512 \
                    --batch ${AB_BATCH:-1,4,16,64} --batch-context 512 $args 2>&1 | tee -a "$LOGS/ab.log" \
                    | grep -E "^ +[0-9]+ +[0-9]+ +[0-9,.]+ +[0-9.]+$|prompt 512"
            done
        done
    fi
fi
if want attention; then
    timeout ${ATTENTION_TIMEOUT:-300} python3 tools/bench_attention.py --only ${ATTENTION_ONLY:-decode} --batch ${ATTENTION_BATCH:-1,4,16,64} \
        --lengths ${ATTENTION_LENGTHS:-512,32768,131072} ${ATTENTION_ARGS:-} 2>&1 | tee "$LOGS/bench_attention.log" | grep -v Warning
fi
if want chunks; then
    for round in $(seq ${CHUNKS_RUNS:-2}); do
        for chunk in ${CHUNKS:-4096 1024 512}; do
            echo "== round $round, --prefill-chunk $chunk: clients, requests, failed, output tok/s, ..."
            timeout ${CHUNKS_TIMEOUT:-100} python3 -m qat4.cli bench serve "${E2B[@]}" --concurrency ${CHUNKS_CONCURRENCY:-16,64} \
                --input-len 512 --output-len 128 --server-args="--prefill-chunk $chunk" \
                --json "$LOGS/bench_serve_chunk${chunk}_$round.json" 2>&1 | tee -a "$LOGS/chunks.log" | grep -E "^ +[0-9]+ +[0-9]+ +[0-9]+ "
        done
    done
fi
