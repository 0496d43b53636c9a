"""The reference engine: a small, honest model of an inference engine's KV-cache side.

It drives the planner through its public contract exactly as an engine adapter would, so
the simulator (``kvoffload.sim``) and most end-to-end tests exercise what vLLM would.

* ``engine``: the step loop (``ReferenceEngine``, the entry point, and ``offload_for``);
  ``context``: what its parts share (``EngineConfig``, the engine's limits, and
  ``EngineContext``);
  ``scheduler``: queues, scheduling, preemption, admission (``Scheduler``);
  ``transfers``: jobs in flight, report delivery, loads waiting, late loads and parked
  blocks; ``recording``: hits per request and tier, samples.
* ``block_pool``, ``group_policies``, ``prefix_cache``: the hybrid prefix-caching block
  pool, its per-kind rules (hits, freed positions, allocation) and its cache index.
* ``executors``, ``device``, ``verify``: the worker side (accounting, or the real worker
  on real tensors) and bytes mode's contents and checks.
* ``requests``, ``timing``, ``metrics``: a request in the engine, modelled time, and what
  a run counts.
"""
