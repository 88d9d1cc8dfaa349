"""Two source trees of atom in one run: the offline throughput workload (256 prompts) and
batch-1 decode, each tree in its own process, alternated (before, after, before, after...)
so that the machine's drift falls on both.

    git archive <commit> | tar -x -C /tmp/before      # the tree to compare against
    python -m benchmarks.before_after /tmp/before . --rounds 2

Prints one JSON line per run and a summary line with each tree's median and the ratio
after / before (a refactor's acceptance: within noise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.harness import emit


def run_tree(tree: Path, extra: list[str]) -> dict[str, float]:
    """{case: output tok/s} of one `benchmarks.offline_throughput --skip-hf` run in `tree`."""
    env = dict(os.environ, PYTHONPATH=f"{tree}:{os.environ.get('PYTHONPATH', '')}")
    command = [sys.executable, "-m", "benchmarks.offline_throughput", "--skip-hf", *extra]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"offline_throughput failed in {tree} (exit {done.returncode})")
    figures = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("engine") == "atom" and "output_tok_s" in record:
                figures[record["case"]] = record["output_tok_s"]
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, help="the tree to compare against")
    parser.add_argument("after", type=Path, help="the tree under test")
    parser.add_argument("--rounds", type=int, default=2, help="before/after pairs")
    parser.add_argument("extra", nargs="*", help="arguments for offline_throughput (after --)")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for round_ in range(args.rounds):
        for label in ("before", "after"):
            tree = getattr(args, label).resolve()
            figures = run_tree(tree, args.extra)
            runs[label].append(figures)
            emit(tree=label, round=round_, **figures)
    summary = {}
    for case in runs["after"][0]:
        before = statistics.median(r[case] for r in runs["before"])
        after = statistics.median(r[case] for r in runs["after"])
        summary[case] = dict(before=before, after=after, ratio=round(after / before, 3))
    emit(case="summary", **summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
