"""`qat4 serve` child processes: their command line, the wait until they answer, their stop.

A server counts as ready once `GET /health` answers 200 as a qat4 server (with the child's own
pid, when that is known). It is stopped with SIGTERM, which qat4 serve answers by ending its open
replies within 5 s, and killed if it is still there after a grace period. `qat4 bench serve` and
`qat4 eval` run one for their length (`ServerProcess`), unless given the --url of a running server
(:func:`serving`); `qat4 serve --detach` (qat4.server_control) starts one that outlives it.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Protocol

import httpx

from qat4.api_client import served_model
from qat4.errors import Qat4Error

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 600.0  # a Hub checkpoint may download first
STOP_GRACE_S = 15.0
KILL_WAIT_S = 10.0  # how long a SIGKILLed process may take to go
POLL_INTERVAL_S = 0.2
HEALTH_TIMEOUT_S = 2.0
OUTPUT_TAIL_CHARS = 3000


def free_port() -> int:
    """A loopback port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def serve_command(model: str, port: int, *, host: str = HOST, device: str | None = None, max_queue: int | None = None,
                  log_level: str = "warning", extra_args: Sequence[str] = ()) -> list[str]:
    """The `python -m qat4.cli serve` command line; `extra_args` come last, so they win over ours."""
    cmd = [sys.executable, "-m", "qat4.cli", "serve", "--model", model, "--host", host, "--port", str(port),
           "--log-level", log_level]
    if device is not None:
        cmd += ["--device", device]
    if max_queue is not None:
        cmd += ["--max-queue", str(max_queue)]
    return cmd + list(extra_args)


def split_server_args(text: str, command: str) -> list[str]:
    """--server-args as words for a `qat4 serve` that `command` starts; the host and port are its to choose."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise Qat4Error(f"--server-args cannot be split into words ({exc})") from None
    if any(w in ("--host", "--port") or w.startswith(("--host=", "--port=")) for w in words):
        raise Qat4Error(f"--server-args must not set --host or --port; {command} picks a free loopback port")
    return words


def output_tail(output: IO[bytes], start: int = 0) -> str:
    """The last few thousand characters of a binary file from byte `start` on, or '(nothing)'."""
    output.seek(0, os.SEEK_END)
    output.seek(max(start, output.tell() - OUTPUT_TAIL_CHARS))
    return output.read().decode(errors="replace").rstrip() or "(nothing)"


def fetch_health(url: str, timeout_s: float = HEALTH_TIMEOUT_S,
                 client: httpx.Client | None = None) -> httpx.Response | None:
    """GET url/health (through `client`, else a client of its own), or None when nothing answers."""
    try:
        if client is None:
            return httpx.get(f"{url}/health", timeout=timeout_s)
        return client.get(f"{url}/health", timeout=timeout_s)
    except httpx.TransportError:
        return None


def health_body(response: httpx.Response) -> dict | None:
    """The JSON object of a qat4 server's /health answer (200 or 503), or None for anything else."""
    if response.status_code not in (200, 503):
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) and "status" in body and "model" in body else None


def _answers_healthy(url: str, pid: int | None, client: httpx.Client) -> bool:
    """Whether url/health answers 200 as a qat4 server, reporting `pid` when that is given (not another
    program on the port)."""
    response = fetch_health(url, client=client)
    body = None if response is None or response.status_code != 200 else health_body(response)
    return body is not None and (pid is None or body.get("pid") == pid)


def wait_for_health(url: str, exit_code: Callable[[], int | None], last_output: Callable[[], str],
                    timeout_s: float, pid: int | None = None) -> None:
    """Return once `url/health` answers 200 (reporting `pid`, when that is given); raise Qat4Error
    with the server's `last_output()` if `exit_code()` says it exited first, or if `timeout_s` passes.
    One client asks every time (a client of its own for each request would load the CA certificates
    anew: about 60 ms of CPU a poll, taken from the server that is starting)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client() as client:
        while True:
            code = exit_code()
            if code is not None:
                raise Qat4Error(f"the server exited with status {code} before {url}/health answered; "
                                f"its last output:\n{last_output()}")
            if _answers_healthy(url, pid, client):
                return
            if time.monotonic() > deadline:
                raise Qat4Error(f"the server did not answer {url}/health within {timeout_s:g} s; "
                                f"its last output:\n{last_output()}")
            time.sleep(POLL_INTERVAL_S)


class Stoppable(Protocol):
    """What terminate_then_kill needs of a process: subprocess.Popen has it."""

    pid: int

    def send_signal(self, sig: int) -> None: ...

    def wait(self, timeout: float | None = None) -> int | None: ...


def terminate_then_kill(process: Stoppable, grace_s: float) -> bool:
    """SIGTERM, then SIGKILL if the process is still there after `grace_s`; returns once it is
    gone, True when it ended on SIGTERM. A `wait` that runs out raises subprocess.TimeoutExpired."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace_s)
        return True
    except subprocess.TimeoutExpired:
        pass
    process.send_signal(signal.SIGKILL)
    try:
        process.wait(KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        raise Qat4Error(f"pid {process.pid} is still there {KILL_WAIT_S:g} s after SIGKILL") from None
    return False


class ServerProcess:
    """A server child process, used as `with ServerProcess(cmd, url) as server: ...`.

    `url` is where the command will listen; entering waits until `url/health` answers with the
    child's pid (raising Qat4Error with the end of the child's output if it exits or takes longer
    than `startup_timeout_s`); leaving stops it.
    """

    def __init__(self, command: Sequence[str], url: str, *, env: dict[str, str] | None = None,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S, stop_grace_s: float = STOP_GRACE_S):
        self.command, self.url = list(command), url.rstrip("/")
        self.env = env
        self.startup_timeout_s, self.stop_grace_s = startup_timeout_s, stop_grace_s
        self.process: subprocess.Popen | None = None
        self._output = None

    def __enter__(self) -> ServerProcess:
        self._output = tempfile.TemporaryFile()
        self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=self._output,
                                        stderr=subprocess.STDOUT, env=self.env)
        try:
            wait_for_health(self.url, self.process.poll, self.output_tail, self.startup_timeout_s, self.process.pid)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def output_tail(self) -> str:
        """The last few thousand characters the child wrote (stdout and stderr together)."""
        if self._output is None or self._output.closed:
            return ""
        return output_tail(self._output)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after `stop_grace_s`; waits until the child is gone."""
        if self.process is not None and self.process.poll() is None:
            terminate_then_kill(self.process, self.stop_grace_s)
        if self._output is not None:
            self._output.close()


@dataclass(frozen=True)
class Served:
    """The server a client command talks to: its base URL (no /v1), the model name to send (None
    leaves it out), and the `qat4 serve` command line when the command started it (else empty)."""

    url: str
    model: str | None
    command: tuple[str, ...] = ()


@contextmanager
def serving(who: str, url: str | None, model: str | None, *, api_key: str | None, device: str | None,
            server_args: str, max_queue: int, log: Callable[[str], None]) -> Iterator[Served]:
    """The server `who` (the command, for messages: "qat4 eval gsm8k") talks to for the block.

    With `url` (an OpenAI client's base URL ending in /v1 too), that server and `model`, else the
    first model its /v1/models lists. Without, `qat4 serve --model model` on a free loopback port,
    with `device`, `server_args`, `api_key` and `max_queue`, stopped after the block. `log`
    follows the start.
    """
    extra_args = split_server_args(server_args, who)
    if url:
        if extra_args or device:
            raise Qat4Error(f"--server-args and --device set up the qat4 serve that {who} starts; "
                            "leave them out with --url")
        url = url.rstrip("/").removesuffix("/v1")
        served = served_model(url, api_key)  # also: Qat4Error when nothing answers there
        yield Served(url, model or served)
        return
    if not model:
        raise Qat4Error(f"{who} needs --url of a running server, or --model to start one")
    port = free_port()
    url = f"http://{HOST}:{port}"
    command = serve_command(model, port, device=device, max_queue=max_queue, extra_args=extra_args)
    env = {**os.environ, "QAT4_API_KEY": api_key} if api_key else None
    log(f"starting qat4 serve --model {model} on {url}")
    start = time.perf_counter()
    with ServerProcess(command, url, env=env):
        log(f"the server answered after {time.perf_counter() - start:.1f} s")
        yield Served(url, served_model(url, api_key), ("qat4", *command[3:]))
