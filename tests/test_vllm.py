"""A real vLLM server (`--engine vllm`) on a tiny head_dim-64 model: the sample through generate and logprob scoring,
statuses and token counts, identical greedy outputs across two runs, and no process left behind.

Needs the vLLM environment that `make vllm` builds (`.venv-vllm`, or `MEDSAFE_VLLM_PYTHON`); skips and says why
without it. The server takes one to two minutes to become healthy on two CPU cores, so one server serves the
library tests (module fixture); the CLI test starts its own, as a user's run does."""
import json, os, subprocess, sys, time
from pathlib import Path

import pytest

from medsafe_nb.core import ConfigError, STATUSES

pytestmark = pytest.mark.integration   # real components end to end: `make test-integration`

LIMIT, MAX_NEW = 24, 8                         # 24 items x 3 conditions; short replies keep decoding cheap
MODEL_ARGS = {"max_model_len": 2048}


def vllm_python_or_skip() -> str:
    from medsafe_nb.models.vllm import find_vllm_python
    try: return find_vllm_python()
    except ConfigError as e: pytest.skip(f"no vLLM environment: {e}")


@pytest.fixture(scope="module")
def vllm_python():
    py = vllm_python_or_skip()
    probe = subprocess.run([py, "-c", "import vllm, sys; print(vllm.__version__)"], capture_output=True, text=True, timeout=300)
    if probe.returncode != 0: pytest.skip(f"{py} cannot import vllm (run `make vllm`): {probe.stderr.strip()[-300:]}")
    return py


@pytest.fixture(scope="module")
def tiny64_dir(tmp_path_factory):
    "The tiny random Llama with hidden 128 and 2 heads: head_dim 64, which vLLM's CPU attention supports (16 is not)"
    from medsafe_nb.testing.doubles import build_tiny_model
    path = build_tiny_model(tmp_path_factory.mktemp("tiny64") / "model", hidden_size=128, num_heads=2)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64
    return path


@pytest.fixture(scope="module")
def served(vllm_python, tiny64_dir, tmp_path_factory):
    "One vLLM server for the library tests; stopped (with its process group) at the end"
    from medsafe_nb.models.vllm import vllm_backend
    out = tmp_path_factory.mktemp("vllm-run")
    backend = vllm_backend(f"hf:{tiny64_dir}", out, model_args=MODEL_ARGS, vllm_python=vllm_python, max_new_tokens=MAX_NEW)
    yield backend
    pid = backend.server.proc.pid
    backend.close()
    assert not group_alive(pid), "the vLLM server left processes behind"


def group_alive(pgid: int, wait: float = 15.0) -> bool:
    "True if a process of group `pgid` still runs after `wait` seconds (zombies awaiting their reaper do not count)"
    deadline = time.monotonic() + wait
    while True:
        live = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try: fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError: continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"): live.append(stat.parent.name)
        if not live or time.monotonic() > deadline: return bool(live)
        time.sleep(0.2)


def sample_items():
    from medsafe_nb.items.release import load_medmisbench
    return load_medmisbench("all", "sample")[:LIMIT]


def test_server_record(served):
    rec = served.server.record()
    assert rec["engine"] == "vllm" and rec["vllm_version"] and rec["startup_s"] > 0
    assert rec["env"]["VLLM_CPU_KVCACHE_SPACE"] == os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
    assert (Path(rec["env"]["PYTHONPATH"].split(os.pathsep)[0]) / "medsafe_vllm_forced.py").is_file()   # the option-scoring plugin
    assert "--max-logprobs" in rec["command"] and Path(rec["log"]).exists()
    ident = served.identity()
    assert ident["engine"] == "vllm" and "base_url" not in ident and served.name.startswith("hf:")


def test_generate_statuses_tokens_and_determinism(served):
    from medsafe_nb.run.predict import run_benchmark
    items = sample_items()
    first = run_benchmark(items, served, scoring="generate", max_new_tokens=MAX_NEW, progress=False)
    second = run_benchmark(items, served, scoring="generate", max_new_tokens=MAX_NEW, progress=False)  # own in-memory ledger: asked again
    assert len(first) == 3 * LIMIT and set(first["status"]) <= set(STATUSES)
    assert (first["status"] != "error").all(), first.loc[first["status"] == "error", "raw"].tolist()
    assert (first["prompt_tokens"] > 0).all()
    assert first["completion_tokens"].between(1, MAX_NEW).all()
    assert ((first["status"] != "truncated") | (first["completion_tokens"] == MAX_NEW)).all()
    assert first["raw"].tolist() == second["raw"].tolist()            # greedy: the same text, twice
    assert first["completion_tokens"].tolist() == second["completion_tokens"].tolist()


def test_logprob_scoring(served):
    from medsafe_nb.run.predict import run_benchmark
    items = sample_items()
    df = run_benchmark(items, served, scoring="logprob", progress=False)
    again = run_benchmark(items, served, scoring="logprob", progress=False)
    assert len(df) == 3 * LIMIT and set(df["status"]) <= set(STATUSES)
    ok = df[df["status"] == "ok"]
    assert len(ok) >= 0.9 * len(df), df["status"].value_counts().to_dict()
    assert ok["pred"].notna().all() and ok["p_gold"].between(0, 1).all() and (ok["prompt_tokens"] > 0).all()
    assert df["pred"].tolist() == again["pred"].tolist()


def test_option_scoring_matches_inprocess(served, tiny64_dir):
    "Option scoring on the engine (each prompt continued with each option's tokens, the prompt from the prefix cache): in-process's values"
    from medsafe_nb.models.base import ScoreRequest
    from medsafe_nb.models.hf import HFBackend
    from medsafe_nb.protocols import build_prompts
    items = [it for it in sample_items() if not it.is_multi][:8]
    by_id = {it.id: it for it in items}
    reqs = [ScoreRequest(p.messages, p.keys, prefix="", continuations=tuple(by_id[p.item_id].options[k] for k in p.keys))
            for p in build_prompts(items, ["clean", "type1", "type2"])]
    v = dict(served.score(reqs))
    i = dict(HFBackend(str(tiny64_dir)).score(reqs))
    assert not [s.error for s in v.values() if s.error]
    diff = max(abs(v[j].logprobs[k] - i[j].logprobs[k]) for j in i for k in i[j].logprobs)
    assert diff < 1e-3, diff
    assert [max(s.logprobs, key=s.logprobs.get) for _, s in sorted(v.items())] == [max(s.logprobs, key=s.logprobs.get) for _, s in sorted(i.items())]


def test_cli_engine_vllm(vllm_python, tiny64_dir, tmp_path):
    "`medsafe run --engine vllm` end to end (skips until the CLI has the flag)"
    help_text = subprocess.run([sys.executable, "-m", "medsafe_nb.cli", "run", "--help"], capture_output=True, text=True).stdout
    if "--engine" not in help_text: pytest.skip("`medsafe run` has no --engine option yet")
    out = tmp_path / "run"
    env = {**os.environ, "MEDSAFE_VLLM_PYTHON": vllm_python}
    r = subprocess.run([sys.executable, "-m", "medsafe_nb.cli", "run", "--model", f"hf:{tiny64_dir}", "--engine", "vllm",
                        "--limit", "8", "--max-new-tokens", str(MAX_NEW), "--model-args", "max_model_len=2048",
                        "--out", str(out), "--no-progress"], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, f"medsafe run --engine vllm failed:\n{r.stdout}\n{r.stderr}"
    import pandas as pd
    df = pd.read_parquet(out / "predictions.parquet")
    assert len(df) == 24 and (df["status"] != "error").all()
    record = (out / "run.json").read_text()
    assert '"vllm_version"' in record and (out / "vllm.log").exists()
