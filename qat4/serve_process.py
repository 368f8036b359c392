"""A `qat4 serve` child process for `qat4 bench serve`.

The server starts on a free loopback port with its output going to a temporary file; it counts as
ready once `GET /health` answers 200. However the benchmark ends (done, an error, Ctrl-C), the
child is asked to stop (SIGTERM, which qat4 serve answers by ending its open replies within 5 s)
and killed if it is still there after a grace period.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import httpx

from qat4.errors import Qat4Error

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 600.0  # a Hub checkpoint may download first
STOP_GRACE_S = 15.0
POLL_INTERVAL_S = 0.2
OUTPUT_TAIL_CHARS = 3000


def free_port() -> int:
    """A loopback port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def serve_command(model: str, port: int, *, device: str | None = None, max_queue: int | None = None,
                  extra_args: Sequence[str] = ()) -> list[str]:
    """The `python -m qat4.cli serve` command line; `extra_args` come last, so they win over ours."""
    cmd = [sys.executable, "-m", "qat4.cli", "serve", "--model", model, "--host", HOST, "--port", str(port),
           "--log-level", "warning"]
    if device is not None:
        cmd += ["--device", device]
    if max_queue is not None:
        cmd += ["--max-queue", str(max_queue)]
    return cmd + list(extra_args)


class ServerProcess:
    """A server child process, used as `with ServerProcess(cmd, url) as server: ...`.

    `url` is where the command will listen; entering waits until `url/health` answers (raising
    Qat4Error with the end of the child's output if it exits or takes longer than
    `startup_timeout_s`); leaving stops it.
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
            self._wait_until_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise Qat4Error(f"the server exited with status {code} before {self.url}/health answered; "
                                f"its last output:\n{self.output_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise Qat4Error(f"the server did not answer {self.url}/health within {self.startup_timeout_s:g} s; "
                                f"its last output:\n{self.output_tail()}")
            time.sleep(POLL_INTERVAL_S)

    def output_tail(self) -> str:
        """The last few thousand characters the child wrote (stdout and stderr together)."""
        if self._output is None or self._output.closed:
            return ""
        self._output.seek(0, os.SEEK_END)
        size = self._output.tell()
        self._output.seek(max(0, size - OUTPUT_TAIL_CHARS))
        return self._output.read().decode(errors="replace").rstrip() or "(nothing)"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after `stop_grace_s`; waits until the child is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._output is not None:
            self._output.close()
