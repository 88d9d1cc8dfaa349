"""Real clients, unmodified, against the server: lm-eval-harness and LangChain.

lm-eval's `local-completions` model scores a small multiple-choice task written to a local
file (log-likelihoods through `echo` + `logprobs`); its accuracy must equal the same task
scored here with HF transformers' log-probabilities. LangChain's ChatOpenAI invokes and
streams.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from tests.entrypoints.server_support import MODEL

QUESTIONS = [
    ("The sky is", ["blue", "green", "loud", "square"], 0),
    ("Two plus two is", ["four", "seven", "purple", "ten"], 0),
    ("The capital of France is", ["Berlin", "Paris", "Madrid", "Rome"], 1),
    ("Water freezes at zero degrees", ["Celsius", "Fahrenheit", "Kelvin", "Rankine"], 0),
    ("A cat says", ["woof", "meow", "moo", "quack"], 1),
    ("The opposite of hot is", ["warm", "cold", "big", "fast"], 1),
    ("Monday comes before", ["Sunday", "Friday", "Tuesday", "Saturday"], 2),
    ("The sun rises in the", ["west", "north", "south", "east"], 3),
]


def _write_task(root) -> str:
    data = root / "questions.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS
        )
    )
    (root / "atom_mc.yaml").write_text(
        f"""task: atom_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
    )
    return str(root)


def _hf_accuracy(model_dir: str) -> float:
    """The task scored with HF log-probabilities, split as lm-eval splits context and
    continuation (encode the whole, cut at the context's length; " " as delimiter)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    correct = 0
    for question, choices, answer in QUESTIONS:
        scores = []
        for choice in choices:
            context_ids = tokenizer(question, add_special_tokens=False).input_ids
            whole = tokenizer(question + " " + choice, add_special_tokens=False).input_ids
            with torch.no_grad():
                logprobs = model(torch.tensor([whole])).logits[0].log_softmax(-1)
            scores.append(
                sum(logprobs[i - 1, whole[i]].item() for i in range(len(context_ids), len(whole)))
            )
        correct += int(max(range(len(choices)), key=scores.__getitem__) == answer)
    return correct / len(QUESTIONS)


def test_lm_eval_local_completions_equals_hf(server, model_dir, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    task_dir = _write_task(tmp_path)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(
            f"model={MODEL},base_url={server.url}/v1/completions,tokenizer={model_dir},"
            "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1"
        ),
        tasks=["atom_mc"],
        task_manager=TaskManager(include_path=task_dir),
        log_samples=False,
    )
    accuracy = results["results"]["atom_mc"]["acc,none"]
    print("lm-eval accuracy", accuracy)
    assert accuracy == pytest.approx(_hf_accuracy(model_dir))


def test_langchain_chat_openai_invoke_and_stream(server):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        base_url=f"{server.url}/v1",
        api_key="unused",
        model=MODEL,
        max_tokens=6,
        temperature=0,
        max_retries=0,
    )
    answer = chat.invoke("Hello there")
    expected = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=6,
        temperature=0,
    )
    assert answer.content == expected.choices[0].message.content
    streamed = "".join(chunk.content for chunk in chat.stream("Hello there"))
    assert streamed == answer.content
    os.environ.pop("LANGCHAIN_TRACING_V2", None)
