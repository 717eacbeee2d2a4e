"""SGLang's own benchmark client (`python -m sglang.benchmark.serving`) as a second client of `kvrep bench`.

Workload: multi-turn generated-shared-prefix over the chat API (`--backend sglang-oai-chat`): `groups` system
prompts of `system_len` tokens, `conversations` conversations per group, `turns` turns each, sent at `rate`
requests/s. The client authenticates with `OPENAI_API_KEY` (sent as a bearer token); `--output-details` writes
every request's TTFT, prompt length and error to its JSONL output file, read back by `read_output`.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

WORKLOAD = "sgl-gsp"
"""The workload name of the rows this client's runs make in `kvrep bench`'s tables."""


@dataclass
class GspConfig:
    groups: int = 2
    conversations: int = 3
    turns: int = 2
    system_len: int = 1024
    question_len: int = 64
    output_len: int = 8
    rate: float = 1.0

    @property
    def requests(self) -> int:
        return self.groups * self.conversations * self.turns


def argv(base_url: str, model: str, out_file: Path, seed: int, cfg: GspConfig) -> list[str]:
    """The client's command line (run from any directory; `model` is the served model's path, also its
    tokenizer)."""
    return [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang-oai-chat",
            "--base-url", base_url, "--model", model, "--tokenizer", model,
            "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(cfg.groups),
            "--gsp-prompts-per-group", str(cfg.conversations), "--gsp-num-turns", str(cfg.turns),
            "--gsp-system-prompt-len", str(cfg.system_len), "--gsp-question-len", str(cfg.question_len),
            "--gsp-output-len", str(cfg.output_len), "--num-prompts", str(cfg.groups * cfg.conversations),
            "--request-rate", f"{cfg.rate:g}", "--seed", str(seed), "--warmup-requests", "0",
            "--output-file", str(out_file), "--output-details", "--disable-tqdm"]


def run(base_url: str, model: str, out_file: Path, seed: int, cfg: GspConfig, api_key: Optional[str],
        log_file: Path, timeout_s: float = 1800.0) -> list[dict]:
    """Runs the client once against `base_url` (bearer `api_key`, if any); returns `read_output(out_file)`."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "API_KEY")}
    if api_key:
        env["OPENAI_API_KEY"] = api_key
    out_file.unlink(missing_ok=True)  # the client appends
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "w") as log:
        proc = subprocess.run(argv(base_url, model, out_file, seed, cfg), env=env, stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0 or not out_file.exists():
        raise RuntimeError(f"sglang.benchmark.serving exited {proc.returncode}; log: {log_file}")
    return read_output(out_file)


def read_output(path: Path) -> list[dict]:
    """The requests of the last run in the client's JSONL output (`--output-details`): one record per request,
    {"rid", "prompt_tokens", "output_tokens", "ttft_s" (None if it failed), "error" (None if it answered)}."""
    lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: no result")
    res = json.loads(lines[-1])
    ttfts, errors = res["ttfts"], res["errors"]
    n = len(ttfts)
    inputs, outputs = res.get("input_lens", [0] * n), res.get("output_lens", [0] * n)
    out = []
    for i in range(n):
        err = errors[i] or None
        t = ttfts[i]
        ok = err is None and t is not None and t > 0 and not math.isnan(t)
        out.append({"rid": i, "prompt_tokens": inputs[i], "output_tokens": outputs[i],
                    "ttft_s": round(t, 4) if ok else None, "error": err if err or ok else "no first token"})
    return out


def results(requests: list[dict]) -> list:
    """`read_output`'s records as `kvrep_dev.loadgen.Result`s (for `loadgen.summarize`; no send times or
    end-to-end latencies: the client's output has neither per request)."""
    from kvrep_dev.loadgen import Result

    return [Result(rid=q["rid"], kind=WORKLOAD, sent_s=0.0, prompt_tokens=q["prompt_tokens"],
                   output_tokens=q["output_tokens"], ttft_s=q["ttft_s"] if q["ttft_s"] is not None else math.nan,
                   error=q["error"]) for q in requests]
