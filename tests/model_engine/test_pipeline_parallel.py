"""Pipeline parallelism on CPU (gloo, spawned ranks): PP=2 generates what PP=1 does.

Each spawned engine is reused for several checks (the machine has 2 cores): greedy and
seeded tokens equal PP=1's under chunked prefill, preemption, prefix-cache hits and
asynchronous scheduling, with every stage's page tables in checked mode (each step
compares the host rows with the sequences' block tables and the device rows with the
host rows); then a killed rank is named by stage, and nothing is left behind.
"""

import multiprocessing
import os
import signal
import time

import pytest
import torch
import transformers

from atom.distributed import PipelineError, stage_layer_range
from atom.model_engine.llm import LLM
from atom.model_engine.rendezvous import Rendezvous, RendezvousSpec
from atom.model_engine.workers import WorkerFailedError
from atom.sampling_params import SamplingParams
from tests.engine_support import TINY, build_llm, random_prompts
from tests.model_engine.test_tensor_parallel import pid_alive, runner_pids, token_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def three_layer_llama(tmp_path_factory):
    """Three layers: two stages split them unevenly (layers 0-1, then 2)."""
    torch.manual_seed(7)
    config = transformers.LlamaConfig(
        **dict(TINY, num_hidden_layers=3, vocab_size=49152, bos_token_id=1, eos_token_id=2)
    )
    path = tmp_path_factory.mktemp("pp") / "llama3layers"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def test_stage_layer_ranges_cover_every_layer_once():
    assert [stage_layer_range(3, s, 2) for s in range(2)] == [(0, 2), (2, 3)]
    assert [stage_layer_range(30, s, 4) for s in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    with pytest.raises(PipelineError, match="2 decoder layers cannot fill 3 pipeline stages"):
        stage_layer_range(2, 0, 3)


def test_errors_name_replica_stage_and_rank():
    spec = RendezvousSpec("127.0.0.1", 1, world_size=4, pipeline_parallel_size=2)
    assert spec.describe(3) == "pipeline stage 1, tensor-parallel rank 1 (rank 3)"
    one = RendezvousSpec("127.0.0.1", 1, world_size=2, pipeline_parallel_size=2)
    assert one.replica_spec(1, 2, 2).describe(1) == "replica 1, pipeline stage 1 (rank 1)"
    assert WorkerFailedError(1, "died", spec=one).stage == 1


def test_too_many_stages_fail_before_spawning(tiny_model_dirs):
    before = set(multiprocessing.active_children())
    with pytest.raises(PipelineError, match="2 decoder layers cannot fill 3 pipeline stages"):
        LLM(tiny_model_dirs["llama"], device="cpu", pipeline_parallel_size=3)
    assert set(multiprocessing.active_children()) == before


def test_pp2_equals_pp1_then_a_killed_stage_is_named(three_layer_llama):
    """One PP=2 engine (4 micro-batches, asynchronous scheduling, a small KV cache and
    token budget: chunked prefill, preemption, prefix hits) against PP=1 with the same
    settings; then SIGKILL the last stage's rank mid-generation."""
    settings = dict(
        max_num_batched_tokens=24,
        max_num_seqs=6,
        num_kvcache_blocks=12,
        async_scheduling=True,
    )
    shared = random_prompts(11, [40])[0]
    prompts = [shared + [7, 8]] + random_prompts(12, [30, 1, 44, 9]) + [shared + [9]]
    params = [GREEDY] * 4 + [SamplingParams(temperature=0.8, seed=5, max_tokens=10), GREEDY]
    expected = token_ids(build_llm(three_layer_llama, **settings), prompts, params)
    llm = build_llm(three_layer_llama, pipeline_parallel_size=2, num_micro_batches=4, **settings)
    runner = llm.engine.model_runner
    pids, port = runner_pids(llm), runner.port
    try:
        assert token_ids(llm, prompts, params) == expected
        engine = llm.engine
        assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.prefix_hit_blocks > 0
        stats = runner.rank_stats()
        assert [s["stage"] for s in stats] == [0, 1]
        # Each stage's four slots kept their own page tables, published without a loss;
        # both stages followed the same batches, so their revisions agree slot by slot.
        tables = [s["page_tables"] for s in stats]
        assert all(cpu == gpu for stage in tables for cpu, gpu in stage), tables
        assert tables[0] == tables[1] and all(cpu > 0 for cpu, _ in tables[0]), tables
        assert all(s["steps"] == engine.stats.steps for s in stats)
        # The last stage samples without a SamplingPlan: its options are refused clearly.
        for options in (dict(logprobs=1), dict(presence_penalty=0.5), dict(json_object=True)):
            with pytest.raises(ValueError, match="pipeline parallelism"):
                engine.add_request(prompts[0], SamplingParams(max_tokens=2, **options))

        for prompt in random_prompts(13, [5, 9, 17]):
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=500))
        for _ in range(3):
            engine.step()
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerFailedError) as caught:
            for _ in range(100):
                engine.step()
        assert time.monotonic() - start < 30
        error = caught.value
        assert error.rank == 1 and error.stage == 1, str(error)
        assert "pipeline stage 1" in str(error) and "SIGKILL" in str(error), str(error)
        assert not any(pid_alive(pid) for pid in pids)
        for seq_id in list(engine.requests):  # leave nothing for the block-leak check
            engine.abort(seq_id)
    finally:
        llm.shutdown()
    with Rendezvous.start(world_size=2, master_port=port) as again:  # the port is free
        assert again.spec.port == port


def test_pp2_by_tp2_with_tied_embeddings_equals_one_rank(tiny_model_dirs):
    """Four ranks: two stages of two tensor-parallel ranks. llama3: GQA, llama3 rope and
    a tied LM head, which the last stage (no embedding of its own) loads from the
    embedding's tensor."""
    prompts = random_prompts(14, [1, 7, 33])
    expected = token_ids(build_llm(tiny_model_dirs["llama3"]), prompts)
    llm = build_llm(tiny_model_dirs["llama3"], pipeline_parallel_size=2, tensor_parallel_size=2)
    try:
        assert token_ids(llm, prompts) == expected
        stats = llm.engine.model_runner.rank_stats()
        assert [(s["stage"], s["tp_rank"]) for s in stats] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    finally:
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_pp2_equals_pp1_in_fp32(three_layer_llama):
    """NCCL send/recv between cuda:0 (stage 0) and cuda:1 (stage 1), 2 micro-batches."""
    prompts = random_prompts(15, [1, 9, 40, 129])
    kwargs = dict(device="cuda", dtype="float32", num_kvcache_blocks=512, max_num_seqs=8)
    expected = token_ids(build_llm(three_layer_llama, **kwargs), prompts)
    llm = build_llm(three_layer_llama, pipeline_parallel_size=2, **kwargs)
    try:
        assert token_ids(llm, prompts) == expected
    finally:
        llm.shutdown()
