"""Ray Serve LLM's way (docs/serve.md): ``specbatch.serve.LLMConfig`` and ``build_openai_app`` with Ray Serve LLM's
field names, several models behind one app routed by ``model``, its documented Python example and Serve config with
only the import path changed, talked to with the official ``openai`` client."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import openai
import pytest
import yaml
from test_pipeline import REPO

from specbatch.serve import LLMConfig, build_openai_app

# Ray Serve LLM's documented Python example (its quickstart), with the import changed, two models (tiny ones this
# machine has, on CPU replicas: no accelerator_type nor tensor parallelism), the second with a speculative config.
SERVE_LLM_EXAMPLE = """
from ray import serve
from specbatch.serve import LLMConfig, build_openai_app

llm_config = LLMConfig(
    model_loading_config=dict(
        model_id="tiny-a",
        model_source=TARGET,
    ),
    deployment_config=dict(
        autoscaling_config=dict(
            min_replicas=1, max_replicas=2,
        )
    ),
    engine_kwargs=dict(max_num_seqs=4),
)
llm_config_b = LLMConfig(
    model_loading_config=dict(model_id="tiny-b", model_source=TARGET),
    engine_kwargs=dict(
        max_num_seqs=4,
        # length_policy (this engine's own field): draft every step, whatever the tiny draft's acceptance.
        speculative_config=dict(model=DRAFT, num_speculative_tokens=3, length_policy="static"),
    ),
)

app = build_openai_app({"llm_configs": [llm_config, llm_config_b]})
serve.run(app, name=NAME, route_prefix=PREFIX)
"""

# Its Serve config file's form (import_path changed), as `serve run config.yaml` reads it.
SERVE_LLM_YAML = """
applications:
- name: llm_app
  route_prefix: /yaml
  import_path: specbatch.serve:build_openai_app
  args:
    llm_configs:
      - model_loading_config:
          model_id: tiny-a
          model_source: {target}
        deployment_config:
          autoscaling_config:
            min_replicas: 1
            max_replicas: 2
        engine_kwargs:
          max_num_seqs: 4
      - model_loading_config:
          model_id: tiny-b
          model_source: {target}
        engine_kwargs:
          max_num_seqs: 4
          speculative_config:
            model: {draft}
            num_speculative_tokens: 3
            length_policy: static
"""


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_dirs):
    from ray import serve
    from test_pipeline import unused_ports

    port = unused_ports(1)[0]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    scope = {"TARGET": tiny_dirs["target"], "DRAFT": tiny_dirs["draft"], "NAME": "llm", "PREFIX": "/"}
    exec(SERVE_LLM_EXAMPLE, scope)
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_every_model_and_an_unknown_one_is_a_404_naming_them(client, server):
    assert sorted(model.id for model in client.models.list().data) == ["tiny-a", "tiny-b"]
    assert client.models.retrieve("tiny-b").id == "tiny-b"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="tiny-c", prompt="the cat", max_tokens=4)
    assert "tiny-a" in str(missing.value) and "tiny-b" in str(missing.value)
    body = httpx.post(f"{server}/v1/completions", json={"prompt": "the cat", "max_tokens": 2}, timeout=60).json()
    assert body["error"]["param"] == "model"  # two models: a request must name one


@pytest.mark.parametrize("model", ["tiny-a", "tiny-b"])
def test_chat_and_completions_streamed_and_not_reach_the_model_named(client, model):
    completion = client.completions.create(model=model, prompt="the cat sat", max_tokens=8, temperature=0)
    assert completion.model == model and completion.choices[0].text and completion.usage.completion_tokens > 0
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "the cat"}],
                                          max_tokens=8, temperature=0)
    assert chat.model == model and chat.choices[0].message.content
    streamed = client.completions.create(model=model, prompt="the cat sat", max_tokens=8, temperature=0,
                                         stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == completion.choices[0].text
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "the cat"}],
                                                 max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    # The speculative config reached its model: its responses carry drafted tokens.
    drafted = completion.model_extra["metrics"]["speculative_decoding"]["num_draft_tokens"]
    assert drafted > 0 if model == "tiny-b" else True


def test_the_router_reads_a_bodys_model_with_the_replicas_json_parser():
    """json.loads recursed per level: a body 100k lists deep raised RecursionError out of the route."""
    from deploy.router import _model_of

    assert _model_of(b'{"model": "m", "prompt": "x"}') == "m" and _model_of(b"") is None
    assert _model_of(b"[1]") is None and _model_of(b'{"model": 3}') is None
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"model": '):
        with pytest.raises(ValueError):
            _model_of(body)


def test_the_routers_replicas_import_neither_torch_nor_transformers():
    """The router only relays bytes: its module (what its replica imports) leaves the engine's stack to the model
    replicas: 5 CPU-s and 430 MB of resident memory less for every application's router."""
    code = ("import sys, deploy.router; heavy = sorted({'torch', 'transformers', 'decoding.engine.engine'} & "
            "set(sys.modules)); print(heavy); sys.exit(bool(heavy))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


def test_a_body_nested_past_the_parsers_bound_is_the_routers_openai_shaped_400(server):
    """As the one-model server answers it; the router's json.loads raised RecursionError, a plain-text 500."""
    deep = httpx.post(f"{server}/v1/completions", content=b"[" * 100_000 + b"]" * 100_000,
                      headers={"Content-Type": "application/json"}, timeout=60)
    assert deep.status_code == 400 and deep.json()["error"]["type"] == "invalid_request_error", deep.text
    assert "Invalid JSON" in deep.json()["error"]["message"]


def test_a_models_own_errors_come_back_through_the_router_in_openais_shape(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny-a", prompt="the cat", max_tokens=4, extra_body={"top_k": -5})
    assert refused.value.body["param"] == "top_k"


def test_a_replica_killed_mid_stream_ends_the_stream_with_an_error_event_and_done(server, client):
    """The model's replica dies while a stream runs: the client gets an error event and [DONE], not a hung or
    truncated stream; Serve starts another replica and the model answers again."""
    import ray

    replicas = [actor for actor in ray.util.list_named_actors(all_namespaces=True)
                if actor["name"].startswith("SERVE_REPLICA::llm#LLMServer:tiny-a#")]
    assert replicas
    body = {"model": "tiny-a", "prompt": "the cat", "max_tokens": 240, "n": 16, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        next(events)  # under way
        for actor in replicas:
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=False)
        rest = list(events)
    assert rest[-1] == "data: [DONE]"
    assert '"error"' in rest[-2] and "service_unavailable" in rest[-2]
    deadline = time.monotonic() + 120
    while True:  # a new replica comes up; until then the model's requests are 503s, never hangs
        try:
            answer = client.completions.create(model="tiny-a", prompt="the cat", max_tokens=4)
            break
        except openai.APIStatusError as refused:
            assert refused.status_code == 503 and time.monotonic() < deadline
            time.sleep(2)
    assert answer.choices[0].text is not None


def test_the_serve_config_file_form_runs_with_only_the_import_path_changed(server, tiny_dirs, tmp_path):
    """What `serve run config.yaml` does: import the builder named by import_path, call it with args, run the app
    under the file's name and route prefix."""
    from ray import serve
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.utils import import_attr

    serve.delete("llm")  # the Python example's app: room on the test cluster's CPUs for this one
    text = SERVE_LLM_YAML.format(target=tiny_dirs["target"], draft=tiny_dirs["draft"])
    (application,) = yaml.safe_load(text)["applications"]
    app = call_user_app_builder_with_args_if_necessary(import_attr(application["import_path"]), application["args"])
    serve.run(app, name=application["name"], route_prefix=application["route_prefix"])
    try:
        client = openai.OpenAI(base_url=f"{server}/yaml/v1", api_key="unused", max_retries=0, timeout=120)
        assert sorted(model.id for model in client.models.list().data) == ["tiny-a", "tiny-b"]
        for model in ("tiny-a", "tiny-b"):
            answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=4)
            assert answer.model == model and answer.choices[0].finish_reason in ("stop", "length")
    finally:
        serve.delete(application["name"])


def test_metrics_behind_the_api_key_are_refused_by_the_router_as_the_replicas_refuse_them(server, tiny_dirs):
    """With ``metrics_require_api_key``, the merged /metrics of several models is the replicas' 401 without the key
    (not their error bodies parsed as Prometheus text), and every model's metrics with it."""
    from ray import serve

    serve.delete("llm")  # room on the test cluster's CPUs
    guarded = {"api_key": "sk-metrics", "metrics_require_api_key": True, "batch_size": 2}
    configs = [LLMConfig(model_loading_config={"model_id": name, "model_source": tiny_dirs["target"]},
                         specbatch=guarded) for name in ("tiny-m1", "tiny-m2")]
    serve.run(build_openai_app({"llm_configs": configs}), name="guarded", route_prefix="/guarded")
    try:
        refused = httpx.get(f"{server}/guarded/metrics", timeout=60)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "invalid_request_error"
        text = httpx.get(f"{server}/guarded/metrics", headers={"Authorization": "Bearer sk-metrics"}, timeout=60).text
        assert 'model_name="tiny-m1"' in text and 'model_name="tiny-m2"' in text
    finally:
        serve.delete("guarded")


def test_llm_config_takes_ray_serve_llms_fields_and_refuses_what_specbatch_does_not_do(tiny_dirs):
    # ray.serve.llm itself imports vLLM; its config classes do not.
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig as RayLLMConfig
    from ray.llm._internal.serve.core.configs.llm_config import ModelLoadingConfig as RayModelLoadingConfig

    from specbatch.serve import ModelLoadingConfig

    assert set(RayLLMConfig.model_fields) <= set(LLMConfig.model_fields)
    assert set(RayModelLoadingConfig.model_fields) <= set(ModelLoadingConfig.model_fields)
    config = LLMConfig(model_loading_config={"model_id": "m", "model_source": tiny_dirs["target"]},
                       engine_kwargs={"max_num_seqs": 8, "max_model_len": 64, "seed": 3},
                       deployment_config={"num_replicas": 2, "max_ongoing_requests": 64},
                       specbatch={"graceful_shutdown_timeout_s": 5}).engine_config()
    assert (config.served_model_name, config.model, config.batch_size, config.max_model_len) == (
        "m", tiny_dirs["target"], 8, 64)
    assert (config.concurrency, config.graceful_shutdown_timeout_s, config.sampling.seed) == (2, 5, 3)
    for fields, named in (({"lora_config": {"dynamic_lora_loading_path": "s3://x", "bogus": 1}}, "lora_config"),
                          ({"llm_engine": "SGLang"}, "llm_engine"),
                          ({"engine_kwargs": {"tensor_parallel_size": 2}}, "tensor_parallel_size"),
                          ({"deployment_config": {"replicas": 2}}, "deployment_config"),
                          ({"engine_kwargs": {"bogus": 1}}, "bogus")):
        with pytest.raises(ValueError, match=named):
            LLMConfig(model_loading_config={"model_id": "m"}, **fields)
    with pytest.raises(ValueError, match="more than once"):
        build_openai_app({"llm_configs": [{"model_loading_config": {"model_id": "m"}}] * 2})


def test_build_llm_deployment_honours_deployment_config_runtime_env_and_accelerator(tiny_dirs, monkeypatch):
    import deploy.router
    from specbatch.serve import build_llm_deployment

    # The app is built, never run: whether the cluster can hold an A100 replica is not this test's point.
    monkeypatch.setattr(deploy.router, "check_cluster", lambda config, what: None)
    app = build_llm_deployment(LLMConfig(
        model_loading_config={"model_id": "m", "model_source": tiny_dirs["target"]}, accelerator_type="A100",
        deployment_config={"num_replicas": 3, "max_ongoing_requests": 64, "ray_actor_options": {"num_cpus": 0.5}},
        runtime_env={"env_vars": {"A": "1"}, "pip": ["x"]}))
    deployment = app._bound_deployment  # the replicas are the app's ingress: no router in front
    assert deployment.name == "LLMServer:m"
    assert (deployment.num_replicas, deployment.max_ongoing_requests) == (3, 64)
    actor = deployment.ray_actor_options
    assert (actor["num_cpus"], actor["accelerator_type"]) == (0.5, "A100")
    assert actor["runtime_env"] == {"pip": ["x"], "env_vars": {"RAY_worker_niceness": "0", "A": "1"}}
