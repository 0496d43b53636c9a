"""Translation of vLLM 0.32's KV-cache specs into kvoffload groups, spec class by spec class.

Real vLLM spec objects, no engine. Every ``KVCacheSpec`` subclass vLLM defines is listed
in ``EXPECTED``: a new class in a future vLLM fails ``test_every_vllm_spec_class_is_decided``
until someone decides how to offload it.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest

from integration.markers import VLLM

pytestmark = VLLM

torch = pytest.importorskip("torch")


def _attn(**kw: Any) -> dict[str, Any]:
    return {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float16, **kw}


def specs() -> dict[str, Any]:
    """One instance of every spec class, keyed by class name."""
    import vllm.v1.kv_cache_interface as k

    return {
        "FullAttentionSpec": k.FullAttentionSpec(**_attn()),
        "MLAAttentionSpec": k.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576,
                                               dtype=torch.bfloat16),
        "HiddenStateCacheSpec": k.HiddenStateCacheSpec(block_size=16, num_kv_heads=1,
                                                       head_size=64, dtype=torch.float16),
        "SinkFullAttentionSpec": k.SinkFullAttentionSpec(**_attn(), sink_len=16),
        "RSWASpec": k.RSWASpec(**_attn(), rswa_window=256),
        "SlidingWindowSpec": k.SlidingWindowSpec(**_attn(), sliding_window=128),
        "SlidingWindowMLASpec": k.SlidingWindowMLASpec(block_size=16, num_kv_heads=1,
                                                       head_size=576, dtype=torch.bfloat16,
                                                       sliding_window=128),
        "ChunkedLocalAttentionSpec": k.ChunkedLocalAttentionSpec(**_attn(),
                                                                 attention_chunk_size=8192),
        "MambaSpec": k.MambaSpec(block_size=64, shapes=((3, 160), (4, 32, 16)),
                                 dtypes=(torch.float32, torch.float32), page_size_padded=16384,
                                 mamba_cache_mode="align"),
        "CircularBufferSpec": k.CircularBufferSpec(**_attn()),
        "EncoderOnlyAttentionSpec": k.EncoderOnlyAttentionSpec(**_attn()),
        "CrossAttentionSpec": k.CrossAttentionSpec(**_attn()),
        "HiSparseHotSpec": k.HiSparseHotSpec(block_size=16, page_size=4096,
                                             blocks_per_request=4),
        "HiSparseResidentSpec": k.HiSparseResidentSpec(block_size=16, page_size=4096),
        "AttentionSpec": k.AttentionSpec(**_attn()),
        "UniformTypeKVCacheSpecs": k.UniformTypeKVCacheSpecs(
            block_size=16, kv_cache_specs={"a": k.FullAttentionSpec(**_attn()),
                                           "b": k.FullAttentionSpec(**_attn(head_size=128))}),
    }


ATTN_PAGE = 16 * 2 * (64 + 64) * 2  # tokens x kv heads x (K + V) x fp16
# class name -> (kind, window, page bytes) or the words the refusal must contain
EXPECTED: dict[str, tuple[str, int | None, int] | str] = {
    "FullAttentionSpec": ("full_attention", None, ATTN_PAGE),
    "MLAAttentionSpec": ("full_attention", None, 16 * 576 * 2),
    "HiddenStateCacheSpec": ("full_attention", None, 16 * 64 * 2),
    "SinkFullAttentionSpec": ("full_attention", None, ATTN_PAGE),
    "SlidingWindowSpec": ("sliding_window", 128, ATTN_PAGE),
    "SlidingWindowMLASpec": ("sliding_window", 128, 16 * 576 * 2),
    "ChunkedLocalAttentionSpec": ("sliding_window", 8192, ATTN_PAGE),
    "MambaSpec": ("mamba", None, (3 * 160 + 4 * 32 * 16) * 4),
    "UniformTypeKVCacheSpecs": ("full_attention", None, ATTN_PAGE + 2 * ATTN_PAGE),
    "RSWASpec": "frees blocks in the middle",
    "CircularBufferSpec": "not prefix-cacheable",
    "EncoderOnlyAttentionSpec": "encoder-only",
    "CrossAttentionSpec": "cross-attention",
    "HiSparseHotSpec": "not a KV-cache spec kvoffload knows",
    "HiSparseResidentSpec": "not a KV-cache spec kvoffload knows",
    "AttentionSpec": "not a KV-cache spec kvoffload knows",
}


def test_every_vllm_spec_class_is_decided() -> None:
    import vllm.v1.kv_cache_interface as k

    classes = {name for name, cls in inspect.getmembers(k, inspect.isclass)
               if issubclass(cls, k.KVCacheSpec) and cls is not k.KVCacheSpec}
    assert classes == set(EXPECTED), "decide how to translate: " + \
        str(sorted(classes ^ set(EXPECTED)))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_spec_translation(name: str) -> None:
    from kvoffload.integrations.vllm.translate import UnsupportedSpecError, translate_group

    spec = specs()[name]
    expected = EXPECTED[name]
    if isinstance(expected, str):
        with pytest.raises(UnsupportedSpecError, match=expected) as info:
            translate_group(3, ["model.layers.7.attn"], spec)
        message = str(info.value)
        assert "KV-cache group 3" in message and "model.layers.7.attn" in message
        return
    kind, window, page = expected
    group = translate_group(0, ["l0", "l1"], spec)
    assert (group.kind.value, group.sliding_window, group.page_bytes) == (kind, window, page)
    assert group.block_size == spec.block_size
    uniform = name == "UniformTypeKVCacheSpecs"
    assert group.num_layers == (1 if uniform else 2)


def test_padded_pages_move_only_their_real_bytes() -> None:
    import vllm.v1.kv_cache_interface as k

    from kvoffload.integrations.vllm.translate import translate_group

    padded = k.FullAttentionSpec(**_attn(), page_size_padded=3 * ATTN_PAGE)
    assert translate_group(0, ["l"], padded).page_bytes == ATTN_PAGE


def test_window_includes_tokens_vllm_retains_for_spec_decode() -> None:
    import vllm.v1.kv_cache_interface as k

    from kvoffload.integrations.vllm.translate import translate_group

    spec = k.SlidingWindowSpec(**_attn(), sliding_window=128, extra_retained_tokens=3)
    assert translate_group(0, ["l"], spec).sliding_window == 131


def test_mamba_without_prefix_caching_is_refused_with_the_fix() -> None:
    import vllm.v1.kv_cache_interface as k

    from kvoffload.integrations.vllm.translate import UnsupportedSpecError, translate_group

    spec = k.MambaSpec(block_size=64, shapes=((3, 160),), dtypes=(torch.float32,),
                       mamba_cache_mode="none")
    with pytest.raises(UnsupportedSpecError, match="--enable-prefix-caching"):
        translate_group(0, ["mixer"], spec)


def test_bounded_replay_sliding_mla_is_refused() -> None:
    import vllm.v1.kv_cache_interface as k

    from kvoffload.integrations.vllm.translate import UnsupportedSpecError, translate_group

    spec = k.SlidingWindowMLASpec(block_size=16, num_kv_heads=1, head_size=576,
                                  dtype=torch.bfloat16, sliding_window=128,
                                  bounded_replay=True)
    with pytest.raises(UnsupportedSpecError, match="bounded replay"):
        translate_group(0, ["l"], spec)


def test_uniform_group_mixing_kinds_is_refused() -> None:
    import vllm.v1.kv_cache_interface as k

    from kvoffload.integrations.vllm.translate import UnsupportedSpecError, translate_group

    mixed = k.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={
        "a": k.FullAttentionSpec(**_attn()),
        "b": k.SlidingWindowSpec(**_attn(), sliding_window=64)})
    with pytest.raises(UnsupportedSpecError, match="mix kinds"):
        translate_group(0, ["a", "b"], mixed)


def _config(groups: list[Any], hash_block_size: int | None = 16) -> Any:
    import vllm.v1.kv_cache_interface as k

    return k.KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=groups,
                           hash_block_size=hash_block_size)


def test_hybrid_config_translates_group_by_group() -> None:
    import vllm.v1.kv_cache_interface as k

    from kvoffload.integrations.vllm.options import ConnectorOptions
    from kvoffload.integrations.vllm.translate import translate

    s = specs()
    config = _config([
        k.KVCacheGroupSpec(["l0", "l2"], s["SlidingWindowSpec"]),
        k.KVCacheGroupSpec(["l1", "l3"], s["FullAttentionSpec"]),
    ])
    layout = translate(config)
    assert [g.kind.value for g in layout.groups] == ["sliding_window", "full_attention"]
    assert layout.layer_names == (("l0", "l2"), ("l1", "l3"))
    assert (layout.hash_block_size, layout.num_blocks) == (16, 100)
    offload = layout.offload_config(ConnectorOptions(host_memory_bytes=1 << 20,
                                                     block_size_factor=2), num_workers=2)
    assert offload.slot_bytes == 2 * 2 * ATTN_PAGE
    assert offload.num_workers == 2
    assert offload.resolved[0].window_blocks == 4  # 128 tokens / 32-token offloaded blocks


def test_config_level_refusals() -> None:
    import vllm.v1.kv_cache_interface as k

    from kvoffload.integrations.vllm.translate import UnsupportedSpecError, translate

    s = specs()
    with pytest.raises(UnsupportedSpecError, match="no KV-cache groups"):
        translate(_config([]))
    host = k.KVCacheGroupSpec(["l"], s["FullAttentionSpec"], host_resident=True)
    with pytest.raises(UnsupportedSpecError, match="host-resident"):
        translate(_config([host]))
    hidden = k.KVCacheGroupSpec(["l"], s["FullAttentionSpec"], enable_kv_transfer=False)
    with pytest.raises(UnsupportedSpecError, match="not transferable"):
        translate(_config([hidden]))
    with pytest.raises(UnsupportedSpecError, match="not a multiple of vLLM's hash block"):
        translate(_config([k.KVCacheGroupSpec(["l"], s["FullAttentionSpec"])],
                          hash_block_size=48))


def test_hash_block_size_defaults_to_the_block_size() -> None:
    import vllm.v1.kv_cache_interface as k

    from kvoffload.integrations.vllm.translate import translate

    config = _config([k.KVCacheGroupSpec(["l"], specs()["FullAttentionSpec"])],
                     hash_block_size=None)
    assert translate(config).hash_block_size == 16


def test_parallelism_checks() -> None:
    from kvoffload.integrations.vllm.translate import UnsupportedSpecError, check_parallelism

    def parallel(**kw: int) -> Any:
        base = {"tensor_parallel_size": 2, "pipeline_parallel_size": 1,
                "decode_context_parallel_size": 1, "prefill_context_parallel_size": 1}
        return SimpleNamespace(**{**base, **kw})

    assert check_parallelism(parallel()) == 2
    for field, label in (("pipeline_parallel_size", "pipeline"),
                         ("decode_context_parallel_size", "decode context"),
                         ("prefill_context_parallel_size", "prefill context")):
        with pytest.raises(UnsupportedSpecError, match=label):
            check_parallelism(parallel(**{field: 2}))
