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


def _llama_cpp_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows in llama.cpp's order (its converter interleaves each head's rotary halves)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).transpose(1, 2).reshape(weight.shape)


def gguf_pair(model: LlamaForCausalLM, path, layers: str = "Q4_1", embedding: str = "Q8_0",
              head: str | None = "Q8_0") -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """``model``'s weights quantized to GGUF blocks and written to the GGUF file ``path`` as llama.cpp lays a Llama
    out (q and k rows permuted; ``head`` None: no output tensor, the head stays float). Returns (reference, blocks):
    a float copy holding the blocks' dequantized weights, and a copy of that multiplying the file's blocks."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    from decoding.model.gguf_blocks import LAYER_LINEARS, use_gguf_blocks

    config = model.config
    reference = copy.deepcopy(model)
    writer = GGUFWriter(str(path), "llama")

    def add(name: str, weight: torch.Tensor, type_name: str, stored: torch.Tensor | None = None) -> torch.Tensor:
        kind = GGMLQuantizationType[type_name]
        raw = quants.quantize((weight if stored is None else stored).detach().float().numpy(), kind)
        writer.add_tensor(name, raw, raw_dtype=kind)
        # quantization is per row, so the permuted rows dequantize to the permuted dequantized rows
        return torch.from_numpy(quants.dequantize(quants.quantize(weight.detach().float().numpy(), kind), kind))

    with torch.no_grad():
        base = reference.model
        base.embed_tokens.weight.copy_(add("token_embd.weight", base.embed_tokens.weight, embedding))
        for index, layer in enumerate(base.layers):
            for short, (parent, child) in LAYER_LINEARS.items():
                module = getattr(getattr(layer, parent), child)
                stored = None
                if short in ("attn_q", "attn_k"):
                    heads = config.num_attention_heads if short == "attn_q" else config.num_key_value_heads
                    stored = _llama_cpp_rows(module.weight, heads)
                module.weight.copy_(add(f"blk.{index}.{short}.weight", module.weight, layers, stored))
        if head is not None:
            reference.lm_head.weight.copy_(add("output.weight", reference.lm_head.weight, head))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference, use_gguf_blocks(copy.deepcopy(reference), path)
