"""A gateway for real traffic (`serve`): an API key that every request but /health must send, checked before its
body is read, and no server reachable from other machines without one (unless --insecure-no-auth). Over a
stand-in engine: the key is the HTTP side's, whatever serves the generations."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request

import openai
import pytest

from conftest import post
from lightning_otel.errors import UserError
from lightning_otel.serve.gateway import Gateway, GatewayConfig
from test_responses import ScriptedEngine

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


@pytest.fixture
def keyed():
    gateway = Gateway(ScriptedEngine(["hello"] * 4), GatewayConfig(api_key="s3cret-key"))
    gateway.start()
    yield gateway
    gateway.close()


def test_only_requests_with_the_key_are_served(keyed):
    url = keyed.url + "/v1/chat/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret-key"},
                    {"Authorization": "Bearer s3cret-ke"}, {"Authorization": "Bearer s3cret-key-and-more"}):
        status, _, raw = post(url, BODY, "application/json", headers=headers)
        assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key", (headers, raw)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(keyed.url + "/v1/models", timeout=10)
    assert refused.value.code == 401
    with urllib.request.urlopen(keyed.url + "/health", timeout=10) as answer:  # probes need no key
        assert answer.status == 200
    status, _, raw = post(url, BODY, "application/json", headers={"Authorization": "bearer s3cret-key"})
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == "hello"
    client = openai.OpenAI(base_url=keyed.base_url(), api_key="s3cret-key", max_retries=0)
    assert client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]) \
        .choices[0].message.content == "hello"
    client.close()


def test_a_refused_request_is_answered_before_its_body_arrives(keyed):
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n")
        head = sock.recv(200)
    assert head.startswith(b"HTTP/1.1 401"), head


def test_no_key_on_a_host_other_machines_reach_is_refused():
    for host in ("0.0.0.0", "::", "192.168.1.20"):
        with pytest.raises(UserError, match="--api-key.*--insecure-no-auth"):
            GatewayConfig(host=host)
    GatewayConfig(host="0.0.0.0", api_key="k", port=0)
    GatewayConfig(host="0.0.0.0", insecure_no_auth=True)
    with pytest.raises(UserError, match="API key is empty"):
        GatewayConfig(api_key=" ")
    # The command refuses before it resolves the policy or starts an engine.
    result = subprocess.run([sys.executable, "-m", "lightning_otel.cli", "serve", "no-such-policy", "--host",
                             "0.0.0.0"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "--api-key" in result.stderr and "no-such-policy" not in result.stderr, \
        result.stderr[-2000:]
