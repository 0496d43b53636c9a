"""The oracle: a simulator-only cache policy that knows the future of the workload it
replays (``docs/policy.md``).

* ``future``: the workload's future, hashed as the engine hashes it (``WorkloadFuture``);
* ``eviction``: evict the key whose next use is furthest per byte (``OraclePolicy``);
* ``store``: store only what a later request hits (``OracleStorePolicy``);
* ``binding``: both halves bound to one future for one run.
"""
