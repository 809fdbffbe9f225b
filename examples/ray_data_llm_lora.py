"""Ray Data LLM's LoRA example ("Batch inference with LoRA adapters", Ray 2.60 docs), run by specbatch: only the
import, the config's class name and the model changed. Each row names its adapter in ``model``; the engine reads it
from ``dynamic_lora_loading_path/<name>`` (a folder or an ``s3://``/``gs://`` URI) and batches rows of different
adapters, and of the base model, in the same steps. Ray's example reads adapters from S3; this one first saves a
small random adapter for the bundled model in a local folder (any PEFT adapter folder works).

    python examples/ray_data_llm_lora.py
"""

import json
import tempfile
from pathlib import Path

import ray
import torch
from safetensors.torch import save_file

from specbatch import ProcessorConfig, build_processor


def save_random_adapter(folder: Path, rank: int = 8) -> None:
    """A PEFT adapter folder for SmolLM2-135M (30 layers, hidden 576, 3 key-value heads of 64) on q_proj and
    v_proj, with random weights: it changes the answers, nothing more."""
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(30):
        for projection, out in (("q_proj", 576), ("v_proj", 192)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{projection}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, 576, generator=generator) * 0.05
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.05
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}))


adapters = Path(tempfile.mkdtemp())
save_random_adapter(adapters / "random-adapter")

ray.init()

config = ProcessorConfig(
    model_source="smollm2-135m-instruct",
    engine_kwargs={
        "enable_lora": True,
        "max_lora_rank": 32,
        "max_loras": 1,
    },
    concurrency=1,
    batch_size=16,
    dynamic_lora_loading_path=str(adapters),
)

processor = build_processor(
    config,
    preprocess=lambda row: dict(
        # Rows name the adapter to use; the base model's name (or none) means no adapter.
        model="random-adapter" if row["id"] % 2 else "smollm2-135m-instruct",
        messages=[{"role": "user", "content": f"Give me one fact about the number {row['id']}."}],
        sampling_params=dict(temperature=0.3, max_tokens=40),
    ),
    postprocess=lambda row: dict(id=row["id"], adapter=row["lora"], answer=row["generated_text"]),
)

ds = processor(ray.data.from_items([{"id": i} for i in range(4)]))
for result in ds.iter_rows():
    print(f"{result['id']} [{result['adapter'] or 'base'}]: {result['answer']!r}")
