"""Model layouts: what a model's KV cache looks like to kvoffload.

A model's ``config.json`` (a local Hugging Face directory, or the built-in presets'
fields in ``presets.json``) becomes a ``ModelPreset`` (``hf_config``, with ``hf_fields``
reading the fields, ``hf_families`` the model families and ``hf_shapes`` the layer
shapes); a preset laid out for a block size is a ``ModelLayout`` of KV-cache groups
(``presets``).
"""
