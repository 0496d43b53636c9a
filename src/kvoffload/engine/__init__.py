"""The reference engine and the simulator built on it.

A small, honest model of an inference engine's KV-cache side, used by tests, the simulator
and the ``kvoffload`` command. It speaks to the core only through the planner's public
contract, so it exercises exactly what an engine adapter would.

* ``block_pool``, ``group_policies``, ``prefix_cache``: the hybrid prefix-caching block
  pool, its per-kind rules (hits, freed positions, allocation) and its cache index.
* ``scheduler``: the step loop (``ReferenceEngine``, the entry point, and ``EngineConfig``);
  ``scheduling``: queues, scheduling, preemption, admission; ``transfers``: jobs in flight,
  report delivery, loads waiting, late loads and parked blocks; ``recording``: hits per
  request and tier, samples.
* ``executors``, ``device``, ``verify``: the worker side (accounting, or the real worker
  on real tensors) and bytes mode's contents and checks.
* ``timing``, ``metrics``, ``summary``: modelled time and what a run measured.
* ``replay``, ``simulation``: feeding workloads in; a whole simulation from one config.
* ``model_presets``, ``hf_config`` (with ``hf_fields``, ``hf_families``, ``hf_shapes``),
  ``workloads``: model dimensions (derived from a model's config.json or the presets
  file), traces and synthetic workloads.
"""
