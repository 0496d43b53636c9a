"""Each tier's bookkeeping: the tier contract (``base``), host memory (``host``, with
``host_space`` and ``host_stats``), the eviction policies (``eviction``), the tiers below
host memory (``lower``, ``disk``, ``remote``) and the cascade that joins them
(``cascade``, ``tier_jobs``), their configuration (``config``, ``remote_config``,
``option_values``, ``mac_key``) and key naming (``naming``). It decides what each tier
holds; the worker moves the bytes (``docs/tiers.md``)."""
