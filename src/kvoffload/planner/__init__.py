"""The scheduler side: ``planner.Planner`` keeps the engine contract (``contract``) and
decides every transfer; lookups (``prefix_lookup``, ``lookup``), loads
(``load_planning``) and stores (``store_planning``) by each group's rules
(``positions``), jobs in flight and their fence (``jobs_in_flight``, ``fence``), and the
store policies (``store_policy``, ``selective`` with ``admission``, ``insertion``,
``valuation``). Pure Python: ``docs/architecture.md``, "Inside the planner"."""
