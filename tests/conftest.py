"""Shared fixtures: tiny random models saved with transformers, the reference generator, and
what the multi-process tests launch with (two hosts in network namespaces, a one-node Slurm
cluster, clean launcher environments, process trees to stop), and the lock that gives a test
marked `exclusive` the machine to itself when the suite runs in several workers."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from flexgen_dist.distributed.topology import free_port  # noqa: F401 (tests import it from here)
import torch


def _lock_base(uid: str) -> Path:
    return Path(tempfile.gettempdir()) / f"flexgen-tests-{uid}"


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist the controller names the run (``--testrunuid``, which the workers get as
    ``PYTEST_XDIST_TESTRUNUID``), so that it can remove the run's lock files at its end."""
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None) \
            and getattr(config.option, "testrunuid", "") is None:
        config.option.testrunuid = uuid.uuid4().hex


def pytest_unconfigure(config: pytest.Config) -> None:
    uid = None if hasattr(config, "workerinput") else getattr(config.option, "testrunuid", None)
    if uid:  # the controller, after its workers are gone
        for suffix in (".lock", ".turnstile"):
            with contextlib.suppress(OSError):
                os.unlink(f"{_lock_base(uid)}{suffix}")


@contextlib.contextmanager
def _machine_share(exclusive: bool) -> Iterator[None]:
    """Under pytest-xdist (``-n N``), every test holds a shared lock for its setup, call and
    teardown, and a test marked ``exclusive`` (it measures the machine's load) holds it alone.
    A turnstile taken before the lock keeps the other workers from starting tests while an
    exclusive one waits, so it is not starved. Without xdist: nothing."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not uid:
        yield
        return
    base = _lock_base(uid)
    with open(f"{base}.turnstile", "a+") as gate, open(f"{base}.lock", "a+") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            if not exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    with _machine_share(item.get_closest_marker("exclusive") is not None):
        yield


_BUNDLED_ABSENT: list[str | None] = []


def _bundled_absent() -> str | None:
    """Why the bundled model cannot be opened here (None where it can); asked once."""
    if not _BUNDLED_ABSENT:
        from flexgen_dist.models.loader import bundled_model_path
        from flexgen_dist.models.source import ModelLoadError

        try:
            bundled_model_path()
            _BUNDLED_ABSENT.append(None)
        except ModelLoadError as e:
            _BUNDLED_ABSENT.append(str(e))
    return _BUNDLED_ABSENT[0]


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``bundled`` needs the bundled model, a requirement of the package: without
    it the test fails in one line naming the fix, or, where the model cannot be installed (a
    GPU machine it cannot be carried to, FLEXGEN_TESTS_WITHOUT_BUNDLED=1), is skipped saying so."""
    if item.get_closest_marker("bundled") is None:
        return
    why = _bundled_absent()
    if why is None:
        return
    if os.environ.get("FLEXGEN_TESTS_WITHOUT_BUNDLED") == "1":
        pytest.skip(f"no bundled model on this machine (FLEXGEN_TESTS_WITHOUT_BUNDLED=1): {why}")
    pytest.fail(f"{why} (FLEXGEN_TESTS_WITHOUT_BUNDLED=1 skips the tests that need it where it cannot be "
                "installed)", pytrace=False)


PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28], [40, 41],
           [50, 51, 52, 53, 54], [60, 61, 62, 63, 64, 65, 66]]


@dataclass
class TinyModel:
    name: str
    path: Path
    model: torch.nn.Module
    pad_id: int


def _build(kind: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    torch.manual_seed({"opt-pre": 1, "opt-post-proj": 2, "opt-pre-proj": 3, "llama-gqa": 4,
                       "llama-tied": 5}[kind])
    if kind.startswith("opt"):
        cfg = OPTConfig(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=4,
                        num_attention_heads=4, max_position_embeddings=128,
                        do_layer_norm_before=kind.startswith("opt-pre"),
                        word_embed_proj_dim=32 if kind.endswith("proj") else 64,
                        pad_token_id=1, bos_token_id=2, eos_token_id=2)
        return OPTForCausalLM(cfg)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2 if kind == "llama-gqa" else 4,
                      max_position_embeddings=128, rope_theta=5000.0,
                      tie_word_embeddings=kind == "llama-tied", pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)
    return LlamaForCausalLM(cfg)


MODEL_KINDS = ["opt-pre", "opt-post-proj", "opt-pre-proj", "llama-gqa", "llama-tied"]


@pytest.fixture(scope="session", autouse=True)
def _own_hardware_cache(tmp_path_factory: pytest.TempPathFactory):
    """No test sees this machine's cached hardware profile (a plain run would plan with it):
    the profiles measured during the session go to a directory of its own, which the runs
    the tests start inherit. Tests that want a profile make one there or pass --hardware."""
    old = os.environ.get("FLEXGEN_HARDWARE_CACHE")
    os.environ["FLEXGEN_HARDWARE_CACHE"] = str(tmp_path_factory.mktemp("hardware-cache"))
    yield
    if old is None:
        os.environ.pop("FLEXGEN_HARDWARE_CACHE", None)
    else:
        os.environ["FLEXGEN_HARDWARE_CACHE"] = old


@pytest.fixture(autouse=True)
def _cpu_unless_marked_gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests not marked ``gpu`` run as on a machine without CUDA, also where one is visible:
    they compare against float32 transformers on the CPU, and ``--device auto`` would
    otherwise pick cuda + float16. Subprocesses they start see no GPU either."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def gpu_device() -> torch.device:
    """The CUDA device for tests marked ``gpu`` (skipped without one).
    ``FLEXGEN_GPU_TESTS_ON_CPU=1`` runs them on the CPU, to check their own logic."""
    if os.environ.get("FLEXGEN_GPU_TESTS_ON_CPU") == "1":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (FLEXGEN_GPU_TESTS_ON_CPU=1 runs this test's logic on the CPU)")
    return torch.device("cuda")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    out = {}
    for kind in MODEL_KINDS:
        m = _build(kind).eval()
        d = tmp_path_factory.mktemp(kind)
        m.save_pretrained(d)
        out[kind] = TinyModel(kind, d, m, m.config.pad_token_id)
    return out


def left_padded(tm: TinyModel, prompts: list[list[int]], device: str | torch.device = "cpu"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of the prompts left-padded with the model's pad id."""
    s = max(map(len, prompts))
    ids = torch.tensor([[tm.pad_id] * (s - len(p)) + p for p in prompts], device=device)
    mask = (torch.arange(s)[None] >= torch.tensor([s - len(p) for p in prompts])[:, None]).long().to(device)
    return ids, mask


# the placements a family's parity test runs: all on the device; weights and cache half on disk
# with the CPU's attention; everything in RAM with merged decode over two GPU batches
FAMILY_POLICIES = [
    dict(percent=(100, 0, 100, 0, 100, 0)),
    dict(percent=(0, 50, 0, 50, 100, 0), cpu_attention=True),
    dict(percent=(0, 100, 0, 100, 100, 0), num_gpu_batches=2),
]


def engine_matches(tm: TinyModel, prompts: list[list[int]], gen_len: int, ref: list[list[int]], tmp_path: Path,
                   **opts: Any) -> None:
    """The engine's greedy tokens for ``prompts`` (blocks of 2, the given policy ``opts``) are
    ``ref``, and its spec counts the reference model's parameters."""
    from flexgen_dist import LLM

    base = dict(gpu_batch_size=2, num_gpu_batches=1, offload_dir=str(tmp_path / "off"), ignore_eos=True,
                progress=False)
    with LLM(str(tm.path), **{**base, **opts}) as llm:
        spec = llm.model.spec
        assert [c.token_ids for c in llm.generate(prompts, gen_len=gen_len)] == ref
    assert spec.total_numel() == sum(p.numel() for p in tm.model.parameters())


def saved(factory: pytest.TempPathFactory, name: str, model: torch.nn.Module) -> TinyModel:
    """``model`` saved as a Hugging Face directory of its own, as a ``TinyModel`` (pad id 0)."""
    d = factory.mktemp(name)
    model.save_pretrained(d)
    return TinyModel(name, d, model, 0)


def reference_generate(tm: TinyModel, prompts: list[list[int]], gen_len: int) -> list[list[int]]:
    """Greedy tokens from transformers' generate() on a left-padded batch (float32), ``gen_len``
    each with the EOS id an ordinary token, as the engine's ``ignore_eos`` takes it (not
    ``min_new_tokens``, which would suppress it where it is the argmax)."""
    ids, mask = left_padded(tm, prompts)
    s = ids.shape[1]
    gc = tm.model.generation_config
    eos, gc.eos_token_id = gc.eos_token_id, None
    try:
        with torch.no_grad():
            out = tm.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=gen_len, do_sample=False,
                                    pad_token_id=tm.pad_id)
    finally:
        gc.eos_token_id = eos
    return out[:, s:].tolist()


def kept_codes_sized_as_stored(path: Path) -> tuple[int, int]:
    """(the budget check's predicted RAM bytes, the bytes the engine stores) for a checkpoint's
    two layers alone in RAM under --compress-weight (its kept codes sized from the file's
    header, ``packed_formats``): the two must be equal."""
    from flexgen_dist.engine.footprint import predict_peaks
    from flexgen_dist.engine.policy import Policy
    from flexgen_dist.engine.stage import StageEngine
    from flexgen_dist.models.loader import load_model

    lm = load_model(str(path), load_tokenizer=False)
    pol = Policy(1, 1, 0, 100, 100, 0, 100, 0, compress_weight=True)  # weights alone in RAM
    peak = predict_peaks(lm.spec, pol, (0, 2), has_embed=False, has_head=False, prompt_len=4, gen_len=1,
                         dtype_bytes=4, packed=lm.source.packed_formats)
    eng = StageEngine(lm.spec, lm.source, (0, 2), has_embed=False, has_head=False, policy=pol,
                      device=torch.device("cpu"), dtype=torch.float32)
    stored = eng.weights.bytes_per_tier()
    eng.close()
    return peak["cpu"], stored["cpu"]


def copy_with_eos(src: Path, dst: Path, eos: int) -> Path:
    """A copy of the model directory ``src`` whose stop id is ``eos``: in config.json and, where
    the directory has one, generation_config.json (which the loader reads first, as transformers)."""
    import shutil

    shutil.copytree(src, dst)
    for name in ("config.json", "generation_config.json"):
        f = dst / name
        if f.exists():
            cfg = json.loads(f.read_text())
            cfg["eos_token_id"] = eos
            f.write_text(json.dumps(cfg))
    return dst


BPE_TEXT = ['{"name": "Ada", "age": 36, "city": "London"}', "yes no maybe 123-4567 abc", "The quick brown fox.",
            '[1, 2, 3] {"ok": true, "n": null}'] * 8


def bpe_chat_model(factory: pytest.TempPathFactory, name: str, template: str, added: tuple[str, ...] = (),
                   specials: tuple[str, ...] = ()) -> tuple[Path, torch.nn.Module, Any]:
    """A random Llama of 320 logits with a byte-level BPE tokenizer of 300 tokens (then
    ``added`` tokens and ``specials`` special tokens; the rest of the vocabulary is padding, as
    many checkpoints have), EOS id 1, chat template ``template``: (its directory, the model,
    the tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(BPE_TEXT, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>")
    if added:
        tok.add_tokens(list(added))
    if specials:
        tok.add_special_tokens({"additional_special_tokens": list(specials)})
    tok.chat_template = template
    torch.manual_seed(7)
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      eos_token_id=1, pad_token_id=0, bos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    d = factory.mktemp(name)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d, model, tok


def masked_reference(model: torch.nn.Module, tok: Any, prompt: list[int], structure: Any, gen_len: int,
                     bias: dict[int, float] | None = None) -> list[int]:
    """Greedy tokens of one prompt of a ``bpe_chat_model``, each step's float32 logits (plus
    ``bias``) masked by llguidance's own matcher for ``structure`` (no mask without one), up to
    and including EOS (id 1)."""
    import llguidance

    from flexgen_dist.engine.structure import guide_tokenizer

    lt = guide_tokenizer(tok, 320, (1,))
    m = None if structure is None else llguidance.LLMatcher(lt, structure.grammar_text())
    seq, out = list(prompt), []
    for _ in range(gen_len):
        with torch.no_grad():
            lg = model(torch.tensor([seq])).logits[0, -1].float()
        for t, b in (bias or {}).items():
            lg[t] += b
        if m is not None:
            mask = m.compute_bitmask()  # bytes, little-endian, bit k of byte j: token 8j + k
            bits = torch.tensor(list(mask), dtype=torch.uint8)
            allowed = ((bits[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()[:lg.numel()].bool()
            lg[~allowed] = float("-inf")
        t = int(lg.argmax())
        out.append(t)
        if t == 1:
            break
        if m is not None:
            assert m.consume_token(t)
        seq.append(t)
    return out


def write_jsonl(path: Path, prompts: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": p}) + "\n" for i, p in enumerate(prompts)))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)


def local_ranks(target: list[str], nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    """``target`` (``["-m", module, *args]`` or a script and its arguments) under torchrun with
    ``nproc`` ranks on this host (loopback rendezvous on a free port pair); the finished process,
    its output captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port(pair=True)), *target]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------ launching ranks

REPO = Path(__file__).resolve().parents[1]
LAUNCHER_VARS = re.compile(r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|"
                           r"MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*|OMPI_.*|PMIX_.*|SLURM_.*)$")


def clean_env(**extra: str) -> dict[str, str]:
    """The environment minus any launcher variables this pytest itself may run under, set to
    run the communication self-check unless ``extra`` names another MODULE."""
    env = {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MODULE": "flexgen_dist.distributed.check",
                "PYTHON": sys.executable, **extra})  # extra may name another MODULE
    return env


def start(cmd: list[str], env: dict[str, str], out: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(out, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop(procs: list[subprocess.Popen]) -> None:
    """Kill what we started and is still running, with its descendants, and reap it."""
    for p in procs:
        if p.poll() is None:
            kill_tree(p.pid)
        p.wait()


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and all its descendants (torchrun puts its workers in new sessions)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    for p in tree:  # parents first, so none of them starts a new child meanwhile
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts() -> Iterator[list[tuple[str, str, str]]]:
    """Two namespaces joined by a veth pair: [(netns, interface, address)] for node 0 and 1."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` (iproute2) to create network namespaces")
    tag = f"{os.getpid() % 10000:04d}{random.randrange(1000):03d}"
    net = f"10.{random.randrange(100, 250)}.{random.randrange(256)}"
    hosts = [(f"fgt{tag}n{k}", f"fgv{tag}{k}", f"{net}.{k + 1}") for k in range(2)]
    created: list[str] = []
    try:
        for ns, _, _ in hosts:
            try:
                sh("ip", "netns", "add", ns)
            except subprocess.CalledProcessError as err:
                pytest.skip(f"cannot create a network namespace: {err.stderr.strip()}")
            created.append(ns)
        (ns0, if0, a0), (ns1, if1, a1) = hosts
        sh("ip", "link", "add", if0, "type", "veth", "peer", "name", if1)
        sh("ip", "link", "set", if0, "netns", ns0)
        sh("ip", "link", "set", if1, "netns", ns1)
        for ns, iface, addr in hosts:
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", iface, "up")
        yield hosts
    finally:
        for ns in created:  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def run_two_hosts(hosts: list[tuple[str, str, str]], tmp_path: Path, *args: str,
                  module: str = "flexgen_dist.distributed.check") -> list[subprocess.Popen]:
    """Start launch/multi_node.sh for ``module`` in each namespace (node k logs to node{k}.out)."""
    master = hosts[0][2]
    procs = []
    for k, (ns, iface, _) in enumerate(hosts):
        env = clean_env(GLOO_SOCKET_IFNAME=iface, MASTER_PORT="29500", MODULE=module)
        cmd = ["ip", "netns", "exec", ns, str(REPO / "launch/multi_node.sh"), "2", str(k), master,
               *args]
        procs.append(start(cmd, env, tmp_path / f"node{k}.out"))
    return procs


def find_mpirun() -> str | None:
    local = Path(sys.executable).parent / "mpirun"
    return str(local) if local.exists() else shutil.which("mpirun")


SLURM_CONF = """\
ClusterName=fgdtest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket.2
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm() -> Iterator[tuple[Path, dict[str, str]]]:
    """munged + slurmctld + slurmd from a temp dir; yields (dir, env with SLURM_CONF)."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster runs its daemons as root")
    needed = ["/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd"]
    missing = [p for p in needed if not os.access(p, os.X_OK)]
    missing += [c for c in ("sbatch", "squeue", "sinfo", "scontrol") if not shutil.which(c)]
    if missing:
        pytest.skip(f"Slurm is not installed (apt-get install -y slurm-wlm munge): no {missing}")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("a 2-task Slurm job needs 2 CPUs")
    d = Path(tempfile.mkdtemp(prefix="fgd-slurm-"))
    daemons: list[subprocess.Popen] = []
    try:
        for sub in ("munge", "state", "spool"):
            (d / sub).mkdir()
        d.chmod(0o711)  # munged insists every directory above its socket is executable by all
        (d / "munge").chmod(0o711)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        conf = d / "slurm.conf"
        conf.write_text(SLURM_CONF.format(d=d, ctld_port=free_port(), slurmd_port=free_port(),
                                          cpus=min(os.cpu_count() or 2, 64)))
        env = clean_env(SLURM_CONF=str(conf))
        m = d / "munge"
        daemons.append(start(["/usr/sbin/munged", "-F", f"--socket={m}/munge.socket.2",
                              f"--key-file={key}", f"--log-file={m}/munged.log",
                              f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed"],
                             env, d / "munged.out"))
        deadline = time.time() + 15
        while not (m / "munge.socket.2").exists() and time.time() < deadline:
            time.sleep(0.1)
        daemons.append(start(["/usr/sbin/slurmctld", "-D", "-c", "-f", str(conf)], env,
                             d / "slurmctld.out"))
        daemons.append(start(["/usr/sbin/slurmd", "-D", "-N", "localhost", "-f", str(conf)], env,
                             d / "slurmd.out"))
        deadline, state = time.time() + 40, ""
        while time.time() < deadline and state != "idle":
            res = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                 text=True, timeout=30)
            state = res.stdout.strip()
            time.sleep(0.3)
        if state != "idle":
            logs = "\n".join(p.read_text()[-1500:] for p in d.glob("*.log"))
            pytest.fail(f"the Slurm node never became idle (state {state!r}):\n{logs}")
        yield d, env
    finally:
        for p in reversed(daemons):  # slurmd, slurmctld, munged: by PID, gently first
            if p.poll() is None:
                p.terminate()
        for p in reversed(daemons):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(d, ignore_errors=True)


def wait_job(job: str, env: dict[str, str], limit: float = 90) -> str:
    """Poll until the job leaves the queue; return its scontrol record."""
    deadline = time.time() + limit
    try:
        while time.time() < deadline:
            res = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env,
                                 capture_output=True, text=True, timeout=30)
            if res.returncode == 0 and res.stdout.strip() in ("", "COMPLETED", "FAILED"):
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"Slurm job {job} still queued/running after {limit} s")
    except BaseException:
        subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
        raise
    return subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True,
                          text=True, timeout=30).stdout
