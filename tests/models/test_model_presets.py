"""Model presets: byte and FLOP figures against hand computation."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kvoffload.config import GroupKind, OffloadConfig
from kvoffload.errors import ConfigError
from kvoffload.models.presets import (
    GEMMA3_27B,
    GPT_OSS_20B,
    LLAMA3_8B,
    NEMOTRON_H_8B,
    PRESETS,
    get_preset,
)


def test_llama3_8b_bytes_per_token() -> None:
    assert LLAMA3_8B.bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131072
    assert LLAMA3_8B.bytes_per_state == 0
    (group,) = LLAMA3_8B.groups(16)
    assert group.kind is GroupKind.FULL_ATTENTION
    assert group.num_layers == 32
    assert group.page_bytes == 16 * 8 * 128 * 2 * 2 == 65536


def test_gpt_oss_20b_has_two_groups_of_twelve_layers() -> None:
    layout = GPT_OSS_20B.layout(16)
    full, window = layout.groups
    assert full.spec.kind is GroupKind.FULL_ATTENTION
    assert window.spec.kind is GroupKind.SLIDING_WINDOW
    assert window.spec.sliding_window == 128
    for g in (full, window):
        assert g.spec.num_layers == 12
        assert g.bytes_per_token == 12 * 8 * 64 * 2 * 2 == 24576
        assert g.spec.page_bytes == 16 * 8 * 64 * 2 * 2 == 32768
    assert GPT_OSS_20B.bytes_per_token == 49152


def test_gemma3_27b_five_local_layers_per_global() -> None:
    full, window = GEMMA3_27B.layout(32).groups
    assert (full.spec.num_layers, window.spec.num_layers) == (10, 52)
    assert window.spec.sliding_window == 1024
    assert full.bytes_per_token == 10 * 16 * 128 * 2 * 2 == 81920
    assert window.bytes_per_token == 52 * 16 * 128 * 2 * 2 == 425984
    assert full.spec.page_bytes == 32 * 16 * 128 * 2 * 2


def test_nemotron_h_8b_mamba_state() -> None:
    attn, mamba = NEMOTRON_H_8B.layout(64, mamba_block_size=256).groups
    assert attn.bytes_per_token == 4 * 8 * 128 * 2 * 2 == 16384
    conv = (4 - 1) * (128 * 64 + 2 * 8 * 128) * 2  # bf16
    ssm = 128 * 64 * 128 * 4  # fp32
    assert (conv, ssm) == (61440, 4194304)
    assert mamba.spec.kind is GroupKind.MAMBA
    assert mamba.spec.block_size == 256
    assert mamba.spec.page_bytes == conv + ssm == 4255744
    assert mamba.bytes_per_state == 24 * (conv + ssm) == NEMOTRON_H_8B.bytes_per_state
    assert mamba.bytes_per_token == 0
    assert NEMOTRON_H_8B.num_layers == 52


def test_flops_per_token_hand_computed() -> None:
    c = 1000
    assert LLAMA3_8B.prefill_flops_per_token(c) == (2 * LLAMA3_8B.params_per_token
                                                    + 32 * 4 * 32 * 128 * c)
    # The window caps the sliding layers' span at 128.
    assert GPT_OSS_20B.prefill_flops_per_token(c) == (2 * GPT_OSS_20B.params_per_token
                                                      + 12 * 4 * 64 * 64 * c
                                                      + 12 * 4 * 64 * 64 * 128)
    mamba = 24 * 6 * 128 * 64 * 128
    assert NEMOTRON_H_8B.prefill_flops_per_token(c) == (2 * NEMOTRON_H_8B.params_per_token
                                                        + 4 * 4 * 32 * 128 * c + mamba)


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize(("computed", "total"), [(0, 1), (0, 200), (100, 1500), (1023, 1025)])
def test_prefill_flops_closed_form_matches_the_sum(name: str, computed: int,
                                                   total: int) -> None:
    preset = PRESETS[name]
    brute = sum(preset.prefill_flops_per_token(i + 1) for i in range(computed, total))
    assert preset.prefill_flops(total, computed) == brute


def test_scaled_layout_keeps_real_sizes_for_accounting() -> None:
    layout = NEMOTRON_H_8B.layout(16, scale_bytes=64)
    attn, mamba = layout.groups
    assert attn.spec.page_bytes == 64 and attn.real_page_bytes == 65536
    # 4255744 * 64 / 65536 = 4155.99 -> 4156 -> rounded up to 8 bytes.
    assert mamba.spec.page_bytes == 4160 and mamba.real_page_bytes == 4255744
    assert layout.is_scaled and "SCALED" in layout.describe()
    assert [s.page_bytes for s in layout.real_specs] == [65536, 4255744]
    assert mamba.real_block_bytes == 24 * 4255744
    unscaled = NEMOTRON_H_8B.layout(16)
    assert not unscaled.is_scaled and "real sizes" in unscaled.describe()
    assert unscaled.specs == layout.real_specs


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_groups_make_a_valid_offload_config(name: str) -> None:
    groups = PRESETS[name].groups(16, scale_bytes=16)
    config = OffloadConfig(groups=groups, hash_block_size=16, host_capacity_bytes=1 << 20,
                           eviction_policy="lru")
    assert len(config.resolved) == len(groups)
    assert PRESETS[name].name in PRESETS[name].describe()


def test_bad_inputs_raise() -> None:
    with pytest.raises(ConfigError, match="unknown preset"):
        get_preset("gpt-5")
    with pytest.raises(ConfigError, match="scale_bytes"):
        LLAMA3_8B.layout(16, scale_bytes=0)
    with pytest.raises(ValueError, match="context_len"):
        LLAMA3_8B.prefill_flops_per_token(0)
    assert get_preset("gemma3-27b") is GEMMA3_27B


LAZY_SCRIPT = textwrap.dedent("""
    import json
    from kvoffload.models import hf_config

    derived = []
    derive = hf_config.derive_preset

    def counting(*args, **kwargs):
        derived.append(kwargs["name"])
        return derive(*args, **kwargs)

    hf_config.derive_preset = counting
    from kvoffload.models import presets

    def state():
        return {"derived": len(derived),
                "file_reads": hf_config.preset_entries.cache_info().misses,
                "built": hf_config.builtin_presets.cache_info().currsize}

    steps = {"import": state()}
    first = presets.PRESETS["llama3-8b"]
    steps["first use"] = state()
    assert "gemma3-27b" in presets.PRESETS and len(presets.PRESETS) > 1
    assert presets.get_preset("llama3-8b") is first is presets.LLAMA3_8B
    steps["later uses"] = state()
    steps["entries"] = len(hf_config.preset_entries())
    print(json.dumps(steps))
""")


def test_importing_the_registry_derives_nothing_and_first_use_derives_once() -> None:
    """``import kvoffload.models.presets`` reads no file and derives no preset (a fresh
    interpreter); the first lookup reads presets.json once and derives every preset once."""
    out = subprocess.run([sys.executable, "-c", LAZY_SCRIPT], capture_output=True,
                         text=True, check=True).stdout
    steps = json.loads(out)
    assert steps["import"] == {"derived": 0, "file_reads": 0, "built": 0}
    every = steps["entries"]
    assert every == len(PRESETS)
    assert steps["first use"] == {"derived": every, "file_reads": 1, "built": 1}
    assert steps["later uses"] == steps["first use"]
