"""Shared fixtures: the embedded model (prepared once, cached outside git) and real TorchServes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from llm_api.model.settings import default_checkpoint_path, default_model_path
from llm_api.model.embedded import prepare, prepare_gguf

# Without a GPU the Triton kernels (tests/kernels) run in Triton's CPU interpreter, which Triton reads
# when a kernel is decorated: set it here, before any test module imports llm_api.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

MARKER = "<|endoftext|>"

# The host kind the session stands for (README, "Testing"). DTYPE unset resolves to bfloat16 on a CPU with
# bfloat16 matrix instructions and to float32 on any other (llm_api.model.cpu), so a test that leaves DTYPE
# unset runs in a precision the host picks. LLM_API_TEST_DTYPE=bfloat16 (or float32) runs the whole suite
# as on the one kind (or the other) on any host: servers started without a DTYPE of their own get it, and
# in-process loads read a /proc/cpuinfo of that kind. Every test must give the same verdict both ways.
TEST_DTYPE = os.environ.get("LLM_API_TEST_DTYPE", "")
if TEST_DTYPE not in ("", "bfloat16", "float32"):
    raise pytest.UsageError(f"LLM_API_TEST_DTYPE={TEST_DTYPE!r}: allowed values: bfloat16, float32")
if TEST_DTYPE:
    os.environ["DTYPE"] = TEST_DTYPE
# The float32 kind is the 2-core AMD EPYC the suite also runs on: there CPU_PACKED_WEIGHTS=auto keeps the weights
# plain for the CPU kernels (llm_api.kernels.cpu) where a C compiler exists, as everywhere, and without one splits
# float32 products across the cores (llm_api.model.split_linear): so without a compiler its servers (which read
# the real /proc/cpuinfo) are told to split.
FORCED_CPUINFO = {"bfloat16": "vendor_id\t: GenuineIntel\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16\n",
                  "float32": "vendor_id\t: AuthenticAMD\nflags\t\t: avx2\n"}
if TEST_DTYPE == "float32" and not (shutil.which("cc") or shutil.which("gcc")):
    os.environ.setdefault("CPU_PACKED_WEIGHTS", "split")

CLASSIC_CONFIG = """\
minWorkers: 1
maxWorkers: 1
batchSize: 8
maxBatchDelay: 50
responseTimeout: 120
"""

# One handle() call gets exactly the four requests a test sends at once.
BATCH4_CONFIG = """\
minWorkers: 1
maxWorkers: 1
batchSize: 4
maxBatchDelay: 5000
responseTimeout: 120
"""


@pytest.fixture(scope="session", autouse=True)
def host_kind(tmp_path_factory):
    """With LLM_API_TEST_DTYPE set, in-process loads see a CPU of that kind (tests may still patch it)."""
    if not TEST_DTYPE:
        yield
        return
    from llm_api.model import cpu

    path = tmp_path_factory.mktemp("host-kind") / "cpuinfo"
    path.write_text(FORCED_CPUINFO[TEST_DTYPE])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu, "CPUINFO", path)
        yield


@pytest.fixture
def two_threads():
    """Two torch threads for the test, then the number the process had: for tests of how work is split across
    threads (the CPU kernels, the split float32 products), where scripts/test.sh starts the suite with one
    thread a process (OMP_NUM_THREADS=1: its processes share 2 cores, and a second thread a process only adds
    the cost of waking it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def embedded_model_path() -> Path:
    """What the servers serve: MODEL_PATH where set, else the embedded model's GGUF file (the default)."""
    if os.environ.get("MODEL_PATH"):
        return Path(os.environ["MODEL_PATH"])
    return prepare_gguf(default_model_path(os.environ))


@pytest.fixture(scope="session")
def embedded_checkpoint_path(embedded_model_path) -> Path:
    """The served model as a Hugging Face checkpoint folder, for transformers' own loading (tokenizers, the
    generate() and PEFT oracles): MODEL_PATH where it is one, else the embedded model's weights de-quantized."""
    if (embedded_model_path / "config.json").is_file():
        return embedded_model_path
    return prepare(default_checkpoint_path(os.environ), embedded_model_path)


@pytest.fixture(scope="session")
def tokenizer_folder(request) -> Path:
    """A folder with the embedded model's tokenizer (for tiny random models over its vocabulary):
    ``GPU_MODEL_FILES`` where set (a lent GPU machine has those files but no weights, scripts/gpu_check.sh),
    else the embedded model's own folder."""
    if os.environ.get("GPU_MODEL_FILES"):
        return Path(os.environ["GPU_MODEL_FILES"])
    return request.getfixturevalue("embedded_checkpoint_path")


def _serve(tmp_path_factory, embedded_model_path, name: str, model_config: str | None, wait_ready: bool = True,
           **kw):
    from bench.harness.torchserve_server import TorchServe

    env = {"MODEL_PATH": str(embedded_model_path), **kw.pop("env", {})}
    server = TorchServe(tmp_path_factory.mktemp(name), model_config=model_config, env=env, **kw)
    try:
        server.start(wait_ready=wait_ready)
    except Exception:
        server.stop()
        raise
    return server


def _serve_standalone(tmp_path_factory, embedded_model_path, name: str, env: dict | None = None, **kw):
    from bench.harness.standalone_server import StandaloneServer

    server = StandaloneServer(tmp_path_factory.mktemp(name), env={"MODEL_PATH": str(embedded_model_path),
                                                                 **(env or {})}, **kw)
    try:
        server.start()
    except Exception:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def start_standalone(tmp_path_factory, embedded_model_path):
    """A factory for tests that need an `llm_api serve` of their own: start_standalone(name, env=...)."""

    def start(name: str, env: dict | None = None, **kw):
        return _serve_standalone(tmp_path_factory, embedded_model_path, name, env, **kw)

    return start


@pytest.fixture(scope="session")
def start_server(tmp_path_factory, embedded_model_path):
    """A factory for tests that need a server of their own: start_server(name, model_config, env=...)."""

    def start(name: str, model_config: str | None, **kw):
        return _serve(tmp_path_factory, embedded_model_path, name, model_config, **kw)

    return start


# -------------------------------------------------------------------------------------------------------
# Shared servers and models: one per group of tests, released when the group is done
#
# A session fixture lives as long as its process: on an xdist worker that is the whole run, so every shared
# server (and in-process model) a worker ever started stayed alive beside the ones it started next (8
# servers and 3 workers at once, 16 GiB, and the OOM killer on a 24 GiB host). Instead, the shared ones are
# kept here by name, and ``pytest_runtest_teardown`` below releases them all when the next test belongs to
# another group (a group runs on one worker, its tests one after another: "Running in parallel" below), so
# a worker holds only what its current group uses.


class GroupShared:
    """Objects shared by the tests of one group, built on first use and released at the group's end."""

    def __init__(self) -> None:
        self._items: dict[str, tuple[object, object]] = {}  # name -> (object, release function or None)

    def get(self, name: str, build, release=None):
        if name not in self._items:
            self._items[name] = (build(), release)
        return self._items[name][0]

    def release(self) -> None:
        items, self._items = self._items, {}
        for thing, release in items.values():
            if release is not None:
                release(thing)
        if items:
            import gc

            from llm_api.model.host_memory import release_freed_heap

            del items, thing
            gc.collect()
            release_freed_heap()  # (a model loaded in this process: give its pages back, not only to malloc)


GROUP_SHARED = GroupShared()


@pytest.fixture(scope="session")
def group_shared():
    yield GROUP_SHARED
    GROUP_SHARED.release()


def _stop(server) -> None:
    server.stop()


@pytest.fixture
def embedded_lm_fp32(group_shared, embedded_model_path):
    """The embedded model's file loaded as the server loads it, in float32 on every host (tests compare its greedy
    tokens; in bfloat16 two paths may part at a one-ulp tie), into transformers' classes (ENGINE=generate), whose
    ``generate()`` and forward are the oracle; the server runs the same quantized modules in our tree
    (llm_api.model.decoder_weights). Shared within the test's group."""
    from llm_api.model import loader as model_loader
    from llm_api.model.settings import Settings

    return group_shared.get("embedded_lm_fp32", lambda: model_loader.load(
        Settings.from_env({"MODEL_PATH": str(embedded_model_path), "DTYPE": "float32", "ENGINE": "generate"})))


def _grammar_compiler_built(server):
    """``server``, once a structured-output request has built its grammar compiler. A server builds it for
    the first request that needs one (llm_api.service.grammars: about 0.9 s here, holding the GIL up to
    0.4 s at a stretch), a one-time stall of every stream it serves meanwhile; beside the suite's other
    workers that stall stretched to 9 s inside a hostile test's witness (twice in CI: whichever test sent the
    shared server its first tools request), where what the witness is there to catch is each input's own
    stall. The shared servers whose tests run witnesses build it before their first test."""
    from bench.harness import hostile

    try:
        answer = hostile.post_json(server, hostile.openai_path(server, "chat/completions"),
                                   {"model": server.model_name, "messages": [{"role": "user", "content": "Hi"}],
                                    "max_tokens": 1, "response_format": {"type": "json_object"}})
        assert answer.status == 200, answer.body[:300]
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture
def classic_server(group_shared, tmp_path_factory, embedded_model_path):
    """The paged engine under classic batching (batchSize 8), float32, archive built as a .mar file.

    float32 so that greedy output can be compared token for token with generate(): in bfloat16 the
    two paths may part at a one-ulp tie between the top two logits."""
    return group_shared.get("classic_server", lambda: _serve(
        tmp_path_factory, embedded_model_path, "classic", CLASSIC_CONFIG, mar=True,
        env={"DTYPE": "float32", "GRPC_STREAMING": "true"}), _stop)


@pytest.fixture
def batch4_server(group_shared, tmp_path_factory, embedded_model_path):
    """The generate() reference path with batchSize 4 (one call per four requests); float32 on every host, like
    the other shared servers (its answers are compared with the engine's)."""
    return group_shared.get("batch4_server", lambda: _serve(
        tmp_path_factory, embedded_model_path, "batch4", BATCH4_CONFIG,
        env={"ENGINE": "generate", "GRPC_STREAMING": "true", "DTYPE": "float32"}), _stop)


@pytest.fixture
def async_server(group_shared, tmp_path_factory, embedded_model_path):
    """The shipped model-config.yaml (async mode, engine) with a small KV pool (64 MiB), and gRPC streaming
    on (its clients here are trusted; the shipped default, off, is tested with a server of its own).
    float32 on every host, like the other shared servers: its tests compare greedy tokens and logprob
    order (the bfloat16 paths are tested on purpose elsewhere: README, "Testing"). Speculative decoding is
    on (SPECULATIVE_TOKENS=4), as on standalone_server: greedy answers are the same with it."""
    from bench.harness.torchserve_server import REPO

    config = (REPO / "model-config.yaml").read_text()
    return group_shared.get("async_server", lambda: _grammar_compiler_built(_serve(
        tmp_path_factory, embedded_model_path, "async", config,
        env={"KV_CACHE_MEMORY_MIB": "64", "GRPC_STREAMING": "true", "DTYPE": "float32", "SPECULATIVE_TOKENS": "4"})),
        _stop)


@pytest.fixture
def standalone_server(group_shared, tmp_path_factory, embedded_model_path):
    """`llm_api serve` (the standalone front end) for the tests shared by both front ends: float32 like the
    classic server (greedy answers comparable with generate()), the test servers' KV pool. Speculative
    decoding is on (SPECULATIVE_TOKENS=4): greedy answers are the same with it, so every test of this server
    also checks that, and tests/test_server_speculative.py checks what is particular to it."""
    return group_shared.get("standalone_server", lambda: _grammar_compiler_built(_serve_standalone(
        tmp_path_factory, embedded_model_path, "standalone", {"DTYPE": "float32", "SPECULATIVE_TOKENS": "4"})),
        _stop)


HERMES_TEMPLATE = Path(__file__).parent / "assets" / "hermes_tools.jinja"


def hermes_model(tmp_path_factory, embedded_model_path) -> Path:
    """The embedded model with a Hermes-style chat template of the tests (its own template renders no tools):
    a folder of links to the embedded checkpoint plus ``tests/assets/hermes_tools.jinja``."""
    folder = tmp_path_factory.mktemp("hermes-model")
    for item in Path(embedded_model_path).iterdir():
        if item.name != "chat_template.jinja":
            (folder / item.name).symlink_to(item)
    (folder / "chat_template.jinja").write_text(HERMES_TEMPLATE.read_text())
    return folder


@pytest.fixture(scope="session")
def hermes_model_path(tmp_path_factory, embedded_checkpoint_path) -> Path:
    """``hermes_model`` as a fixture (a test module's own import of conftest may find another conftest)."""
    return hermes_model(tmp_path_factory, embedded_checkpoint_path)


@pytest.fixture
def hermes_server(group_shared, tmp_path_factory, embedded_model_path, embedded_checkpoint_path):
    """TorchServe in the shipped async mode serving the embedded model with a tool format (the Hermes
    template above), a 64 MiB KV pool, gRPC streaming on. float32 on every host: the tool-call tests rely
    on what the model writes greedily, and a bfloat16 tie could turn a call into prose on one host kind
    only."""
    from bench.harness.torchserve_server import REPO

    def start():
        model = hermes_model(tmp_path_factory, embedded_checkpoint_path)
        return _grammar_compiler_built(_serve(
            tmp_path_factory, embedded_model_path, "hermes", (REPO / "model-config.yaml").read_text(),
            env={"MODEL_PATH": str(model), "KV_CACHE_MEMORY_MIB": "64", "GRPC_STREAMING": "true", "DTYPE": "float32"}))

    return group_shared.get("hermes_server", start, _stop)


FRONT_ENDS = ["torchserve", "standalone"]


@pytest.fixture(params=FRONT_ENDS)
def frontend(request):
    """A running front end of each kind (same surface: bench/harness/standalone_server.py): TorchServe in classic
    batching (float32), or `llm_api serve`."""
    return request.getfixturevalue("classic_server" if request.param == "torchserve" else "standalone_server")


@pytest.fixture(params=FRONT_ENDS)
def async_frontend(request):
    """TorchServe in the shipped async mode, or `llm_api serve`."""
    return request.getfixturevalue("async_server" if request.param == "torchserve" else "standalone_server")


# -------------------------------------------------------------------------------------------------------
# Running in parallel (scripts/test.sh: pytest-xdist, --dist loadgroup)
#
# A session fixture is made once per xdist worker, so a shared server would start once on every worker
# whose tests ask for it, and a module's own server once on every worker its tests land on. Each test is
# given one group instead, and a group runs on one worker: the tests of a shared server (asked for by name,
# or by the front-end fixtures' parameter) together, every other test with its module. So no server or
# model load is made twice, and nothing that uses the repository's own folders (test_packaging's
# `make serve`) runs beside itself.

SHARED_SERVERS = ("classic_server", "async_server", "batch4_server", "standalone_server", "hermes_server")
FRONT_END_SERVERS = {"frontend": {"torchserve": "classic_server", "standalone": "standalone_server"},
                     "async_frontend": {"torchserve": "async_server", "standalone": "standalone_server"},
                     # (its TorchServe is the module's own; asked for by name, the standalone server was
                     # started a second time on the module's worker)
                     "reliable_front_end": {"torchserve": "tests/test_reliability.py",
                                            "standalone": "standalone_server"}}


def xdist_group_of(item: pytest.Item) -> str:
    """The group a test runs in: the shared server it uses, else its module."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    for fixture, servers in FRONT_END_SERVERS.items():
        if fixture in params:
            return servers[params[fixture]]
    for server in SHARED_SERVERS:
        if server in item.fixturenames:
            return server
    return item.nodeid.split("::")[0]


# The longest groups, longest first (seconds summed over their tests in a 3-worker run on a 2-core AMD EPYC,
# 2026-11-26): xdist hands out groups in the order the workers collected them (scripts/test.sh turns off its
# reordering by test count), and a long group handed out last would run alone at the end. Groups not named
# follow, in file order.
LONG_GROUPS_FIRST = ("async_server",  # 575
                     "standalone_server",  # 475
                     "tests/engine/test_parity.py",  # 190 (525 before its Triton cases kept one family per kind of call)
                     "tests/test_reliability.py",  # 220 (then its load test ran 20 s per front end; now its TorchServe only)
                     "hermes_server",  # 205 (tests/test_server_structured.py, tests/test_hostile_tools.py)
                     "classic_server",  # 140
                     "tests/test_packaging.py",  # 115 (the main job twice)
                     "tests/test_fair_share_serving.py",  # 100
                     "tests/engine/test_bf16.py",  # 95
                     "tests/engine/test_lora.py",  # 90
                     "tests/kernels/test_sanitized.py",  # 85 (180 when the sources changed: two sanitized builds first)
                     "tests/test_reliability_flood.py",  # 85
                     "tests/engine/test_speculative.py",  # 80
                     "tests/test_model_options.py",  # 80
                     "tests/test_standalone.py",  # 75
                     "tests/engine/test_cuda_graphs.py",  # 70
                     "batch4_server")  # 65


def group_of(item: pytest.Item) -> str:
    """The group a collected test was given (its xdist_group mark)."""
    marks = [mark.args[0] for mark in item.iter_markers("xdist_group") if mark.args]
    return marks[0] if marks else xdist_group_of(item)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(config, items):
    groups = {}
    for item in items:
        groups[item.nodeid] = group_of(item)
        if not any(mark.args for mark in item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    # An xdist worker: the order it reports is the order groups go out. A serial run: each group's tests
    # together too, so that a shared server is started once (GroupShared).
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        rank = {group: i for i, group in enumerate(LONG_GROUPS_FIRST)}
        first_seen = {}
        for item in items:
            first_seen.setdefault(groups[item.nodeid], len(first_seen))
        # (stable: file order within a group; groups not named in LONG_GROUPS_FIRST in order of first appearance)
        items.sort(key=lambda item: (rank.get(groups[item.nodeid], len(rank)), first_seen[groups[item.nodeid]]))


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Release the group's shared servers and models once its last test has run (GroupShared)."""
    if nextitem is None or group_of(nextitem) != group_of(item):
        GROUP_SHARED.release()


def pytest_configure(config):
    import tempfile

    import run_control

    run_control.register(config, Path(tempfile.mkdtemp(prefix="llm_api-run-")) / "stopped")


@pytest.hookimpl(trylast=True)  # after xdist has put each test's group into its id
def pytest_collection_finish(session):
    config = session.config
    if hasattr(config, "workerinput") and config.getvalue("loadgroup"):
        ungrouped = [item.nodeid for item in session.items if "@" not in item.nodeid]
        if ungrouped:  # (a pytest or xdist upgrade can lose the groups without a word: see pyproject.toml)
            raise pytest.UsageError(f"xdist groups lost: {ungrouped[0]} has none; tests would share servers and "
                                    "the repository's folders across workers")
