"""The simulator: workloads replayed through the reference engine with and without
offloading, and what is built on it.

* ``simulation``: one model, one workload, one configuration (``SimulationConfig``,
  ``simulate``, ``run_one``); ``replay``: feeding a workload in; ``summary``: what a run
  measured.
* ``fleet``: several engines behind a router, sharing a modelled remote tier
  (``shared_store``).
* ``oracle``: the reference policy that knows a workload's future.
* ``sweep``: a grid of runs (preset x policy x host capacity, averaged over seeds) and
  reading the memory a hit rate needs off its curves; ``plan``: capacity planning, the
  host memory (and disk) a model and its traffic need and the ``--kv-transfer-config``
  that deploys it.
"""
