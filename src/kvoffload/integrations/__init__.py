"""Engine adapters: ``vllm``, the vLLM KV connector (``docs/vllm.md``)."""
