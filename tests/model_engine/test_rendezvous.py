"""The rendezvous store and the worker group, without a model (gloo on CPU).

Port 0 bound before spawning: many engines starting together never collide. A fixed
port that is taken fails fast with a message naming it. After shutdown the port is
free and no rank process is left. Two "nodes" over loopback get the right ranks. A
rank that raises is reported by rank with its exception.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from atom.model_engine.rendezvous import PortInUseError, Rendezvous, RendezvousError
from atom.model_engine.workers import WorkerFailedError, WorkerGroup
from tests.model_engine.rendezvous_probe import failing_probe, layout_probe

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def port_is_bindable(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def test_port_zero_reads_the_bound_port_back():
    with Rendezvous.start(world_size=2) as rendezvous:
        assert rendezvous.spec.port > 0
        assert not port_is_bindable(rendezvous.spec.port)  # held from now on
        client = dist.TCPStore("127.0.0.1", rendezvous.spec.port, is_master=False)
        client.set("hello", b"world")
        assert rendezvous.store.get("hello") == b"world"
        del client
    assert rendezvous.store is None


def start_probes(argvs: list[list[str]], go_file) -> list[subprocess.Popen]:
    """Start one probe process per argv; release them together once all imported torch."""
    env = dict(os.environ, PYTHONPATH=REPO)
    probes = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.model_engine.rendezvous_probe", "--go-file", go_file]
            + argv,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for argv in argvs
    ]
    for probe in probes:
        assert probe.stdout.readline().strip() == "imported"
    open(go_file, "w").close()
    return probes


def probe_results(probes: list[subprocess.Popen]) -> list[dict]:
    results = []
    for probe in probes:
        out, err = probe.communicate(timeout=240)
        assert probe.returncode == 0, err[-3000:]
        assert "EADDRINUSE" not in err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_eight_engines_started_at_once_all_come_up(tmp_path):
    """8 engine stand-ins bind port 0 at the same instant, each with 2 ranks all-reducing."""
    results = probe_results(start_probes([[] for _ in range(8)], str(tmp_path / "go")))
    began = [r["began"] for r in results]
    assert max(began) - min(began) < 1.0  # really together
    assert len({r["port"] for r in results}) == 8
    for result in results:
        assert [info["sum"] for info in result["infos"]] == [3.0, 3.0]  # 1 + 2
        assert not any(pid_alive(pid) for pid in result["pids"])


def test_taken_fixed_port_fails_fast_with_a_clear_message():
    with Rendezvous.start(world_size=2) as holder:
        port = holder.spec.port
        start = time.monotonic()
        with pytest.raises(PortInUseError) as caught:
            Rendezvous.start(world_size=2, master_port=port)
        assert time.monotonic() - start < 5.0
    message = str(caught.value)
    assert str(port) in message and "already in use" in message
    assert "--master-port" in message


def test_multi_node_needs_a_fixed_port():
    with pytest.raises(RendezvousError, match="fixed --master-port"):
        Rendezvous.start(world_size=2, nnodes=2)


def test_shutdown_frees_the_port_and_leaves_no_rank():
    rendezvous = Rendezvous.start(world_size=2)
    port = rendezvous.spec.port
    group = WorkerGroup(layout_probe, rendezvous)
    assert [info["sum"] for info in group.wait_ready()] == [3.0, 3.0]
    pids = group.pids
    group.shutdown()
    assert [p.exitcode for p in group.processes] == [0, 0]  # stopped when asked
    assert not any(pid_alive(pid) for pid in pids)
    # The port can be bound again at once, as a fixed rendezvous port.
    with Rendezvous.start(world_size=2, master_port=port) as again:
        assert again.spec.port == port


def test_two_nodes_over_loopback_get_the_right_ranks(tmp_path):
    """Two "node" processes: node 0 hosts the store at a fixed port, node 1 joins it as a
    client; each runs 2 ranks, which must be 0, 1 on node 0 and 2, 3 on node 1."""
    with Rendezvous.start(world_size=2) as scout:  # a port that is free right now
        port = scout.spec.port
    common = ["--world-size", "4", "--nnodes", "2", "--port", str(port)]
    probes = start_probes(
        [common + ["--node-rank", "0"], common + ["--node-rank", "1"]], str(tmp_path / "go")
    )
    node0, node1 = probe_results(probes)
    assert node0["port"] == node1["port"] == port
    infos = node0["infos"] + node1["infos"]
    assert [info["rank"] for info in infos] == [0, 1, 2, 3]
    assert all(info["sum"] == 10.0 for info in infos)  # 1 + 2 + 3 + 4
    pids = node0["pids"] + node1["pids"]
    expected = [[0, 0, 0, pids[0]], [1, 0, 1, pids[1]], [2, 1, 0, pids[2]], [3, 1, 1, pids[3]]]
    assert all(info["layout"] == expected for info in infos)


def test_a_rank_that_raises_is_named_with_its_error():
    group = WorkerGroup(failing_probe, Rendezvous.start(world_size=2), args=(1,))
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as caught:
        group.wait_ready()
    assert time.monotonic() - start < 30
    error = caught.value
    assert error.rank == 1
    assert "ValueError: probe failure on rank 1" in str(error)
    assert not any(pid_alive(pid) for pid in group.pids)
    with pytest.raises(WorkerFailedError):  # the group stays failed
        group.send(b"step")
