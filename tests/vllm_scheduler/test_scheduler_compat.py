"""What differs between vLLM 0.32, 0.33 and 0.34 for the connector, checked on the installed
vLLM (``kvoffload.integrations.vllm.compat``; ``docs/vllm.md``, "What changed in vLLM 0.33"
and "What changed in vLLM 0.34")."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from integration.markers import VLLM
from kvoffload.errors import ConfigError

pytestmark = VLLM

kit = pytest.importorskip("vllm_scheduler.kit")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return kit.model_dir(tmp_path_factory.mktemp("llama-config"))


def check(vllm_config: Any, kv_cache_config: Any) -> None:
    from kvoffload.integrations.vllm.compat import check_engine_features

    check_engine_features(vllm_config, kv_cache_config)


def engine_config(**spec: Any) -> SimpleNamespace:
    speculative = None if not spec else SimpleNamespace(**spec)
    return SimpleNamespace(speculative_config=speculative,
                           model_config=SimpleNamespace(enable_sleep_mode=False),
                           num_hash_lookahead_tokens=0)


def full_config() -> Any:
    return kit.Layout("full").kv_cache_config(64)


def test_a_plain_engine_passes() -> None:
    check(engine_config(), full_config())


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "draft_model"])
def test_speculative_decoding_with_draft_kv_is_refused(method: str) -> None:
    config = engine_config(method=method, uses_draft_kv_cache=lambda: True)
    with pytest.raises(ConfigError, match=f"method '{method}' gives the draft model "
                                          "KV-cache layers.*Use speculative decoding "
                                          "without a draft model"):
        check(config, full_config())


def test_a_group_vllm_marks_as_holding_draft_layers_is_refused() -> None:
    kv = full_config()
    kv.kv_cache_groups[0] = dataclasses.replace(kv.kv_cache_groups[0], is_eagle_group=True)
    with pytest.raises(ConfigError, match=r"draft layers: layers\.0\.attn, layers\.2\.attn"):
        check(engine_config(method="eagle"), kv)


def test_per_layer_draft_marks_of_vllm_033_are_read() -> None:
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, UniformTypeKVCacheSpecs

    kv = full_config()
    spec = kv.kv_cache_groups[0].kv_cache_spec
    if "is_draft" not in {f.name for f in dataclasses.fields(spec)}:
        pytest.skip("this vLLM (0.32) has no per-layer draft marks")
    draft = dataclasses.replace(spec, is_draft=True)
    uniform = UniformTypeKVCacheSpecs(block_size=spec.block_size,
                                      kv_cache_specs={"target": spec, "draft": draft})
    kv.kv_cache_groups[0] = KVCacheGroupSpec(["target", "draft"], uniform)
    with pytest.raises(ConfigError, match=r"draft layers: draft\b"):
        check(engine_config(method="eagle", uses_draft_kv_cache=lambda: True), kv)


def test_sleep_mode_is_refused_with_the_fix() -> None:
    from kvoffload.integrations.vllm.connector import KVOffloadConnector

    assert KVOffloadConnector.supports_sleep_mode(None) is False  # what vLLM 0.33 asks
    config = engine_config()
    config.model_config.enable_sleep_mode = True
    with pytest.raises(ConfigError, match="without --enable-sleep-mode"):
        check(config, full_config())


def test_lookahead_block_hashes_are_refused() -> None:
    config = engine_config()
    config.num_hash_lookahead_tokens = 1
    with pytest.raises(ConfigError, match="disable_lookahead_block_hashes"):
        check(config, full_config())


def test_lookahead_block_hashes_are_declared_unsupported() -> None:
    """What vLLM 0.34 asks before it turns lookahead hashing on for a connector."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvoffload.integrations.vllm.connector import KVOffloadConnector

    assert KVOffloadConnector.supports_lookahead_block_hashes(None) is False
    if hasattr(KVConnectorBase_V1, "supports_lookahead_block_hashes"):  # vLLM 0.34
        assert "supports_lookahead_block_hashes" in vars(KVOffloadConnector)


def test_ngram_speculative_decoding_runs_inside_the_real_scheduler(root: Path) -> None:
    """n-gram proposals have no draft KV: the connector starts, and vLLM itself keeps
    lookahead hashes off (0.33: a connector is configured; 0.34: n-gram drops no EAGLE
    blocks, and the connector declares no support)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    transfer = KVTransferConfig(kv_connector="KVOffloadConnector",
                                kv_connector_module_path=kit.CONNECTOR_MODULE,
                                kv_role="kv_both",
                                kv_connector_extra_config={"host_memory_bytes": 1 << 20})
    args = EngineArgs(model=str(root), skip_tokenizer_init=True, dtype="float32",
                      block_size=kit.BLOCK, enforce_eager=True, kv_transfer_config=transfer,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                          "prompt_lookup_max": 3})
    vllm_config = kit.create_engine_config(args)
    assert getattr(vllm_config, "num_hash_lookahead_tokens", 0) == 0
    check(vllm_config, full_config())
