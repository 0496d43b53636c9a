"""Hostile ``--model`` directories: every config.json the issue tried ends in one
``ConfigError`` naming the file and the field (the CLI: one ``error:`` line, exit 2), with
bounded time and memory, before ``transformers`` sees the data; and a fuzz of the reader.

The table runs each case through the library entry point (``resolve_model``, what the
simulator and every command call) and through ``presets``, ``plan``, ``simulate`` and
``sweep`` on the command line. The bases are published configs (``model_configs/``) or
their fields; each case changes one field. docs/models.md, "Bounds on a model's config",
states the bounds; docs/reliability.md, "Hostile input", lists the surface.
"""

from __future__ import annotations

import json
import math
import os
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.cli import main
from kvoffload.errors import ConfigError
from kvoffload.models.hf_bounds import INT_BOUNDS, MAX_CONFIG_BYTES, MAX_LAYERS
from kvoffload.models.hf_config import derive_preset, load_model_config, resolve_model
from kvoffload.models.preset import ModelPreset

CONFIGS = Path(__file__).parent / "model_configs"


def _fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((CONFIGS / name / "config.json").read_text())
    return data


LLAMA = _fixture("Llama-3.1-8B")
NEMOTRON = _fixture("Nemotron-H-8B-Base-8K")
GEMMA3_WRAPPED = _fixture("gemma-3-27b-it")
GEMMA3 = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
          "vocab_size": 262208, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
          **{k: v for k, v in GEMMA3_WRAPPED["text_config"].items() if k != "model_type"}}
QWEN3_MOE = {**_fixture("Qwen3-8B"), "model_type": "qwen3_moe",
             "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128,
             "num_experts_per_tok": 8, "moe_intermediate_size": 768,
             "decoder_sparse_step": 1, "mlp_only_layers": []}

WRONG = {"string": "36", "float": 36.0, "nan": math.nan, "inf": math.inf, "bool": True,
         "null": None, "list": [36], "negative": -1}
"""The wrong values the issue tried for each field."""

# (field, base): null is "absent" for a field the config may leave out (the layout is then
# derived without it); for num_hidden_layers it is refused.
FIELDS = [("num_hidden_layers", LLAMA), ("head_dim", LLAMA), ("sliding_window", LLAMA),
          ("layer_types", LLAMA), ("mlp_only_layers", QWEN3_MOE), ("torch_dtype", LLAMA)]
VALID_AS_ABSENT = {("head_dim", "null"), ("sliding_window", "null"), ("layer_types", "null"),
                   ("mlp_only_layers", "null"), ("torch_dtype", "null"),
                   ("mlp_only_layers", "list")}  # [36]: layer 36 is an MLP-only layer


def _field_cases() -> list[Any]:
    cases = []
    for field, base in FIELDS:
        for label, value in WRONG.items():
            ok = (field, label) in VALID_AS_ABSENT
            cases.append(pytest.param({**base, field: value}, None if ok else field,
                                      id=f"{field}={label}"))
    return cases


def _deep(depth: int) -> str:
    return '{"model_type": "llama", "x": ' + "[" * depth + "]" * depth + "}"


SHAPE_CASES = [
    pytest.param({**GEMMA3, "sliding_window_pattern": 0}, "sliding_window_pattern",
                 id="gemma3-sliding_window_pattern=0"),
    pytest.param({**GEMMA3_WRAPPED, "text_config": {**GEMMA3_WRAPPED["text_config"],
                                                    "sliding_window_pattern": 0}},
                 "sliding_window_pattern", id="gemma3-wrapped-sliding_window_pattern=0"),
    pytest.param({**LLAMA, "torch_dtype": ["bfloat16"]}, "torch_dtype",
                 id="torch_dtype=list-of-names"),
    pytest.param({**LLAMA, "torch_dtype": "36"}, "torch_dtype", id="torch_dtype=unknown"),
    pytest.param({**LLAMA, "num_hidden_layers": 1e9}, "num_hidden_layers", id="layers=1e9"),
    pytest.param({**LLAMA, "num_hidden_layers": 10**9}, "num_hidden_layers",
                 id="layers=10**9"),
    pytest.param({**LLAMA, "head_dim": 2**40}, "head_dim", id="head_dim=2**40"),
    pytest.param({**LLAMA, "num_key_value_heads": 10**12}, "num_key_value_heads",
                 id="kv_heads=10**12"),
    pytest.param({**LLAMA, "num_key_value_heads": 1e12}, "num_key_value_heads",
                 id="kv_heads=1e12"),
    pytest.param({**LLAMA, "num_hidden_layers": MAX_LAYERS, "head_dim": 16384},
                 "bytes of KV cache per token",
                 id="fields-in-bounds-multiplying-past-them"),
    pytest.param({**NEMOTRON, "hybrid_override_pattern": "M-" * 500_000},
                 "hybrid_override_pattern", id="nemotron-pattern-1M-chars"),
    pytest.param({**NEMOTRON, "hybrid_override_pattern": 52}, "hybrid_override_pattern",
                 id="nemotron-pattern-not-a-string"),
    pytest.param({**LLAMA, "layer_types": ["full_attention"] * 31}, "layer_types",
                 id="layer_types-shorter-than-num_hidden_layers"),
    pytest.param({**LLAMA, "model_type": "x" * 100_000}, "model_type",
                 id="model_type-100k-chars"),
    pytest.param({**LLAMA, "text_config": 5}, "text_config", id="text_config-not-object"),
]


def _write(tmp_path: Path, content: dict[str, Any] | str | bytes) -> Path:
    model = tmp_path / "model"
    model.mkdir(parents=True, exist_ok=True)
    file = model / "config.json"
    if isinstance(content, bytes):
        file.write_bytes(content)
    else:
        file.write_text(content if isinstance(content, str) else json.dumps(content))
    return model


def _refused(model: Path, field: str) -> ConfigError:
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        resolve_model(str(model))
    assert time.monotonic() - started < 10, "refused, but not within bounded time"
    message = str(err.value)
    assert str(model) in message and field in message, message
    assert "\n" not in message and len(message) < 1000, message
    return err.value


@pytest.mark.parametrize(("config", "field"), [*_field_cases(), *SHAPE_CASES])
def test_a_wrong_field_is_one_config_error_naming_file_and_field(
        tmp_path: Path, config: dict[str, Any], field: str | None) -> None:
    model = _write(tmp_path, config)
    if field is None:  # null for an optional field: read as absent
        assert isinstance(resolve_model(str(model)), ModelPreset)
        return
    _refused(model, field)


FILE_CASES = [
    pytest.param(_deep(100_000), "deeper than 32", id="json-nested-100k-deep"),
    pytest.param(_deep(40), "deeper than 32", id="json-nested-40-deep"),
    pytest.param(json.dumps({**NEMOTRON, "hybrid_override_pattern": "M" * 10_000_000}),
                 f"over {MAX_CONFIG_BYTES:,} bytes", id="nemotron-pattern-10M-chars"),
    pytest.param(b"\xff\xfe{}", "not valid UTF-8", id="not-utf8"),
    pytest.param("[1, 2]", "not a JSON object", id="json-list"),
    pytest.param("{", "cannot be read as JSON", id="truncated-json"),
    pytest.param("", "cannot be read as JSON", id="empty"),
]


@pytest.mark.parametrize(("content", "needle"), FILE_CASES)
def test_a_file_that_is_not_a_config_is_refused_with_bounded_memory(
        tmp_path: Path, content: str | bytes, needle: str) -> None:
    model = _write(tmp_path, content)
    tracemalloc.start()
    try:
        _refused(model, needle)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 40 << 20, f"peak {peak:,} bytes"


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _directory(path: Path) -> None:
    path.mkdir()


@pytest.mark.parametrize(("make", "needle"), [(_fifo, "a FIFO"), (_zero, "a device"),
                                              (_directory, "a directory")])
def test_a_config_json_that_is_not_a_regular_file_is_refused_at_once(
        tmp_path: Path, make: Any, needle: str) -> None:
    model = tmp_path / "model"
    model.mkdir()
    make(model / "config.json")
    _refused(model, needle)


CLI_CASES = [
    pytest.param({**LLAMA, "num_hidden_layers": "36"}, "num_hidden_layers", id="layers=str"),
    pytest.param({**LLAMA, "head_dim": math.nan}, "head_dim", id="head_dim=nan"),
    pytest.param({**LLAMA, "head_dim": 2**40}, "head_dim", id="head_dim=2**40"),
    pytest.param({**LLAMA, "num_key_value_heads": 10**12}, "num_key_value_heads",
                 id="kv_heads=10**12"),
    pytest.param({**QWEN3_MOE, "mlp_only_layers": "36"}, "mlp_only_layers",
                 id="mlp_only_layers=str"),
    pytest.param({**LLAMA, "torch_dtype": [1]}, "torch_dtype", id="torch_dtype=list"),
    pytest.param({**GEMMA3, "sliding_window_pattern": 0}, "sliding_window_pattern",
                 id="gemma3-pattern=0"),
    pytest.param(_deep(5000), "deeper than 32", id="deep-json"),
]
COMMANDS = {
    "presets": ["presets", "--model"],
    "plan": ["plan", "--limit", "3", "--quiet", "--model"],
    "simulate": ["simulate", "--limit", "3", "--no-baseline", "--quiet", "--model"],
    "sweep": ["sweep", "--limit", "3", "--quiet", "--model"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize(("config", "field"), CLI_CASES)
def test_every_command_taking_a_model_prints_one_error_line_and_exits_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str,
        config: dict[str, Any] | str, field: str) -> None:
    model = _write(tmp_path, config)
    status = main([*COMMANDS[command], str(model)])
    out, err = capsys.readouterr()
    assert status == 2, (out, err)
    assert "Traceback" not in err and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert str(model) in lines[0] and field in lines[0], err
    assert len(lines[0]) < 1000


def test_plan_recommends_nothing_for_a_shape_outside_the_bounds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _write(tmp_path, {**LLAMA, "head_dim": 2**40, "num_key_value_heads": 10**12})
    status = main(["plan", "--limit", "3", "--quiet", "--model", str(model)])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and "num_key_value_heads" in err
    assert "must be an integer from 1 to 16,384" in err


def test_published_configs_at_the_edges_of_the_bounds_still_derive(tmp_path: Path) -> None:
    """The bounds are generous: a model with the largest count of layers and a wide head
    derives; one past them does not."""
    edge = {**LLAMA, "num_hidden_layers": MAX_LAYERS, "head_dim": 512}
    assert resolve_model(str(_write(tmp_path / "a", edge))).num_layers == MAX_LAYERS
    _refused(_write(tmp_path / "b", {**edge, "num_hidden_layers": MAX_LAYERS + 1}),
             "num_hidden_layers")


# ----------------------------------------------------------------- fuzzing the reader

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)
KNOWN = sorted({*INT_BOUNDS, "model_type", "architectures", "text_config", "layer_types",
                "layers_block_type", "mlp_only_layers", "torch_dtype", "dtype",
                "mamba_ssm_cache_dtype", "hybrid_override_pattern", "use_sliding_window",
                "mamba_d_head", "mamba_dt_rank", "tie_word_embeddings", "rope_scaling"})
PLAUSIBLE = (st.integers(min_value=-2, max_value=70) | st.sampled_from(
    [0, 1, 2, 4096, 4097, 16384, 2**40, 10**12, "auto", "bfloat16", "M-*E", [0, 1],
     ["full_attention", "sliding_attention"], math.nan, math.inf, 36.0, "36"]))
BASES = [LLAMA, NEMOTRON, GEMMA3, GEMMA3_WRAPPED, QWEN3_MOE,
         _fixture("AI21-Jamba-Mini-1.5"), _fixture("DeepSeek-V3"),
         _fixture("Qwen3-Next-80B-A3B-Instruct"), _fixture("Falcon-H1-7B-Instruct"),
         _fixture("granite-4.0-h-small"), _fixture("gpt-oss-20b")]
FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


def _layout_or_config_error(model: Path) -> None:
    """A preset (for one and for two ranks) or ``ConfigError``; any other exception fails."""
    try:
        derive_preset(load_model_config(model), name="m", source=str(model))
        derive_preset(load_model_config(model), name="m", source=str(model),
                      tensor_parallel=2)
    except ConfigError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 2000, str(exc)


@FUZZ
@given(data=st.binary(max_size=200))
def test_fuzz_any_bytes(tmp_path: Path, data: bytes) -> None:
    _layout_or_config_error(_write(tmp_path, data))


@FUZZ
@given(value=JSON)
def test_fuzz_any_json_value(tmp_path: Path, value: Any) -> None:
    _layout_or_config_error(_write(tmp_path, json.dumps(value)))


@settings(FUZZ, max_examples=150)
@given(base=st.sampled_from(BASES),
       changes=st.dictionaries(st.sampled_from(KNOWN), PLAUSIBLE | JSON, min_size=1,
                               max_size=3))
def test_fuzz_known_fields_set_to_any_json(tmp_path: Path, base: dict[str, Any],
                                           changes: dict[str, Any]) -> None:
    _layout_or_config_error(_write(tmp_path, {**base, **changes}))


@pytest.mark.parametrize("ref", ["model\0dir", "m" * 100_000, "/" + "m" * 100_000 + "/x"],
                         ids=["nul-byte", "100k-char-name", "100k-char-path"])
def test_a_model_path_the_system_cannot_name_is_a_short_config_error(ref: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_model(ref)
    assert "\n" not in str(err.value) and len(str(err.value)) < 1000, str(err.value)[:300]
