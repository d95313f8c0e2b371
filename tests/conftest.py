"""Shared fixtures: tiny real HF Qwen2 / Qwen3 checkpoints written by transformers itself."""
from __future__ import annotations

import json
import os
from pathlib import Path

# The suite runs on the CPU. libtpu comes with the test extras (tests/test_plan.py compiles for TPU
# slices); without this every JAX process here, subprocesses included, would first probe for a TPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The suite is compile-bound: tiny models, hundreds of distinct XLA programs, each run a few times.
# Two settings of XLA's CPU backend make those compiles cheaper without changing the HLO programs
# the tests compare and inspect: optimisation level 0 (LLVM's machine-code optimisation off; ~2.5x
# faster compiles) and the older elemental emitters for fusions instead of the MLIR fusion emitters
# (measured side by side on test_batch_engine + test_model_parity: backend compile -37%, wall
# -21%, all passing). Every comparison in the suite runs both sides in this setting (or against
# torch, with tolerances); test_full_opt.py runs the parity modules again on XLA's default backend,
# the one users run. Set before JAX is imported; SPRINT_JAX_TEST_FULL_OPT=1 keeps XLA's defaults,
# and a setting the user put in XLA_FLAGS is kept (and passed on to the subprocesses).
_SUITE_DEFAULTS = {"--xla_backend_optimization_level": "0", "--xla_cpu_use_fusion_emitters": "false"}
_USER_FLAGS = os.environ.get("XLA_FLAGS", "").split()
if os.environ.get("SPRINT_JAX_TEST_FULL_OPT"):
    SUITE_XLA_FLAGS: tuple[str, ...] = ()
else:
    SUITE_XLA_FLAGS = tuple(next((f for f in _USER_FLAGS if f.split("=")[0] == name), f"{name}={value}")
                            for name, value in _SUITE_DEFAULTS.items())
    os.environ["XLA_FLAGS"] = " ".join([f for f in _USER_FLAGS if f not in SUITE_XLA_FLAGS]
                                       + list(SUITE_XLA_FLAGS))

import pytest  # noqa: E402

from sprint_jax.config import CONFIG_DIR  # noqa: E402


def xla_flags(*extra: str) -> str:
    """XLA_FLAGS for a test's subprocess: the suite's own flags plus `extra` (e.g. fake devices)."""
    return " ".join(SUITE_XLA_FLAGS + extra)


@pytest.fixture
def training_subprocesses(monkeypatch):
    """For a test whose subprocesses train for tens of steps: they run with XLA's CPU optimisation
    level 1 instead of the suite's 0 (a level the user set is kept). Measured on the tiny recipe's
    SPRINT training (62 steps of 16 x 256 tokens): the step compiles as fast (~20 s) but runs in
    0.32 s against 1.3 s, 44 s against 90 s in all; in-process tests, which compile many small
    programs and run them briefly, stay at level 0 (at level 1 they were slower)."""
    if "--xla_backend_optimization_level=0" in SUITE_XLA_FLAGS and "--xla_backend_optimization_level" not in {
            f.split("=")[0] for f in _USER_FLAGS}:
        flags = os.environ["XLA_FLAGS"].replace("--xla_backend_optimization_level=0",
                                                "--xla_backend_optimization_level=1")
        monkeypatch.setenv("XLA_FLAGS", flags)

# The one tiny test model: configs/model_tiny.json (`Qwen2Config.preset("tiny")`). Odd sizes catch
# transposes. Here as HF Qwen2Config keyword arguments.
TINY_HF = {k: v for k, v in json.loads((CONFIG_DIR / "model_tiny.json").read_text()).items()
           if k not in ("model_type", "tie_word_embeddings")}
# The tiny Qwen3 preset: same odd sizes, head_dim 20 != hidden / heads (= 12).
TINY_QWEN3_HF = {k: v for k, v in json.loads((CONFIG_DIR / "model_tiny-qwen3.json").read_text()).items()
                 if k not in ("model_type", "tie_word_embeddings")}


def hf_classes(family: str):
    """(config class, model class) of transformers for one family."""
    import transformers

    name = {"qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    return getattr(transformers, f"{name}Config"), getattr(transformers, f"{name}ForCausalLM")


def make_hf_checkpoint(path: Path, tied: bool = False, seed: int = 0, family: str = "qwen2",
                       **overrides) -> Path:
    """Build a random Qwen2/Qwen3ForCausalLM with transformers (random biases and norms too), save it."""
    import torch

    HFConfig, HFModel = hf_classes(family)
    torch.manual_seed(seed)
    base = TINY_HF if family == "qwen2" else TINY_QWEN3_HF
    cfg = HFConfig(**{**base, **overrides}, tie_word_embeddings=tied, attn_implementation="eager",
                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = HFModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    return Path(path)


def load_hf(path: Path, dtype=None):
    """The HF model class named by the checkpoint's model_type, eager attention."""
    import torch

    family = json.loads((Path(path) / "config.json").read_text())["model_type"]
    return hf_classes(family)[1].from_pretrained(path, attn_implementation="eager",
                                                 dtype=dtype or torch.float32).eval()


@pytest.fixture(scope="session")
def hf_untied(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf_untied"), tied=False, seed=0)


@pytest.fixture(scope="session")
def hf_tied(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf_tied"), tied=True, seed=1)


@pytest.fixture(scope="session")
def hf_qwen3_untied(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf_qwen3_untied"), tied=False, seed=2, family="qwen3")


@pytest.fixture(scope="session")
def hf_qwen3_tied(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf_qwen3_tied"), tied=True, seed=3, family="qwen3")


def tiny_vocab_tokenizer(size: int = 307):
    """A VocabTokenizer covering every id of the tiny model (random models emit any id)."""
    import string

    from sprint_jax.model.tokenizer import VocabTokenizer

    base = ["<pad>", "<bos>", "<eos>"] + list(string.printable[:95]) + ["\n"]
    extra = [f"<t{i}>" for i in range(size - len(base))]
    return VocabTokenizer(base + extra, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>")


def start_lock_holder(directory: Path):
    """A separate process that takes `directory`'s output lock (sprint_jax.outlock) and sleeps; it has
    the lock once this returns. The caller kills it."""
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time; from sprint_jax import outlock; "
                               "l = outlock.acquire(sys.argv[1], 'test'); print('locked', flush=True); time.sleep(600)",
                               str(directory)], cwd=Path(__file__).resolve().parents[1],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    holder.stdout.close()                 # it writes nothing more; an open pipe is a ResourceWarning later
    return holder


def greedy_by_full_forward(model, tokens, n: int, width: int = 64) -> list[int]:
    """An engine-independent reference: n greedy tokens after `tokens`, each the argmax of one plain
    causal forward (`qwen2.forward`, no cache) over the whole sequence so far, padded at the end to
    `width` (one compile; causal attention keeps the padding out of earlier rows)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sprint_jax.model.qwen2 import forward

    fwd = jax.jit(forward, static_argnums=1)
    seq = [int(t) for t in tokens]
    for _ in range(n):
        assert len(seq) <= width, (len(seq), width)
        row = np.zeros((1, width), np.int32)
        row[0, : len(seq)] = seq
        logits = np.asarray(fwd(model.params, model.config, jnp.asarray(row)))[0, len(seq) - 1]
        seq.append(int(np.argmax(logits)))
    return seq[len(tokens):]


# Engines shared by the test modules (one compile of each program shape for the whole session):
# the tiny untied checkpoint at a few fixed capacities. A test leaves its engine idle: every
# sequence it opened closed (`SingleRun.close`, `Engine.close`), which the fixtures check.
SHARED_ENGINES = {
    # short contexts, many children per fork (16 branches), four sequences at once
    "engine_96": dict(max_seqs=4, max_children=16, max_seq_len=96, max_branch_tokens=48, decode_chunk=8,
                      prefill_chunk=32, eos_token_ids=[]),
    # SPRINT runs of the orchestrator / eval tests: two sequences, two executors per stage
    "engine_224": dict(max_seqs=2, max_children=2, max_seq_len=224, max_branch_tokens=40, decode_chunk=8,
                       prefill_chunk=32, eos_token_ids=[]),
}


@pytest.fixture(scope="session")
def tiny_model(hf_untied):
    """The tiny untied Qwen2 checkpoint, loaded once."""
    from sprint_jax.model import from_pretrained

    return from_pretrained(hf_untied)


def _shared_engine(name: str, tiny_model):
    from sprint_jax.infer.engine import Engine

    engine = Engine(tiny_model, tiny_vocab_tokenizer(), **SHARED_ENGINES[name])
    yield engine


@pytest.fixture(scope="session")
def _engine_96(tiny_model):
    yield from _shared_engine("engine_96", tiny_model)


@pytest.fixture(scope="session")
def _engine_224(tiny_model):
    yield from _shared_engine("engine_224", tiny_model)


def _idle_after(engine):
    yield engine
    assert engine.free_slots == engine.max_seqs and not engine.busy, "a test left sequences open on a shared engine"


@pytest.fixture
def engine_96(_engine_96):
    """The shared Engine of SHARED_ENGINES["engine_96"] (checked idle after the test)."""
    yield from _idle_after(_engine_96)


@pytest.fixture
def engine_224(_engine_224):
    """The shared Engine of SHARED_ENGINES["engine_224"] (checked idle after the test)."""
    yield from _idle_after(_engine_224)


@pytest.fixture
def alone_96(engine_96):
    """Single-run calls on the shared engine_96 (its sequence closed after the test)."""
    from sprint_jax.infer.single import SingleRun

    run = SingleRun(engine_96)
    yield run
    run.close()


@pytest.fixture
def alone_224(engine_224):
    """Single-run calls on the shared engine_224 (its sequence closed after the test)."""
    from sprint_jax.infer.single import SingleRun

    run = SingleRun(engine_224)
    yield run
    run.close()


def chains_policy_config(root: Path, data_format: str = "sprint", layout: str = "trie", n_chains: int = 2,
                         length: int = 2):
    """A tiny policy's training setup: 200 digit-chains problems (seed 1) of `n_chains` chains of
    `length` steps, written to `root` as SPRINT text (a plan with one prompt per chain, their
    executions, a combining plan, the final answer) or ThreadWeaver text (one block with the same
    outlines and threads, then the answer); the demo's word-level tokenizer; a 2-layer fp32 Qwen2
    trained from scratch for 60 steps in `layout`: enough to plan, fork and answer. Returns
    (TrainConfig, tokenizer, problems); train it with `train(config, dir, tokenizer=tok)`."""
    from sprint_jax import format as fmt
    from sprint_jax import threadweaver as tw
    from sprint_jax.config import from_dict
    from sprint_jax.model.tokenizer import VocabTokenizer
    from sprint_jax.tasks import chains
    from sprint_jax.train.config import TrainConfig

    tasks = chains.generate(200, 1, n_chains, n_chains, length)
    data = root / ("tw.jsonl" if data_format == "threadweaver" else "sprint.jsonl")
    with open(data, "w") as f:
        for t in tasks:
            starts = t.answer["starts"]
            prompts, bodies = [f"Chain {s}:" for s in starts], [chains.chain(s, length) for s in starts]
            if data_format == "threadweaver":
                text = tw.render_completion(tw.TWTrajectory(blocks=[tw.ParallelBlock("", prompts, bodies)],
                                                            after=chains.COMBINE, answer=str(t.answer["value"])))
            else:
                text = fmt.render_completion(fmt.Trajectory(stages=[
                    fmt.Stage(1, [fmt.Prompt(p) for p in prompts], bodies),
                    fmt.Stage(2, [chains.COMBINE])], final_answer=str(t.answer["value"])))
            f.write(json.dumps({"id": t.id, "kind": "sprint", "prompt": chains.prompt_for(t),
                                "completion": text}) + "\n")
    tok = VocabTokenizer(chains.token_vocabulary(max_prompts=n_chains), eos_token="<eos>", pad_token="<pad>")
    model = {"model_type": "qwen2", "vocab_size": (len(tok) + 7) // 8 * 8, "hidden_size": 32,
             "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
             "max_position_embeddings": 256, "tie_word_embeddings": False, "eos_token_id": tok.eos_token_id}
    data_cfg = {"train": [str(data)], "layout": layout, "seq_len": 128}
    if data_format != "sprint":
        data_cfg["format"] = data_format
    tc = from_dict(TrainConfig, {
        "model": {"name": model, "init": "scratch", "dtype": "float32", "remat": "none", "loss_chunk": 0},
        "data": data_cfg,
        "optim": {"lr": 1e-2, "warmup_steps": 5, "batch_size": 8},
        "mesh": {"data": 1, "fsdp": 1, "tensor": 1}, "checkpoint": {"every": 0, "resume": False},
        "steps": 60, "log_every": 20, "tensorboard": False, "plot": False})
    return tc, tok, tasks


def _map_count() -> int:
    try:
        with open(f"/proc/{os.getpid()}/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """After a test module, drop jax's compiled executables once the process holds many memory
    mappings. XLA CPU keeps every executable's JIT code in its own mappings; an xdist worker that
    ran many modules reached ~59,000 of the kernel's default 65,530 (vm.max_map_count) and then
    crashed inside a compile (segfault or abort). Clearing only past half of that keeps the shared
    engines' programs (SHARED_ENGINES) compiled across modules."""
    yield
    import gc
    import sys

    if "jax" in sys.modules and _map_count() > 30_000:
        sys.modules["jax"].clear_caches()
        gc.collect()


# The fast tier (`./dev.sh test --fast`, i.e. -m "not slow"): besides the tests marked slow in their
# files, every test listed in tests/slow_tests.txt (measured: more than ~8 s each) is slow.
_SLOW_LIST = Path(__file__).with_name("slow_tests.txt")


# The files in the order the workers take them: heaviest first (tests/file_order.txt).
_FILE_ORDER = Path(__file__).with_name("file_order.txt")


def _file_weights() -> dict[str, float]:
    out = {}
    for line in _FILE_ORDER.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, seconds = line.split()
            out[name] = float(seconds)
    return out


def pytest_collection_modifyitems(config, items):
    listed = {line.strip() for line in _SLOW_LIST.read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    for item in items:
        if f"{Path(str(item.fspath)).name}::{item.name}" in listed:
            item.add_marker(pytest.mark.slow)
    # Longest files first (a stable sort: the tests of a file keep their order), so that with
    # `--dist loadfile --no-loadscope-reorder` the run ends on short files, not one long one.
    weights = _file_weights()
    items.sort(key=lambda item: -weights.get(Path(str(item.fspath)).name, 0.0))
