"""`krait serve --speculative-config`: greedy completions equal the offline engine's without
speculation, the spec-decode counters appear on /metrics, and a bad config stops the server
at startup with a message naming the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from krait import LLM, SamplingParams  # noqa: E402
from tests.server.test_api_server import _free_port, metric, wait_healthy  # noqa: E402
from tests.utils import make_tiny_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def _serve(model_dir: str, spec: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "krait", "serve", model_dir, "--port", str(port),
           "--served-model-name", "tiny", "--max-num-seqs", "8", "--speculative-config", spec]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ))
    return proc, f"http://127.0.0.1:{port}"


def test_serve_with_speculative_decoding(tmp_path) -> None:
    model_dir = make_tiny_llama(tmp_path / "m")
    proc, base = _serve(model_dir, json.dumps(SPEC), tmp_path / "log")
    try:
        wait_healthy(proc, base, tmp_path / "log")
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [11, 12, 13, 14]]
        got = [client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)
               .choices[0].text for p in prompts]
        stream = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=12,
                                           temperature=0, stream=True)
        streamed = "".join(c.choices[0].text for c in stream)
        llm = LLM(model_dir, device="cpu")
        want = [o.outputs[0].text for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)]
        assert got == want and streamed == want[0]
        assert metric(base, "krait:spec_decode_num_drafts_total") > 0
        assert metric(base, "krait:spec_decode_num_draft_tokens_total") > 0
        assert metric(base, "krait:spec_decode_num_accepted_tokens_total") >= 0
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_bad_speculative_config_stops_the_server(tmp_path) -> None:
    model_dir = make_tiny_llama(tmp_path / "m")
    bad = json.dumps({"num_speculative_tokens": 3, "lookahead_slots": 2})
    proc, _ = _serve(model_dir, bad, tmp_path / "log")
    assert proc.wait(timeout=120) != 0
    assert "lookahead_slots" in (tmp_path / "log").read_text()
