"""Tensor parallelism on CPU (gloo, 2 spawned ranks): TP=2 generates what TP=1 does.

Also: the step messages keep every rank's mirror equal to the engine's batches (checked
in-process, step by step), a model that does not split fails before anything is
spawned, a killed rank is reported by rank with no process left behind, and two
"nodes" over loopback serve one engine. Tiny models and few tokens: the test machine
has 2 cores.
"""

import multiprocessing
import os
import pickle
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from atom.distributed import ShardingError
from atom.model_engine.llm import LLM
from atom.model_engine.rendezvous import PortInUseError, Rendezvous
from atom.model_engine.sequence import FinishReason
from atom.model_engine.step_messages import SequenceMirror, StepEncoder
from atom.model_engine.workers import WorkerFailedError
from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def all_gone(pids, timeout_s: float = 5.0) -> bool:
    """Every pid has exited within `timeout_s` (helpers such as a node's multiprocessing
    resource tracker leave a moment after their parent)."""
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def runner_pids(llm) -> list[int]:
    return llm.engine.model_runner.workers.pids


def token_ids(llm, prompts, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama3"])
def test_greedy_tp2_equals_tp1(tiny_model_dirs, kind):
    """llama: GQA (4 heads, 2 KV heads -> 2 and 1 per rank); qwen2: qkv bias; llama3:
    tied embeddings (the LM head shares the vocab-parallel embedding's shard)."""
    prompts = random_prompts(0, [1, 7, 33, 70])
    expected = token_ids(build_llm(tiny_model_dirs[kind]), prompts)
    llm = build_llm(tiny_model_dirs[kind], tensor_parallel_size=2)
    try:
        assert token_ids(llm, prompts) == expected
    finally:
        llm.shutdown()
    assert not any(pid_alive(pid) for pid in runner_pids(llm))


def test_chunked_prefill_preemption_prefix_cache_async(tiny_model_dirs):
    """Every path of the step messages at once: chunks, preemption and re-admission,
    prefix-cache hits, placeholders filled on every rank (asynchronous scheduling), two
    micro-batches and a seeded sampled request, against TP=1 with the same settings."""
    settings = dict(
        max_num_batched_tokens=16,
        max_num_seqs=4,
        num_kvcache_blocks=9,
        async_scheduling=True,
        num_micro_batches=2,  # two runner slots per rank, each with its own page table
    )
    shared = random_prompts(3, [40])[0]
    prompts = [shared + [7, 8], shared + [9]] + random_prompts(4, [30, 44])
    params = [GREEDY] * 3 + [SamplingParams(temperature=0.8, seed=11, max_tokens=12)]
    single = build_llm(tiny_model_dirs["llama"], **settings)
    expected = token_ids(single, prompts, params)
    llm = build_llm(tiny_model_dirs["llama"], tensor_parallel_size=2, **settings)
    try:
        assert token_ids(llm, prompts, params) == expected
        engine = llm.engine
        assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.prefix_hit_blocks > 0
    finally:
        llm.shutdown()


class MirrorCheckingRunner:
    """Wraps a TP=1 engine's ModelRunner: each batch also goes through StepEncoder ->
    pickle -> SequenceMirror, and the mirrored batch must equal the engine's."""

    def __init__(self, inner):
        self.inner = inner
        self.num_kvcache_blocks = inner.num_kvcache_blocks
        self.encoder = StepEncoder()
        self.mirror = SequenceMirror()
        self.message_sizes = []  # (num_seqs, is_decode, pickled bytes)

    def launch(self, batch):
        payload = pickle.dumps(self.encoder.encode(batch), protocol=pickle.HIGHEST_PROTOCOL)
        self.message_sizes.append((len(batch.seqs), batch.is_decode_only, len(payload)))
        mirrored = self.mirror.apply(pickle.loads(payload))
        assert mirrored.num_new_tokens == batch.num_new_tokens
        assert mirrored.num_decodes == batch.num_decodes
        for mine, theirs in zip(mirrored.seqs, batch.seqs, strict=True):
            assert mine.seq_id == theirs.seq_id
            assert mine.token_ids == theirs.token_ids
            assert mine.num_computed_tokens == theirs.num_computed_tokens
            assert mine.block_table == theirs.block_table
            assert mine.pending_token == theirs.pending_token
            assert mine.block_version == theirs.block_version
        assert (mirrored.layout, mirrored.step) == (batch.layout, batch.step)
        in_batch = {s.seq_id for s in batch.seqs}
        assert [s.seq_id for s in mirrored.grown] == [
            s.seq_id for s in batch.grown if s.seq_id in in_batch
        ]
        handle = self.inner.launch(batch)
        self.mirror.on_launch(mirrored)
        return _RecordingHandle(handle, self.encoder, batch)


class _RecordingHandle:
    def __init__(self, handle, encoder, batch):
        self.handle, self.encoder, self.batch = handle, encoder, batch

    def result(self):
        tokens = self.handle.result()
        self.encoder.record_sampled(self.batch, tokens)
        return tokens

    def logprobs(self):
        return self.handle.logprobs()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_messages_keep_the_mirror_equal_to_the_engine(tiny_model_dirs, async_scheduling):
    llm = build_llm(
        tiny_model_dirs["llama"],
        max_num_batched_tokens=24,
        max_num_seqs=6,
        num_kvcache_blocks=12,
        async_scheduling=async_scheduling,
    )
    checker = MirrorCheckingRunner(llm.engine.model_runner)
    llm.engine.model_runner = checker
    shared = random_prompts(5, [33])[0]
    prompts = [shared + [1], shared + [2, 3]] + random_prompts(6, [50, 20, 9, 64, 3])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = llm.engine
    for prompt in prompts:
        engine.add_request(prompt, params)
    aborted = False
    while engine.has_unfinished():
        engine.step()
        if not aborted and engine.stats.steps == 6:  # an abort mid-flight leaves the mirror
            aborted = engine.abort(next(iter(engine.requests)))
    assert aborted and engine.scheduler.num_preemptions > 0
    # A decode step's message carries ids, counts and new tokens, never whole block tables:
    # its size depends on the number of sequences, not on how long they have grown.
    decodes = [(seqs, size) for seqs, is_decode, size in checker.message_sizes if is_decode]
    assert decodes and all(size <= 400 + 40 * seqs for seqs, size in decodes), decodes
    llm.engine.model_runner = checker.inner


def test_model_that_does_not_split_fails_before_spawning(tiny_model_dirs):
    before = set(multiprocessing.active_children())
    start = time.monotonic()
    with pytest.raises(ShardingError, match="num_key_value_heads \\(2\\).*tensor_parallel_size 4"):
        LLM(tiny_model_dirs["llama"], device="cpu", tensor_parallel_size=4)
    assert time.monotonic() - start < 30
    assert set(multiprocessing.active_children()) == before


def test_taken_fixed_port_fails_before_spawning(tiny_model_dirs):
    """The engine binds its store before any rank exists: a taken --master-port is a
    PortInUseError naming the port within 5 s, with no process started."""
    before = set(multiprocessing.active_children())
    with Rendezvous.start(world_size=2) as other_engine:
        port = other_engine.spec.port
        start = time.monotonic()
        with pytest.raises(PortInUseError, match=f"port {port}.*--master-port"):
            LLM(tiny_model_dirs["llama"], device="cpu", tensor_parallel_size=2, master_port=port)
        assert time.monotonic() - start < 5.0
    assert set(multiprocessing.active_children()) == before


def test_killed_rank_is_reported_and_everything_stops(tiny_model_dirs):
    """SIGKILL one rank mid-generation: the engine names rank 1 and SIGKILL, stops rank 0
    too, leaves no process behind, frees the rendezvous port, and does not hang."""
    llm = LLM(
        tiny_model_dirs["llama"],
        device="cpu",
        tensor_parallel_size=2,
        kv_cache_memory_bytes=16 << 20,
        skip_tokenizer_init=True,
    )
    runner = llm.engine.model_runner
    pids, port = runner.workers.pids, runner.port
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    seqs = [engine.requests[engine.add_request(p, params)] for p in random_prompts(8, [5, 9, 17])]
    for _ in range(3):
        engine.step()
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as caught:
        for _ in range(100):
            engine.step()
    assert time.monotonic() - start < 30
    error = caught.value
    assert error.rank == 1 and "SIGKILL" in str(error), str(error)
    assert not any(pid_alive(pid) for pid in pids)
    # The requests of the lost steps end with reason "error", without placeholder tokens.
    assert all(s.finish_reason == FinishReason.ERROR and -1 not in s.token_ids for s in seqs)
    late = engine.add_request(random_prompts(9, [4])[0], params)
    with pytest.raises(WorkerFailedError):  # the engine stays failed, it does not hang
        engine.step()
    engine.abort(late)
    llm.shutdown()  # idempotent
    with Rendezvous.start(world_size=2, master_port=port) as again:  # the port is free
        assert again.spec.port == port


def start_node1(model: str, port: int) -> subprocess.Popen:
    """Node-rank 1 of a 2-node, 2-rank run: the offline script with --node-rank 1."""
    return subprocess.Popen(
        [sys.executable, "-m", "atom.examples.simple_inference", "--model", model]
        + ["--device", "cpu", "-tp", "2", "--nnodes", "2", "--master-port", str(port)]
        + ["--node-rank", "1"],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def free_port() -> int:
    with socket.socket() as scout:
        scout.bind(("127.0.0.1", 0))
        return scout.getsockname()[1]


def node0_llm(model: str, port: int):
    return LLM(
        model,
        device="cpu",
        tensor_parallel_size=2,
        nnodes=2,
        master_port=port,
        distributed_timeout_s=120,
        kv_cache_memory_bytes=16 << 20,
        skip_tokenizer_init=True,
    )


def test_two_nodes_over_loopback_serve_one_engine(tiny_model_dirs):
    """Node 1 (a separate process) hosts rank 1 and receives the step messages through the
    store; node 0 runs the engine and rank 0. Node 1 stops when node 0 shuts down."""
    model = tiny_model_dirs["llama"]
    prompts = random_prompts(9, [3, 21])
    expected = token_ids(build_llm(model), prompts)
    port = free_port()
    node1 = start_node1(model, port)
    try:
        llm = node0_llm(model, port)
        try:
            assert token_ids(llm, prompts) == expected
        finally:
            llm.shutdown()
        out, err = node1.communicate(timeout=60)
        assert node1.returncode == 0, err[-3000:]
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_killed_remote_rank_is_named_on_both_nodes(tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    port = free_port()
    node1 = start_node1(model, port)
    try:
        llm = node0_llm(model, port)
        engine = llm.engine
        engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=500))
        for _ in range(3):
            engine.step()
        with open(f"/proc/{node1.pid}/task/{node1.pid}/children") as children:
            pids = [int(pid) for pid in children.read().split()]
        ranks = [
            pid
            for pid in pids
            if b"resource_tracker" not in open(f"/proc/{pid}/cmdline", "rb").read()
        ]
        assert len(ranks) == 1
        os.kill(ranks[0], signal.SIGKILL)
        with pytest.raises(WorkerFailedError) as caught:
            for _ in range(100):
                engine.step()
        assert caught.value.rank == 1 and "SIGKILL" in caught.value.reason, str(caught.value)
        out, err = node1.communicate(timeout=30)
        assert node1.returncode == 2 and "rank 1" in err and "SIGKILL" in err, err[-3000:]
        assert all_gone(pids + runner_pids(llm))
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_tp2_equals_tp1_in_fp32(tiny_model_dirs):
    """NCCL, one GPU per rank (cuda:0, cuda:1); fp32 so both sizes agree token for token."""
    prompts = random_prompts(10, [1, 9, 40, 129])
    kwargs = dict(device="cuda", dtype="float32", num_kvcache_blocks=1024, max_num_seqs=8)
    expected = token_ids(build_llm(tiny_model_dirs["llama"], **kwargs), prompts)
    llm = build_llm(tiny_model_dirs["llama"], tensor_parallel_size=2, **kwargs)
    try:
        assert token_ids(llm, prompts) == expected
    finally:
        llm.shutdown()
