"""Weight-only quantization (decoding/model/quantize.py): the int4 and int8 kernels compute the quantized weights, a
head with exact top logits recomputes them in float, fused siblings compute what separate layers compute."""

from __future__ import annotations

import copy

import torch


def test_int4_and_int8_kernels_compute_the_quantized_weights() -> None:
    from decoding.model.quantize import int4_groupwise, int8_per_channel, quantize_linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    x = torch.randn(5, 64)
    for scheme in ("int4", "int8"):
        layer = copy.deepcopy(linear)
        quantize_linear(layer, scheme, groupsize=32)
        # The kernels read bf16 activations and scales (their fast path on CPU): the reference rounds alike.
        if scheme == "int4":
            q, scales_and_zeros = int4_groupwise(linear.weight.detach(), 32)
            scale, zero = scales_and_zeros.bfloat16().float().permute(1, 0, 2).unbind(-1)  # [N, K / 32]
            weight = ((q.float().reshape(48, 2, 32) - 8) * scale[..., None] + zero[..., None]).reshape(48, 64)
        else:
            q, scale = int8_per_channel(linear.weight.detach())
            weight = q.float() * scale.bfloat16().float()[:, None]
        expected = x.bfloat16().float() @ weight.T + linear.bias
        assert torch.allclose(layer(x), expected, atol=0.02 * float(expected.abs().max()))
        assert (weight - linear.weight).abs().max() < 0.1 * linear.weight.abs().max()
    odd = torch.nn.Linear(64, 6)  # 6 outputs: the CPU int4 packing wants multiples of 16, so this layer is int8
    quantize_linear(odd, "int4", groupsize=32)
    q, scale = int8_per_channel(odd.weight.detach())
    expected = x.bfloat16().float() @ (q.float() * scale.bfloat16().float()[:, None]).T + odd.bias
    assert torch.allclose(odd(x), expected, atol=0.02 * float(expected.abs().max()))


def test_a_head_with_exact_top_logits_recomputes_its_largest_outputs_in_float() -> None:
    from decoding.model.quantize import quantize_linear

    torch.manual_seed(0)
    head = torch.nn.Linear(64, 96)
    x = torch.randn(2, 3, 64)
    plain, rescored = copy.deepcopy(head), copy.deepcopy(head)
    quantize_linear(plain, "int4", groupsize=32)
    quantize_linear(rescored, "int4", groupsize=32, exact_top=5)
    approximate, mixed, exact = plain(x), rescored(x), head(x).detach()
    chosen = approximate.topk(5, -1).indices
    top = torch.zeros_like(mixed, dtype=torch.bool).scatter(-1, chosen, True)
    assert int(top.sum()) == 2 * 3 * 5
    torch.testing.assert_close(mixed[top], exact[top])  # the int4 head's top 5 of each row, in float
    assert torch.equal(mixed[~top], approximate[~top])  # the rest as the int4 head computed them
    assert not torch.equal(mixed, approximate)


def test_fused_siblings_compute_what_separate_layers_compute(target) -> None:
    from decoding.model.quantize import FusedSiblings, _kernel, quantize_linear, quantized, siblings_weight

    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, n, bias=bias) for n, bias in ((48, True), (16, False), (32, True))]
    separate = copy.deepcopy(layers)
    for layer in separate:
        quantize_linear(layer, "int4", groupsize=32)
    FusedSiblings(layers, _kernel(*siblings_weight(layers), "int4", 32))
    x, y = torch.randn(3, 64), torch.randn(3, 64)
    expected = [layer(x) for layer in separate]
    # In order, out of order, and a sibling called with another input (computes again, never mixes inputs).
    assert all(torch.allclose(layer(x), want, atol=1e-5) for layer, want in zip(layers, expected))
    assert torch.allclose(layers[2](x), expected[2], atol=1e-5)
    assert torch.allclose(layers[0](x), expected[0], atol=1e-5)
    assert torch.allclose(layers[1](y), separate[1](y), atol=1e-5)
    assert torch.allclose(layers[1](x), expected[1], atol=1e-5)
    # The twin fuses q/k/v and gate/up, and computes what a twin of separate layers computes.
    twin = quantized(target, "int4")
    attention = twin.model.layers[0].self_attn
    assert attention.q_proj.forward.func.__self__ is attention.v_proj.forward.func.__self__
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    unfused = copy.deepcopy(target)
    for module in unfused.modules():
        if isinstance(module, torch.nn.Linear):
            head = module is unfused.get_output_embeddings()  # int4 with its top 8 logits exact
            quantize_linear(module, "int4", 32, exact_top=8 if head else 0)
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, unfused(ids).logits, rtol=1e-4, atol=1e-4)
