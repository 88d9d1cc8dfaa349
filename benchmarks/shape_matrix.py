"""The batch-1 shape matrix: defaults against every fusion off, per model shape (issue 30).

    python -m benchmarks.offline_throughput --shapes               # every shape
    python -m benchmarks.offline_throughput --shapes llama-3.1-8b qwen2.5-7b

For each shape of benchmarks/model_shapes.py (random bf16 weights, CUDA graphs of
batch 1, a 128-token prompt; decode_profile.measure's method) one engine measures the
defaults and every fusion off, twice each, and prints one table: tok/s, their ratio, each
one's fraction of the weight-read limit (weight bytes over the streaming read measured at
the start of the same run), and how many batch-1 GEMV sites the GEMV policy
(atom/kernels/gemv_policy.py) gave the Triton kernel, with its per-site report.
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile

import torch

from atom.fusions import Fusions
from benchmarks.decode_profile import (
    build_engine,
    emit,
    measure,
    policy_record,
    print_policy,
    selected_shapes,
)

MATRIX_CONFIGS = ("all_off", "default", "all_off_end", "default_end")


def run_matrix(args, bandwidth: dict) -> None:
    """Each shape's batch-1 decode with the defaults and with every fusion off, twice each
    in the order of MATRIX_CONFIGS (the machine's drift), in one engine per shape; then one
    table: tok/s of each (the mean of its two), their ratio, and each one's fraction of the
    weight-read limit (the streaming read measured at the start of this run)."""
    from atom.kernels import gemv_policy
    from benchmarks.model_shapes import hf_config

    rows = []
    for name in selected_shapes(args.shapes):
        shape, config = f"{name}-shape", hf_config(name)
        gemv_policy.set_policy(None)  # a fresh policy (the disk cache stays): its report
        fusions = {"all_off": Fusions.none(), "default": Fusions.from_env()}
        records = {}
        with tempfile.TemporaryDirectory() as model_dir:
            config.save_pretrained(model_dir)
            llm = build_engine(model_dir, args, fusions["default"])
            for label in MATRIX_CONFIGS:
                record = measure(llm, shape, fusions[label.removesuffix("_end")], args, bandwidth)
                record["config"] = label
                if label == "default":
                    record.update(policy_record())
                emit(record)
                records[label] = record
            llm.engine.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        print_policy(shape, records["default"]["gemv_policy"])
        rows.append(matrix_row(name, records))
        emit(dict(case="shape_matrix_row", **rows[-1]))
    print_matrix(rows)


def matrix_row(name: str, records: dict) -> dict:
    def mean(label: str, key: str) -> float:
        return statistics.mean(records[k][key] for k in (label, f"{label}_end"))

    default_ms, off_ms = (
        mean("default", "decode_ms_per_step"),
        mean("all_off", "decode_ms_per_step"),
    )
    limit_ms = records["default"]["weight_read_limit_ms"]
    return dict(
        shape=name,
        default_tok_s=round(1e3 / default_ms, 1),
        all_off_tok_s=round(1e3 / off_ms, 1),
        default_over_all_off=round(off_ms / default_ms, 3),
        default_of_limit=round(limit_ms / default_ms, 3),
        all_off_of_limit=round(limit_ms / off_ms, 3),
        read_limit_tok_s=round(1e3 / limit_ms, 1),
        weight_gb=round(records["default"]["weight_bytes"] / 1e9, 2),
        gemv_sites_fused=f"{records['default']['gemv_sites_fused']}/"
        f"{records['default']['gemv_sites']}",
    )


def print_matrix(rows: list[dict]) -> None:
    print("\nbatch-1 decode, defaults vs every fusion off (tok/s: mean of two windows sets; "
          "of limit: weight-read limit / step time)", file=sys.stderr)  # fmt: skip
    head = ("shape", "default", "all-off", "ratio", "def/lim", "off/lim", "limit", "GEMVs fused")
    print(f"{head[0]:<15}" + "".join(f"{h:>12}" for h in head[1:]), file=sys.stderr)
    for r in rows:
        print(f"{r['shape']:<15}{r['default_tok_s']:>12.0f}{r['all_off_tok_s']:>12.0f}"
              f"{r['default_over_all_off']:>12.3f}{r['default_of_limit']:>12.2f}"
              f"{r['all_off_of_limit']:>12.2f}{r['read_limit_tok_s']:>12.0f}"
              f"{r['gemv_sites_fused']:>12}", file=sys.stderr)  # fmt: skip
