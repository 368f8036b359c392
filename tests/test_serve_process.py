"""The server child process of `qat4 bench serve`: ready once /health answers, stopped however the
benchmark ends, killed when it ignores SIGTERM, and its output shown when it fails to start."""

from __future__ import annotations

import sys

import httpx
import pytest

from qat4.errors import Qat4Error
from qat4.serve_process import ServerProcess, free_port, serve_command

HEALTHY_SERVER = """
import http.server, json, os, signal, sys
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(json.dumps({"status": "ok", "model": "m", "pid": os.getpid()}).encode())
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def child(port: int, *flags: str) -> list[str]:
    return [sys.executable, "-c", HEALTHY_SERVER, str(port), *flags]


def test_the_server_is_stopped_when_the_benchmark_is_interrupted():
    port = free_port()
    server = ServerProcess(child(port), f"http://127.0.0.1:{port}")
    with pytest.raises(KeyboardInterrupt):
        with server:
            assert httpx.get(f"{server.url}/health").status_code == 200
            raise KeyboardInterrupt
    assert server.process.returncode == -15  # SIGTERM


def test_a_server_that_ignores_sigterm_is_killed():
    port = free_port()
    with ServerProcess(child(port, "--ignore-term"), f"http://127.0.0.1:{port}", stop_grace_s=0.5) as server:
        pass
    assert server.process.returncode == -9  # SIGKILL


def test_a_server_that_exits_at_start_shows_its_output():
    command = [sys.executable, "-c", "import sys; print('no such checkpoint: m', file=sys.stderr); sys.exit(3)"]
    with pytest.raises(Qat4Error, match=r"exited with status 3 before .*/health answered; its last output:\nno such checkpoint: m"):
        with ServerProcess(command, f"http://127.0.0.1:{free_port()}"):
            pass


def test_a_server_that_never_answers_times_out_and_is_stopped():
    server = ServerProcess([sys.executable, "-c", "import time; time.sleep(60)"], f"http://127.0.0.1:{free_port()}",
                           startup_timeout_s=0.5)
    with pytest.raises(Qat4Error, match="did not answer .*/health within 0.5 s"):
        with server:
            pass
    assert server.process.returncode is not None


def test_the_flags_given_to_qat4_serve_come_last_and_win():
    from qat4.cli import build_parser

    command = serve_command("synthetic:tiny", 8123, device="cpu", max_queue=16, extra_args=["--max-queue", "2"])
    assert command[:3] == [sys.executable, "-m", "qat4.cli"]
    args = build_parser().parse_args(command[3:])
    assert (args.command, args.model, args.host, args.port, args.device) == ("serve", "synthetic:tiny", "127.0.0.1", 8123, "cpu")
    assert args.max_queue == 2
