"""The offline script: JSON on stdout, errors as a message and exit code 2."""

import json
import os
import subprocess
import sys

from atom.examples.simple_inference import main


def test_json_lines_on_stdout(tiny_model_dirs, capsys):
    code = main(
        [
            "--model",
            tiny_model_dirs["llama"],
            "--device",
            "cpu",
            "--max-tokens",
            "5",
            "--ignore-eos",
            "--prompt",
            "Hello there",
            "--prompt",
            "Second prompt",
            "--json",
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.strip().splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello there", "Second prompt"]
    assert all(len(line["token_ids"]) == 5 and isinstance(line["text"], str) for line in lines)
    assert "tok/s" in captured.err


def test_chat_template_and_sampling_flags(tiny_model_dirs, capsys):
    code = main(
        [
            "--model",
            tiny_model_dirs["llama"],
            "--device",
            "cpu",
            "--max-tokens",
            "3",
            "--chat",
            "--temperature",
            "0.7",
            "--top-p",
            "0.9",
            "--top-k",
            "20",
            "--seed",
            "3",
            "--json",
        ]
    )
    assert code == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 4  # the built-in prompts


def test_bad_model_path_is_a_message_not_a_traceback(tmp_path, capsys):
    code = main(["--model", str(tmp_path / "missing"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2
    assert "does not exist" in err and "Traceback" not in err


def test_bad_sampling_value_is_a_message(tiny_model_dirs, capsys):
    code = main(["--model", tiny_model_dirs["llama"], "--device", "cpu", "--top-p", "1.5"])
    assert code == 2
    assert "top_p" in capsys.readouterr().err


def test_tensor_parallel_script_matches_one_process(tiny_model_dirs, capsys):
    """`python -m atom.examples.simple_inference --tensor-parallel-size 2` (2 spawned ranks
    on gloo) prints the same greedy tokens as one process."""
    args = ["--model", tiny_model_dirs["llama"], "--device", "cpu", "--max-tokens", "6"]
    args += ["--ignore-eos", "--prompt", "Hello there", "--prompt", "Tensor parallel", "--json"]
    assert main(args) == 0
    expected = [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-m", "atom.examples.simple_inference", "--tensor-parallel-size", "2"]
        + args,
        cwd=repo,
        env=dict(os.environ, PYTHONPATH=repo),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [json.loads(line)["token_ids"] for line in done.stdout.splitlines()] == expected
