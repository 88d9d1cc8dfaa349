"""`LLM`: offline batch generation over one engine, or data-parallel replicas of it.

Its own module: it picks the engine through `data_parallel.build_engine`, which builds on
llm_engine.py, so neither of those imports the other back.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from atom import profiling
from atom.config import Config
from atom.gc_heap import frozen_heap
from atom.model_engine.data_parallel import build_engine
from atom.model_engine.llm_engine import RequestOutput
from atom.sampling_params import SamplingParams


class LLM:
    """Offline batch generation: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, **kwargs):
        config = kwargs.pop("config", None) or Config(model=model, **kwargs)
        self.engine = build_engine(config)  # replicas when data_parallel_size > 1
        self.tokenizer = self.engine.tokenizer
        self._profiler: profiling.TraceRecorder | None = None

    @classmethod
    def from_config(cls, config: Config) -> LLM:
        return cls(config=config)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def start_profile(self) -> None:
        """Record a torch.profiler trace (with `ATOM::<stage>` annotations) from now on."""
        directory = self.engine.config.profiler_dir
        if not directory:
            raise ValueError(
                "profiling needs a trace directory: set ATOM_TORCH_PROFILER_DIR or "
                "Config.profiler_dir (the offline script: --profile DIR)"
            )
        if self._profiler is None:
            self._profiler = profiling.TraceRecorder(directory)
        self._profiler.start()

    def stop_profile(self):
        """Stop recording; returns the path of the Chrome trace written."""
        if self._profiler is None:
            raise RuntimeError("profiling is not running; call start_profile() first")
        return self._profiler.stop()

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        engine = self.engine
        seqs = []
        # n > 1: samples 1.. of a prompt join once sample 0 has its first token, so its
        # prompt blocks are in the prefix cache and they share them (parent index -> rest).
        later: dict[int, list[tuple[int, str | list[int], SamplingParams]]] = {}
        try:
            for prompt, params in zip(prompts, sampling_params, strict=True):
                index = len(seqs)
                seqs.append(engine.requests[engine.add_request(prompt, params.for_sample(0))])
                seqs.extend([None] * (params.n - 1))
                if params.n > 1:
                    later[index] = [(index + i, prompt, params.for_sample(i)) for i in range(1, params.n)]  # fmt: skip
        except Exception:
            for seq in seqs:  # a bad prompt refuses the whole call; leave nothing queued
                if seq is not None:
                    engine.abort(seq.seq_id)
            raise
        bar = tqdm(
            total=len(seqs), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True
        )
        try:
            with frozen_heap():  # collections while it steps skip the engine's own heap
                self._run_steps(seqs, later, bar)
        finally:
            bar.close()
            for seq in seqs:
                if seq is not None and not seq.is_finished:
                    engine.abort(seq.seq_id)
        results, start = [], 0
        for params in sampling_params:
            group = [engine.output_of(s) for s in seqs[start : start + params.n]]
            if params.n > 1:
                group[0].outputs = group
            results.append(group[0])
            start += params.n
        return results

    def _run_steps(self, seqs: list, later: dict, bar) -> None:
        """Step the engine until every sample of `seqs` has finished (LLM.generate)."""
        engine = self.engine
        start, generated = time.perf_counter(), 0
        while any(s is None or not s.is_finished for s in seqs):
            for parent in [i for i in later if seqs[i].num_emitted_tokens or seqs[i].is_finished]:
                for index, prompt, params in later.pop(parent):
                    seqs[index] = engine.requests[engine.add_request(prompt, params)]
            outputs = engine.step()
            generated += sum(len(o.new_token_ids) for o in outputs)
            done = sum(1 for o in outputs if o.finished)
            if done:
                bar.update(done)
            elapsed = time.perf_counter() - start
            bar.set_postfix_str(f"{generated / max(elapsed, 1e-9):.0f} tok/s", refresh=False)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` rendered through the model's chat template."""
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
