"""Ray Data LLM's quickstart ("Quickstart: vLLM batch inference", Ray 2.60 docs), run by specbatch: only the import,
the config's class name and the model changed (any model path, hub id or alias works; this one is bundled).

    python examples/ray_data_llm_quickstart.py
"""

import ray

from specbatch import ProcessorConfig, build_processor

# Initialize Ray
ray.init()

# simple dataset
ds = ray.data.from_items([
    {"prompt": "What is machine learning?"},
    {"prompt": "Explain neural networks in one sentence."},
])

# Minimal configuration
config = ProcessorConfig(
    model_source="smollm2-135m-instruct",
    concurrency=1,  # 1 engine replica
    batch_size=32,  # 32 samples per batch
)

# Build processor
# preprocess: converts input row to format expected by the engine (OpenAI chat format)
# postprocess: extracts generated text from the engine's output
processor = build_processor(
    config,
    preprocess=lambda row: {
        "messages": [{"role": "user", "content": row["prompt"]}],
        "sampling_params": {"temperature": 0.7, "max_tokens": 100},
    },
    postprocess=lambda row: {
        "prompt": row["prompt"],
        "response": row["generated_text"],
    },
)

# inference
ds = processor(ds)

# iterate through the results
for result in ds.iter_rows():
    print(f"Q: {result['prompt']}")
    print(f"A: {result['response']}\n")
