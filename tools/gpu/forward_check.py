"""The GPU forward check: the fused Triton layer against the reference forward, on the device, old against new.

Run by ``tools/gpu/forward.sh`` on a GPU machine (one call); on a CPU it runs small (``--tiny``, the Triton
kernels interpreted), which is how it is tested. Parts, each recorded in ``forward_check.json`` (rewritten after
every part, so a run cut short keeps what it measured; a part that fails is recorded and the rest go on) and one
Markdown table, ``forward_check.md``:

- ``correct``: logits of the fused Triton forward against the reference forward (SDPA over gathered blocks) on
  random-weight models of SmolLM2-135M's and Llama-3-8B's shapes: decode steps and a 16-node tree over rows of
  ragged cached lengths; the largest difference and the share of rows whose argmax agrees.
- ``graphs``: CUDA graphs captured at build replayed against the eager forward of the same inputs (fresh inputs
  and lengths each call), for the fused kernels (one graph for every context) and the reference (key buckets).
- ``steps``: ms of the target's decode forward, a 6-token verification and the int4 self-draft's decode forward,
  replayed as graphs, at batch 1/8/64 after 512 cached tokens, old (reference attention) against new (fused);
  bytes moved (weights and cached keys and values) and the share of the device's memory bandwidth.
- ``plain``: the engine's plain decoding step (``speculative.method: none``), ms a step, SmolLM2's shape, old and
  new execution, batch 1/8/64.
- ``launches``: kernel launches of one eager forward (the profiler), per forward and per layer, old and new.
- ``micro``: GB/s of the 8B shape's GEMMs (``F.linear`` and tinygemm int4 at group sizes 32 and 128) at 1/8/64
  rows, and of attention alone (reference against fused) over 512 and 4096 cached tokens, 1/8/16/64 tree nodes,
  batch 1/8/64.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench import shape_costs
from bench.measure import Clock, ForwardBytes, count_launches, device_bandwidth
from decoding.model.execution import Execution
from decoding.model.forward import forward_tree
from decoding.model.kv_cache import CacheShape, PagedKVCache
from decoding.model.lean_forward import lean_view
from decoding.model.model_runner import ModelRunner
from decoding.model.quantize import int4_groupwise, int4_matmul, quantized
from decoding.verification.tree import TreeTopology, chain_ancestors

log = logging.getLogger("forward-check")

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "vocab_size": 49152, "rope_theta": 100000.0, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    },
    "llama3-8b": shape_costs.SHAPES["llama3-8b"],
    "tiny": {  # a CPU stand-in with the 8B shape's grouping (4 query heads per kv head)
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    },
    "tiny-gqa3": {  # SmolLM2's grouping (3 query heads per kv head)
        "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 6,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096, "tie_word_embeddings": True,
    },
}
BLOCK_SIZE = 16


def execution(device: torch.device, kernels: str, graphs: bool) -> Execution:
    return Execution(device_type=device.type, kernels=kernels,  # type: ignore[arg-type]
                     graphs=graphs and device.type == "cuda", compile=False, graph_memory_bytes=4 << 30,
                     interpret=device.type != "cuda")


def random_model(shape: str, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(LlamaConfig(**SHAPES[shape]), dtype=dtype)
    return model.eval()


def pool(config: LlamaConfig, lengths: list[int], extra: int, dtype: torch.dtype, device: torch.device,
         mode: Execution) -> PagedKVCache:
    """A pool whose rows hold ``lengths`` cached positions (random keys and values) and room for ``extra`` more."""
    positions = max(lengths) + extra
    blocks = len(lengths) * -(-positions // BLOCK_SIZE)
    cache = PagedKVCache(CacheShape.of(config), blocks, len(lengths), positions, block_size=BLOCK_SIZE,
                         dtype=dtype, device=device, execution=mode)
    generator = torch.Generator(device=device).manual_seed(1)
    cache.keys.normal_(generator=generator)
    cache.values.normal_(generator=generator)
    rows = cache.add_rows([positions] * len(lengths))
    cache.ensure(rows, [positions] * len(lengths))
    for row, length in enumerate(lengths):
        cache.host_lengths[row] = length
    return cache


def tree_of(nodes: int) -> tuple[torch.Tensor, int]:
    """The ancestors of a tree of ``nodes`` nodes (one root, then ``nodes - 1`` over a few levels), and its size."""
    if nodes == 1:
        return chain_ancestors(1), 1
    for depth in (7, 5, 3, 1):
        if (nodes - 1) % depth == 0:
            topology = TreeTopology(num_candidates=(nodes - 1) // depth, max_depth=depth)
            return topology.ancestors, topology.size(depth)
    return chain_ancestors(nodes), nodes


def timed(run: Callable[[], Any], clock: Clock, repeats: int, warm_up: int = 3) -> float:
    """Mean ms of ``run()``."""
    for _ in range(warm_up):
        run()
    clock.settle()
    seconds: list[float] = []
    with clock.span(seconds.append):
        for _ in range(repeats):
            run()
    clock.settle()
    return 1e3 * seconds[0] / repeats


# -------------------------------------------------------------------------------------------------- parts
def part_correct(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    out = {}
    lengths = [37, 512, 129, 16, 1000] if not args.tiny else [5, 40, 16]
    for shape in args.shapes:
        model = random_model(shape, device, dtype)
        view = lean_view(model)
        modes = {name: execution(device, name, graphs=False) for name in ("reference", "triton")}
        cache = pool(model.config, lengths, 32, dtype, device, modes["reference"])
        results = {}
        for case, nodes in (("decode", 1), ("tree16", 16)):
            ancestors, size = tree_of(nodes)
            ids = torch.randint(0, model.config.vocab_size, (len(lengths), size), device=device)
            valid = torch.ones(len(lengths), size, dtype=torch.bool)
            logits = {}
            for name, mode in modes.items():
                cache.execution = mode
                logits[name], _ = forward_tree(view, cache, slice(0, len(lengths)), ids, ancestors, valid)
            ref, new = logits["reference"].float(), logits["triton"].float()
            results[case] = {
                "max_abs_diff": float((ref - new).abs().max()), "max_abs_logit": float(ref.abs().max()),
                "argmax_agree": float((ref.argmax(-1) == new.argmax(-1)).float().mean()),
            }
            log.info("correct %s %s: %s", shape, case, results[case])
        out[shape] = results
        del model, view, cache
    return out


def part_graphs(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Replays against eager, fresh inputs each call (needs CUDA graphs: on a CPU, the eager stand-in recorder)."""
    from decoding.model.cuda_graphs import GraphedForward, build_shapes, pool_key, record_eagerly

    shape = args.shapes[0]
    model = random_model(shape, device, dtype)
    view = lean_view(model)
    out = {}
    for kernels in ("triton", "reference"):
        mode = execution(device, kernels, graphs=True)
        cache = pool(model.config, [64] * 4, 600, dtype, device, mode)
        positions = cache.max_positions_per_row
        # On a CPU the eager stand-in recorder: the buffers, padding and replays, without a device.
        graphed = ModelRunner(view, cache, captured=True).graphs if device.type == "cuda" else GraphedForward(
            functools.partial(view.flat_forward, execution=mode), positions, record=record_eagerly,
            key_buckets=kernels != "triton")
        shapes = build_shapes(pool_key(cache.keys), 4, positions, [1, 7], hidden=False,
                              keys_bucketed=graphed.key_buckets)
        captured = graphed.capture(shapes, cache.keys, cache.values, 4 << 30,
                                   (lambda: torch.cuda.memory_reserved(device)) if device.type == "cuda" else
                                   (lambda: 0))
        worst, calls = 0.0, 0
        for call, (batch, nodes, context) in enumerate([(1, 1, 30), (3, 1, 300), (4, 7, 77), (2, 7, 511),
                                                        (4, 1, 600)]):
            for row in range(4):
                cache.host_lengths[row] = context + 13 * row
            ancestors, size = tree_of(nodes)
            ids = torch.randint(0, model.config.vocab_size, (batch, size), device=device)
            meta, positions_ = cache.tree_metadata(slice(0, batch), ancestors, torch.ones(batch, size,
                                                                                         dtype=torch.bool), 0, size)
            at = torch.arange(size)
            replayed = graphed(ids, positions_, meta, cache.keys, cache.values, at, None)
            eager = view(ids, positions_, meta, cache.keys, cache.values, at, None, execution=mode)
            if replayed is None:
                raise AssertionError(f"call {call}: shape not captured")
            worst = max(worst, float((replayed[0].float() - eager[0].float()).abs().max()))
            calls += 1
        out[kernels] = {"captured": captured, "calls": calls, "max_abs_diff": worst,
                        "graphs": len(graphed.graphs)}
        log.info("graphs %s: %s", kernels, out[kernels])
    return out


def part_steps(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    clock = Clock(device)
    bandwidth = device_bandwidth(device)
    rows = []
    for shape in args.shapes[::-1]:  # the 8B shape first
        model = random_model(shape, device, dtype)
        target = lean_view(model)
        draft = lean_view(quantized(model, "int4")) if shape != "smollm2-135m" or args.tiny else None
        costs = {"target": ForwardBytes.of(target)}
        if draft is not None:
            costs["draft"] = ForwardBytes.of(draft)
        for batch in args.batches:
            for kernels in ("reference", "triton"):
                mode = execution(device, kernels, graphs=True)
                cache = pool(model.config, [args.context] * batch, 8, dtype, device, mode)
                forwards = [("target decode", target, 1, "target"), ("target verify d5", target, 6, "target")]
                if draft is not None:
                    forwards.append(("int4 self-draft decode", draft, 1, "draft"))
                for name, view, tokens, weights in forwards:
                    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), device=device)
                    ancestors, valid = chain_ancestors(tokens), torch.ones(batch, tokens, dtype=torch.bool)

                    runner = ModelRunner(view, cache, captured=True)  # replayed, as the engine's step forwards

                    def run(runner=runner, ids=ids, ancestors=ancestors, valid=valid) -> None:
                        runner.step(slice(0, ids.shape[0]), ids, ancestors, valid)

                    ms = timed(run, clock, args.repeats)
                    moved = costs[weights](batch * args.context)
                    rows.append({"shape": shape, "forward": name, "batch": batch, "kernels": kernels, "ms": ms,
                                 "bytes": moved, "bandwidth": moved / (ms / 1e3) / (bandwidth.gbs * 1e9)})
                    log.info("steps %s", rows[-1])
                del cache
        del model, target, draft
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return {"bandwidth_gbs": bandwidth.gbs, "bandwidth_source": bandwidth.source, "context": args.context,
            "rows": rows}


def part_plain(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The engine's plain step, random SmolLM2-shaped weights (the step's cost does not depend on them)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from tiny import tiny_tokenizer

    from decoding import Config, Engine, Request

    shape = args.shapes[0]
    model = random_model(shape, device, dtype)
    tokenizer = tiny_tokenizer()
    rows = []
    for batch in args.batches:
        for kernels in ("reference", "triton"):
            config = Config.model_validate({
                "model": shape, "batch_size": batch, "max_model_len": 1024, "execution": {"kernels": kernels},
                "speculative": {"method": "none"},
                "sampling": {"max_tokens": args.plain_tokens, "ignore_eos": True, "detokenize": False}})
            engine = Engine(config, target=model, tokenizer=tokenizer, device=device)
            generator = torch.Generator().manual_seed(batch)
            prompts = [torch.randint(3, model.config.vocab_size, (128,), generator=generator).tolist()
                       for _ in range(batch)]
            for i, prompt in enumerate(prompts):
                engine.add_request(Request(id=f"w{i}", prompt_token_ids=prompt))
            while engine.has_unfinished():  # warm-up: the same shapes
                engine.step()
            for i, prompt in enumerate(prompts):
                engine.add_request(Request(id=str(i), prompt_token_ids=prompt))
            engine.step()  # the prefill
            steps, started = 0, time.perf_counter()
            while engine.has_unfinished():
                engine.step()
                steps += 1
            ms = 1e3 * (time.perf_counter() - started) / max(steps, 1)
            rows.append({"shape": shape, "batch": batch, "kernels": kernels, "ms_per_step": ms, "steps": steps})
            log.info("plain %s", rows[-1])
            del engine
    return {"rows": rows}


def part_launches(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    out = {}
    for shape in args.shapes:
        model = random_model(shape, device, dtype)
        view = lean_view(model)
        layers = model.config.num_hidden_layers
        for kernels in ("reference", "triton"):
            mode = execution(device, kernels, graphs=False)
            cache = pool(model.config, [args.context], 8, dtype, device, mode)
            ids = torch.randint(0, model.config.vocab_size, (1, 1), device=device)

            def run(view=view, cache=cache, ids=ids) -> None:
                forward_tree(view, cache, slice(0, 1), ids, chain_ancestors(1), torch.ones(1, 1, dtype=torch.bool))

            run()
            count = count_launches(run, device)
            out[f"{shape} {kernels}"] = {"per_forward": count, "per_layer": count / layers}
            log.info("launches %s %s: %d (%.1f a layer)", shape, kernels, count, count / layers)
        del model, view
    return out


def part_micro(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    from decoding.model import triton_kernels as tk
    from decoding.model.attention import AttentionMetadata, reference_attention

    clock = Clock(device)
    config = LlamaConfig(**SHAPES[args.shapes[-1]])
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads
    gemms = {"qkv": (hidden + 2 * kv_heads * head_dim, hidden), "o": (hidden, hidden), "gate_up": (2 * inter, hidden),
             "down": (hidden, inter)}
    linear = []
    for name, (n, k) in gemms.items():
        weight = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        packed = {}
        if device.type == "cuda":
            for group in (32, 128):
                q, scales = int4_groupwise(weight, group)
                nibbles = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # as quantize.py packs for CUDA
                packed[group] = (torch.ops.aten._convert_weight_to_int4pack(nibbles, 8), scales.to(dtype))
        for m in args.batches:
            x = torch.randn(m, k, device=device, dtype=dtype)
            ms = timed(lambda x=x, weight=weight: torch.nn.functional.linear(x, weight), clock, args.repeats)
            row = {"gemm": name, "rows": m, "bf16_ms": ms, "bf16_gbs": n * k * dtype.itemsize / ms / 1e6}
            for group, (q, scales) in packed.items():
                ms4 = timed(lambda x=x, q=q, scales=scales, group=group: int4_matmul(x, q, scales, group), clock,
                            args.repeats)
                row[f"int4_g{group}_ms"] = ms4
                row[f"int4_g{group}_gbs"] = (n * k / 2 + n * k // group * 4) / ms4 / 1e6
            linear.append(row)
            log.info("micro %s", row)
    attention = []
    scale = head_dim**-0.5
    for context in args.contexts:
        for batch in args.batches:
            shape = CacheShape(1, kv_heads, head_dim)
            positions = context + 64
            blocks = batch * -(-positions // BLOCK_SIZE)
            cache = PagedKVCache(shape, blocks, batch, positions, block_size=BLOCK_SIZE, dtype=dtype, device=device)
            cache.keys.normal_()
            cache.values.normal_()
            every = cache.add_rows([positions] * batch)
            cache.ensure(every, [positions] * batch)
            for row in range(batch):
                cache.host_lengths[row] = context
            for nodes in args.nodes:
                ancestors, size = tree_of(nodes)
                meta, _ = cache.tree_metadata(every, ancestors, torch.ones(batch, size, dtype=torch.bool), 0, size)
                q = torch.randn(batch * size, heads, head_dim, device=device, dtype=dtype)
                k = torch.randn(batch * size, kv_heads, head_dim, device=device, dtype=dtype)
                v = torch.randn_like(k)
                keys, values = cache.keys[0], cache.values[0]
                moved = 2 * batch * context * kv_heads * head_dim * dtype.itemsize
                row = {"context": context, "batch": batch, "nodes": size}
                ref_meta = AttentionMetadata(meta.slots, meta.block_tables, meta.row_starts, meta.prefix_len,
                                             meta.tree_mask, meta.max_keys)
                try:
                    ms = timed(functools.partial(reference_attention, keys, values, q, k, v, ref_meta, scale), clock,
                               args.repeats)
                    row.update(reference_ms=ms, reference_gbs=moved / ms / 1e6)
                except torch.OutOfMemoryError:
                    row.update(reference_ms=None)
                ms = timed(functools.partial(tk.paged_attention, q, keys, values, meta.block_tables, meta.prefix_len,
                                             meta.tree_mask, scale, size), clock, args.repeats)
                row.update(fused_ms=ms, fused_gbs=moved / ms / 1e6)
                attention.append(row)
                log.info("micro %s", row)
            del cache
    return {"linear": linear, "attention": attention}


def part_race(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """A short speculative run of the engine with the fused kernels (what ``compute-sanitizer --tool racecheck``
    wraps): a tiny random model, n-gram drafts at a static depth, sampled and greedy rows."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from tiny import tiny_model, tiny_tokenizer

    from decoding import Config, Engine, Request

    config = Config.model_validate({
        "model": "tiny", "batch_size": 4, "execution": {"kernels": "triton", "graphs": "off"},
        "speculative": {"method": "ngram", "num_speculative_tokens": 3, "num_candidates": 2,
                        "length_policy": "static"}, "sampling": {"max_tokens": 8}})
    engine = Engine(config, target=tiny_model().to(device), tokenizer=tiny_tokenizer(), device=device)
    results = engine.generate([Request(id=str(i), prompt_token_ids=[3, 4, 5, 3, 4, 5, 3],
                                       sampling={"temperature": float(i % 2), "seed": i}) for i in range(4)])
    return {"tokens": sum(len(r.token_ids) for r in results),
            "drafted": sum(sum(r.per_step_drafted) for r in results),
            "accepted": sum(sum(r.per_step_accepted) for r in results)}


PARTS: dict[str, Callable[[argparse.Namespace, torch.device, torch.dtype], dict[str, Any]]] = {
    "correct": part_correct, "steps": part_steps, "plain": part_plain, "launches": part_launches,
    "graphs": part_graphs, "micro": part_micro, "race": part_race,
}


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Forward check: {report['env'].get('device')}", "", f"`{json.dumps(report['env'])}`", ""]
    steps = report["parts"].get("steps", {})
    if "rows" in steps:
        lines += [f"## Forwards replayed, {steps['context']} cached tokens a row "
                  f"({steps['bandwidth_gbs']:.0f} GB/s, {steps['bandwidth_source']})", "",
                  "| shape | forward | batch | old ms | old bw | new ms | new bw |", "|---|---|---|---|---|---|---|"]
        by_key = {(r["shape"], r["forward"], r["batch"], r["kernels"]): r for r in steps["rows"]}
        for (shape, forward, batch, kernels), row in by_key.items():
            if kernels != "reference":
                continue
            new = by_key.get((shape, forward, batch, "triton"), {})
            lines.append(f"| {shape} | {forward} | {batch} | {row['ms']:.3f} | {row['bandwidth']:.1%} | "
                         f"{new.get('ms', float('nan')):.3f} | {new.get('bandwidth', float('nan')):.1%} |")
    plain = report["parts"].get("plain", {})
    if "rows" in plain:
        lines += ["", "## Engine plain step", "", "| batch | kernels | ms a step |", "|---|---|---|"]
        lines += [f"| {r['batch']} | {r['kernels']} | {r['ms_per_step']:.3f} |" for r in plain["rows"]]
    for name in ("correct", "graphs", "launches"):
        if name in report["parts"]:
            lines += ["", f"## {name}", "", "```", json.dumps(report["parts"][name], indent=1), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--parts", nargs="+", default=[p for p in PARTS if p != "race"], choices=list(PARTS))
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama3-8b"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 8, 16, 64])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--plain-tokens", type=int, default=48)
    parser.add_argument("--budget", type=float, default=300.0, help="seconds; no part starts after it")
    parser.add_argument("--tiny", action="store_true", help="small shapes (a CPU run, kernels interpreted)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        args.shapes = ["tiny-gqa3", "tiny"]
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    import triton

    report: dict[str, Any] = {"env": {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "torch": torch.__version__, "triton": triton.__version__, "dtype": str(dtype)}, "parts": {}, "seconds": {}}
    started = time.perf_counter()
    for name in args.parts:
        if time.perf_counter() - started > args.budget:
            report["parts"][name] = {"skipped": "budget"}
            continue
        part_started = time.perf_counter()
        try:
            report["parts"][name] = PARTS[name](args, device, dtype)
        except Exception as exc:  # recorded; the other parts go on
            report["parts"][name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            log.error("part %s failed: %s", name, exc)
        report["seconds"][name] = round(time.perf_counter() - part_started, 1)
        (output / "forward_check.json").write_text(json.dumps(report, indent=1))
        (output / "forward_check.md").write_text(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
