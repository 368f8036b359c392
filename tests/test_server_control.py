"""`qat4 serve --detach`, `qat4 status` and `qat4 stop`, and what /health says about the process.

One real round trip on the tiny synthetic model (a start takes seconds); the rest runs against
stand-ins: a small HTTP server whose command line reads like qat4 serve's, a `sleep`, a plain
listening socket, and pid files written by hand.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from server_harness import LiveServer, ScriptedEngine, wait_until

import qat4
from qat4 import server_control
from qat4.cli import build_parser, main
from qat4.errors import Qat4Error
from qat4.serve_process import free_port, wait_for_health
from qat4.server.app import create_app
from qat4.server.process_info import ProcessInfo
from qat4.server_control import LOOPBACK, PidFile, live_pid_file, process_start, stale_reason, url_for

HEALTH_IDENTITY = {"pid", "version", "device", "device_name", "uptime_s", "max_ctx", "max_num_seqs"}

# An HTTP server whose command line (`python -c CODE qat4 serve --port N [--host H]`) reads like qat4 serve's
# and whose /health reports its pid (or --health-pid P's); with --ignore-term it ignores SIGTERM.
FAKE_SERVE = """
import http.server, json, os, signal, socket, sys
def flag(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
host, pid = flag("--host", "127.0.0.1"), int(flag("--health-pid", os.getpid()))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ok", "model": "fake", "pid": pid}).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json"); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
class Server(http.server.HTTPServer):
    address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
Server((host, int(flag("--port", 0))), Health).serve_forever()
"""


@pytest.fixture
def state(tmp_path, monkeypatch) -> Path:
    """The state directory (pid and log files), empty; no $QAT4_URL."""
    monkeypatch.setenv("QAT4_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("QAT4_URL", raising=False)
    return tmp_path


@pytest.fixture
def spawn():
    """Start a process for the test: spawn(argv) -> Popen; every one is killed at the end."""
    started: list[subprocess.Popen] = []

    def start(argv: list[str]) -> subprocess.Popen:
        started.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL))
        cmdline = Path(f"/proc/{started[-1].pid}/cmdline")
        deadline = time.monotonic() + 10
        while argv[-1].encode() not in cmdline.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)  # until the child has exec'd: before, /proc shows the test's own command line
        return started[-1]

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def fake_serve(spawn, port: int, *flags: str, host: str = "127.0.0.1") -> subprocess.Popen:
    """FAKE_SERVE on host:port, once it answers."""
    process = spawn([sys.executable, "-c", FAKE_SERVE, "qat4", "serve", "--port", str(port), "--host", host, *flags])
    wait_for_health(url_for(host, port), process.poll, lambda: "", timeout_s=30)
    return process


def write_pid_file(path: Path, pid: int, port: int, host: str = "127.0.0.1", **fields) -> None:
    """A pid file for `pid`, recording its start unless `fields` say otherwise."""
    fields = {"start_ticks": process_start(pid), **fields}
    PidFile(path, pid, host, port, url_for(host, port), "m", str(path.with_suffix(".log")), 0.0,
            ["qat4", "serve"], **fields).write()


def one_line(text: str) -> str:
    assert len(text.strip().splitlines()) == 1, text
    return text.strip()


def gone(pid: int) -> bool:
    return stale_reason(pid) is not None


# ---- the real round trip ---------------------------------------------------------------------


def test_detach_status_refusal_stop_and_status_again(state, capsys):
    port = free_port()
    started = subprocess.run([sys.executable, "-m", "qat4.cli", "serve", "--detach", "--model", "synthetic:tiny",
                              "--device", "cpu", "--port", str(port), "--max-queue", "5"],
                             capture_output=True, text=True, timeout=300, env=os.environ)
    line = re.fullmatch(rf"qat4 serve: running as pid (\d+) on http://127\.0\.0\.1:{port}/ "
                        rf"\(log: (.+), pid file: (.+)\)", started.stdout.strip())
    assert started.returncode == 0 and line, started.stderr
    pid = int(line[1])
    try:
        pid_path, log_path = state / f"serve-{port}.pid", state / f"serve-{port}.log"
        assert (line[2], line[3]) == (str(log_path), str(pid_path))
        record = json.loads(pid_path.read_text())
        assert {k: record[k] for k in ("pid", "host", "port", "url", "model", "log_file")} == {
            "pid": pid, "host": "127.0.0.1", "port": port, "url": f"http://127.0.0.1:{port}",
            "model": "synthetic:tiny", "log_file": str(log_path)}
        assert "--detach" not in record["command"] and "--max-queue=5" in record["command"]
        assert os.getsid(pid) == pid  # a session of its own, away from this terminal
        assert "Uvicorn running" in log_path.read_text()

        assert main(["status", "--port", str(port)]) == 0
        out = capsys.readouterr().out
        assert re.search(rf"^  pid +{pid} \(pid file {re.escape(str(pid_path))}\)$", out, re.M)
        assert re.search(r"^  model +synthetic:tiny$", out, re.M)
        assert re.search(r"^  device +cpu \(.+\)$", out, re.M)
        assert re.search(r"^  memory +[\d,]+ MiB resident$", out, re.M)

        assert main(["status", "--port", str(port), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["status"] == "ok" and report["pid"] == pid and report["device"] == "cpu"
        assert report["memory"]["resident_mib"] > 0 and report["max_num_seqs"] >= 1
        assert (report["pid_file"], report["log_file"], report["url"]) == (str(pid_path), str(log_path),
                                                                           f"http://127.0.0.1:{port}")

        assert main(["serve", "--detach", "--model", "synthetic:tiny", "--device", "cpu", "--port", str(port)]) == 1
        assert one_line(capsys.readouterr().err) == (f"qat4 serve: 127.0.0.1:{port} is in use (by qat4 serve pid "
                                                     f"{pid}); stop it first or pick --port")

        assert main(["stop", "--port", str(port)]) == 0
        assert re.fullmatch(rf"qat4 stop: stopped pid {pid} \(gracefully, in [\d.]+ s\)",
                            one_line(capsys.readouterr().out))
        assert gone(pid) and not pid_path.exists()
        assert main(["status", "--port", str(port)]) == 1
        assert one_line(capsys.readouterr().err) == (f"qat4 status: no server answers at http://127.0.0.1:{port} "
                                                     f"(no pid file at {pid_path})")
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


# ---- starting ----------------------------------------------------------------------------------


def test_a_port_another_program_holds_is_refused_before_starting(state, capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert main(["serve", "--detach", "--model", "synthetic:tiny", "--device", "cpu", "--port", str(port)]) == 1
    assert one_line(capsys.readouterr().err) == (f"qat4 serve: 127.0.0.1:{port} is in use (by another program); "
                                                 "stop it first or pick --port")
    assert list(state.iterdir()) == []


def test_a_live_pid_file_for_the_port_is_refused(state, spawn, capsys):
    """A qat4 serve that is still loading (running, not yet listening) has the port already."""
    port = free_port()
    process = spawn([sys.executable, "-c", "import time; time.sleep(60)", "qat4", "serve"])
    write_pid_file(state / f"serve-{port}.pid", process.pid, port)
    assert main(["serve", "--detach", "--model", "synthetic:tiny", "--device", "cpu", "--port", str(port)]) == 1
    assert f"names qat4 serve pid {process.pid}, which is running and not yet listening on port {port}" in \
        one_line(capsys.readouterr().err)
    assert process.poll() is None


def test_a_server_that_dies_before_health_leaves_its_log_tail_and_no_pid_file(state, capsys):
    port = free_port()
    assert main(["serve", "--detach", "--model", "/nonexistent", "--device", "cpu", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"exited with status 1 before http://127.0.0.1:{port}/health answered; its last output:\n" in err
    assert "/nonexistent does not exist" in err
    assert not (state / f"serve-{port}.pid").exists() and (state / f"serve-{port}.log").exists()


def test_a_server_that_does_not_answer_in_time_is_stopped_and_leaves_no_pid_file(state, capsys):
    port = free_port()
    assert main(["serve", "--detach", "--model", "synthetic:tiny", "--device", "cpu", "--port", str(port),
                 "--startup-timeout", "0.3"]) == 1
    err = capsys.readouterr().err
    assert f"did not answer http://127.0.0.1:{port}/health within 0.3 s" in err
    pid = int(re.search(r"started pid (\d+)", err)[1])
    assert gone(pid) and not (state / f"serve-{port}.pid").exists()


@pytest.mark.parametrize("flags, message", [
    (["--pid-file", "x.pid"], "--pid-file, --log-file and --startup-timeout go with --detach"),
    (["--detach", "--startup-timeout", "0"], "--startup-timeout must be more than 0 seconds, got 0"),
    (["--detach", "--port", "70000"], "--port must be 1 to 65535, got 70000"),
])
def test_bad_detach_flags_are_one_line(flags, message, state, capsys):
    assert main(["serve", "--model", "synthetic:tiny", "--device", "cpu", *flags]) == 1
    assert one_line(capsys.readouterr().err) == f"qat4 serve: {message}"


def test_the_detached_server_gets_the_same_flags_and_the_api_key_in_its_environment(state, monkeypatch, capsys):
    seen = {}

    def start_detached(command, *, env, **where):
        seen.update(command=command, env=env, **where)
        return PidFile(where["pid_path"], 4321, where["host"], where["port"], "http://127.0.0.1:8555", "m",
                       str(where["log_path"]), 0.0, command)

    monkeypatch.setattr(server_control, "start_detached", start_detached)
    assert main(["serve", "--detach", "--model", "m", "--device", "cpu", "--port", "8555", "--api-key", "sekrit",
                 "--max-queue", "3", "--speculative", "ngram", "--model-name=-odd", "--log-file", "x.log"]) == 0
    assert capsys.readouterr().out == (f"qat4 serve: running as pid 4321 on http://127.0.0.1:8555/ (log: "
                                       f"{Path('x.log').absolute()}, pid file: {state / 'serve-8555.pid'})\n")
    command = seen["command"]
    assert "sekrit" not in " ".join(command) and seen["env"]["QAT4_API_KEY"] == "sekrit"
    args = build_parser().parse_args(command[3:])
    assert (args.model, args.port, args.device, args.max_queue, args.speculative, args.model_name) == (
        "m", 8555, "cpu", 3, "ngram", "-odd")
    assert (args.detach, args.log_file, args.log_level) == (False, None, "info")


def test_the_detached_server_does_not_inherit_an_api_key_the_flag_clears(state, monkeypatch, capsys):
    seen = {}

    def start_detached(command, *, env, **where):
        seen.update(env=env)
        return PidFile(where["pid_path"], 4321, where["host"], where["port"], "http://127.0.0.1:8555", "m",
                       str(where["log_path"]), 0.0, command)

    monkeypatch.setattr(server_control, "start_detached", start_detached)
    monkeypatch.setenv("QAT4_API_KEY", "inherited")
    assert main(["serve", "--detach", "--model", "m", "--device", "cpu", "--port", "8555", "--api-key", ""]) == 0
    assert "QAT4_API_KEY" not in seen["env"]


def test_a_pid_file_is_written_whole_and_never_over_another(tmp_path):
    path = tmp_path / "serve-1.pid"
    write_pid_file(path, 1234, 1)
    assert PidFile.read(path).pid == 1234 and [p.name for p in tmp_path.iterdir()] == ["serve-1.pid"]
    with pytest.raises(Qat4Error, match="another qat4 serve wrote the pid file"):
        write_pid_file(path, 5678, 1)
    assert PidFile.read(path).pid == 1234 and [p.name for p in tmp_path.iterdir()] == ["serve-1.pid"]


# ---- stale pid files -----------------------------------------------------------------------------


def _finished_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


@pytest.mark.parametrize("command", ["status", "stop"])
def test_a_pid_file_whose_process_is_gone_is_removed(command, state, capsys):
    port = free_port()
    path, pid = state / f"serve-{port}.pid", _finished_pid()
    write_pid_file(path, pid, port)
    assert main([command, "--port", str(port)]) == 1
    assert f"pid file {path} names pid {pid}, which is not running; removed it" in capsys.readouterr().err
    assert not path.exists()


@pytest.mark.parametrize("command", ["status", "stop"])
def test_a_pid_file_naming_another_program_is_removed_and_the_program_left_alone(command, state, spawn, capsys):
    port = free_port()
    path, sleeper = state / f"serve-{port}.pid", spawn(["sleep", "60"])
    write_pid_file(path, sleeper.pid, port)
    assert main([command, "--port", str(port)]) == 1
    assert (f"pid file {path} names pid {sleeper.pid}, which is now another program (sleep 60); removed it"
            in capsys.readouterr().err.splitlines()[0])
    assert not path.exists() and sleeper.poll() is None


def test_start_removes_a_stale_pid_file_with_a_note(state, capsys):
    """The note, then the start goes on (here to the port check, which a held port fails)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        path, pid = state / f"serve-{port}.pid", _finished_pid()
        write_pid_file(path, pid, port)
        assert main(["serve", "--detach", "--model", "m", "--device", "cpu", "--port", str(port)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"qat4 serve: pid file {path} names pid {pid}, which is not running; removed it"
    assert "is in use (by another program)" in err[1] and not path.exists()


def test_live_pid_file_keeps_a_running_qat4_serve(state, spawn):
    port = free_port()
    process = fake_serve(spawn, port)
    write_pid_file(state / "a.pid", process.pid, port)
    record, note = live_pid_file(state / "a.pid")
    assert record.pid == process.pid and note is None


def test_a_pid_file_is_stale_once_its_pid_is_another_process_or_not_qat4_serve(state, spawn):
    """A pid taken over by another qat4 serve (a later start), or a command line where `serve` is
    not the subcommand, is not the server the file recorded; a pid file without the start (older
    qat4) is judged by the command line alone."""
    port = free_port()
    process = fake_serve(spawn, port)
    write_pid_file(state / "later.pid", process.pid, port, start_ticks=process_start(process.pid) - 1)
    assert live_pid_file(state / "later.pid") == (None, f"pid file {state / 'later.pid'} names pid {process.pid}, "
                                                        "which is now another qat4 serve (it started after the pid "
                                                        "file was written); removed it")
    bench = spawn([sys.executable, "-c", "import time; time.sleep(60)", "qat4", "bench", "serve"])
    write_pid_file(state / "bench.pid", bench.pid, port)
    assert "which is now another program" in live_pid_file(state / "bench.pid")[1]
    write_pid_file(state / "old.pid", process.pid, port, start_ticks=None)
    assert live_pid_file(state / "old.pid")[0].pid == process.pid
    assert process.poll() is None and bench.poll() is None


def test_a_stale_pid_file_is_removed_only_while_it_names_the_stale_pid(state, monkeypatch):
    """A server started meanwhile may have written its own pid file in the stale one's place."""
    path, pid = state / "serve-1.pid", _finished_pid()
    write_pid_file(path, pid, 1)

    def replaced(stale_pid, **_):
        path.unlink()
        write_pid_file(path, os.getpid(), 1)
        return "which is not running"

    monkeypatch.setattr(server_control, "stale_reason", replaced)
    assert live_pid_file(path)[0] is None and PidFile.read(path).pid == os.getpid()


def test_url_for_reaches_a_wildcard_address_by_the_loopback_of_its_family():
    assert [url_for(host, 80) for host in ("::", "0.0.0.0", "", "::1", "example.org")] == [
        "http://[::1]:80", "http://127.0.0.1:80", "http://127.0.0.1:80", "http://[::1]:80", "http://example.org:80"]


def test_status_port_asks_the_address_the_pid_file_records(state, spawn, capsys):
    """A server on `::` listens on IPv6 only; its pid file records http://[::1]:PORT."""
    port = free_port()
    process = fake_serve(spawn, port, host="::1")
    write_pid_file(state / f"serve-{port}.pid", process.pid, port, host="::")
    assert main(["status", "--port", str(port)]) == 0
    assert f"qat4 serve at http://[::1]:{port}/: ok" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["status", "--url", "http://localhost:abc"], "--url 'http://localhost:abc' is not a server address"),
    (["status", "--url", "http://localhost:99999"], "--url 'http://localhost:99999' is not a server address"),
    (["status", "--url", "http://[::1"], "--url 'http://[::1' is not a server address"),
    (["status", "--port", "0"], "--port must be 1 to 65535, got 0"),
    (["status", "--port", "70000"], "--port must be 1 to 65535, got 70000"),
    (["stop", "--port", "-1"], "--port must be 1 to 65535, got -1"),
    (["stop", "--timeout", "nan"], "--timeout must be a finite number of seconds, 0 or more, got nan"),
])
def test_bad_status_and_stop_flags_are_one_line(argv, message, state, capsys):
    assert main(argv) == 1
    assert one_line(capsys.readouterr().err).startswith(f"qat4 {argv[0]}: {message}")


def test_a_bad_qat4_url_is_one_line(state, monkeypatch, capsys):
    monkeypatch.setenv("QAT4_URL", "http://localhost:abc")
    assert main(["status"]) == 1
    assert one_line(capsys.readouterr().err).startswith("qat4 status: $QAT4_URL 'http://localhost:abc' is not")


def test_the_startup_wait_wants_the_childs_pid_in_health(state, spawn):
    port = free_port()
    other = fake_serve(spawn, port)
    with pytest.raises(Qat4Error, match="did not answer"):
        wait_for_health(url_for(LOOPBACK, port), lambda: None, lambda: "", timeout_s=0.3, pid=os.getpid())
    wait_for_health(url_for(LOOPBACK, port), lambda: None, lambda: "", timeout_s=5, pid=other.pid)


def test_a_file_that_is_not_a_pid_file_is_named_and_kept(state, capsys):
    path = state / "notes.txt"
    path.write_text("my notes\n")
    assert main(["stop", "--pid-file", str(path)]) == 1
    assert f"qat4 stop: {path} is not a qat4 serve pid file" in one_line(capsys.readouterr().err)
    assert path.read_text() == "my notes\n"


# ---- stopping ------------------------------------------------------------------------------------


def test_stop_without_a_pid_file_stops_the_pid_health_reports(state, spawn, capsys):
    port = free_port()
    process = fake_serve(spawn, port)
    assert main(["status", "--port", str(port)]) == 0
    out = capsys.readouterr().out
    assert f"qat4 serve at http://127.0.0.1:{port}/: ok" in out and f"pid        {process.pid} (no pid file)" in out
    assert main(["stop", "--port", str(port)]) == 0
    assert one_line(capsys.readouterr().out).startswith(f"qat4 stop: stopped pid {process.pid} (gracefully")
    assert gone(process.pid)


def test_stop_after_a_stale_pid_file_stops_the_pid_health_reports(state, spawn, capsys):
    port = free_port()
    path, pid = state / f"serve-{port}.pid", _finished_pid()
    write_pid_file(path, pid, port)
    process = fake_serve(spawn, port)
    assert main(["stop", "--port", str(port)]) == 0
    captured = capsys.readouterr()
    assert one_line(captured.err) == f"qat4 stop: pid file {path} names pid {pid}, which is not running; removed it"
    assert one_line(captured.out).startswith(f"qat4 stop: stopped pid {process.pid} (gracefully")


def test_stop_leaves_a_qat4_serve_of_another_port_alone(state, spawn, capsys):
    """/health on the port asked about reports the pid of a qat4 serve listening elsewhere."""
    port, elsewhere = free_port(), free_port()
    other = spawn([sys.executable, "-c", "import time; time.sleep(60)", "qat4", "serve", "--port", str(elsewhere)])
    fake_serve(spawn, port, "--health-pid", str(other.pid))
    assert main(["stop", "--port", str(port)]) == 1
    assert f"reports pid {other.pid}, which is a qat4 serve of another port" in one_line(capsys.readouterr().err)
    assert other.poll() is None


def test_a_server_that_ignores_sigterm_is_killed_after_the_timeout(state, spawn, capsys):
    port = free_port()
    process = fake_serve(spawn, port, "--ignore-term")
    path = state / "ignores.pid"
    write_pid_file(path, process.pid, port)
    assert main(["stop", "--pid-file", str(path), "--timeout", "0.3"]) == 0
    assert one_line(capsys.readouterr().out) == f"qat4 stop: stopped pid {process.pid} (killed after 0.3 s)"
    assert gone(process.pid) and not path.exists()


def test_nothing_to_stop_is_one_line(state, capsys):
    port = free_port()
    assert main(["stop", "--port", str(port)]) == 1
    assert one_line(capsys.readouterr().err) == (f"qat4 stop: no pid file at {state / f'serve-{port}.pid'} and no "
                                                 f"qat4 server answers at http://127.0.0.1:{port}; nothing to stop")
    assert main(["stop", "--pid-file", str(state / "none.pid")]) == 1
    assert one_line(capsys.readouterr().err) == f"qat4 stop: no pid file at {state / 'none.pid'}; nothing to stop"


# ---- status and /health ------------------------------------------------------------------------


@pytest.fixture
def scripted():
    engine = ScriptedEngine(max_num_seqs=3)
    with LiveServer(create_app(engine, model_name="scripted")) as server:
        server.engine = engine
        yield server


def test_health_says_which_process_and_device_answers(scripted):
    health = httpx.get(scripted.url + "/health").json()
    assert {k: health[k] for k in ("status", "model", "queue_depth", "running", "busy", "kv_pool_usage")} == {
        "status": "ok", "model": "scripted", "queue_depth": 0, "running": 0, "busy": False,
        "kv_pool_usage": {"full_attention": 0.0}}
    assert (health["pid"], health["version"], health["device"]) == (os.getpid(), qat4.__version__, "cpu")
    assert health["device_name"] and health["uptime_s"] >= 0
    assert (health["max_ctx"], health["max_num_seqs"]) == (4096, 3)
    assert set(health["memory"]) == {"resident_mib"} and health["memory"]["resident_mib"] > 0


def test_an_unhealthy_server_still_says_which_it_is_and_status_shows_its_error(scripted, capsys):
    scripted.engine.step_error = RuntimeError("device lost")
    httpx.post(scripted.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert wait_until(lambda: httpx.get(scripted.url + "/health").status_code == 503)
    health = httpx.get(scripted.url + "/health").json()
    assert health["status"] == "error" and "device lost" in health["error"] and HEALTH_IDENTITY <= set(health)
    assert main(["status", "--url", scripted.url]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"qat4 serve at {scripted.url}/: error\n  error      device lost")


def test_health_on_a_gpu_reads_the_allocator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 3 << 30)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 4 << 30)
    process = ProcessInfo(torch.device("cuda"))
    assert (process.identity()["device"], process.identity()["device_name"]) == ("cuda:0", "NVIDIA H200")
    memory = process.memory()
    assert (memory["allocated_mib"], memory["reserved_mib"]) == (3072.0, 4096.0) and memory["resident_mib"] > 0


def test_status_of_a_program_that_is_not_qat4(state, spawn, capsys):
    port = free_port()
    spawn([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(state)])
    assert wait_until(lambda: _listening(port), timeout=30)
    assert main(["status", "--port", str(port)]) == 1
    assert one_line(capsys.readouterr().err) == (f"qat4 status: http://127.0.0.1:{port} answers, but not as a qat4 "
                                                 "server (GET /health: 404)")


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True
