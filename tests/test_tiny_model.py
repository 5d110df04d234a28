"""The generated model is a real mlx-lm model: it loads offline and generates tokens."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rankscope.shared.tiny_model import TinyModelSpec, write_tiny_model

pytestmark = pytest.mark.mlx

REPO = Path(__file__).parent.parent


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(layers=3, hidden=32))


def test_mlx_lm_loads_it_offline_and_generates(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlx_lm

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = mlx_lm.load(str(tiny_model))
    model, tokenizer = loaded[0], loaded[1]
    assert len(model.layers) == 3
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "which rank is stuck?"}], add_generation_prompt=True
    )
    tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=8)]
    assert len(tokens) >= 1
    assert all(0 <= t < tokenizer.vocab_size for t in tokens)


def test_tokenizer_round_trips_any_text(tiny_model: Path) -> None:
    from mlx_lm.tokenizer_utils import load

    tokenizer = load(tiny_model)
    text = "Rank 1 is stuck in decode_barrier — ünïcode 日本 🙂"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_same_seed_same_files_other_seed_other_weights(tiny_model: Path, tmp_path: Path) -> None:
    again = write_tiny_model(tmp_path / "again", TinyModelSpec(layers=3, hidden=32))
    other = write_tiny_model(tmp_path / "other", TinyModelSpec(layers=3, hidden=32, seed=1))
    assert _digest(again) == _digest(tiny_model)
    assert _digest(other)["model.safetensors"] != _digest(tiny_model)["model.safetensors"]
    assert _digest(other)["tokenizer.json"] == _digest(tiny_model)["tokenizer.json"]


def test_config_describes_the_architecture(tiny_model: Path) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["num_hidden_layers"] == 3
    assert config["hidden_size"] == 32


@pytest.mark.parametrize(
    ("kwargs", "complaint"),
    [
        ({"layers": 0}, "layers"),
        ({"hidden": 40}, "multiple of 16"),
        ({"vocab": 10}, "vocab"),
        ({"arch": "gpt2"}, "no tiny 'gpt2' model; the architectures are: llama, mistral"),
    ],
)
def test_bad_shapes_are_refused(kwargs: dict[str, Any], complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        TinyModelSpec(**kwargs)


def test_cli_writes_the_model(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rankscope.services.cli",
            "tiny-model",
            str(tmp_path / "m"),
            "--layers",
            "2",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "2-layer qwen2 model" in result.stdout
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_hidden_layers"] == 2


def test_cli_refuses_a_bad_shape_in_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rankscope.services.cli",
            "tiny-model",
            str(tmp_path / "m"),
            "--hidden",
            "40",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "rankscope: hidden must be a positive multiple of 16, got 40"
    assert not (tmp_path / "m").exists()
