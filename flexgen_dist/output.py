"""Writing a job's outputs: one JSON line per prompt, durable block by block, resumable.

A run with ``--output FILE`` writes, next to it, ``FILE.run.json``: the fingerprint of what
determines the lines (model, dtype, sampling, seed, gen-len, the prompts' ids), not how they
are computed (policy, ranks). Lines go out in prompt order, a block at a time, each block
written whole and fsynced before the run moves on. A run stopped at any moment (preemption,
a dead node, SIGKILL) leaves a prefix of the file an uninterrupted run writes, plus at most
one torn line; ``--resume`` checks the fingerprint, drops the torn line, and generates the
prompts after the prefix, so the finished file is byte for byte the uninterrupted one.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import IO, Any

from .config import ConfigError
from .engine.sampling import TokenLogprobs
from .prompts import Prompt


def fingerprint_path(output: Path) -> Path:
    return output.with_name(output.name + ".run.json")


def prompts_digest(prompts: list[Prompt]) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.id, p.ids] + ([p.lora] if p.lora else []), default=str).encode())
        h.update(b"\n")
    return h.hexdigest()


def check_writable(flag: str, path: str | None) -> None:
    """A one-line error now, not after hours of generation, if ``path`` cannot be a file:
    an ancestor that is a file, a directory in its place, or a directory that is not writable."""
    if path is None:
        return
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"{flag} {path} is a directory: give a file name")
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: {parent} is a file, not a directory; choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {parent} is not writable; choose another path or fix its permissions")


class OutputWriter:
    """Writes one JSON line per prompt, in prompt order, fsynced block by block.

    ``start`` decides, before anything is generated, where the job stands: a fresh file, or
    (``resume``) the number of prompts already complete in it. The file is opened at the
    first write, so a run that fails before its first block leaves the file as it was."""

    def __init__(self, path: str | None, tokenizer: Any | None, *, resume: bool = False,
                 overwrite: bool = False, id_field: str = "id") -> None:
        self.tokenizer = tokenizer
        self.id_field = id_field  # the field of a line that names its prompt (a batch: custom_id)
        self.path = Path(path).expanduser() if path else None
        self.resume, self.overwrite = resume, overwrite
        self.f: IO[str] | None = None
        self.done = 0  # prompts complete in the file before this run
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def start(self, prompts: list[Prompt], fingerprint: dict[str, Any]) -> int:
        """Check the existing output against this job; returns the prompts already done."""
        if self.path is None:
            return 0
        fp = {**fingerprint, "prompts_sha256": prompts_digest(prompts), "num_prompts": len(prompts)}
        fpath = fingerprint_path(self.path)
        exists = self.path.exists() and self.path.stat().st_size > 0
        if exists and not (self.resume or self.overwrite):
            raise ConfigError(f"--output {self.path} exists and is not empty: pass --resume to finish that job, "
                              "or --overwrite to start it over")
        if exists and self.resume:
            try:
                old = json.loads(fpath.read_text())
            except (OSError, ValueError):
                raise ConfigError(f"--resume: {fpath} is missing or unreadable, so {self.path} cannot be "
                                  "checked against this job; use --overwrite to start over") from None
            changed = [k for k in sorted(set(fp) | set(old)) if fp.get(k) != old.get(k)]
            if changed:
                k = changed[0]
                what = "the prompts" if k == "prompts_sha256" else f"{k} ({old.get(k)!r} -> {fp.get(k)!r})"
                raise ConfigError(f"--resume: {what} changed since {self.path} was started; rerun with the "
                                  "original settings, or use --overwrite to start over")
            self.done, keep = self._complete_prefix(prompts)
            if keep < self.path.stat().st_size:
                os.truncate(self.path, keep)  # the torn line of an interrupted write
        fpath.write_text(json.dumps(fp, indent=2) + "\n")
        return self.done

    def _complete_prefix(self, prompts: list[Prompt]) -> tuple[int, int]:
        """(lines complete, their bytes) at the head of the file; a torn last line is dropped."""
        assert self.path is not None
        raw = self.path.read_bytes()
        n, pos = 0, 0
        while pos < len(raw):
            end = raw.find(b"\n", pos)
            if end < 0:
                break  # torn: the write of this line was cut off
            try:
                rec = json.loads(raw[pos:end])
            except ValueError:
                if raw.find(b"\n", end + 1) < 0:
                    break  # a torn last line that happened to end in a newline byte
                raise ConfigError(f"--resume: line {n + 1} of {self.path} is not JSON; the file is damaged, "
                                  "use --overwrite to start over") from None
            if n >= len(prompts) or not isinstance(rec, dict) or rec.get(self.id_field) != prompts[n].id:
                raise ConfigError(f"--resume: line {n + 1} of {self.path} is not the output of prompt "
                                  f"{prompts[n].id if n < len(prompts) else '(none)'!r}; use --overwrite "
                                  "to start over")
            n, pos = n + 1, end + 1
        return n, pos

    def record(self, p: Prompt, tokens: list[int], text: str | None = None,
               logprobs: TokenLogprobs | None = None, reasoning: str | None = None) -> dict[str, Any]:
        """The output line of prompt ``p``; ``text`` is the decoded completion (a reasoning
        model's answer, its thinking in ``reasoning``) if known already;
        ``logprobs`` (``--logprobs K``) adds each token's log-probability and K alternatives
        (``{"token_logprobs": [...], "top_logprobs": [[{"id", "token", "logprob"}, ...], ...]}``,
        "token" where there is a tokenizer)."""
        rec: dict[str, Any] = {"id": p.id}
        if p.messages is not None:
            rec["messages"] = p.messages
        if p.text is not None:
            rec["prompt"] = p.text
        if reasoning is not None:
            rec["reasoning"] = reasoning
        if text is not None:
            rec["text"] = text
        elif self.tokenizer is not None:
            rec["text"] = self.tokenizer.decode(tokens, skip_special_tokens=True)
        rec["tokens"] = tokens
        if logprobs is not None:
            rec["logprobs"] = {"token_logprobs": logprobs.token_logprobs,
                               "top_logprobs": [[self._alt(i, lp) for i, lp in alts] for alts in logprobs.top]}
        return rec

    def _alt(self, i: int, lp: float) -> dict[str, Any]:
        if self.tokenizer is None:
            return {"id": i, "logprob": lp}
        return {"id": i, "token": self.tokenizer.decode([i]), "logprob": lp}

    def write(self, recs: list[dict[str, Any]]) -> None:
        """One block's lines, whole, on disk (fsynced) before returning."""
        if self.path is None:
            return
        if self.f is None:
            self.f = open(self.path, "a" if self.done else "w", encoding="utf-8")
        self.f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None
