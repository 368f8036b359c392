"""`qat4 bench serve`: load an OpenAI-compatible server at several concurrency levels (or request
rates) and measure it.

Every request asks for exactly `output_len` new tokens (`max_tokens` with `ignore_eos`, which
qat4, llama.cpp's llama-server and vLLM accept) after a prompt of `input_len` random token ids
(/v1/completions, so the length is exact) or random words (/v1/chat/completions). Replies are
streamed, so the time to first token is what a client sees, queueing included. At each level
exactly `concurrency` clients send the level's requests, each sending its next one as soon as its
last one has ended (a closed loop). With request rates instead (`--request-rate`), a level sends
its requests at that rate on average, the gaps between them drawn from a gamma distribution
(`--burstiness`, 1: a Poisson process), whether or not earlier replies have come (an open loop),
at most `--max-concurrency` in flight. One warm-up request comes before the first level and is not
counted.

Figures of a level, as vllm bench serve defines them:

- output tok/s: output tokens of the completed requests over the level's wall time (first request
  sent to last reply ended); total tok/s adds their prompt tokens; req/s counts completed requests.
- TTFT (time to first token): from sending a request to the first streamed text.
- TPOT (time per output token): per request, (latency - TTFT) / (output tokens - 1).
- ITL (inter-token latency): the gaps between successive streamed text chunks, over all requests
  (a server that sends several tokens in one chunk shows one longer gap for them).
- E2E latency: from sending a request to the end of its reply.

Token counts are the server's `usage` (asked for with `stream_options.include_usage`); without
it, output tokens are the number of text chunks and prompt tokens `input_len`.

The package, one job a module: `workload` (what each request asks for), `driver` (sending the
requests and timing them), `stats` (percentiles), `levels` (the run by levels and its
figures), `multi_turn` (`--multi-turn` conversations against the prompt cache) and `output` (the
tables, the JSON and the plot). `qat4.commands.bench` parses the options and gets the server from
`qat4.serve_process.serving` (a running one, or a `qat4 serve` it starts); `qat4.api_client` talks to it.
"""
