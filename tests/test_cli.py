"""CLI contract: outputs, metrics, config precedence, and one-line errors for bad input."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PROMPTS, read_jsonl, reference_generate, write_jsonl
from flexgen_dist.run import main


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    rc = main(args + ["--no-progress"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_outputs_metrics_and_yaml_precedence(tiny_models, prompts_file: Path, tmp_path: Path, capsys) -> None:
    tm = tiny_models["opt-pre"]
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {tm.path}\ngen_len: 3\nignore_eos: true\ngpu_batch_size: 2\n")
    out, met = tmp_path / "o.jsonl", tmp_path / "m.json"
    rc, stdout, _ = run_cli(["--config", str(cfg), "--prompts", str(prompts_file), "--output", str(out),
                             "--metrics", str(met)], capsys)
    assert rc == 0
    assert all(len(r["tokens"]) == 3 for r in read_jsonl(out))  # YAML gen_len applies
    m = json.loads(met.read_text())
    for k in ("prefill_throughput", "decode_throughput", "total_throughput", "prefill_time_s",
              "decode_time_s", "num_prompts", "prompt_len", "gen_len", "world_size", "policy",
              "peak_bytes", "predicted"):
        assert k in m, k
    assert m["num_prompts"] == len(PROMPTS) and m["gen_len"] == 3 and m["policy"][0]["gpu_batch_size"] == 2
    assert "tok/s" in stdout
    rc, _, _ = run_cli(["--config", str(cfg), "--prompts", str(prompts_file), "--output", str(out),
                        "--gen-len", "5", "--overwrite"], capsys)
    assert rc == 0
    recs = read_jsonl(out)
    assert all(len(r["tokens"]) == 5 for r in recs)  # the flag beats the YAML
    assert [r["tokens"] for r in recs] == reference_generate(tm, PROMPTS, 5)


def test_ids_default_to_line_numbers_and_echo(tiny_models, tmp_path: Path, capsys) -> None:
    p = tmp_path / "p.jsonl"
    p.write_text('{"input_ids": [5, 6, 7]}\n{"id": {"k": 1}, "input_ids": [8, 9]}\n{"id": "x", "input_ids": [3]}\n')
    out = tmp_path / "o.jsonl"
    rc, _, _ = run_cli(["--model", str(tiny_models["llama-gqa"].path), "--prompts", str(p), "--output",
                        str(out), "--gen-len", "2"], capsys)
    assert rc == 0
    assert [r["id"] for r in read_jsonl(out)] == [0, {"k": 1}, "x"]


def test_dummy_weights_for_a_registry_shape(tmp_path: Path, capsys) -> None:
    out = tmp_path / "o.jsonl"
    rc, _, _ = run_cli(["--model", "opt-125m", "--dummy-weights", "--num-prompts", "3", "--prompt-len", "8",
                        "--gen-len", "2", "--output", str(out)], capsys)
    assert rc == 0
    recs = read_jsonl(out)
    assert len(recs) == 3 and all(len(r["tokens"]) == 2 and "text" not in r for r in recs)


def test_dummy_fill_ones_gives_every_weight_one() -> None:
    """``--dummy-fill ones`` (FlexGen's dummy values, for timings beside it): every tensor 1;
    the default random fill has norms 1, biases 0 and the pool's values elsewhere."""
    from flexgen_dist.models.loader import load_model

    ones = load_model("opt-125m", dummy_weights=True, dummy_fill="ones")
    rnd = load_model("opt-125m", dummy_weights=True)
    w1, wr = ones.source.get("layer", 0), rnd.source.get("layer", 0)
    assert set(w1) == set(wr) and all(bool((t == 1).all()) for t in w1.values())
    assert bool((wr["fc1.b"] == 0).all()) and bool((wr["attn_norm.w"] == 1).all())
    assert 0.01 < float(wr["fc1.w"].std()) < 0.03
    assert "ones" in ones.origin and "ones" not in rnd.origin


@pytest.mark.parametrize("case", ["unknown-model", "registry-no-weights", "no-weights", "corrupt", "bad-config",
                                  "too-long", "empty-file", "bad-yaml-key", "gen-len-0", "bad-policy",
                                  "missing-prompts", "text-without-tokenizer", "bad-json-line", "unknown-dummy",
                                  "temperature", "top-p-0", "top-p-big", "yaml-top-p-word", "yaml-gen-len-word",
                                  "bad-flag-value", "unknown-flag", "output-under-file", "metrics-under-file",
                                  "output-exists", "resume-without-output", "resume-and-overwrite",
                                  "output-is-dir", "log-dir-under-file", "print-outputs",
                                  "balanced-fixed-policy", "prefill-items", "dummy-fill-alone",
                                  "bad-state-percent", "state-percent-yaml"])
def test_bad_input_gives_one_line_error(case: str, tiny_models, tmp_path: Path, capsys) -> None:
    tm = tiny_models["opt-pre"]
    model = ["--model", str(tm.path)]
    p = write_jsonl(tmp_path / "p.jsonl", [[5, 6, 7]])
    args, expect = {
        "unknown-model": (["--model", "no-such-model-xyz"], "unknown model name"),
        "registry-no-weights": (["--model", "opt-125m"], "--dummy-weights"),
        "too-long": (model + ["--prompts", str(write_jsonl(tmp_path / "l.jsonl", [[5] * 126])),
                              "--gen-len", "8"], "exceeds the model's 128 positions"),
        "empty-file": (model + ["--prompts", str(_touch(tmp_path / "e.txt"))], "no prompts"),
        "gen-len-0": (model + ["--gen-len", "0"], "--gen-len 0"),
        "bad-policy": (model + ["--prompts", str(p), "--percent", "80", "30", "100", "0", "100", "0"],
                       "w_gpu_percent + w_cpu_percent"),
        "missing-prompts": (model + ["--prompts", str(tmp_path / "nope.txt")], "no such file"),
        "text-without-tokenizer": (["--model", "opt-125m", "--dummy-weights", "--prompts",
                                    str(_write(tmp_path / "t.txt", "hello\n"))], "no tokenizer"),
        "bad-json-line": (model + ["--prompts", str(_write(tmp_path / "b.jsonl", '{"id": 1}\n'))],
                          "needs a 'prompt', 'messages' or 'input_ids'"),
        "unknown-dummy": (["--model", "opt-999b", "--dummy-weights"], "unknown model name 'opt-999b'"),
        "temperature": (model + ["--temperature", "-0.5"], "--temperature -0.5"),
        "top-p-0": (model + ["--top-p", "0"], "--top-p 0"),
        "top-p-big": (model + ["--top-p", "1.5"], "--top-p 1.5"),
        "yaml-top-p-word": (model + ["--config", str(_write(tmp_path / "c1.yaml", "top_p: high\n"))],
                            "key 'top_p': expected a number, got 'high'"),
        "yaml-gen-len-word": (model + ["--config", str(_write(tmp_path / "c2.yaml", "gen_len: many\n"))],
                              "key 'gen_len': expected an integer"),
        "bad-flag-value": (model + ["--gen-len", "x"], "argument --gen-len: invalid int value"),
        "unknown-flag": (model + ["--gen-lenn", "3"], "unrecognized arguments: --gen-lenn"),
        "output-under-file": (model + ["--output", str(_write(tmp_path / "f", "x") / "o.jsonl")], "is a file"),
        "metrics-under-file": (model + ["--metrics", str(_write(tmp_path / "f2", "x") / "m.json")], "is a file"),
        "output-exists": (model + ["--prompts", str(p), "--output", str(_write(tmp_path / "o.jsonl", "{}\n"))],
                          "--resume"),
        "resume-without-output": (model + ["--resume"], "--resume needs --output"),
        "resume-and-overwrite": (model + ["--output", str(tmp_path / "o"), "--resume", "--overwrite"],
                                 "exclude each other"),
        "output-is-dir": (model + ["--output", str(tmp_path)], "is a directory"),
        "log-dir-under-file": (model + ["--log-dir", str(_write(tmp_path / "f3", "x") / "logs")], "--log-dir"),
        "print-outputs": (model + ["--print-outputs", "-1"], "--print-outputs -1"),
        "balanced-fixed-policy": (model + ["--partition", "balanced"], "needs --policy auto"),
        "prefill-items": (model + ["--prefill-items", "rows"], "argument --prefill-items: invalid choice"),
        "dummy-fill-alone": (model + ["--dummy-fill", "ones"], "add --dummy-weights"),
        "bad-state-percent": (model + ["--prompts", str(p), "--state-percent", "60", "50"],
                              "state_gpu_percent + state_cpu_percent = 110 > 100 for linear-attention states"),
        "state-percent-yaml": (model + ["--prompts", str(p), "--policy",
                                        str(_write(tmp_path / "pol.yaml", "state_percent: [1, 2, 3]\n"))],
                               "policy state_percent=[1, 2, 3]: give two numbers SG SC"),
    }.get(case, (None, None))
    if case == "no-weights":
        d = tmp_path / "m"
        d.mkdir()
        (d / "config.json").write_text((tm.path / "config.json").read_text())
        args, expect = ["--model", str(d), "--prompts", str(p)], "no *.safetensors"
    if case == "corrupt":
        d = tmp_path / "m"
        d.mkdir()
        (d / "config.json").write_text((tm.path / "config.json").read_text())
        (d / "model.safetensors").write_bytes(b"\x00\x01garbage" * 10)
        args, expect = ["--model", str(d), "--prompts", str(p)], "cannot read checkpoint"
    if case == "bad-config":
        d = tmp_path / "m"
        d.mkdir()
        (d / "config.json").write_text("{not json")
        args, expect = ["--model", str(d)], "cannot parse"
    if case == "bad-yaml-key":
        c = _write(tmp_path / "c.yaml", "gen_len: 3\nbatch_size_typo: 4\n")
        args, expect = model + ["--config", str(c)], "unknown key 'batch_size_typo'"
    rc, _, err = run_cli(args, capsys)
    assert rc in (1, 2)
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and expect in lines[0], err
    assert "usage:" not in err and "Traceback" not in err


def test_module_exit_code_and_stderr(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "flexgen_dist.run", "--model", "nope-123"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("error: unknown model name 'nope-123'")
    assert "Traceback" not in r.stderr


def _touch(p: Path) -> Path:
    p.write_text("")
    return p


def _write(p: Path, text: str) -> Path:
    p.write_text(text)
    return p


# every command a user runs as `python -m ...`, with the subcommands that have their own help
HELP_COMMANDS = [["flexgen_dist.run"], ["flexgen_dist.eval"], ["flexgen_dist.eval", "ppl"],
                 ["flexgen_dist.planner"], ["flexgen_dist.planner", "plan"],
                 ["flexgen_dist.planner", "profile"], ["flexgen_dist.distributed.check"],
                 ["flexgen_dist.bench.single"], ["flexgen_dist.bench.offload"],
                 ["bench.scaling"], ["flexgen_dist.bench.accuracy"],
                 ["flexgen_dist.bench.planner_accuracy"], ["flexgen_dist.bench.gpu_suite"], ["flexgen_dist.bench.gpu_baselines"],
                 ["flexgen_dist.bench"], ["flexgen_dist.bench", "compare"]]


def test_every_command_prints_its_help() -> None:
    """`--help` of every entry point exits 0 with a usage line. argparse expands each help
    string with %-formatting, so a bare '%' in one (e.g. "10 %;") crashes only at --help."""
    script = (
        "import contextlib, io, json, runpy, sys\n"
        f"cmds = {HELP_COMMANDS!r}\n"
        "res = {}\n"
        "for cmd in cmds:\n"
        "    sys.argv = [cmd[0]] + cmd[1:] + ['--help']\n"
        "    out = io.StringIO()\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(out):\n"
        "            runpy.run_module(cmd[0], run_name='__main__', alter_sys=True)\n"
        "        code = 'no exit'\n"
        "    except SystemExit as e:\n"
        "        code = e.code\n"
        "    except Exception as e:\n"
        "        code = repr(e)\n"
        "    res[' '.join(cmd)] = [code, out.getvalue()[:200]]\n"
        "print(json.dumps(res))\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[1])  # bench/ is found from the repository root
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(res) == len(HELP_COMMANDS)
    for cmd, (code, text) in res.items():
        assert code in (0, None) and text.startswith("usage:"), (cmd, code, text)
