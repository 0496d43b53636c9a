"""Tensor-parallel vLLM engines (two ranks, each bound to its own core) for
``test_vllm_tensor_parallel.py``; run as ``python -m integration.tp_run
MODEL_DIR[:MAX_NUM_BATCHED_TOKENS] ...``.

One engine per argument, one after the other in this process (each with its own engine
core and worker processes, shut down before the next starts: only the imports of this
process are shared). Three rounds of the same prompts: the first computes and stores
them, the second (after vLLM's own prefix cache is dropped) must get them from kvoffload,
the third does the same with rank 1's loaded bytes overwritten (a negative control). Each
rank counts the bytes it loads (a ``WorkerSide.after_load`` hook installed through vLLM's
``collective_rpc``). Prints one ``RESULT`` JSON line per engine: its argument, outputs and
cached tokens per round, the bytes each rank loaded, and the connector's Prometheus
counters as vLLM aggregated them (vLLM registers them afresh for each engine).
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import time
from typing import Any


def _side() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker_side


def count_loads(worker: Any) -> int:
    """In each worker process: count loaded bytes of this rank (``loaded_bytes()``)."""
    side = _side()
    side.loaded = 0

    def hook(job: Any, layout: Any) -> None:
        for t in job.groups:
            for seg in layout.groups[t.group].segments:
                side.loaded += seg.page_bytes * len(t.block_ids)
        if getattr(side, "corrupt", False):
            import torch

            gen = torch.Generator().manual_seed(1234)
            for t in job.groups:
                for seg in layout.groups[t.group].segments:
                    for block in t.block_ids:
                        page = seg.pages[block].view(torch.uint8)
                        page.copy_(torch.randint(0, 256, page.shape, dtype=torch.uint8,
                                                 generator=gen))

    side.after_load = hook
    return int(side.worker.rank)


def loaded_bytes(worker: Any) -> tuple[int, int]:
    side = _side()
    return int(side.worker.rank), int(side.loaded)


def corrupt_rank_one(worker: Any) -> None:
    side = _side()
    side.corrupt = side.worker.rank == 1


def run(model: str, max_num_batched_tokens: int | None = None) -> dict[str, Any]:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512,
              enable_prefix_caching=True, kv_cache_memory_bytes=16 << 20, max_num_seqs=4,
              block_size=32, tensor_parallel_size=2, disable_log_stats=False, seed=0,
              max_num_batched_tokens=max_num_batched_tokens,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KVOffloadConnector",
                  kv_connector_module_path="kvoffload.integrations.vllm", kv_role="kv_both",
                  kv_load_failure_policy="recompute",
                  kv_connector_extra_config={"host_memory_bytes": "32MiB"}))
    try:
        return rounds_of(llm)
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def rounds_of(llm: Any) -> dict[str, Any]:
    from vllm import SamplingParams

    ranks = llm.collective_rpc(count_loads)
    prompts = [{"prompt_token_ids": [(7 * i + 13 * n) % 990 + 5 for i in range(n)]}
               for n in (70, 150, 260)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    rounds = []
    loaded: list[Any] = []
    metrics: dict[str, Any] = {}
    for r in range(3):
        if r == 2:
            llm.collective_rpc(corrupt_rank_one)
        outs = llm.generate(prompts, params, use_tqdm=False)
        rounds.append([[list(o.outputs[0].token_ids), o.num_cached_tokens] for o in outs])
        time.sleep(0.5)  # the engine core drains the stores in flight meanwhile
        if r == 1:
            loaded = llm.collective_rpc(loaded_bytes)
            metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                       if m.name.startswith("vllm:kvoffload_")}
        assert llm.reset_prefix_cache()
    return {"ranks": ranks, "rounds": rounds, "loaded": loaded, "metrics": metrics}


def main(args: list[str]) -> None:
    for arg in args:
        model, sep, tokens = arg.rpartition(":")
        result = run(model, int(tokens)) if sep else run(arg)
        print("RESULT " + json.dumps({"run": arg, **result}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
