"""Tiny randomly initialised models and a character tokenizer, built in-process for fast tests."""

from __future__ import annotations

import copy
import string

import numpy as np
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
               kv_heads: int = 2, hidden: int = 64, intermediate: int = 128) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
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


def k_quant_bytes(weight: np.ndarray, type_name: str) -> np.ndarray:
    """[N, K] float32 weights rounded to the nearest of a Q4_K or Q6_K grid (the ``gguf`` package quantizes to
    neither), as the [N, K / 256 * bytes] super-blocks ggml lays out (``block_q4_K``, ``block_q6_K``)."""
    rows, cols = weight.shape
    supers = cols // 256

    def f16(values: np.ndarray) -> np.ndarray:
        return values.astype(np.float16)

    def safe(values: np.ndarray) -> np.ndarray:
        return np.where(values == 0, 1, values)

    if type_name == "Q6_K":
        groups = weight.reshape(rows, supers, 16, 16)
        wanted = np.abs(groups).max(-1) / 31  # each half-block's step
        big_d = f16(wanted.max(-1) / 127)
        scales = np.clip(np.round(wanted / safe(big_d.astype(np.float32))[..., None]), 1, 127).astype(np.int8)
        step = big_d.astype(np.float32)[..., None] * scales
        q = (np.clip(np.round(groups / safe(step)[..., None]), -32, 31) + 32).astype(np.uint8)
        q = q.reshape(rows, supers, 2, 128)  # a 128-weight half: low nibbles of 64 bytes, bit pairs of 32
        low, high = q & 15, (q >> 4).reshape(rows, supers, 2, 4, 32)
        ql = low[..., :64] | low[..., 64:] << 4
        qh = high[..., 0, :] | high[..., 1, :] << 2 | high[..., 2, :] << 4 | high[..., 3, :] << 6
        parts = [ql.reshape(rows, supers, 128), qh.reshape(rows, supers, 64), scales.view(np.uint8),
                 big_d[..., None].view(np.uint8)]
    else:
        groups = weight.reshape(rows, supers, 8, 32)
        lowest = np.minimum(groups.min(-1), 0)
        wanted_scale, wanted_min = (groups.max(-1) - lowest) / 15, -lowest
        big_d, big_min = f16(wanted_scale.max(-1) / 63), f16(wanted_min.max(-1) / 63)
        scales = np.clip(np.round(wanted_scale / safe(big_d.astype(np.float32))[..., None]), 1, 63).astype(np.uint8)
        mins = np.clip(np.round(wanted_min / safe(big_min.astype(np.float32))[..., None]), 0, 63).astype(np.uint8)
        step = big_d.astype(np.float32)[..., None] * scales
        offset = big_min.astype(np.float32)[..., None] * mins
        q = np.clip(np.round((groups + offset[..., None]) / step[..., None]), 0, 15).astype(np.uint8)
        q = q.reshape(rows, supers, 4, 2, 32)  # 64 weights: 32 bytes, the first 32 low, the next 32 high
        nibbles = (q[:, :, :, 0] | q[:, :, :, 1] << 4).reshape(rows, supers, 128)
        packed = np.concatenate([scales[..., :4] | (scales[..., 4:] >> 4) << 6,  # 6-bit scales and mins
                                 mins[..., :4] | (mins[..., 4:] >> 4) << 6,
                                 (scales[..., 4:] & 15) | (mins[..., 4:] & 15) << 4], -1)
        parts = [big_d[..., None].view(np.uint8), big_min[..., None].view(np.uint8), packed, nibbles]
    return np.concatenate([part.reshape(rows, supers, -1) for part in parts], -1).reshape(rows, -1)


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

        def quantize(values: torch.Tensor) -> np.ndarray:
            values = values.detach().float().numpy()
            return k_quant_bytes(values, type_name) if type_name.endswith("_K") else quants.quantize(values, kind)

        writer.add_tensor(name, quantize(weight if stored is None else stored), raw_dtype=kind)
        # quantization is per row, so the permuted rows dequantize to the permuted dequantized rows
        return torch.from_numpy(quants.dequantize(quantize(weight), kind))

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
