"""Layouts from a model's own config.json (``kvoffload.models.hf_config``) and the presets file.

``model_configs/<model>/config.json`` are the public config.json files of one model of
every family (trimmed to the fields the model's loaders read; ``MODELS`` names each
one's Hugging Face repo). Each is derived the way ``--model DIR`` does (through
``transformers``' config class when it is installed) and checked against bytes worked out
by hand below; the same files read as plain data must give the same presets, and so must
the entries of ``presets.json``.

Only what needs a config class skips without ``transformers`` (``needs_transformers``): the
tests that call one, and the fixtures of ``NEEDS_CONFIG_CLASS``, whose published file
leaves out a field only the class supplies. Everything else runs either way, reading the
files as data where ``transformers`` is missing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from kvoffload.config import GroupKind
from kvoffload.errors import ConfigError
from kvoffload.models import hf_config
from kvoffload.models.hf_config import (
    ModelFields,
    derive_preset,
    load_model_config,
    read_presets_file,
    resolve_model,
)
from kvoffload.models.preset import ModelPreset
from kvoffload.models.presets import PRESETS

CONFIGS = Path(__file__).parent / "model_configs"
# Published config.json files that leave out a field only transformers' class supplies.
NEEDS_CONFIG_CLASS = frozenset({"gemma-3-27b-it"})
FULL, WINDOW, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA


@dataclass(frozen=True)
class Expected:
    """A fixture's repo, its preset in presets.json, and its hand-computed figures."""

    repo: str
    preset: str | None
    groups: dict[tuple[GroupKind, int | None], int]  # (kind, window) -> layers
    bytes_per_token: int
    bytes_per_state: int = 0
    state_bytes_per_layer: int = 0


BF16 = 2
MODELS: dict[str, Expected] = {
    # Dense: layers x KV heads x head dim x (K and V) x bytes.
    "Llama-3.1-8B": Expected("meta-llama/Llama-3.1-8B", "llama3.1-8b", {(FULL, None): 32},
                             32 * 8 * 128 * 2 * BF16),                       # 131,072
    "Qwen3-8B": Expected("Qwen/Qwen3-8B", "qwen3-8b", {(FULL, None): 36},
                         36 * 8 * 128 * 2 * BF16),                           # 147,456
    # A model-level sliding_window and no layer_types: every layer is windowed (vLLM).
    "Mistral-7B-v0.1": Expected("mistralai/Mistral-7B-v0.1", "mistral-7b",
                                {(WINDOW, 4096): 32}, 32 * 8 * 128 * 2 * BF16),
    "Ministral-8B-Instruct-2410": Expected("mistralai/Ministral-8B-Instruct-2410",
                                           "ministral-8b", {(WINDOW, 32768): 36},
                                           36 * 8 * 128 * 2 * BF16),
    # gpt-oss alternates sliding (128) and full layers: 12 of each, 8 KV heads of 64.
    "gpt-oss-20b": Expected("openai/gpt-oss-20b", "gpt-oss-20b",
                            {(FULL, None): 12, (WINDOW, 128): 12},
                            12 * 8 * 64 * 2 * BF16 + 12 * 8 * 64 * 2 * BF16),  # 49,152
    # Gemma 2: sliding (window 4096) and full layers alternate, 21 of each, 8 KV heads of
    # 256; the float32 checkpoint is served in bf16 (vLLM's default for it).
    "gemma-2-9b": Expected("google/gemma-2-9b", None, {(FULL, None): 21, (WINDOW, 4096): 21},
                           42 * 8 * 256 * 2 * BF16),                         # 344,064
    # Gemma 3: 5 local layers (window 1024) per global one; layers 5, 11, ..., 59 global.
    # The published file leaves sliding_window_pattern (6) to the config class.
    "gemma-3-27b-it": Expected("google/gemma-3-27b-it", "gemma3-27b",
                               {(FULL, None): 10, (WINDOW, 1024): 52},
                               (10 + 52) * 16 * 128 * 2 * BF16),              # 507,904
    # Qwen3-Next: every 4th layer full attention (2 KV heads of 256), the other 36 gated
    # delta-net: conv (4 - 1) x (2 x 16 key heads x 128 + 32 value heads x 128) = 24,576
    # elements and state 32 x 128 (v dim) x 128 (k dim) = 524,288 elements, bf16.
    "Qwen3-Next-80B-A3B-Instruct": Expected(
        "Qwen/Qwen3-Next-80B-A3B-Instruct", "qwen3-next-80b-a3b",
        {(FULL, None): 12, (MAMBA, None): 36}, 12 * 2 * 256 * 2 * BF16,       # 24,576
        36 * (3 * (2 * 16 * 128 + 32 * 128) + 32 * 128 * 128) * BF16,         # 39,518,208
        (24_576 + 524_288) * BF16),                                           # 1,097,728
    # Granite 4.0 H: 36 Mamba2 layers (128 heads x 64, 1 group, state 128, conv 4) and 4
    # attention layers: conv 3 x (8192 + 2 x 1 x 128) = 25,344, SSM 128 x 64 x 128.
    "granite-4.0-h-small": Expected(
        "ibm-granite/granite-4.0-h-small", "granite-4.0-h-small",
        {(FULL, None): 4, (MAMBA, None): 36}, 4 * 8 * 128 * 2 * BF16,         # 16,384
        36 * (3 * (128 * 64 + 2 * 1 * 128) + 128 * 64 * 128) * BF16,          # 77,322,240
        (25_344 + 1_048_576) * BF16),                                         # 2,147,840
    # Nemotron-H: pattern M/*/- with 24 Mamba2, 4 attention, 24 MLP layers; 8 groups; the
    # SSM state is float32 (vLLM's NemotronH default), the conv state bf16.
    "Nemotron-H-8B-Base-8K": Expected(
        "nvidia/Nemotron-H-8B-Base-8K", "nemotron-h-8b",
        {(FULL, None): 4, (MAMBA, None): 24}, 4 * 8 * 128 * 2 * BF16,         # 16,384
        24 * (3 * (128 * 64 + 2 * 8 * 128) * BF16 + 128 * 64 * 128 * 4),      # 102,137,856
        61_440 + 4_194_304),                                                  # 4,255,744
    # Falcon-H1: attention and Mamba2 side by side in all 44 layers; 2 KV heads of 128;
    # Mamba 24 heads x 128 (d_ssm 3072), 1 group, state 256: conv 3 x (3072 + 2 x 256).
    "Falcon-H1-7B-Instruct": Expected(
        "tiiuae/Falcon-H1-7B-Instruct", "falcon-h1-7b",
        {(FULL, None): 44, (MAMBA, None): 44}, 44 * 2 * 128 * 2 * BF16,       # 45,056
        44 * (3 * (3072 + 2 * 256) + 24 * 128 * 256) * BF16,                  # 70,152,192
        (10_752 + 786_432) * BF16),                                           # 1,594,368
    # Jamba: attention at layer 4 of every 8 (4 layers), Mamba1 elsewhere (28 layers):
    # d_inner 2 x 4096; conv 3 x 8192, SSM 8192 x 16, bf16.
    "AI21-Jamba-Mini-1.5": Expected(
        "ai21labs/AI21-Jamba-Mini-1.5", "jamba-mini-1.5",
        {(FULL, None): 4, (MAMBA, None): 28}, 4 * 8 * 128 * 2 * BF16,         # 16,384
        28 * (3 * 8192 + 8192 * 16) * BF16, (24_576 + 131_072) * BF16),       # 8,716,288
    # DeepSeek MLA: one latent of kv_lora_rank 512 + qk_rope_head_dim 64 per token and
    # layer, no per-head K and V: 61 x 576 x 2 B.
    "DeepSeek-V3": Expected("deepseek-ai/DeepSeek-V3", "deepseek-v3", {(FULL, None): 61},
                            61 * (512 + 64) * BF16),                          # 70,272
}


def groups_of(preset: ModelPreset) -> dict[tuple[GroupKind, int | None], int]:
    return {(g.kind, g.sliding_window): g.num_layers for g in preset.groups(16)}


def needs_transformers() -> ModuleType:
    """``transformers``, imported; the calling test is skipped where it is not installed."""
    return pytest.importorskip("transformers", reason="transformers is not installed")


def from_fixture(name: str, *, tensor_parallel: int = 1) -> ModelPreset:
    """A fixture derived the way ``--model DIR`` does; a ``NEEDS_CONFIG_CLASS`` fixture
    skips the calling test without ``transformers`` (read as data it is incomplete)."""
    if name in NEEDS_CONFIG_CLASS:
        needs_transformers()
    path = CONFIGS / name
    return derive_preset(load_model_config(path), name=name, source=str(path),
                         tensor_parallel=tensor_parallel)


def from_data(name: str) -> ModelPreset:
    data = json.loads((CONFIGS / name / "config.json").read_text())
    return derive_preset(ModelFields.from_mapping(data, name), name=name, source=name)


def figures(p: ModelPreset) -> tuple[object, ...]:
    return (p.num_layers, p.attention, p.mamba, p.params_per_token, p.family)


def test_every_fixture_is_checked() -> None:
    assert sorted(p.name for p in CONFIGS.iterdir()) == sorted(MODELS)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_config_gives_the_hand_computed_bytes(name: str) -> None:
    want = MODELS[name]
    preset = from_fixture(name)
    assert groups_of(preset) == want.groups
    assert preset.bytes_per_token == want.bytes_per_token
    assert preset.bytes_per_state == want.bytes_per_state
    if want.state_bytes_per_layer:
        assert preset.mamba is not None
        assert preset.mamba.state_bytes_per_layer == want.state_bytes_per_layer
        (mamba,) = [g for g in preset.layout(16).groups if g.spec.kind is MAMBA]
        assert mamba.spec.page_bytes == want.state_bytes_per_layer  # a page is one state
    # An attention page is block_size tokens of one layer.
    for group in preset.layout(16).groups:
        if group.spec.kind is not MAMBA:
            assert group.real_page_bytes == 16 * group.bytes_per_token // group.spec.num_layers


@pytest.mark.parametrize("name", sorted(n for n, m in MODELS.items() if m.preset))
def test_the_presets_file_holds_the_same_models(name: str) -> None:
    preset = MODELS[name].preset
    assert preset is not None
    assert figures(PRESETS[preset]) == figures(from_fixture(name))


@pytest.mark.parametrize("name", sorted(set(MODELS) - NEEDS_CONFIG_CLASS))
def test_a_complete_config_read_as_data_gives_the_same_preset(name: str) -> None:
    assert figures(from_data(name)) == figures(from_fixture(name))


@pytest.mark.parametrize("name", sorted(hf_config.preset_entries()))
def test_transformers_config_classes_derive_every_preset_alike(name: str) -> None:
    """presets.json is read as data; transformers' class for each entry agrees."""
    auto_config = needs_transformers().AutoConfig

    entry = hf_config.preset_entries()[name]
    fields = dict(entry.config)
    cfg = auto_config.for_model(fields.pop("model_type"), **fields)
    derived = derive_preset(ModelFields(cfg.get_text_config(), top=cfg, where=name,
                                        from_class=True), name=name, source=entry.source)
    assert figures(derived) == figures(PRESETS[name])


def test_the_config_class_supplies_what_a_published_file_leaves_out() -> None:
    needs_transformers()
    # gemma-3-27b-it's config.json has no sliding_window_pattern: transformers' class
    # defaults it to 6; read as data, the field is asked for, in one line.
    assert groups_of(from_fixture("gemma-3-27b-it")) == {(FULL, None): 10, (WINDOW, 1024): 52}
    with pytest.raises(ConfigError, match="sliding_window_pattern: is missing") as err:
        from_data("gemma-3-27b-it")
    assert "\n" not in str(err.value) and "install transformers" in str(err.value)


def test_the_four_original_presets_keep_their_layouts() -> None:
    """The hand-written presets presets.json replaced: same groups, bytes and, where the
    old count was exact, the same parameters."""
    old = {  # name: (groups at block 16 as (kind, window, layers, page bytes), B/state)
        "llama3-8b": ([("full_attention", None, 32, 65536)], 0),
        "gpt-oss-20b": ([("full_attention", None, 12, 32768),
                         ("sliding_window", 128, 12, 32768)], 0),
        "gemma3-27b": ([("full_attention", None, 10, 131072),
                        ("sliding_window", 1024, 52, 131072)], 0),
        "nemotron-h-8b": ([("full_attention", None, 4, 65536), ("mamba", None, 24, 4255744)],
                          24 * 4255744),
    }
    for name, (groups, state) in old.items():
        preset = PRESETS[name]
        assert [(s.kind.value, s.sliding_window, s.num_layers, s.page_bytes)
                for s in preset.groups(16)] == groups
        assert preset.bytes_per_state == state
    assert PRESETS["llama3-8b"].params_per_token == 7_504_924_672
    assert PRESETS["nemotron-h-8b"].params_per_token == 7_563_981_824


def test_params_per_token_by_hand() -> None:
    # Llama 3 8B: per layer q and o 4096 x 4096, k and v 4096 x 1024, MLP 3 x 4096 x
    # 14336, two norms; then the final norm and the LM head (input embedding left out).
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert PRESETS["llama3-8b"].params_per_token == 32 * layer + 4096 + 128256 * 4096
    # gpt-oss-20b: attention 2880 -> 64 x 64 (q), 8 x 64 (k, v) -> 2880; a router over 32
    # experts and 4 experts of 3 x 2880 x 2880 a token.
    attention = 2 * 2880 * 4096 + 2 * 2880 * 512
    moe = 2880 * 32 + 4 * 3 * 2880 * 2880
    assert PRESETS["gpt-oss-20b"].params_per_token == (24 * (attention + moe + 2 * 2880)
                                                       + 2880 + 201088 * 2880)
    # The model card's active counts (attention + active MLP + unembedding): 3.61B, 5.13B.
    assert round(PRESETS["gpt-oss-20b"].params_per_token / 1e7) == 361
    assert round(PRESETS["gpt-oss-120b"].params_per_token / 1e7) == 513
    # Qwen3-Next: published 3,874,929,408 active with both embeddings; less the input one
    # (151936 x 2048) within 0.01 % (norm vectors are left out).
    assert PRESETS["qwen3-next-80b-a3b"].params_per_token == pytest.approx(
        3_874_929_408 - 151936 * 2048, rel=1e-4)


def test_tp_two_halves_the_bytes_of_each_rank() -> None:
    for name in ("Llama-3.1-8B", "Nemotron-H-8B-Base-8K", "Qwen3-Next-80B-A3B-Instruct",
                 "granite-4.0-h-small", "AI21-Jamba-Mini-1.5"):
        one, two = from_fixture(name), from_fixture(name, tensor_parallel=2)
        assert two.name == f"{name}@tp2" and two.tensor_parallel == 2
        assert two.bytes_per_token * 2 == one.bytes_per_token, name
        assert [g.num_layers for g in two.groups(16)] == [g.num_layers for g in one.groups(16)]
        assert two.params_per_token == -(-one.params_per_token // 2)
    # Nemotron-H per rank: 64 heads, 4 of the 8 groups: conv 3 x (4096 + 2 x 4 x 128) x 2 B
    # + SSM 64 x 64 x 128 x 4 B, exactly half a state.
    nemotron = from_fixture("Nemotron-H-8B-Base-8K", tensor_parallel=2)
    assert nemotron.mamba is not None
    assert nemotron.mamba.state_bytes_per_layer == 3 * (4096 + 1024) * 2 + 64 * 64 * 128 * 4
    assert nemotron.mamba.state_bytes_per_layer * 2 == 4_255_744
    # Granite has one Mamba group: vLLM replicates it, so the conv state is not halved.
    granite = from_fixture("granite-4.0-h-small", tensor_parallel=2)
    assert granite.mamba is not None
    assert granite.mamba.conv_state_elements == 3 * (4096 + 2 * 1 * 128)


def test_tp_replicates_too_few_kv_heads_and_keeps_an_mla_latent() -> None:
    # Falcon-H1 has 2 KV heads: with 4 ranks each keeps one (vLLM replicates them).
    falcon = from_fixture("Falcon-H1-7B-Instruct", tensor_parallel=4)
    assert falcon.bytes_per_token == 44 * 1 * 128 * 2 * BF16
    # DeepSeek's latent is whole on every rank; its 128 query heads split.
    deepseek = from_fixture("DeepSeek-V3", tensor_parallel=8)
    assert deepseek.bytes_per_token == 61 * 576 * BF16
    assert deepseek.attention[0].num_q_heads == 16


@pytest.mark.parametrize(("name", "tp", "needle"), [
    ("Llama-3.1-8B", 3, "3 ranks do not divide its 32 attention heads"),
    # 12 query heads split over 3 ranks, but 2 KV heads neither split nor replicate.
    ("Falcon-H1-7B-Instruct", 3, "3 ranks cannot share its 2 KV heads"),
    # Heads split over 16 (8 KV heads replicated), but vLLM splits 8 B/C groups only evenly.
    ("Nemotron-H-8B-Base-8K", 16, "16 ranks do not divide its 8 Mamba groups"),
    ("Nemotron-H-8B-Base-8K", 256, "256 ranks do not divide its 32 attention heads"),
    ("AI21-Jamba-Mini-1.5", 0, "tensor_parallel: must be a positive integer"),
])
def test_a_rank_count_that_cannot_split_the_heads_is_one_line(name: str, tp: int,
                                                              needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as err:
        from_fixture(name, tensor_parallel=tp)
    assert "\n" not in str(err.value)
    assert err.value.field == "tensor_parallel"


def test_more_ranks_than_kv_heads_keep_one_head_each() -> None:
    # gpt-oss: 8 KV heads; with 16 ranks (a multiple of 8) every rank keeps one head.
    eight, sixteen = (from_fixture("gpt-oss-20b", tensor_parallel=n) for n in (8, 16))
    assert eight.bytes_per_token == sixteen.bytes_per_token == 24 * 1 * 64 * 2 * BF16
    assert sixteen.attention[0].num_q_heads == 64 // 16


def write(tmp_path: Path, config: dict[str, object]) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_an_unknown_architecture_is_one_line_naming_it(tmp_path: Path) -> None:
    path = write(tmp_path, {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"],
                            "d_model": 512})
    with pytest.raises(ConfigError, match=r"architecture 't5' \(T5ForConditionalGeneration\) "
                                          "is not one kvoffload derives") as err:
        load_model_config(path)
    assert "\n" not in str(err.value) and "Known: deepseek_v2" in str(err.value)


def test_an_unknown_layer_kind_and_missing_fields_are_one_line(tmp_path: Path) -> None:
    base = json.loads((CONFIGS / "Llama-3.1-8B" / "config.json").read_text())
    fields = ModelFields.from_mapping({**base, "layer_types": ["chunked_attention"] * 32},
                                      "cfg")
    with pytest.raises(ConfigError, match=r"layer_types\[0\]: layer kind 'chunked_attention'"):
        derive_preset(fields, name="x", source="x")
    no_heads = {k: v for k, v in base.items() if k != "num_attention_heads"}
    with pytest.raises(ConfigError, match="num_attention_heads: is missing") as err:
        derive_preset(ModelFields.from_mapping(no_heads, "cfg"), name="x", source="x")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="num_key_value_heads: must be an integer"):
        derive_preset(ModelFields.from_mapping({**base, "num_key_value_heads": "8"}, "cfg"),
                      name="x", source="x")
    with pytest.raises(ConfigError, match="is neither a model directory"):
        load_model_config(tmp_path / "nowhere")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="cannot be read as JSON"):
        load_model_config(tmp_path / "bad.json")


def test_float32_checkpoints_run_in_bf16_unless_told(tmp_path: Path) -> None:
    base = json.loads((CONFIGS / "Llama-3.1-8B" / "config.json").read_text())
    path = write(tmp_path, {**base, "torch_dtype": "float32"})
    preset = derive_preset(load_model_config(path), name="x", source="x")
    assert preset.bytes_per_token == 131072 and "float32 checkpoint" in preset.assumptions
    engine_f32 = derive_preset(load_model_config(path), name="x", source="x", dtype="float32")
    assert engine_f32.bytes_per_token == 2 * 131072


def test_resolve_model_takes_names_and_paths() -> None:
    assert resolve_model("gemma3-27b") is PRESETS["gemma3-27b"]
    assert resolve_model("gemma3-27b", 2).bytes_per_token * 2 == PRESETS["gemma3-27b"] \
        .bytes_per_token
    directory = resolve_model(str(CONFIGS / "Qwen3-8B"))
    assert directory.name == "Qwen3-8B"
    assert figures(resolve_model(str(CONFIGS / "Qwen3-8B" / "config.json"))) == \
        figures(directory)
    with pytest.raises(ConfigError, match="unknown preset 'gpt-5'"):
        resolve_model("gpt-5")


def test_a_malformed_presets_file_names_the_entry() -> None:
    with pytest.raises(ConfigError, match=r"presets\[0\]: needs a name"):
        read_presets_file('{"presets": [{"name": "x"}]}')
    entry = {"name": "x", "source": "s", "config": {}}
    with pytest.raises(ConfigError, match="repeats the name 'x'"):
        read_presets_file(json.dumps({"presets": [entry, entry]}))
    with pytest.raises(ConfigError, match="holds no 'presets' list"):
        read_presets_file("[]")


def test_every_preset_names_its_source_and_family() -> None:
    for name, entry in hf_config.preset_entries().items():
        preset = PRESETS[name]
        assert "/" in entry.source and "config.json" in entry.source  # a HF repo id
        assert preset.family and preset.source.startswith(entry.source)
        assert name in preset.describe()
