"""Model layouts: what a model's KV cache looks like to kvoffload.

A model's ``config.json`` (a local Hugging Face directory, or the built-in presets' fields
in ``presets.json``) becomes a ``ModelPreset``; a preset laid out for a block size is a
``ModelLayout`` of KV-cache groups. The modules, each importing only those listed before it:

* ``hf_fields``, ``hf_families``, ``hf_shapes``: reading a config's fields, the model
  families and their layer kinds, the layer shapes, bytes and parameter counts;
* ``layout``: ``ModelLayout`` and its ``ModelGroup``s (moved and real page sizes, scaling);
* ``preset``: ``AttentionLayers``, ``MambaLayers``, ``ModelPreset`` (a model's cache-holding
  layers, its layout, its bytes and prefill FLOPs);
* ``hf_config``: config.json -> ``ModelPreset`` (``derive_preset``), the presets file,
  ``resolve_model`` (a preset name or a model path);
* ``presets``: the built-in presets registry (``PRESETS``, ``get_preset``), built on first
  use.

Importing any of them reads no file and derives no preset.
"""
