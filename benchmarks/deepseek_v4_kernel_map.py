"""CPU map of DeepSeek-V4's batch-1 decode: kernels per layer, grouped by the code that
launches them (issue 32: "use torch.profiler's kernel list as the map").

    python -m benchmarks.deepseek_v4_kernel_map [--hc-mult 4] [--top 12] [--torch-path]

Builds a tiny random V4 (one CSA, one HCA and one sliding layer, fp32, HF `save_pretrained`
so atom loads it as a checkpoint), prefills a 40-token prompt and profiles one batch-1
decode step on the CPU. The CUDA path runs under Triton's interpreter
(`TRITON_INTERPRET=1 ATOM_INTERPRET_CUDA_PATH=1`, set here before anything imports Triton;
`--torch-path` maps the plain-CPU torch references instead).

What counts as a kernel (what the step would launch on a GPU):
- a Triton launch: one kernel (torch ops the interpreter runs inside it are not counted);
- a torch op with no torch op under it that is not a view, an allocation or a no-op
  (`aten::mm`, `aten::add`, `aten::copy_` of `.to(dtype)`, ...).
Cost: the profiler's Python stacks (``with_stack``, for the sources) would also record every
call inside the interpreted kernels (over 20 GB); each interpreted launch runs on a thread
the profiler does not trace, so a step takes under a minute and about 0.6 GB.
One JSON line per layer (`kernels`, `triton`, `torch`, `by_source`: source function ->
kernels) and one for the rest of the step (embedding, head, LM head, sampler).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from collections import Counter, defaultdict

if "--torch-path" not in sys.argv:  # before Triton is imported: jit reads it at decoration
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["ATOM_INTERPRET_CUDA_PATH"] = "1"

import torch  # noqa: E402

from benchmarks.harness import emit  # noqa: E402

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

# torch ops that launch nothing on a GPU: views, allocations, metadata, no-op casts.
NO_KERNEL = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::expand",
    "aten::select", "aten::slice", "aten::transpose", "aten::permute", "aten::unsqueeze",
    "aten::squeeze", "aten::t", "aten::split", "aten::split_with_sizes", "aten::unbind",
    "aten::chunk", "aten::narrow", "aten::detach", "aten::alias", "aten::empty",
    "aten::empty_like", "aten::empty_strided", "aten::resolve_conj", "aten::resolve_neg",
    "aten::_unsafe_view", "aten::lift_fresh", "aten::to", "aten::contiguous", "aten::flatten",
    "aten::unflatten", "aten::view_as", "aten::expand_as", "aten::numpy_T", "aten::result_type",
    "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense", "aten::set_",
    "aten::movedim", "aten::_has_compatible_shallow_copy_type", "aten::diagonal",
    "aten::dim", "aten::size", "aten::stride", "aten::unfold", "aten::broadcast_tensors",
    "aten::align_to", "aten::_unsafe_split", "aten::unsafe_split", "aten::lift",
}  # fmt: skip
INIT = {"aten::fill_", "aten::zero_"}  # a reduction's output fill on the CPU


def tiny_v4(hc_mult: int) -> dict:
    return dict(
        vocab_size=320, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4,
        head_dim=32, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=8,
        partial_rotary_factor=0.25, hc_sinkhorn_iters=20, hc_mult=hc_mult, o_groups=2,
        o_lora_rank=8, index_n_heads=8, index_head_dim=16, index_topk=4,
        max_position_embeddings=512, num_hidden_layers=3, layer_types=[CSA, HCA, SWA],
        mlp_layer_types=["hash_moe", "moe", "moe"], compress_rates={CSA: 4, HCA: 16},
        sliding_window=8, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def save_model(path: str, hc_mult: int) -> list[str]:
    import transformers

    torch.manual_seed(0)
    config = transformers.DeepseekV4Config(**tiny_v4(hc_mult))
    transformers.DeepseekV4ForCausalLM(config).save_pretrained(path)
    return list(config.layer_types)


def _source(event) -> str:
    """The innermost atom frame above an op ("atom/models/deepseek_v4.py:mixes")."""
    for ancestor in _ancestors(event):
        if "atom/" in ancestor.name and "(" in ancestor.name:
            path, _, function = ancestor.name.partition(": ")
            return f"atom/{path.split('atom/', 1)[-1].split('(')[0]}:{function}"
    return "?"


def _launches(event) -> int:
    """Kernels a torch op stands for on a GPU: those of its children, or one when none of
    them launches (an output fill under a reduction is the CPU's, not a kernel)."""
    inner = sum(
        _launches(child)
        for child in event.cpu_children
        if child.name.startswith("aten::") and child.name not in INIT
    )
    if event.name in NO_KERNEL or inner:
        return inner
    return 1


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def kernel_map(events) -> dict[str, Counter]:
    """Per range ("layer<i>" or "outside"): "source [op]" -> kernels."""
    ranges: dict[str, Counter] = defaultdict(Counter)
    for event in events:
        triton = event.name.startswith("triton:")
        if not triton and not event.name.startswith("aten::"):
            continue
        names = [a.name for a in _ancestors(event)]
        if "decode_step" not in names or any(n.startswith(("triton:", "aten::")) for n in names):
            continue  # inside an interpreted launch or another op (counted there)
        count = 1 if triton else _launches(event)
        if count:
            layer = next((n for n in names if n.startswith("layer")), "outside")
            op = "triton" if triton else event.name
            ranges[layer][f"{_source(event) if not triton else event.name} [{op}]"] += count
    return ranges


def profile_decode(path: str, prompt_len: int):
    import triton.runtime.interpreter as interpreter

    from atom.model_engine.llm import LLM
    from atom.sampling_params import SamplingParams

    llm = LLM(path, device="cpu", skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20,
              max_model_len=256, max_num_seqs=1)  # fmt: skip
    engine = llm.engine
    engine.add_request(list(range(3, 3 + prompt_len)), SamplingParams(temperature=0.0,
                       max_tokens=8, ignore_eos=True))  # fmt: skip
    while engine.scheduler.waiting or any(
        s.num_uncomputed_tokens > 1 for s in engine.scheduler.running
    ):
        engine.step()
    engine.step()  # one decode step outside the profile (first-call work)

    open_ranges = []

    def enter(name):
        record = torch.profiler.record_function(name)
        record.__enter__()
        open_ranges.append(record)

    def leave(*_):
        open_ranges.pop().__exit__(None, None, None)

    layers = engine.model_runner.model.model.layers
    hooks = []
    for index, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda *_, i=index: enter(f"layer{i}")))
        hooks.append(layer.register_forward_hook(leave))
    run = interpreter.InterpretedFunction.run

    def traced_run(self, *args, **kwargs):
        # The interpreted launch runs on a thread of its own, started after the profiler:
        # its Python calls are not traced (tracing them took over 24 GB for V4.1's map), and
        # its torch ops have no `decode_step` range above them, so none is counted (as before,
        # when the `triton:` range above them excluded them).
        result = []
        with torch.profiler.record_function(f"triton:{self.fn.__name__}"):
            worker = threading.Thread(target=lambda: result.append(run(self, *args, **kwargs)))
            worker.start()
            worker.join()
        if not result:
            raise RuntimeError(f"interpreted launch of {self.fn.__name__} failed (see above)")
        return result[0]

    interpreter.InterpretedFunction.run = traced_run
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    with_stack=True) as prof:  # fmt: skip
            with torch.profiler.record_function("decode_step"):
                engine.step()
    finally:
        interpreter.InterpretedFunction.run = run
        for hook in hooks:
            hook.remove()
    while engine.has_unfinished():
        engine.step()
    return kernel_map(prof.events())


def emit_map(ranges: dict[str, Counter], layer_types: list[str], torch_path: bool, top: int,
             **fields) -> None:  # fmt: skip
    """One JSON line per layer and one for the rest of the step (with ``fields``), and the
    costliest ``top`` sources of each on stderr."""
    path_name = "torch" if torch_path else "cuda (interpreted)"
    names = [f"layer{i}" for i in range(len(layer_types))] + ["outside"]
    for name in names:
        counts = ranges.get(name, Counter())
        triton = sum(v for k, v in counts.items() if k.endswith("[triton]"))
        by_source = Counter()
        for key, value in counts.items():
            by_source[key.rsplit(" [", 1)[0]] += value
        kind = layer_types[int(name[5:])] if name != "outside" else "rest of the step"
        emit(case="kernel_map", **fields, path=path_name, range=name, layer_type=kind,
             kernels=sum(counts.values()), triton=triton, torch=sum(counts.values()) - triton,
             by_source=dict(by_source.most_common(top)))  # fmt: skip
        print(f"{name} ({kind}): {sum(counts.values())} kernels ({triton} Triton)", file=sys.stderr)
        for key, value in counts.most_common(top):
            print(f"  {value:4d}  {key}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hc-mult", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--top", type=int, default=12, help="sources printed per layer")
    parser.add_argument("--torch-path", action="store_true", help="map the CPU references")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as path:
        layer_types = save_model(path, args.hc_mult)
        ranges = profile_decode(path, args.prompt_len)
    emit_map(ranges, layer_types, args.torch_path, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
