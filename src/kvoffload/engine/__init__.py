"""The reference engine: model presets, workloads and a hybrid block pool.

A small, honest model of an inference engine's KV-cache side, used by tests and the
simulator. It speaks to the core only through the planner's public contract.
"""
