"""A test double of an OpenAI-compatible judge server (NOT vLLM): a tiny local HTTP server in a thread that
answers ``/health``, ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions`` with a reply chosen by the
test, and can fail the first requests (HTTP 500), answer late (for timeouts) and count what it got.

The real server is tested in tests/test_vllm_judge.py (``vllm serve`` of a tiny local model)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Stub:
    """What the stub answers and what it saw. ``reply(prompt) -> text``; ``fail_first``: that many requests
    get HTTP 500 (with ``retry-after-ms: 10``, so the client's backoff is short); ``delay_s``: each completion
    waits that long."""

    reply: Callable[[str], str] = lambda prompt: "SCORE: 7"
    fail_first: int = 0
    delay_s: float = 0.0
    context_chars: int | None = None  # a prompt longer than this gets vLLM's HTTP 400 "longer than the maximum ..."
    model: str = "stub-judge"
    requests: int = 0  # completion requests received (retries included)
    prompts: list[str] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    base_url: str = ""


def _handler(stub: Stub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _send(self, code: int, body: dict, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout test)
                pass

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": stub.model, "object": "model", "created": 0,
                                                             "owned_by": "stub", "root": "/models/stub"}]})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            with stub.lock:
                stub.requests += 1
                n = stub.requests
                stub.in_flight += 1
                stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
            try:
                time.sleep(stub.delay_s)
                if n <= stub.fail_first:
                    self._send(500, {"error": {"message": "stub failure"}}, {"retry-after-ms": "10"})
                    return
                chat = self.path == "/v1/chat/completions"
                prompt = body["messages"][-1]["content"] if chat else body["prompt"]
                if stub.context_chars is not None and len(prompt) > stub.context_chars:
                    self._send(400, {"object": "error", "type": "BadRequestError", "code": 400, "message":
                                     f"The decoder prompt (length {len(prompt)}) is longer than the maximum model "
                                     f"length of {stub.context_chars}. Make sure that `max_model_len` is no "
                                     "smaller than the number of text tokens."})
                    return
                with stub.lock:
                    stub.prompts.append(prompt)
                text = stub.reply(prompt)
                choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                          if chat else {"index": 0, "text": text, "finish_reason": "stop"})
                self._send(200, {"id": "x", "object": "chat.completion" if chat else "text_completion",
                                 "created": 0, "model": body["model"], "choices": [choice]})
            finally:
                with stub.lock:
                    stub.in_flight -= 1

    return Handler


@contextmanager
def running(stub: Stub) -> Iterator[Stub]:
    """Serve ``stub`` on a free port of 127.0.0.1 for the block; ``stub.base_url`` is its ``/v1``."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(stub))
    server.daemon_threads = True
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    stub.base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        yield stub
    finally:
        server.shutdown()
        server.server_close()
