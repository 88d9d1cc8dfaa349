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
import sys
from collections import Counter
from pathlib import Path

from benchmarks.deepseek_v4_kernel_map import profile_decode  # sets the interpreter flags
from benchmarks.harness import emit

REFERENCE = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "deepseek_v41"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-minimal", choices=["tiny-minimal", "tiny-full"])
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--top", type=int, default=12, help="sources printed per layer")
    parser.add_argument("--torch-path", action="store_true", help="map the CPU references")
    args = parser.parse_args(argv)
    path = REFERENCE / args.model
    layer_types = json.loads((path / "config.json").read_text())["layer_types"]
    ranges = profile_decode(str(path), args.prompt_len)
    path_name = "torch" if args.torch_path else "cuda (interpreted)"
    names = [f"layer{i}" for i in range(len(layer_types))] + ["outside"]
    for name in names:
        counts = ranges.get(name, Counter())
        triton = sum(v for k, v in counts.items() if k.endswith("[triton]"))
        by_source = Counter()
        for key, value in counts.items():
            by_source[key.rsplit(" [", 1)[0]] += value
        kind = layer_types[int(name[5:])] if name != "outside" else "rest of the step"
        emit(case="kernel_map", model=args.model, path=path_name, range=name, layer_type=kind,
             kernels=sum(counts.values()), triton=triton, torch=sum(counts.values()) - triton,
             by_source=dict(by_source.most_common(args.top)))  # fmt: skip
        print(f"{name} ({kind}): {sum(counts.values())} kernels ({triton} Triton)", file=sys.stderr)
        for key, value in counts.most_common(args.top):
            print(f"  {value:4d}  {key}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
