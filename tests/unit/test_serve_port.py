"""`rayspec serve`'s checks of its HTTP port (rayspec_cli/serve.py), without a Ray cluster: a taken port refused
before Ray starts, and the check that Serve's proxy (not another server) answers on it once the app runs.
The command serving end to end: tests/cluster/test_rayspec_serve_cli.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from serve_utils import free_port

REPO = Path(__file__).resolve().parents[2]



def test_a_taken_port_is_refused_before_ray_starts(tiny_model_dir):
    """A port something already listens on: `rayspec serve` says so and exits 2 at once, with no Ray started
    (Serve's proxy would start all the same and leave the port to whatever held it)."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", free_port()))
        holder.listen()
        port = holder.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.run([sys.executable, "-m", "rayspec_cli", "serve", str(tiny_model_dir), "--host", "127.0.0.1",
                               "--port", str(port)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr and "choose another --port" in proc.stderr, proc.stderr
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout


def test_the_proxy_check_tells_a_stranger_on_the_port_from_serve(monkeypatch):
    """What `rayspec serve` checks once its app runs: Serve's proxy listing the app's route on the port; a
    server of another kind there (as when one of Ray's own processes took the port first) is reported."""
    import http.server
    import json

    from rayspec_cli.serve import _proxy_problem

    class Routes(http.server.BaseHTTPRequestHandler):
        body = b"{}"

        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(self.body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Routes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        Routes.body = json.dumps({"/": "rayspec"}).encode()
        # (an HTTP proxy in the environment is not asked: the port is this machine's)
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{free_port()}")
        monkeypatch.setenv("no_proxy", "")
        assert _proxy_problem("127.0.0.1", port, 0) is None
        assert _proxy_problem("0.0.0.0", port, 0) is None  # (all interfaces: checked on loopback)
        Routes.body = b"{}"
        assert "not this app's route" in _proxy_problem("127.0.0.1", port, 0)
        Routes.body = b"\x00\x00\x06\x04"  # not JSON (an HTTP/2 frame, say)
        assert _proxy_problem("127.0.0.1", port, 0)
    finally:
        server.shutdown()
        server.server_close()
    assert "Connection refused" in _proxy_problem("127.0.0.1", port, 0)
