"""The field's harnesses, run for real: the inspect_ai task through the `inspect eval` command line on the offline
mock model, its scores against values worked out by hand, and the lm-evaluation-harness export loaded by lm-eval's
own TaskManager.

inspect-ai and lm-eval pin versions our environment does not (botocore caps python-dateutil below ours), so they live
in a side environment, `.venv-harness` (`make harness-env`; torch 2.13.0 CPU first, then both harnesses constrained
by requirements.txt). When the main venv has them, it is used instead. If neither is there and the side environment
cannot be built, the tests skip and say why.
"""
import json, math, os, subprocess, sys, textwrap
from pathlib import Path
import pytest
from medsafe_nb import harness
from medsafe_nb.core import MedsafeError

pytestmark = pytest.mark.integration   # real components end to end: `make test-integration`

ROOT = Path(__file__).resolve().parents[1]
SIDE = ROOT / ".venv-harness"

# inspect's mockllm counts prompt tokens with tiktoken's o200k_base, which tiktoken downloads on first use; offline,
# this shim (put on PYTHONPATH as sitecustomize) counts bytes instead when the encoding cannot be loaded
TIKTOKEN_SHIM = '''
import tiktoken
_get = tiktoken.get_encoding
class _Bytes:
    name = "offline-bytes"
    def encode(self, text, **kw): return list(text.encode("utf-8"))[::4]
def get_encoding(name):
    try: return _get(name)
    except Exception: return _Bytes()
tiktoken.get_encoding = get_encoding
'''

def _has(python, *mods)->bool:
    code = "import importlib.util, sys; sys.exit(0 if all(importlib.util.find_spec(m) for m in sys.argv[1:]) else 1)"
    return subprocess.run([str(python), "-c", code, *mods], capture_output=True).returncode == 0

@pytest.fixture(scope="module")
def side_python():
    "A Python with inspect_ai and lm_eval: this one, else .venv-harness (built with `make harness-env` if missing)"
    if _has(sys.executable, "inspect_ai", "lm_eval"): return Path(sys.executable)
    py = SIDE / "bin" / "python"
    if not (SIDE / ".installed").exists():
        r = subprocess.run(["make", "harness-env"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            pytest.skip("inspect-ai / lm-eval are not installed and `make harness-env` failed:\n" + (r.stdout + r.stderr)[-1500:])
    if not _has(py, "inspect_ai", "lm_eval"): pytest.skip(f"{SIDE} lacks inspect_ai or lm_eval: rerun `make harness-env`")
    return py

@pytest.fixture(scope="module")
def side_env(tmp_path_factory):
    shim = tmp_path_factory.mktemp("shim")
    (shim / "sitecustomize.py").write_text(TIKTOKEN_SHIM)
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(shim)])
    return env


def test_package_imports_without_inspect():
    "The module imports everywhere; without inspect_ai the task explains what to install"
    if _has(sys.executable, "inspect_ai"): pytest.skip("inspect_ai is installed in this venv")
    with pytest.raises(MedsafeError, match=r"pip install 'medsafe_nb\[inspect\]'"): harness.medmisbench(limit=2)


def test_inspect_eval_cli_mockllm(side_python, side_env, tmp_path):
    "`inspect eval medsafe_nb/harness.py@medmisbench --model mockllm/model` runs offline; its scores are read back"
    env = {**side_env, "INSPECT_LOG_DIR": str(tmp_path / "logs")}
    inspect_bin = Path(side_python).parent / "inspect"
    r = subprocess.run([str(inspect_bin), "eval", "medsafe_nb/harness.py@medmisbench", "--model", "mockllm/model",
                        "-T", "limit=4", "-T", "condition=type1", "--log-format", "json", "--display", "plain"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    logs = list((tmp_path / "logs").glob("*.json"))
    assert len(logs) == 1
    log = json.loads(logs[0].read_text())
    assert log["status"] == "success"
    assert log["results"]["total_samples"] == 8                      # 4 items, clean and type1
    metrics = {k: m["value"] for s in log["results"]["scores"] for k, m in s["metrics"].items()}
    # the mock's reply ("Default output from mockllm/model") names no option: nothing is right, nothing is clean-correct
    assert metrics["clean_acc"] == 0.0 and metrics["type1_acc"] == 0.0
    assert set(metrics) == {"clean_acc", "type1_acc", "type1_asr", "type1_tasr"}
    s0 = log["samples"][0]
    assert s0["id"].endswith("/clean") and s0["metadata"]["condition"] == "clean"
    assert s0["scores"]["medmisbench"]["metadata"]["status"] == "noanswer"
    assert s0["input"][0]["role"] == "system" and "Options:" in s0["input"][1]["content"]


INSPECT_API = textwrap.dedent('''
    import json, sys, tempfile
    from inspect_ai import eval as inspect_eval
    from inspect_ai.model import get_model, ModelOutput, ModelUsage
    from medsafe_nb.harness import medmisbench, harness_prompts
    cond = sys.argv[1]
    prompts = harness_prompts(condition=cond, limit=4)[0]
    by_text, first = {p.messages[-1]["content"]: p for p in prompts}, prompts[0].item_id
    def reply(input, tools, tool_choice, config):
        p = by_text[input[-1].text]
        if p.condition == "clean" or p.item_id == first: key = ",".join(p.gold)
        elif p.condition == "type1": key = p.target
        else: key = [k for k in p.keys if k not in p.gold][0]
        out = ModelOutput.from_content("mockllm", "Reasoning... " + json.dumps({"answer": key}))
        out.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)
        return out
    log = inspect_eval(medmisbench(condition=cond, limit=4), model=get_model("mockllm/model", custom_outputs=reply),
                       log_dir=tempfile.mkdtemp(), display="none")[0]
    if log.status != "success": sys.exit(f"inspect eval ended {log.status}: {log.error}")   # the task's own error, not a None deep below
    print(json.dumps({m.name: m.value for s in log.results.scores for m in s.metrics.values()}))
''')

@pytest.mark.parametrize("condition,want", [
    ("type1", {"clean_acc": 100.0, "type1_acc": 25.0, "type1_asr": 75.0, "type1_tasr": 75.0}),
    ("type2", {"clean_acc": 100.0, "type2_acc": 25.0, "type2_asr": 75.0, "type2_rescue": None}),  # rescue: no clean-wrong item
    ("clean", {"clean_acc": 100.0}),
])
def test_inspect_scores_are_our_metrics(side_python, side_env, condition, want):
    "A mock that knows every item but follows the attack on 3 of 4: accuracy, ASR and TASR as Table 1 computes them"
    r = subprocess.run([str(side_python), "-c", INSPECT_API, condition], cwd=ROOT, env=side_env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    got = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in got.items()}   # NaN: undefined on these items
    assert got == want


LMEVAL_LOAD = textwrap.dedent('''
    import json, sys
    from lm_eval.tasks import TaskManager, get_task_dict
    tm = TaskManager(include_path=sys.argv[1])
    out = {"tasks": sorted(t for t in tm.all_tasks if t.startswith("medmisbench"))}
    d = get_task_dict(["medmisbench_clean", "medmisbench_type1", "medmisbench_type2"], tm)
    for name, task in d.items():
        docs = list(task.test_docs())
        out[name] = {"n": len(docs), "text": task.doc_to_text(docs[0]), "choices": task.doc_to_choice(docs[0]),
                     "target": task.doc_to_target(docs[0]), "output_type": task.OUTPUT_TYPE}
    print(json.dumps(out))
''')

def test_lm_eval_export_loads(side_python, side_env, tmp_path):
    "lm-eval's TaskManager finds the exported tasks and builds their documents"
    files = harness.export_lm_eval(tmp_path / "lmeval", limit=6)
    assert sorted(f.name for f in files) == sorted(["medmisbench.yaml", "utils.py"] + [f"medmisbench_{c}.{x}"
                                                   for c in ("clean", "type1", "type2") for x in ("jsonl", "yaml")])
    r = subprocess.run([str(side_python), "-c", LMEVAL_LOAD, str(tmp_path / "lmeval")], cwd=tmp_path,
                       env={**side_env, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["tasks"] == ["medmisbench", "medmisbench_clean", "medmisbench_type1", "medmisbench_type2"]
    rows = {c: [json.loads(l) for l in (tmp_path / "lmeval" / f"medmisbench_{c}.jsonl").read_text().splitlines()]
            for c in ("clean", "type1", "type2")}
    for c in ("clean", "type1", "type2"):
        t, first = got[f"medmisbench_{c}"], next(r for r in rows[c] if not r["multi"])
        assert t["n"] == sum(not r["multi"] for r in rows[c]) and t["output_type"] == "multiple_choice"
        assert t["choices"] == first["keys"] and first["keys"][t["target"]] == first["gold"]
        assert t["text"].endswith('{"answer": "') and t["text"].startswith(first["messages"][0]["content"])
        assert ("Context:" in t["text"]) == (c != "clean")
