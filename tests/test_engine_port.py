"""The engine's port: one picked free can be bound by another process before vLLM binds it (seen with two
pytest workers). The engine then starts again on a new port; a port the user chose is never changed.

vLLM itself is replaced here by a small HTTP server started the same way (the engine's `python -m ... --port P`
command line), because what is tested is the engine's start-up and retry, and a real vLLM start takes a minute;
the real engine goes through the same start() in every engine test."""
from __future__ import annotations

import logging
import socket
import sys
import textwrap

import pytest

from lightning_otel.errors import UserError
from lightning_otel.serve.engine import EngineConfig, VLLMEngine

SERVER = textwrap.dedent("""\
    #!{python}
    # Stands in for `python -m vllm.entrypoints.openai.api_server ... --port P`: binds P or dies as uvicorn does.
    import http.server, json, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({{"data": [{{"id": "policy"}}]}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    try:
        server = http.server.HTTPServer(("127.0.0.1", port), Models)
    except OSError as exc:
        print(f"ERROR: [Errno 98] error while attempting to bind on address: {{exc}}", flush=True)
        sys.exit(1)
    server.serve_forever()
""")


@pytest.fixture
def stand_in(tmp_path):
    path = tmp_path / "python"
    path.write_text(SERVER.format(python=sys.executable))
    path.chmod(0o755)
    return path


@pytest.fixture
def model(tmp_path):
    """A model folder as far as the engine's config checks go (the stand-in loads nothing)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return folder


@pytest.fixture
def taken():
    """A port another process holds (listening), as the one that won the race would."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.heavy
@pytest.mark.parametrize("kept_log", [True, False], ids=["log kept", "no log"])
def test_a_picked_port_taken_before_the_engine_bound_it_is_replaced(stand_in, model, taken, tmp_path, caplog, kept_log):
    log_path = tmp_path / "engine.log" if kept_log else None
    engine = VLLMEngine(EngineConfig(model_dir=model, python=str(stand_in), log_path=log_path,
                                     startup_timeout_s=30))
    engine.port, engine.url = taken, f"http://127.0.0.1:{taken}"  # the pick another process then took
    try:
        with caplog.at_level(logging.WARNING, logger="lightning_otel.serve.engine"):
            engine.start()
        assert engine.port != taken and engine.url == f"http://127.0.0.1:{engine.port}"
        assert engine.process.poll() is None
        assert f"port {taken} was taken" in caplog.text
    finally:
        engine.stop()


def test_a_port_the_user_chose_is_not_changed(stand_in, model, taken, tmp_path):
    engine = VLLMEngine(EngineConfig(model_dir=model, python=str(stand_in), port=taken,
                                     log_path=tmp_path / "engine.log", startup_timeout_s=30))
    with pytest.raises(UserError, match=f"could not bind 127.0.0.1:{taken}.*another process holds it"):
        engine.start()
    assert engine.process is None and engine.port == taken


def test_an_engine_that_fails_for_another_reason_is_not_restarted(model, tmp_path):
    broken = tmp_path / "python"
    broken.write_text(f"#!{sys.executable}\nimport sys\nprint('no such model', flush=True)\nsys.exit(3)\n")
    broken.chmod(0o755)
    engine = VLLMEngine(EngineConfig(model_dir=model, python=str(broken), log_path=tmp_path / "engine.log",
                                     startup_timeout_s=30))
    first = engine.port
    with pytest.raises(UserError, match="exited with code 3 while starting"):
        engine.start()
    assert engine.port == first
    assert (tmp_path / "engine.log").read_text().count("no such model") == 1  # started once
