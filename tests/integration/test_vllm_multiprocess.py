"""Smoke test in vLLM's default deployment shape: engine core and worker in their own
processes, so the connector's scheduler and worker roles only talk through the metadata
vLLM serializes between them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from integration.markers import VLLM

pytestmark = VLLM

SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig

if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=512,
              enable_prefix_caching=True, kv_cache_memory_bytes=8 << 20, max_num_seqs=4,
              block_size=32, kv_transfer_config=KVTransferConfig(
                  kv_connector="KVOffloadConnector",
                  kv_connector_module_path="kvoffload.integrations.vllm", kv_role="kv_both",
                  kv_load_failure_policy="recompute",
                  kv_connector_extra_config={"host_memory_bytes": "16MiB"}))
    prompts = [{"prompt_token_ids": [(7 * i + 13 * n) % 990 + 5 for i in range(n)]}
               for n in (70, 150)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    rounds = []
    for r in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        rounds.append([[list(o.outputs[0].token_ids), o.num_cached_tokens] for o in outs])
        if r == 0:
            import time
            time.sleep(0.5)  # the engine core drains the stores in flight meanwhile
            assert llm.reset_prefix_cache()
    print("RESULT " + json.dumps(rounds))
"""


def test_two_rounds_across_processes(tmp_path: Path, tiny_model: Callable[[str], Path]) -> None:
    script = tmp_path / "run_mp.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(script), str(tiny_model("llama"))], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    first, second = json.loads(lines[-1].removeprefix("RESULT "))
    assert [t for t, _ in second] == [t for t, _ in first]
    assert [c for _, c in first] == [0, 0]
    assert [c for _, c in second] == [64, 128]
