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


def check(vllm_config: Any, kv_cache_config: Any) -> int:
    """``check_engine_features``: the draft groups' proof tokens, or ``ConfigError``."""
    from kvoffload.integrations.vllm.compat import check_engine_features

    return check_engine_features(vllm_config, kv_cache_config).proof_tokens


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
def test_draft_kv_no_group_is_marked_for_keys_every_group_late(method: str) -> None:
    """Where vLLM marks no group as the drafter's, any group may hold its layers: every
    group is keyed late (the target pays one block of every hit), which the translation
    accepts where every group is full attention and refuses otherwise, saying why."""
    from kvoffload.integrations.vllm.compat import check_engine_features
    from kvoffload.integrations.vllm.translate import UnsupportedSpecError, translate

    config = engine_config(method=method, uses_draft_kv_cache=lambda: True,
                           num_speculative_tokens=2)
    draft = check_engine_features(config, full_config())
    assert (draft.proof_tokens, draft.every_group) == (3, True)
    groups = translate(full_config(), proof_tokens=3, every_group_draft=True).groups
    assert [g.proof_tokens for g in groups] == [3]
    hybrid = kit.Layout("hybrid").kv_cache_config(64)
    with pytest.raises(UnsupportedSpecError, match="may hold\\) a speculative drafter's "
                                                   "layers and is a sliding_window group"):
        translate(hybrid, proof_tokens=3, every_group_draft=True)


def marks_drafts() -> bool:
    from kvoffload.integrations.vllm.compat import marks_draft_layers

    return marks_draft_layers()


def test_a_group_vllm_marks_as_holding_draft_layers_is_a_draft_group() -> None:
    """vLLM 0.33 on marks a drafter's layers: the group it marks is a draft group, with
    ``num_speculative_tokens + 1`` proof tokens (``test_speculative``). vLLM 0.32 sets
    ``is_eagle_group`` by guesses and marks no draft layer: every group is keyed late."""
    from kvoffload.integrations.vllm.compat import check_engine_features

    kv = full_config()
    kv.kv_cache_groups[0] = dataclasses.replace(kv.kv_cache_groups[0], is_eagle_group=True)
    config = engine_config(method="eagle", num_speculative_tokens=2)
    draft = check_engine_features(config, kv)
    assert (draft.proof_tokens, draft.every_group) == (3, not marks_drafts())


def test_per_layer_draft_marks_of_vllm_033_are_read() -> None:
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, UniformTypeKVCacheSpecs

    from kvoffload.integrations.vllm.compat import draft_layers
    from kvoffload.integrations.vllm.translate import translate

    kv = full_config()
    spec = kv.kv_cache_groups[0].kv_cache_spec
    if "is_draft" not in {f.name for f in dataclasses.fields(spec)}:
        pytest.skip("this vLLM (0.32) has no per-layer draft marks")
    draft = dataclasses.replace(spec, is_draft=True)
    uniform = UniformTypeKVCacheSpecs(block_size=spec.block_size,
                                      kv_cache_specs={"target": spec, "draft": draft})
    kv.kv_cache_groups[0] = KVCacheGroupSpec(["target", "draft"], uniform)
    assert draft_layers(kv) == ["draft"]
    config = engine_config(method="eagle", uses_draft_kv_cache=lambda: True,
                           num_speculative_tokens=4)
    proof = check(config, kv)
    assert proof == 5
    # The whole group is the drafter's: its target layer is keyed late as well.
    assert [g.proof_tokens for g in translate(kv, proof_tokens=proof).groups] == [5]


def draft_kv(*, separate: bool = True, **spec: Any) -> tuple[SimpleNamespace, Any]:
    """An EAGLE engine (``spec`` overrides) and a KV-cache config whose last group vLLM
    marks as the drafter's."""
    kv = kit.Layout("draft" if separate else "merged-draft").kv_cache_config(64)
    fields = {"method": "eagle", "num_speculative_tokens": 3,
              "uses_draft_kv_cache": lambda: True, "use_eagle_block_drop": lambda: True,
              **spec}
    return engine_config(**fields), kv


@pytest.mark.parametrize(("method", "why"), [
    ("dflash", "DFlash builds its draft KV"),
    ("dspark", "DSpark builds its draft KV"),
    ("extract_hidden_states", "hidden states in a KV-cache layer")])
def test_drafters_without_a_rule_are_refused_with_why(method: str, why: str) -> None:
    config, kv = draft_kv(method=method)
    with pytest.raises(ConfigError, match=f"method '{method}' gives the draft model "
                                          rf"KV-cache layers \(draft layers: "
                                          rf"draft\.layers\.0\.attn\).*{why}"):
        check(config, kv)


def test_a_custom_speculative_method_is_refused() -> None:
    config, kv = draft_kv(custom_method="my_drafter")
    with pytest.raises(ConfigError, match=r"custom method 'my_drafter' .*no rule"):
        check(config, kv)


@pytest.mark.parametrize("why", ["no is_draft (vLLM 0.32)", "disable_eagle_block_drop",
                                 "a separate draft model"])
def test_draft_kv_vllm_marks_no_group_for_keys_every_group_late(
        monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    """What vLLM 0.32 gets (no per-layer marks), what ``disable_eagle_block_drop`` gives
    (no ``is_eagle_group``), and a separate draft model: the marked group alone would not
    be enough, so every group is treated as the drafter's."""
    from kvoffload.integrations.vllm import compat

    monkeypatch.setattr(compat, "marks_draft_layers", lambda: why != "no is_draft (vLLM 0.32)")
    spec: dict[str, Any] = {
        "disable_eagle_block_drop": {"use_eagle_block_drop": lambda: False},
        "a separate draft model": {"method": "draft_model"}}.get(why, {})
    config, kv = draft_kv(**spec)
    if why == "a separate draft model":  # its groups carry no is_eagle_group
        kv = full_config()
    draft = compat.check_engine_features(config, kv)
    assert (draft.proof_tokens, draft.every_group) == (4, True)


def test_draft_marks_without_a_drafter_are_refused() -> None:
    _, kv = draft_kv()
    with pytest.raises(ConfigError, match="speculative_config: is not set, yet vLLM marks"):
        check(engine_config(), kv)
    with pytest.raises(ConfigError, match="method 'ngram' gives the draft model"):
        check(engine_config(method="ngram", uses_draft_kv_cache=lambda: False), kv)


@pytest.mark.parametrize("separate", [True, False])
def test_the_draft_group_gets_the_proof_and_the_rest_none(
        monkeypatch: pytest.MonkeyPatch, separate: bool) -> None:
    from kvoffload.integrations.vllm import compat
    from kvoffload.integrations.vllm.translate import translate

    monkeypatch.setattr(compat, "marks_draft_layers", lambda: True)
    config, kv = draft_kv(separate=separate, num_speculative_tokens=15)
    proof = check(config, kv)
    assert proof == 16
    groups = translate(kv, proof_tokens=proof).groups
    assert [g.proof_tokens for g in groups] == ([0, 16] if separate else [16])


def test_a_proof_longer_than_a_block_is_refused() -> None:
    from kvoffload.integrations.vllm.translate import UnsupportedSpecError, translate

    _, kv = draft_kv()
    with pytest.raises(UnsupportedSpecError, match=r"KV-cache group 1 .*depends on the 17 "
                                                   r"tokens after it.*Use at most 15 "
                                                   "speculative tokens"):
        translate(kv, proof_tokens=17)
    with pytest.raises(UnsupportedSpecError, match="gives no draft KV to prove"):
        translate(kv)


def test_a_draft_group_that_is_not_full_attention_is_refused() -> None:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from kvoffload.integrations.vllm.translate import UnsupportedSpecError, translate

    _, kv = draft_kv()
    full = kv.kv_cache_groups[1].kv_cache_spec
    window = SlidingWindowSpec(block_size=full.block_size, num_kv_heads=full.num_kv_heads,
                               head_size=full.head_size, dtype=full.dtype, sliding_window=64)
    kv.kv_cache_groups[1] = dataclasses.replace(kv.kv_cache_groups[1], kv_cache_spec=window)
    with pytest.raises(UnsupportedSpecError, match=r"KV-cache group 1 .*drafter's layers and "
                                                   "is a sliding_window group"):
        translate(kv, proof_tokens=4)


def test_the_drafter_names_the_tiers_namespace() -> None:
    """Another drafter of the same shapes writes other draft KV: lower tiers keep the
    engines apart (``with_model_id``)."""
    from kvoffload.integrations.vllm.connector import with_model_id
    from kvoffload.tiers.config import DiskTierConfig, TierConfig

    tiers = TierConfig(disk=DiskTierConfig(path="/tmp/unused", capacity_bytes=1 << 30))
    config = SimpleNamespace(
        model_config=SimpleNamespace(model="m", revision=None, dtype="bfloat16"),
        speculative_config=SimpleNamespace(
            method="eagle3", model="d",
            draft_model_config=SimpleNamespace(model="d", revision="r1")))
    assert with_model_id(tiers, config).model_id == "m@main:bfloat16"
    assert with_model_id(tiers, config, 4).model_id == "m@main:bfloat16+eagle3:d@r1/4"


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
