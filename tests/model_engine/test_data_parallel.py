"""Data parallelism on CPU (gloo): two engine replicas, each on its own spawned rank.

One DP=2 engine is reused for every check: offline outputs equal DP=1's in input order
(greedy and seeded sampling), both replicas served requests, the OpenAI server in front
of it routes requests to both and reports each replica in /metrics; then a killed rank of
replica 1 is named, every replica is stopped and the shared store's port is free.
"""

import multiprocessing
import os
import signal
import time

import pytest
import torch

from atom.model_engine.data_parallel import DataParallelEngine
from atom.model_engine.rendezvous import Rendezvous
from atom.model_engine.workers import WorkerFailedError
from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm, random_prompts
from tests.model_engine.test_tensor_parallel import pid_alive, token_ids


def test_dp2_equals_dp1_serves_both_replicas_then_a_killed_rank_is_named(tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    prompts = random_prompts(20, [3, 40, 17, 9, 25])
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 4 + [
        SamplingParams(temperature=0.9, seed=3, max_tokens=8, ignore_eos=True)
    ]
    expected = token_ids(build_llm(model), prompts, params)
    before = set(multiprocessing.active_children())
    llm = build_llm(model, data_parallel_size=2, max_model_len=256)
    engine = llm.engine
    assert isinstance(engine, DataParallelEngine)
    port = engine.rendezvous.spec.port
    pids = [pid for replica in engine.replicas for pid in replica.model_runner.workers.pids]
    try:
        assert token_ids(llm, prompts, params) == expected  # in input order
        assert [replica.stats.requests for replica in engine.replicas] == [3, 2]
        assert all(replica.stats.generated_tokens > 0 for replica in engine.replicas)

        pytest.importorskip("openai")  # the server test helpers use it (not on every GPU image)
        from tests.entrypoints.server_support import parse_metrics, raw_request, run_server

        server, stop = run_server(llm, "tiny-dp")
        try:
            for prompt in prompts[:4]:
                status, body = raw_request(
                    server,
                    "POST",
                    "/v1/completions",
                    {"model": "tiny-dp", "prompt": prompt, "max_tokens": 4, "temperature": 0},
                )
                assert status == 200, body
                assert body["choices"][0]["finish_reason"] == "length"
            status, text = raw_request(server, "GET", "/metrics")
            assert status == 200
            metrics = parse_metrics(text)
            label = 'model_name="tiny-dp"'
            routed = [
                metrics[f'atom_replica_requests_total{{{label},replica="{i}"}}'] for i in (0, 1)
            ]
            assert min(routed) >= 3 and sum(routed) == 9, routed  # 5 offline + 4 served
            assert metrics[f"atom_requests_total{{{label}}}"] == 9
        finally:
            stop()

        for prompt in random_prompts(21, [5, 9]):
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=500))
        for _ in range(2):
            engine.step()
        os.kill(engine.replicas[1].model_runner.workers.pids[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerFailedError) as caught:
            for _ in range(100):
                engine.step()
        assert time.monotonic() - start < 30
        error = caught.value
        assert error.replica == 1 and "replica 1" in str(error) and "SIGKILL" in str(error)
        assert not any(pid_alive(pid) for pid in pids)  # replica 0 was stopped too
        for replica in engine.replicas:  # leave nothing for the block-leak check
            for seq_id in list(replica.requests):
                replica.abort(seq_id)
    finally:
        llm.shutdown()
    with Rendezvous.start(world_size=2, master_port=port) as again:  # the port is free
        assert again.spec.port == port
    assert set(multiprocessing.active_children()) <= before


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_dp2_equals_dp1_in_fp32(tiny_model_dirs):
    """Replica 0 on cuda:0, replica 1 on cuda:1; fp32 so both agree token for token."""
    prompts = random_prompts(22, [1, 9, 40, 129])
    kwargs = dict(device="cuda", dtype="float32", num_kvcache_blocks=512, max_num_seqs=8)
    expected = token_ids(build_llm(tiny_model_dirs["llama"], **kwargs), prompts)
    llm = build_llm(tiny_model_dirs["llama"], data_parallel_size=2, **kwargs)
    try:
        assert token_ids(llm, prompts) == expected
        assert [replica.stats.requests for replica in llm.engine.replicas] == [2, 2]
    finally:
        llm.shutdown()
