"""The GEMM form policy: each shape's form is timed once per machine, stored, and every later
call and process uses the stored form, so two runs of one job compute the same sums."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import PROMPTS, read_jsonl, reference_generate, write_jsonl
from flexgen_dist import kernels
from flexgen_dist.kernels import gemm
from flexgen_dist.models import common

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def policy(tmp_path: Path, monkeypatch) -> gemm.GemmPolicy:
    """A fresh policy on a file of its own, as this process's policy."""
    p = gemm.GemmPolicy(tmp_path / "gemm.json")
    monkeypatch.setattr(gemm, "_process", {"policy": p})
    return p


def stored(p: gemm.GemmPolicy) -> dict[str, str]:
    assert p.path is not None
    return json.loads(p.path.read_text())["choices"]


def key_name(m: int, n: int, k: int, dtype: torch.dtype = torch.float32) -> str:
    """The stored key of a product of m rows: keyed by m's bucket (the next power of two)."""
    return gemm._name((gemm.rows_bucket(m), n, k, dtype, torch.get_num_threads()))


@pytest.mark.parametrize("rows", [1, 6, 32, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear_and_stores_small_shapes(policy, rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 24, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    x = torch.randn(rows, 1, 24, generator=g)
    ref = F.linear(x, w, b)
    for _ in range(3):
        out = common.linear(x, w, b)
        assert out.shape == ref.shape and out.is_contiguous()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if rows <= gemm.MAX_ROWS:
        assert stored(policy)[key_name(rows, 48, 24)] in gemm.FORMS and policy.tuned == 1
    else:
        assert not policy.path.exists() and policy.tuned == 0  # big GEMMs run F.linear, untimed


def test_linear_accepts_strided_input(policy) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 8, generator=g)
    x = torch.randn(8, 4, generator=g).t()  # (4, 8), not contiguous
    for _ in range(3):
        torch.testing.assert_close(common.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_a_stored_form_is_used_and_never_timed(policy, monkeypatch) -> None:
    policy.path.write_text(json.dumps({"choices": {key_name(3, 16, 8): "t"}}))
    monkeypatch.setattr(gemm, "time_forms", lambda *a: pytest.fail("a stored shape was timed again"))
    before = policy.path.stat().st_mtime_ns
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 8, generator=g), torch.randn(16, 8, generator=g)
    for _ in range(3):
        assert torch.equal(common.linear(x, w), gemm._transposed(x, w, None, 3, None))
    assert policy.path.stat().st_mtime_ns == before and policy.tuned == 0
    s = gemm.summary()
    assert s["gemm_tune"] and s["file"] == str(policy.path) and s["stored"] == 1 and s["used"] == 1


def test_processes_tuning_at_once_store_one_choice(tmp_path: Path, monkeypatch) -> None:
    """Two policies on one file (two ranks of a node) miss the same shape at the same time:
    the second waits for the first's lock, finds its choice in the file and uses it."""
    calls = []

    def fake_time(m, n, k, dtype, forms):  # a different winner on each call
        calls.append(m)
        time.sleep(0.2)
        return {0: 1.0, 1: 0.5 if len(calls) == 1 else 2.0}

    monkeypatch.setattr(gemm, "time_forms", fake_time)
    a, b = gemm.GemmPolicy(tmp_path / "g.json"), gemm.GemmPolicy(tmp_path / "g.json")
    got: dict[str, int] = {}
    threads = [threading.Thread(target=lambda n=n, p=p: got.__setitem__(n, p.form(5, 7, 9, torch.float32)))
               for n, p in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and got["a"] == got["b"] == 1
    assert stored(a) == {key_name(5, 7, 9): "t"}


def test_an_unreadable_file_is_timed_again_and_rewritten(policy, caplog) -> None:
    policy.path.write_text("{torn")
    with caplog.at_level(logging.WARNING, logger="flexgen_dist.kernels"):
        common.linear(torch.randn(2, 8), torch.randn(4, 8))
    assert "unreadable" in caplog.text and key_name(2, 4, 8) in stored(policy)


def test_an_unwritable_directory_keeps_choices_in_the_process(tmp_path: Path, monkeypatch, caplog) -> None:
    (tmp_path / "file").write_text("")
    p = gemm.GemmPolicy(tmp_path / "file" / "gemm.json")  # a directory that cannot be made
    monkeypatch.setattr(gemm, "_process", {"policy": p})
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="flexgen_dist.kernels"):
        torch.testing.assert_close(common.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert "cannot be stored" in caplog.text
    s = p.summary()
    assert s["file"] is None and s["error"] and s["used"] == 1 and p.tuned == 1


def test_tuning_can_be_switched_off(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLEXGEN_GEMM_TUNE", "0")
    monkeypatch.setattr(gemm, "_process", {})  # opened afresh, from the environment
    monkeypatch.setenv("FLEXGEN_KERNEL_DIR", str(tmp_path))
    x, w = torch.randn(4, 8), torch.randn(16, 8)
    for _ in range(3):
        assert torch.equal(common.linear(x, w), F.linear(x, w))
    s = gemm.summary()
    assert not s["gemm_tune"] and s["file"] is None and s["used"] == 0
    assert not list(tmp_path.glob("gemm-*.json"))


def test_without_a_compiler_the_torch_forms_are_tuned(monkeypatch, caplog, policy) -> None:
    monkeypatch.setattr(kernels.build, "_state", {})
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with caplog.at_level(logging.WARNING, logger="flexgen_dist.kernels"):
        assert kernels.library() is None
    assert "no C++ compiler" in caplog.text
    x, w = torch.randn(4, 8), torch.randn(16, 8)
    assert kernels.linear_f32(x, w) is None
    torch.testing.assert_close(common.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert stored(policy)[key_name(4, 16, 8)] in ("plain", "t")


def test_time_forms_and_the_margin() -> None:
    med = gemm.time_forms(4, 32, 16, torch.float32, (0, 1))
    assert set(med) == {0, 1} and all(t > 0 for t in med.values())
    assert gemm.choose({0: 1.0, 1: 0.96}) == 0  # within 5 %: F.linear stays
    assert gemm.choose({0: 1.0, 1: 0.9, 2: 0.7}) == 2


def test_two_runs_in_fresh_processes_use_the_same_forms(tiny_models, tmp_path: Path) -> None:
    """The job of a batch run, twice: the first process times its shapes and stores them, the
    second times nothing, leaves the file as it was, and writes the same tokens."""
    tm = tiny_models["llama-gqa"]
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    env = {**os.environ, "FLEXGEN_KERNEL_DIR": str(tmp_path / "kernels"), "FLEXGEN_GEMM_TUNE": "1",
           "OMP_NUM_THREADS": "1"}
    tokens, policies, files = [], [], []
    for run in range(2):
        out, met = tmp_path / f"o{run}.jsonl", tmp_path / f"m{run}.json"
        r = subprocess.run([sys.executable, "-m", "flexgen_dist.run", "--model", str(tm.path), "--prompts",
                            str(prompts), "--gen-len", "4", "--ignore-eos", "--gpu-batch-size", "2",
                            "--num-gpu-batches", "3", "--output", str(out), "--metrics", str(met), "--no-progress"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        tokens.append([rec["tokens"] for rec in read_jsonl(out)])
        policies.append(json.loads(met.read_text())["kernel_policy"][0])
        f = Path(policies[-1]["file"])
        files.append((f.read_bytes(), f.stat().st_mtime_ns))
    first, second = policies
    assert first["tuned"] > 0 and first["used"] == first["stored"] > 0
    assert second["tuned"] == 0 and second["digest"] == first["digest"] and files[1] == files[0]
    assert tokens[0] == tokens[1] == reference_generate(tm, PROMPTS, 4)


def test_row_counts_share_their_bucket(policy) -> None:
    """Products of 5 to 8 rows use the one form stored for 8 rows (timed once), so a run whose
    products vary in rows (a mixture's experts) times few shapes."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(32, 16, generator=g)
    for m in (5, 6, 7, 8):
        x = torch.randn(m, 16, generator=g)
        torch.testing.assert_close(common.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert policy.tuned == 1 and list(stored(policy)) == [key_name(8, 32, 16)]
    assert [gemm.rows_bucket(m) for m in (1, 2, 3, 4, 5, 33, 64)] == [1, 2, 4, 4, 8, 64, 64]
