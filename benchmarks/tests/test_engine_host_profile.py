"""`python -m benchmarks.engine_host_profile` at a toy shape."""

from __future__ import annotations

import gc


def test_engine_host_profile_smoke(capsys):
    """`python -m benchmarks.engine_host_profile` at a toy shape: every phase of both
    cases, the logprob conversion only with the options, the heap's freeze undone."""
    import json

    from benchmarks import engine_host_profile

    frozen = gc.get_freeze_count()
    argv = ["--device", "cpu", "--batch", "4", "--vocab", "512", "--prompt-len", "8"]
    assert engine_host_profile.main([*argv, "--decode-len", "4"]) == 0
    records = {}
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            records[record["case"]] = record
    plain, options = records["plain"], records["with_options"]
    for record in (plain, options):
        assert record["decode_steps"] >= 2
        assert set(record["phases"]) == set(engine_host_profile.PHASES)
        assert all("ops" in p and "sync_ops" in p for p in record["phases"].values())
    assert plain["phases"]["logprobs"]["ms"] == 0 < options["phases"]["logprobs"]["ms"]
    assert "extra_ms_by_phase" in records["summary"]
    assert gc.get_freeze_count() == frozen
