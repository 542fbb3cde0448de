"""HTTPSampler against real HTTP servers: retries and backoff, auth and 4xx errors, a dead server, the cache, the concurrency limit."""
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slm_bench.infer.http import HTTPSampler, RemoteError
from slm_bench.infer.sampling import HFSampler, SamplingParams
from slm_bench.infer.serve import CompletionService, make_server

OK_BODY = {"choices": [{"index": 0, "text": " ok", "finish_reason": "stop", "token_ids": [5],
                        "logprobs": {"tokens": ["▁ok"], "token_logprobs": [-0.5]}}]}


class Scripted:
    "A real HTTP server whose answers follow a script: a list of (status, body, delay) per request, last one repeating."

    def __init__(self, script):
        self.script, self.calls, self.in_flight, self.max_in_flight = script, 0, 0, 0
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with lock:
                    status, body, delay = outer.script[min(outer.calls, len(outer.script) - 1)]
                    outer.calls += 1
                    outer.in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
                time.sleep(delay)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                with lock:
                    outer.in_flight -= 1

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted():
    servers = []

    def start(script):
        servers.append(Scripted(script))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


def test_retries_with_backoff_then_success(scripted):
    server = scripted([(503, {"error": {"message": "busy"}}, 0), (429, {"error": {"message": "slow down"}}, 0), (200, OK_BODY, 0)])
    sampler = HTTPSampler(server.url, "m", retries=3, backoff=0.05)
    start = time.perf_counter()
    out = sampler.generate([[1, 2, 3]], SamplingParams(max_new_tokens=1))
    assert out[0][0].text == " ok" and out[0][0].token_ids == [5] and out[0][0].logprobs == [-0.5]
    assert server.calls == 3 and time.perf_counter() - start >= 0.05 + 0.1  # waited 0.05 then 0.1


def test_server_that_stays_down(scripted):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sampler = HTTPSampler(f"http://127.0.0.1:{port}/v1", "m", retries=2, backoff=0.01)
    with pytest.raises(RemoteError, match=r"no answer after 3 attempts \(ConnectError.*is the server up\?"):
        sampler.generate([[1, 2]], SamplingParams())
    busy = scripted([(503, {"error": {"message": "overloaded"}}, 0)])
    with pytest.raises(RemoteError, match=r"no answer after 2 attempts \(HTTP 503: overloaded\)"):
        HTTPSampler(busy.url, "m", retries=1, backoff=0.01).generate([[1]], SamplingParams())


def test_auth_and_client_errors_are_not_retried(scripted):
    denied = scripted([(401, {"error": {"message": "bad key"}}, 0)])
    with pytest.raises(RemoteError, match="authentication failed \\(HTTP 401\\); check the API key"):
        HTTPSampler(denied.url, "m", retries=3, backoff=0.01).generate([[1]], SamplingParams())
    assert denied.calls == 1
    rejected = scripted([(400, {"error": {"message": "max_tokens is too large"}}, 0)])
    with pytest.raises(RemoteError, match="rejected the request \\(HTTP 400\\): max_tokens is too large"):
        HTTPSampler(rejected.url, "m", retries=3, backoff=0.01).generate([[1]], SamplingParams())
    assert rejected.calls == 1


def test_concurrency_limit(scripted):
    server = scripted([(200, OK_BODY, 0.2)])
    sampler = HTTPSampler(server.url, "m", concurrency=2)
    sampler.generate([[i] for i in range(6)], SamplingParams(max_new_tokens=1))
    assert server.calls == 6 and server.max_in_flight == 2


def test_response_cache(scripted, tmp_path):
    server = scripted([(200, OK_BODY, 0)])
    sampler = HTTPSampler(server.url, "m", cache_dir=tmp_path / "cache")
    first = sampler.generate([[1, 2], [3]], SamplingParams(max_new_tokens=1, seed=4))
    again = HTTPSampler(server.url, "m", cache_dir=tmp_path / "cache").generate([[1, 2], [3]], SamplingParams(max_new_tokens=1, seed=4))
    assert server.calls == 2 and first == again  # the second sampler answered from disk
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2
    HTTPSampler(server.url, "m", cache_dir=tmp_path / "cache").generate([[1, 2]], SamplingParams(max_new_tokens=1, seed=5))
    assert server.calls == 3  # a different request (seed) is a different key


def test_api_key_against_the_real_server(tiny_checkpoint):
    service = CompletionService(HFSampler.from_checkpoint(tiny_checkpoint), "tiny")
    server = make_server(service, api_key="s3cret")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        with pytest.raises(RemoteError, match="HTTP 401"):
            HTTPSampler(url, "tiny", api_key="wrong").generate([[1, 5]], SamplingParams(max_new_tokens=2))
        out = HTTPSampler(url, "tiny", api_key="s3cret").generate([[1, 5]], SamplingParams(max_new_tokens=2))
        assert len(out[0][0].token_ids) >= 1
        with pytest.raises(RemoteError, match="HTTP 400.*prompt must be a string or a list of token ids"):
            HTTPSampler(url, "tiny", api_key="s3cret").post("/completions", {"prompt": {"not": "valid"}})
    finally:
        server.shutdown()
        server.server_close()
