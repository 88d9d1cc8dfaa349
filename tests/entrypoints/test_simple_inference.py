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


def _run(model_dir, capsys, *flags) -> list[list[int]]:
    """Token ids of each prompt printed by the script with `flags` (JSON lines)."""
    args = ["--model", model_dir, "--device", "cpu", "--ignore-eos", "--json", *flags]
    assert main(args) == 0
    return [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]


def test_seed_is_the_engine_seed_and_sampling_flags_do_what_they_say(tiny_model_dirs, capsys):
    """--seed seeds the engine (vLLM's meaning): a run repeats exactly, another seed
    changes it, and a prompt given twice samples two different texts (it used to be every
    request's own seed, so repeated prompts sampled the same "random" text)."""
    model = tiny_model_dirs["llama"]
    sampled = ["--max-tokens", "8", "--temperature", "1.0", "--top-p", "0.9", "--top-k", "50"]
    twice = ["--prompt", "Tell me", "--prompt", "Tell me"]
    first = _run(model, capsys, *sampled, *twice, "--seed", "3")
    assert len(first) == 2 and all(len(ids) == 8 for ids in first)
    assert first[0] != first[1]
    assert _run(model, capsys, *sampled, *twice, "--seed", "3") == first
    assert _run(model, capsys, *sampled, *twice, "--seed", "4") != first


def test_temperature_zero_and_top_k_one_are_greedy(tiny_model_dirs, capsys):
    """With --chat over the built-in prompts: --temperature 0 and --top-k 1 (at a
    temperature) both print the engine's greedy tokens."""
    from atom.examples.simple_inference import DEFAULT_PROMPTS
    from atom.sampling_params import SamplingParams
    from tests.engine_support import build_llm

    model = tiny_model_dirs["llama"]
    llm = build_llm(model)
    prompts = [llm.chat_prompt([{"role": "user", "content": p}]) for p in DEFAULT_PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    flags = ["--chat", "--max-tokens", "6"]
    assert _run(model, capsys, *flags, "--temperature", "0") == expected
    top1 = ["--temperature", "0.9", "--top-k", "1", "--seed", "5"]
    assert _run(model, capsys, *flags, *top1) == expected


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
