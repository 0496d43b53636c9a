"""The simulator: workloads replayed through the reference engine with and without
offloading, and what is built on it.

* ``simulation``: one model, one workload, one configuration (``SimulationConfig``,
  ``simulate``, ``run_one``); ``replay``: feeding a workload in; ``summary``: what a run
  measured.
* ``fleet``: several engines behind a router, sharing a modelled remote tier
  (``shared_store``).
* ``oracle``: the reference policy that knows a workload's future.
"""
