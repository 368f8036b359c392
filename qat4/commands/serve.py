"""`qat4 serve`: the OpenAI-compatible HTTP server and web chat page (README, "Server"); with
--detach, the same server in the background (qat4.server_control; README, "Running it in the
background")."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
from collections.abc import Callable
from pathlib import Path

import uvicorn

from qat4 import server_control as control
from qat4.commands.model_args import add_dense_weights_argument, add_model_arguments, add_prefill_chunk_argument, \
    add_speculative_arguments, load_engine, resolve_device, speculative_options
from qat4.errors import Qat4Error
from qat4.serve_process import STARTUP_TIMEOUT_S, serve_command
from qat4.server.limits import CHARS_PER_CONTEXT_TOKEN, DEFAULT_MAX_MESSAGES, DEFAULT_MAX_TOOLS, RequestLimits
from qat4.server.protocol import HeaderTimeoutProtocol
from qat4.server_control import DEFAULT_PORT, LOOPBACK_HOSTS

DEFAULT_MAX_QUEUE = 256
SHUTDOWN_GRACE_S = 5  # on Ctrl-C, answers still streaming after this long are cut (and their generation cancelled)
DETACH_OPTIONS = ("pid_file", "log_file", "startup_timeout")  # the flags that go with --detach
# The engine's step loop and the event loop that streams its tokens share one interpreter. A thread
# that wants the GIL waits up to Python's switch interval (5 ms by default, longer than a decode
# step) for the other to let go, so the engine could wait most of a step to launch the next one
# while the event loop wrote out the last step's tokens. tools/serve_overhead.py measures this.
SWITCH_INTERVAL_S = 0.0005

# Not passed on to the detached server as flags: serve_command sets these, and the API key goes in its
# environment, where no process list or pid file shows it.
SET_APART = ("detach", *DETACH_OPTIONS, "model", "host", "port", "device", "log_level", "api_key")


def freeze_loaded_objects() -> None:
    """Collect what loading left behind, then move every object still alive (the modules', the
    tokenizer's, the engine's: a few hundred thousand) out of the garbage collector's sight. A
    full collection walks every tracked object while it holds the GIL, so the engine thread
    launches no step meanwhile; over the loaded heap one took 123 ms while 64 clients streamed
    (tools/serve_overhead.py, 1,280 requests), frozen 4.7 ms."""
    gc.collect()
    gc.freeze()


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server with a web chat page",
        description="Serve the model over HTTP: /v1/chat/completions, /v1/completions, /v1/models, /health, "
                    "/metrics, /tokenize, /detokenize, /apply-template and a chat page at /. Up to "
                    "--max-num-seqs generations run at once in one batch; others wait in a bounded queue.")
    add_model_arguments(p, synthetic=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT})")
    p.add_argument("--memory-cap-mib", type=int, default=None, metavar="N",
                   help="refuse to start if weights plus KV cache would exceed N MiB of device memory")
    p.add_argument("--api-key", default=os.environ.get("QAT4_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every API route (default: $QAT4_API_KEY, none)")
    p.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help="generations decoded together in one batch (default: 64 on a GPU, fewer if memory is short; 8 on the CPU)")
    p.add_argument("--kv-tokens", type=int, default=None, metavar="N",
                   help="tokens the full-attention KV pool holds over all sequences (default: --max-ctx)")
    p.add_argument("--prompt-cache-mib", type=float, default=None, metavar="N",
                   help="memory kept for the prompt cache's restart windows beside the running sequences; "
                        "a request whose beginning an earlier one read reuses its KV (default: 64, less if memory "
                        "is short; 0 turns the cache off)")
    add_prefill_chunk_argument(p)
    add_dense_weights_argument(p)
    add_speculative_arguments(p)
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help=f"requests that may wait to join the batch; more get 429 (default: {DEFAULT_MAX_QUEUE})")
    p.add_argument("--allowed-origins", default="", metavar="ORIGINS",
                   help="comma-separated web origins (e.g. http://localhost:3000) whose pages may call this "
                        "server, or '*' for any; others are refused with 403 (default: none but the server's own)")
    p.add_argument("--max-messages", type=int, default=None, metavar="N",
                   help=f"messages a chat request may have (default: {DEFAULT_MAX_MESSAGES})")
    p.add_argument("--max-tools", type=int, default=None, metavar="N",
                   help=f"tools a chat request may declare (default: {DEFAULT_MAX_TOOLS})")
    p.add_argument("--max-prompt-chars", type=int, default=None, metavar="N",
                   help=f"characters of text a request's prompt may have (default: {CHARS_PER_CONTEXT_TOKEN} per token "
                        "of context)")
    p.add_argument("--model-name", default=None, metavar="NAME", help="model id reported by /v1/models (default: derived from --model)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn log level (default: info)")
    p.add_argument("--detach", action="store_true",
                   help="run the server in the background: return once /health answers, leaving a pid file; "
                        "`qat4 status` and `qat4 stop` find it")
    p.add_argument("--pid-file", default=None, metavar="PATH",
                   help="with --detach: the pid file (default: serve-PORT.pid in $QAT4_STATE_DIR, else "
                        "$XDG_STATE_HOME/qat4, else ~/.local/state/qat4)")
    p.add_argument("--log-file", default=None, metavar="PATH",
                   help="with --detach: the file the server's output is appended to (default: serve-PORT.log "
                        "beside the pid file's default)")
    p.add_argument("--startup-timeout", type=float, default=None, metavar="S",
                   help=f"with --detach: give up when /health has not answered after S seconds "
                        f"(default: {STARTUP_TIMEOUT_S:g}; a Hub checkpoint may download first)")
    p.set_defaults(run=run)


def model_name_for(model: str) -> str:
    """The /v1/models id: a hub id as given, a local path by its last component."""
    path = Path(model)
    return path.resolve().name if path.exists() else model


class _Server(uvicorn.Server):
    """uvicorn's server, which on Ctrl-C first stops the generations so open answers end at once."""

    def __init__(self, config: uvicorn.Config, stop_generating: Callable[[], None]):
        super().__init__(config)
        self._stop_generating = stop_generating
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self._loop is not None:  # in a signal handler: hand the work to the event loop
            self._loop.call_soon_threadsafe(self._stop_generating)
        super().handle_exit(sig, frame)


def _check_arguments(args: argparse.Namespace) -> tuple[str | None, dict]:
    """Refuse bad flags before anything loads or starts; returns the device (--device as given with
    --detach) and the speculative options."""
    if args.max_queue < 0:
        raise Qat4Error(f"--max-queue must be >= 0, got {args.max_queue}")
    for flag in ("max_messages", "max_tools", "max_prompt_chars", "prefill_chunk"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise Qat4Error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if not args.detach and any(getattr(args, flag) is not None for flag in DETACH_OPTIONS):
        raise Qat4Error("--pid-file, --log-file and --startup-timeout go with --detach")
    if args.startup_timeout is not None and args.startup_timeout <= 0:
        raise Qat4Error(f"--startup-timeout must be more than 0 seconds, got {args.startup_timeout:g}")
    control.check_port(args.port)
    # The server --detach starts resolves the device itself (and refuses cuda without a GPU), so
    # this process need not import torch, seconds of a start.
    return args.device if args.detach else resolve_device(args.device), speculative_options(args)


def _serve_parser() -> argparse.ArgumentParser:
    """A fresh `qat4 serve` parser, for its flags and their defaults."""
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    return sub.choices["serve"]


def _forwarded_flags(args: argparse.Namespace) -> list[str]:
    """The flags of `args` that differ from their defaults, as `--flag=value` words, less those in SET_APART."""
    flags = []
    for action in _serve_parser()._actions:
        value = getattr(args, action.dest, action.default)
        if not action.option_strings or action.dest in SET_APART or value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):  # --flag / --no-flag
            flags.append(action.option_strings[0 if value else 1])
            continue
        option = max(action.option_strings, key=len)
        flags.append(option if action.nargs == 0 else f"{option}={value}")
    return flags


def _run_detached(args: argparse.Namespace) -> int:
    """Start the server in the background (qat4.server_control) and report where it runs."""
    pid_path = Path(args.pid_file).absolute() if args.pid_file else control.default_pid_file(args.port)
    log_path = Path(args.log_file).absolute() if args.log_file else control.default_log_file(args.port)
    running, note = control.live_pid_file(pid_path)
    if note:
        print(f"qat4 serve: {note}", file=sys.stderr)
    if control.port_in_use(args.host, args.port):
        raise Qat4Error(f"{args.host}:{args.port} is in use (by {control.port_holder(args.host, args.port)}); "
                        "stop it first or pick --port")
    if running is not None:
        raise Qat4Error(f"pid file {pid_path} names qat4 serve pid {running.pid}, which is running and not yet "
                        f"listening on port {args.port}; stop it first (qat4 stop --pid-file {pid_path}) "
                        "or pick --port")
    command = serve_command(args.model, args.port, host=args.host, device=args.device, log_level=args.log_level,
                            extra_args=_forwarded_flags(args))
    env = {key: value for key, value in os.environ.items() if key != "QAT4_API_KEY"}
    if args.api_key:
        env["QAT4_API_KEY"] = args.api_key
    record = control.start_detached(command, env=env, host=args.host, port=args.port, model=args.model,
                                    pid_path=pid_path, log_path=log_path,
                                    startup_timeout_s=args.startup_timeout or STARTUP_TIMEOUT_S)
    print(f"qat4 serve: running as pid {record.pid} on {record.url}/ (log: {log_path}, pid file: {pid_path})")
    return 0


def run(args: argparse.Namespace) -> int:
    device, speculative = _check_arguments(args)
    if args.host not in LOOPBACK_HOSTS and not args.api_key:
        print(f"qat4 serve: warning: listening on {args.host} without --api-key; anyone who can reach it can use it",
              file=sys.stderr)
    if args.detach:  # the server it starts imports the engine and the app, this process need not
        return _run_detached(args)
    from qat4.engine.tuning import pinned_tilings_note
    from qat4.server.app import create_app

    engine = load_engine("serve", args.model, device, max_ctx=args.max_ctx, memory_cap_mib=args.memory_cap_mib,
                         max_num_seqs=args.max_num_seqs, kv_tokens=args.kv_tokens, prefill_chunk=args.prefill_chunk,
                         prompt_cache_mib=args.prompt_cache_mib,
                         dense_weights=args.dense_weights, **speculative)
    limits = RequestLimits.for_context(engine.max_ctx, max_messages=args.max_messages, max_tools=args.max_tools,
                                       max_prompt_chars=args.max_prompt_chars)
    origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()]
    app = create_app(engine, api_key=args.api_key, max_queue=args.max_queue, limits=limits, allowed_origins=origins,
                     loopback_only=args.host in LOOPBACK_HOSTS,
                     model_name=args.model_name or model_name_for(args.model))
    print(f"qat4 serve: {app.state.model_name}, context {engine.max_ctx} tokens, on {control.url_for(args.host, args.port)}/",
          file=sys.stderr)
    print(f"qat4 serve: KV pool: {engine.pool.capacity_tokens} tokens, up to {engine.max_num_seqs} sequences "
          f"({engine.nbytes['kv_cache'] / (1 << 20):,.0f} MiB); prompts read {engine.prefill_chunk} tokens a step; "
          f"prompt cache {'on' if engine.pool.prompt_cache else 'off'}"
          + (f"; 16-bit weight copies {engine.nbytes['dense'] / (1 << 20):,.0f} MiB" if engine.nbytes.get("dense") else ""),
          file=sys.stderr)
    if engine.speculator is not None:
        drafter = engine.nbytes.get("drafter")
        size = f" (the drafter: {drafter / (1 << 20):,.0f} MiB)" if drafter else ""
        print(f"qat4 serve: speculative decoding with {args.speculative} drafts, up to {engine.spec_tokens} a step "
              f"at up to {engine.spec_sizes[-1]} sequences{size}", file=sys.stderr)
    if engine.device.type == "cuda":
        print(f"qat4 serve: {pinned_tilings_note(*engine.pinned_tilings)}", file=sys.stderr)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, http=HeaderTimeoutProtocol,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    freeze_loaded_objects()
    _Server(config, app.state.engine_loop.close).run()
    return 0
