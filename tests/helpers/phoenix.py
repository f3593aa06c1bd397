"""A real Arize Phoenix server (`phoenix serve`, from the .venv-phoenix that `make test` builds) on free loopback
ports, for the tests that send it spans, and its own REST API to read them back."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[2]
PHOENIX = REPO / ".venv-phoenix" / "bin" / "phoenix"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout: float = 30.0, detail=lambda: ""):
    """check()'s first truthy value, polled until timeout (then AssertionError with detail())."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s {detail()}")


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


class Phoenix:
    def __init__(self, folder: Path):
        assert PHOENIX.is_file(), f"{PHOENIX} is missing: `make phoenix` builds it (`make test` does)"
        port = free_port()
        env = {**os.environ, "PHOENIX_PORT": str(port), "PHOENIX_GRPC_PORT": str(free_port()),
               "PHOENIX_HOST": "127.0.0.1", "PHOENIX_WORKING_DIR": str(folder / "phoenix"),
               "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false", "PHOENIX_TELEMETRY_ENABLED": "false"}
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen([str(PHOENIX), "serve"], env=env, stdout=open(folder / "phoenix.log", "wb"),
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)

    def spans(self) -> list[dict]:
        """Every span of Phoenix's default project, through its REST API."""
        spans, cursor = [], None
        while True:
            query = f"{self.url}/v1/projects/default/spans?limit=1000" + (f"&cursor={cursor}" if cursor else "")
            with urllib.request.urlopen(query, timeout=30) as response:
                page = json.loads(response.read())
            spans += page["data"]
            cursor = page.get("next_cursor")
            if not cursor:
                return spans


@contextlib.contextmanager
def running_phoenix(folder: Path) -> Iterator[Phoenix]:
    """Phoenix serving on 127.0.0.1 once it answers /healthz; killed at the end."""
    phoenix = Phoenix(folder)
    try:
        wait_for(lambda: healthy(phoenix.url) or phoenix.process.poll() is not None, timeout=180)
        assert phoenix.process.poll() is None, (folder / "phoenix.log").read_text()[-3000:]
        yield phoenix
    finally:
        phoenix.kill()
