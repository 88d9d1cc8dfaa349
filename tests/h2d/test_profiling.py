"""`ATOM::<stage>` annotations: in the trace while profiling, nothing built when off."""

import json

import pytest
import torch

from atom import profiling
from atom.examples.simple_inference import main
from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm, random_prompts

STAGES = {
    "ATOM::schedule",
    "ATOM::prepare",
    "ATOM::publish",
    "ATOM::forward",
    "ATOM::sample",
    "ATOM::publish.embedding",
    "ATOM::publish.attention_metadata",
    "ATOM::publish.sampler",
}


def _trace_names(path) -> set[str]:
    with open(path) as trace:
        return {event.get("name") for event in json.load(trace)["traceEvents"]}


def test_trace_shows_every_stage(tiny_model_dirs, tmp_path):
    llm = build_llm(tiny_model_dirs["llama"], profiler_dir=str(tmp_path))
    # two temperatures: the sampler's parameters are uploaded (uniform ones are not)
    params = [
        SamplingParams(temperature=t, max_tokens=3, ignore_eos=True, seed=1) for t in (0.5, 0.9)
    ]
    llm.start_profile()
    llm.generate(random_prompts(0, [5, 9]), params, use_tqdm=False)
    path = llm.stop_profile()
    assert path.parent == tmp_path
    assert STAGES <= _trace_names(path)


def test_no_annotation_is_built_when_profiling_is_off(tiny_model_dirs, monkeypatch):
    llm = build_llm(tiny_model_dirs["llama"])

    def refuse(name):
        raise AssertionError(f"record_function({name!r}) built while profiling is off")

    monkeypatch.setattr(torch.profiler, "record_function", refuse)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    assert len(llm.generate(random_prompts(0, [4]), params, use_tqdm=False)[0].token_ids) == 3
    assert profiling.stage("forward") is profiling.stage("sample")  # one shared no-op


def test_profiling_needs_a_directory(tiny_model_dirs, monkeypatch):
    monkeypatch.delenv("ATOM_TORCH_PROFILER_DIR", raising=False)
    llm = build_llm(tiny_model_dirs["llama"])
    with pytest.raises(ValueError, match="ATOM_TORCH_PROFILER_DIR"):
        llm.start_profile()


def test_offline_script_profile_flag_writes_a_trace(tiny_model_dirs, tmp_path, capsys):
    code = main(
        [
            "--model",
            tiny_model_dirs["llama"],
            "--device",
            "cpu",
            "--max-tokens",
            "2",
            "--prompt",
            "Hello",
            "--profile",
            str(tmp_path),
        ]
    )
    assert code == 0
    traces = list(tmp_path.glob("atom_trace_*.json"))
    assert len(traces) == 1 and "profiler trace:" in capsys.readouterr().err
    assert {"ATOM::schedule", "ATOM::forward", "ATOM::publish"} <= _trace_names(traces[0])
