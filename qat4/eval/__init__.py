"""`qat4 eval`: answers scored question by question against an OpenAI-compatible server.

One module per task (gsm8k, bfcl, recall, kld) and for `compare`, which pairs two runs; the
shared pieces are the data locations (data), the HTTP client (client), the concurrent runner
(runner) and the records every task writes (records).
"""
