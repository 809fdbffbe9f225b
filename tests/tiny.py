"""Tiny randomly initialised models and a character tokenizer, built in-process for fast tests."""

from __future__ import annotations

import copy
import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<s>", "</s>"]
CHARS = list(string.ascii_lowercase + " .,")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()  # characters join back without spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return tokenizer


def tiny_model(seed: int = 0, layers: int = 2, vocab_size: int = len(SPECIALS) + len(CHARS), heads: int = 4,
               kv_heads: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
        initializer_range=0.3, eos_token_id=2, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model


def noisy_copy(model: LlamaForCausalLM, scale: float, seed: int = 1) -> LlamaForCausalLM:
    """A draft that mostly agrees with the target: the target's weights plus noise."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale * param.std())
    return draft
