"""A server in a thread for the entrypoint tests, and small HTTP helpers.

The server's engine runs a tiny random Llama; a second engine over the same checkpoint
(the `reference` fixture) gives the offline `LLM.generate` output that greedy server
output must equal.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass

import openai

from atom.entrypoints import openai_server
from atom.entrypoints.async_engine import AsyncEngine
from atom.entrypoints.openai_server import bind_socket, create_app
from atom.model_engine.llm import LLM
from atom.sampling_params import SamplingParams

MODEL = "tiny-llama"
MAX_MODEL_LEN = 256


@dataclass
class Server:
    url: str
    port: int
    llm: LLM  # the server's engine (read it only while the server is idle)
    engine: AsyncEngine

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine holds no request and every KV block is free."""
        engine, bm = self.llm.engine, self.llm.engine.block_manager
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks:
                return
            time.sleep(0.01)
        raise AssertionError(
            f"engine not idle after {timeout} s: {len(engine.scheduler.running)} running, "
            f"{bm.num_blocks - bm.num_free_blocks} blocks in use"
        )


def run_server(llm: LLM, model_name: str, **app_options):
    """Start uvicorn on a free loopback port (bound here: no port race); returns (server, stop).

    `app_options` go to `create_app` (e.g. max_request_bytes)."""
    app = create_app(llm.engine, model_name, **app_options)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = openai_server.Server(app, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)

    def stop() -> None:
        server.should_exit = True
        thread.join(30)
        sock.close()

    url = f"http://127.0.0.1:{port}"
    return Server(url, port, llm, app.state.engine), stop


def greedy(reference: LLM, prompts, max_tokens: int, **kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)
    return reference.generate(prompts, params, use_tqdm=False)


def raw_request(server: Server, method: str, path: str, body=None, headers=None):
    """(status, parsed JSON or text) without the client's own checks."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    if body is not None and not isinstance(body, (str, bytes)):
        body = json.dumps(body)
    connection.request(
        method, path, body=body, headers=headers or {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    text = response.read().decode()
    connection.close()
    try:
        return response.status, json.loads(text)
    except json.JSONDecodeError:
        return response.status, text


PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3 4"]


def parse_metrics(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples
