"""CPU map of DeepSeek-V4.1's batch-1 decode: kernels per layer, grouped by the code that
launches them (issue 32, item 4), modelled on benchmarks/deepseek_v4_kernel_map.py.

    python -m benchmarks.deepseek_v41_kernel_map [--model tiny-minimal] [--top 12] [--torch-path]

Loads a V4.1 reference checkpoint (../shared/reference/deepseek_v41/<model>, README there),
prefills a 40-token prompt and profiles one batch-1 decode step on the CPU. What counts as a
kernel, and the cost of the interpreted CUDA path (`TRITON_INTERPRET=1
ATOM_INTERPRET_CUDA_PATH=1`, set by the V4 map's import before Triton loads), are as in the
V4 map, whose profiler and counting this reuses. `--torch-path` is light.
One JSON line per layer and one for the rest of the step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.deepseek_v4_kernel_map import emit_map, profile_decode  # sets the interpreter flags

REFERENCE = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "deepseek_v41"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-minimal", choices=["tiny-minimal", "tiny-full"])
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--top", type=int, default=12, help="sources printed per layer")
    parser.add_argument("--torch-path", action="store_true", help="map the CPU references")
    args = parser.parse_args(argv)
    path = REFERENCE / args.model
    if not (path / "config.json").is_file():
        parser.error(f"no V4.1 reference checkpoint at {path} (../shared beside the checkout)")
    layer_types = json.loads((path / "config.json").read_text())["layer_types"]
    ranges = profile_decode(str(path), args.prompt_len)
    emit_map(ranges, layer_types, args.torch_path, args.top, model=args.model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
