"""Shared fixtures: tiny random models (in memory and saved as model directories) and a local Ray cluster."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

# The suite's two workers share the machine's cores with their subprocesses, Ray actors and servers, whose engines
# run a torch thread per core: waiting OpenMP threads sleep instead of spinning. Beside two busy loops, the Ray Data
# LLM quickstart example took 107 s with spinning threads and 70 s with sleeping ones; alone, 27 s either way.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Ray starts its worker processes (engine actors, Serve replicas, tasks) at niceness 15, below every other process:
# beside the other worker's in-process tests or a CPU-heavy job they got a few percent of a core (a job of 60 small
# files beside one busy loop: 25-26 s at 15, 19-21 s at 0). Every cluster the tests start, in this process or a
# subprocess, inherits this.
os.environ.setdefault("RAY_worker_niceness", "0")
# The two workers share the machine's cores, so each engine in an actor, replica or job runs one torch thread, as
# SPECBATCH_CPU_THREADS is meant for (tests/test_processor.py alone: 140-146 busy CPU-s with a thread per core,
# 134-138 with one).
os.environ.setdefault("SPECBATCH_CPU_THREADS", "1")
# Ray waits 60 s for a head's dashboard to register, then `ray start --head` exits: beside a busy loop with three
# pytest workers one took 74 s, and the job-submission test failed on a slow machine, not on a fault.
os.environ.setdefault("RAY_DASHBOARD_STARTUP_TIMEOUT_S", "180")

import torch  # noqa: E402

# Triton decides at import whether kernels are interpreted: without a GPU, its kernels run on the CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))
# Engines in tests run the eager lean forward (each tiny model shape would otherwise compile its own package);
# the compiled forward has tests of its own that turn this on.
os.environ.setdefault("SPECBATCH_COMPILE", "0")


SHARED = Path(__file__).resolve().parents[1].parent / "shared"


# Engine tests run on every device this machine has: the CUDA path is tested wherever a GPU is present.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="session", params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


# The engine stack (``engine_cases``, ``tiny``: 3.4 s of imports) is imported by the fixtures that use it, not at
# the top: pytest-xdist's controller loads this file before it starts the workers and runs no test itself.
@pytest.fixture(scope="session")
def tokenizer():
    from tiny import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="session")
def target():
    from tiny import tiny_model

    return tiny_model()


@pytest.fixture(scope="session")
def draft(target):
    from tiny import noisy_copy

    return noisy_copy(target, 0.05)


@pytest.fixture(scope="session")
def reference(tokenizer, target) -> list[list[int]]:
    """transformers' greedy decoding of ``engine_cases.PROMPTS``, one prompt at a time, in float32 on CPU."""
    from engine_cases import transformers_greedy

    return transformers_greedy(target, tokenizer)


@pytest.fixture(scope="module")
def small_models():
    """A target over a 6-token vocabulary (id 2 is EOS) and a noisy draft: small enough to enumerate exact laws."""
    from engine_cases import SMALL_VOCAB
    from tiny import noisy_copy, tiny_model

    target = tiny_model(seed=3, vocab_size=SMALL_VOCAB)
    return target, noisy_copy(target, 0.6, seed=4)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, tokenizer, target, draft) -> dict[str, str]:
    """Target and draft saved as ordinary model directories, for code that loads models by path."""
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for name, model in (("target", target), ("draft", draft)):
        path = root / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[name] = str(path)
    return paths


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session (starting one costs seconds)."""
    import ray

    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    # As `specbatch serve` gives the cluster it starts (jobs/serve.py): Serve's controller replaces an HTTP proxy
    # that has not answered its readiness check in 5 s three times, and serve.start then fails; beside a CPU-heavy
    # job a starting proxy took longer. The cluster's processes inherit this.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
    # Processes report their metrics every second (Ray's default: 10 s), so the metrics tests wait seconds.
    # address="local": a cluster of its own. Without an address ray.init joins the machine's current cluster (Ray's
    # ray_current_cluster file), which another test's cluster may be while it runs.
    ray.init(address="local", num_cpus=4, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False,
             _system_config={"metrics_report_interval_ms": 1000})
    # With log_to_driver off nothing reads what the log monitor publishes, and it polls every worker's log files ten
    # times a second: 27 CPU-s of a whole run's two clusters.
    ray._private.worker._global_node.kill_log_monitor()
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def fresh_data_context():
    """Ray Data's context starts afresh after each test (its defaults made again on first use): what one test sets,
    progress bars or a job's settings, never reaches the next."""
    yield
    if "ray.data" in sys.modules:
        sys.modules["ray.data"].DataContext._set_current(None)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.exists():
        pytest.fail(f"../shared not found at {SHARED}")
    return SHARED


# Tiny models gain nothing from threads, and on a shared 2-core machine spinning OpenMP threads cost a lot.
torch.set_num_threads(1)


def scrape_ray_metrics(ray, prefix: str = "ray_vllm_", **labels: str) -> dict[tuple[str, str], float]:
    """Ray's metrics export of this node, the samples named ``prefix...`` whose labels include ``labels``: (sample
    name, position label) -> value summed over the processes that recorded it."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    port = next(node["MetricsExportPort"] for node in ray.nodes() if node["Alive"])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    totals: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix) and all(sample.labels.get(k) == v for k, v in labels.items()):
                key = (sample.name, sample.labels.get("position", ""))
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


# The whole suite's wall-time budget, enforced where CI runs it (``CI`` set, every collected test run): a change that
# makes the suite slower than this fails there, long before CI's own 90-minute limit. The CI machines differ: 2-core
# VMs ran it alone in about 15 minutes (AVX-512 Xeon and EPYC) and in 21-23 (an AVX2-only Zen 3 EPYC; 32-33 beside
# a CPU-heavy job), so the budget is 45.
SUITE_BUDGET_S = 2700
_started = time.monotonic()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker: the controller judges the whole run
        return
    elapsed = time.monotonic() - _started
    options = session.config.option
    whole = session.config.args == session.config.getini("testpaths") and not options.keyword and not options.markexpr
    if os.environ.get("CI") and whole and exitstatus == pytest.ExitCode.OK and elapsed > SUITE_BUDGET_S:
        session.config.pluginmanager.get_plugin("terminalreporter").write_sep(
            "=", f"the test suite took {elapsed:.0f} s, over its budget of {SUITE_BUDGET_S} s (tests/conftest.py)",
            red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# The README's ``-n 2`` (pyproject: ``--dist loadfile``) gives each worker whole modules, so a module's fixtures (its
# server, its engines) are built once. Modules go out longest first (their wall time in a whole run, seconds), so
# the run ends on short ones that fill both workers: ending on a long module that mostly waits (a server's start, a
# killed driver) left one worker and most of a core idle for its last 35 s.
HEAVY_FIRST = ["test_real_model", "test_pipeline", "test_processor", "test_serve", "test_engine",  # 380-220
               "test_serve_llm", "test_tool_calls", "test_serve_shutdown", "test_triton_kernels",  # 130-100
               "test_constrained", "test_lora", "test_cluster", "test_training", "test_engine_triton",  # 85-55
               "test_limits", "test_sampling_params", "test_pipeline_s3", "test_bad_inputs",  # 55-35
               "test_device_hazards", "test_prefix_cache", "test_grammar", "test_layer_skip", "test_lease",  # 30-18
               "test_packed_checkpoints", "test_gguf_blocks"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: at for at, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(rank)) if item.module else len(rank))


@pytest.fixture(scope="module")
def heads(tmp_path_factory, target) -> dict[str, str]:
    """Untrained (random) heads: the trained policies must stay lossless whatever the head predicts."""
    from decoding.drafting.signal_head import DraftSignalMLP

    paths = {}
    for name, seed in (("acceptance_head", 0), ("decision_model", 1)):
        torch.manual_seed(seed)
        path = tmp_path_factory.mktemp(name)
        DraftSignalMLP(target.config.hidden_size).save(path)
        paths[name] = str(path)
    return paths


@pytest.fixture(scope="module")
def feature_draft(target) -> torch.nn.Module:
    """An untrained feature draft: the engine must stay lossless whatever it proposes."""
    from decoding.drafting.feature_draft import FeatureDraft

    torch.manual_seed(0)
    return FeatureDraft.from_target(target, [1], list(range(target.config.vocab_size)))
