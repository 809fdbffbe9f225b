"""Ray Serve LLM's API for this engine: a Ray Serve LLM deployment switches by changing its import
(``from ray.serve.llm import ...`` -> ``from specbatch.serve import ...``; in a Serve config file, the
``import_path`` ``ray.serve.llm:build_openai_app`` -> ``specbatch.serve:build_openai_app``).

    from ray import serve
    from specbatch.serve import LLMConfig, build_openai_app

    llm_config = LLMConfig(
        model_loading_config={"model_id": "smollm2", "model_source": "smollm2-135m-instruct"},
        deployment_config={"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}},
    )
    serve.run(build_openai_app({"llm_configs": [llm_config]}))

docs/serve.md ("Ray Serve LLM's way") lists the fields and what each means here.
"""

from deploy.llm_config import LLMConfig, ModelLoadingConfig
from deploy.llm_config import ServingArgs as LLMServingArgs
from deploy.router import build_llm_deployment, build_openai_app

__all__ = ["LLMConfig", "LLMServingArgs", "ModelLoadingConfig", "build_llm_deployment", "build_openai_app"]
