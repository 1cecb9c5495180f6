"""`python -m model.inspect` end to end, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from model.inspect import format_bytes, main


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "model.inspect", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.integration
def test_default_run_prints_the_tiny_model_table():
    result = run()
    assert result.returncode == 0, result.stderr
    assert "tiny" in result.stdout and "6.52M" in result.stdout and "KV cache" in result.stdout


@pytest.mark.integration
def test_llama3_8b_prints_8_03b_parameters():
    result = run("model=llama3_8b")
    assert result.returncode == 0, result.stderr
    assert "8.03B (8,030,261,248)" in result.stdout


def test_json_output_compares_presets_and_shows_the_kv_reductions(capsys):
    assert main(["model=llama2_7b,llama3_70b,deepseek_v3", "format=json", "seq_len=4096"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert table["llama2_7b"]["kv_reduction_vs_mha"] == 1.0
    assert table["llama3_70b"]["kv_reduction_vs_mha"] == 8.0
    assert table["deepseek_v3"]["kv_reduction_vs_mha"] > 70
    assert table["llama3_70b"]["kv_bytes_per_sequence"] == 327680 * 4096


def test_overrides_and_sharding_change_the_numbers(capsys):
    assert (
        main(["model=llama3_8b", "model.attention.n_kv_heads=32", "dp_shard=8", "format=json"]) == 0
    )
    row = json.loads(capsys.readouterr().out)["llama3_8b"]
    assert row["kv_reduction_vs_mha"] == 1.0
    assert row["train_state_bytes_per_device"] == row["train_state_bytes"] / 8


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["model=llama5"], "model='llama5' is not a preset"),
        (["model.attention.n_kv_heads=5", "model=llama3_8b"], "not divisible"),
        (["color=red"], "unknown option 'color'"),
        (["dtype=int3"], "dtype='int3'"),
        (["seq_len"], "expected key=value"),
        (["memory_gib=lots"], "memory_gib='lots' must be a number"),
        (["memory_gib=0"], "memory_gib=0 must be > 0"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(args, message, capsys):
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_help_lists_the_presets(capsys):
    assert main(["--help"]) == 0
    assert "llama3_8b" in capsys.readouterr().out


def test_default_seq_len_is_the_readme_tables_8192_within_each_context(capsys):
    """Not a preset's full context (163,840 for DeepSeek-V3): the README's table is at 8192."""
    assert main(["model=deepseek_v3,llama3_8b,llama2_7b,tiny", "format=json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {name: row["seq_len"] for name, row in rows.items()} == {
        "deepseek_v3": 8192,
        "llama3_8b": 8192,
        "llama2_7b": 4096,
        "tiny": 512,
    }
    assert round(rows["deepseek_v3"]["train_flops_per_token"] / 1e9, 1) == 281.2  # README's row
    assert main(["model=deepseek_v3"]) == 0
    assert "seq_len min(8192, context)" in capsys.readouterr().out


def test_sizes_of_1024_gib_and_more_print_in_tib(capsys):
    assert main(["model=deepseek_v3"]) == 0
    table = capsys.readouterr().out
    assert "9.76 TiB" in table and "9999" not in table  # AdamW state: 16 bytes x 671B
    assert format_bytes(1023 * 2**30) == "1023.00 GiB" and format_bytes(2**40) == "1.00 TiB"
