"""The environment of a vLLM engine run in the benchmark's own process (``vllm.LLM``).

Importing this module sets it, where not set already, so it must come before anything
imports vLLM (the benchmarks' helper modules import vLLM only inside functions):

* ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core in this process, so a benchmark
  can reach the scheduler and the connector (step traces, counters);
* ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``: models are made on disk at run time,
  nothing is downloaded;
* ``TOKENIZERS_PARALLELISM=false``, ``VLLM_LOGGING_LEVEL=ERROR``: quiet runs.
"""

import os

for _name, _value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("HF_HUB_OFFLINE", "1"),
                      ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"),
                      ("VLLM_LOGGING_LEVEL", "ERROR")):
    os.environ.setdefault(_name, _value)
