"""Write a tiny but real mlx-lm model directory: one of several architectures people run,
random weights, a byte-level BPE tokenizer trained here. Tests and the demo load it through the same
code path as a user's model, with no model hub involved.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ARCHITECTURES", "TinyModelSpec", "write_tiny_model"]

_CORPUS = """\
A cluster runs one large model across several machines. Each machine runs one runner per
rank, and each runner holds a slice of the model's layers. The first rank embeds the prompt,
passes its activations to the next rank, and the last rank samples the next token.
When a rank stops making progress the others wait for it at the next collective, and the
whole cluster hangs. The flight recorder notes every phase: connect group, load model,
warm up, task agreement, prompt build, prefill, decode, completion. Memory is measured as
active, cache and peak bytes. The quick brown fox jumps over the lazy dog; pack my box with
five dozen liquor jugs. Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ; : ! ? ( ) [ ] { }
"hello" 'world' - + = * / % # @ & are part of ordinary text, as are questions: what is the
rank that is stuck? Which node holds layer seven? How much memory does it hold?
"""
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Shape of the generated model; the same spec and seed give the same files."""

    layers: int = 4
    hidden: int = 64
    vocab: int = 512
    seed: int = 0
    arch: str = "qwen2"

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            known = ", ".join(ARCHITECTURES)
            raise ValueError(f"no tiny {self.arch!r} model; the architectures are: {known}")
        if self.layers < 1:
            raise ValueError(f"layers must be at least 1, got {self.layers}")
        if self.hidden < 16 or self.hidden % 16:
            raise ValueError(f"hidden must be a positive multiple of 16, got {self.hidden}")
        if self.vocab < 300:
            raise ValueError(f"vocab must be at least 300 (256 bytes + merges), got {self.vocab}")


def _train_tokenizer(out: Path, vocab: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "chat_template": _CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return int(tokenizer.get_vocab_size())


def _common(spec: TinyModelSpec, vocab_size: int) -> dict[str, Any]:
    heads = spec.hidden // 16
    return {
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "intermediate_size": spec.hidden * 2,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": _SPECIAL_TOKENS.index("<|im_end|>"),
        "torch_dtype": "float32",
    }


ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {}),
    "mistral": ("MistralForCausalLM", {"tie_word_embeddings": False}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma3_text": (
        "Gemma3ForCausalLM",
        # a short window and pattern, so a test prompt crosses both
        {"head_dim": 16, "sliding_window": 8, "sliding_window_pattern": 3},
    ),
    "phi3": ("Phi3ForCausalLM", {"tie_word_embeddings": False}),
    "olmo2": ("Olmo2ForCausalLM", {"tie_word_embeddings": False}),
}
"""What `write_tiny_model` can make: `model_type` → (HF architecture, config overrides)."""


def write_tiny_model(directory: Path, spec: TinyModelSpec | None = None) -> Path:
    """Write `config.json`, `model.safetensors`, `tokenizer.json` and
    `tokenizer_config.json` into `directory` and return it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes as model_classes
    from mlx_lm.utils import load_config

    spec = spec or TinyModelSpec()
    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = _train_tokenizer(directory, spec.vocab)
    architecture, overrides = ARCHITECTURES[spec.arch]
    config = {
        "model_type": spec.arch,
        "architectures": [architecture],
        **_common(spec, vocab_size),
        **overrides,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mx.random.seed(spec.seed)
    model_class, args_class = model_classes(load_config(directory))
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    return directory
