"""`paper.yaml` on the wire: each of its 11 configurations pointed at a local server that logs request bodies sends what the
authors' evaluation code sends (their decoding, their two frames, their reply format per provider). The API models go to
the mock server on 127.0.0.1 (OpenAI through its gateway switch, Anthropic and Gemini through their own SDKs); the open
models go through the vLLM engine, whose server is a stand-in process that records its command line and serves the mock."""
import json, stat, sys
from dataclasses import replace
from pathlib import Path

import pytest

from medsafe_nb.protocols import format_instruction, load_protocol, protocol_text
from medsafe_nb.run.params import load_params
from medsafe_nb.run.runner import run
from medsafe_nb.items.release import load_medmisbench
from medsafe_nb.testing.mockserver import MockServer

PARAMS = Path(__file__).resolve().parents[1] / "nbs" / "analysis" / "params"
PAPER = load_protocol("paper")
ITEMS = load_medmisbench("all", "sample")[:2]
FAKE_VLLM = """#!{python}
import json, os, signal, sys, time
from medsafe_nb.testing.mockserver import MockServer
args = sys.argv[1:]
val = lambda flag: args[args.index(flag) + 1]
srv = MockServer(policy="first", model=val("--served-model-name"), port=int(val("--port"))).start()
def dump(*_):
    with open(os.environ["FAKE_VLLM_LOG"], "w") as f: json.dump({{"argv": args, "requests": srv.requests}}, f)
    srv.stop(); os._exit(0)
signal.signal(signal.SIGTERM, dump)
while True: time.sleep(1)
"""


def entries():
    return {e.label: e for e in load_params(PARAMS / "paper.yaml").models}


def run_entry(entry, tmp_path, **over):
    "Run one paper.yaml entry on the first two sample items, as the params file configures it but for where it is sent"
    cfg = replace(entry.config, data="sample", limit=2, out=str(tmp_path / "run"), ledger=str(tmp_path / "ledger.sqlite"), progress=False,
                  max_retries=0, **over)
    return run(cfg)


def user_turn(body:dict)->str:
    if "messages" in body: return "".join(m["content"] for m in body["messages"] if m["role"] == "user" and isinstance(m["content"], str))
    return "".join(p["text"] for c in body["contents"] for p in c["parts"])


def check_frames(bodies:list, conditions=("clean", "type1", "type2")):
    "The clean prompt never mentions context; a prompt with context opens with the context frame and its heading"
    users = [user_turn(b) for b in bodies]
    clean = [u for u in users if "Additional clinical context:" not in u]
    framed = [u for u in users if "Additional clinical context:" in u]
    assert len(clean) == 2 and len(framed) == 4
    assert all("context" not in u.split("Question:")[0].lower() and u.startswith(protocol_text(PAPER, "clean_frame")) for u in clean)
    assert all(u.startswith(protocol_text(PAPER, "context_frame") + "\n\nAdditional clinical context:\n") for u in framed)
    assert "reading the additional clinical context" in protocol_text(PAPER, "context_frame")


@pytest.mark.parametrize("label", ["GPT-5.4 (medium)", "GPT-5.4 (none)"])
def test_openai_reasoning_models(tmp_path, monkeypatch, label):
    "OpenAI: JSON mode (no schema), 2,048 completion tokens, the effort, no temperature; the instruction as the system message"
    monkeypatch.setenv("OPENAI_API_KEY", "sk-" "wire-test-key-000000000000")
    e = entries()[label]
    with MockServer(policy="first", model="gpt-5.4") as srv:
        df = run_entry(e, tmp_path, base_url=srv.base_url, model_args={**e.config.model_args, "official_api": True})
        bodies = [r["body"] for r in srv.completions()]
    assert len(bodies) == 6 and (df.status == "ok").all()
    for b in bodies:
        assert b["response_format"] == {"type": "json_object"}
        assert b["max_completion_tokens"] == 2048 and "max_tokens" not in b and "temperature" not in b
        assert b["reasoning_effort"] == e.config.reasoning_effort and "seed" not in b
        assert b["messages"][0] == {"role": "system", "content": format_instruction(ITEMS[0], PAPER)}
    check_frames(bodies)
    rec = json.loads((tmp_path / "run" / "run.json").read_text())
    assert rec["decoding"]["reply_format"] == "json_object" and rec["protocol"] == PAPER.record()


@pytest.mark.parametrize("label", ["Gemini-3.1-pro (high)", "Gemini-3.1-pro (low)", "Gemini-3.1-flash-lite (medium)", "Gemini-3.1-flash-lite (minimal)"])
def test_gemini(tmp_path, monkeypatch, label):
    "Gemini: temperature 1.0, JSON with a schema whose answer is a free string, its thinking level without thoughts, no output cap"
    pytest.importorskip("google.genai")
    monkeypatch.setenv("GEMINI_API_KEY", "AIza" "-wire-test-key-00000000000000000")
    e = entries()[label]
    with MockServer() as srv:                       # no Gemini route: each request is logged, then answered 404 (rows in error)
        run_entry(e, tmp_path, base_url=srv.base_url.removesuffix("/v1"))
        reqs = [r for r in srv.requests if r["path"].endswith(":generateContent")]
    assert len(reqs) == 6 and all(r["path"].endswith(f"/models/{e.config.model.split(':', 1)[1]}:generateContent") for r in reqs)
    level = {"high": "HIGH", "low": "LOW", "medium": "MEDIUM", "minimal": "MINIMAL"}[e.config.reasoning_effort]
    for b in (r["body"] for r in reqs):
        gc = b["generationConfig"]
        assert gc["temperature"] == 1.0 and "maxOutputTokens" not in gc
        assert gc["responseMimeType"] == "application/json"
        schema = json.dumps(gc.get("responseSchema") or gc.get("responseJsonSchema"))
        assert '"answer_letter"' in schema and '"enum"' not in schema
        assert {k.replace("_", "").lower(): v for k, v in gc["thinkingConfig"].items()} == {"thinkinglevel": level, "includethoughts": False}
        assert "systemInstruction" not in b                                  # the instruction ends the user turn
        assert user_turn(b).endswith("\n\n" + format_instruction(ITEMS[0], PAPER))
        assert sorted((s["category"], s["threshold"]) for s in b["safetySettings"]) == sorted(
            (c, "BLOCK_NONE") for c in ("HARM_CATEGORY_HARASSMENT", "HARM_CATEGORY_HATE_SPEECH", "HARM_CATEGORY_SEXUALLY_EXPLICIT", "HARM_CATEGORY_DANGEROUS_CONTENT"))
    check_frames([r["body"] for r in reqs])


@pytest.mark.parametrize("label", ["Claude-sonnet-4.6 (medium)", "Claude-sonnet-4.6 (low)"])
def test_anthropic(tmp_path, monkeypatch, label):
    "Anthropic: temperature 1.0, 2,048 tokens with adaptive thinking inside them, the effort, the instruction as the system text"
    pytest.importorskip("anthropic")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-" "ant-wire-test-key-0000000000")
    e = entries()[label]
    with MockServer() as srv:
        run_entry(e, tmp_path, base_url=srv.base_url.removesuffix("/v1"))
        bodies = [r["body"] for r in srv.requests if r["path"] == "/v1/messages"]
    assert len(bodies) == 6
    for b in bodies:
        assert (b["temperature"], b["max_tokens"], b["thinking"], b["output_config"]) == (1.0, 2048, {"type": "adaptive"}, {"effort": e.config.reasoning_effort})
        assert b["system"] == format_instruction(ITEMS[0], PAPER) and "response_format" not in b and "output_format" not in b
    check_frames(bodies)


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    "A stand-in for vLLM's server: records the command line it was started with, serves the mock, dumps what it got on SIGTERM"
    exe = tmp_path / "fake-vllm-python"
    exe.write_text(FAKE_VLLM.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "fake-vllm.json"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    return exe, log


@pytest.mark.parametrize("label", ["Qwen3.6-27B", "Gemma 4 26B", "MedGemma 27B"])
def test_open_models_on_the_vllm_engine(tmp_path, fake_vllm, label):
    "The open models: temperature 1.0, 2,048 tokens, a JSON schema with no enum; vLLM started with the checkpoint's sampling defaults"
    exe, log = fake_vllm
    e = entries()[label]
    assert e.config.engine == "vllm"
    run_entry(e, tmp_path, vllm_python=str(exe))
    seen = json.loads(log.read_text())
    argv, bodies = seen["argv"], [r["body"] for r in seen["requests"] if r["path"] == "/v1/chat/completions"]
    flag = lambda f: argv[argv.index(f) + 1] if f in argv else None
    assert flag("--model") == e.config.model.split(":", 1)[1] and flag("--generation-config") == "auto" and flag("--max-model-len") == "32768"
    if label.startswith("Qwen"): assert "--trust-remote-code" in argv and flag("--reasoning-parser") == "qwen3"
    else: assert flag("--model-impl") == "transformers"
    assert len(bodies) == 6
    for b in bodies:
        assert (b["temperature"], b["max_tokens"]) == (1.0, 2048)
        rf = b["response_format"]
        assert rf["type"] == "json_schema" and "strict" not in rf["json_schema"] and '"enum"' not in json.dumps(rf)
        assert b["messages"][0] == {"role": "system", "content": format_instruction(ITEMS[0], PAPER)}
        kwargs = (b.get("chat_template_kwargs") or {})
        assert kwargs == ({"enable_thinking": False} if label.startswith("Qwen") else {})
    check_frames(bodies)


def test_paper_yaml_follows_the_authors_code():
    "Every configuration of paper.yaml samples at 1.0 (the backend drops it for OpenAI's reasoning models), one reply, the authors' retries"
    es = entries()
    assert len(es) == 11 and list(es) == [l for l in es]
    assert {e.config.temperature for e in es.values()} == {1.0} and {e.config.samples for e in es.values()} == {1}
    assert {e.config.prompt for e in es.values()} == {"paper"} and {e.config.structured for e in es.values()} == {"auto"}
    assert all(e.config.max_new_tokens is None for l, e in es.items() if l.startswith("Gemini"))
    assert all(e.config.max_new_tokens == 2048 for l, e in es.items() if not l.startswith("Gemini"))
    assert all(e.config.max_retries == 4 and e.config.model_args["backoff"] == 4.0 for e in es.values() if e.config.engine != "vllm")
    greedy = load_params(PARAMS / "paper_greedy.yaml")
    assert [e.label for e in greedy.models] == list(es) and {e.config.temperature for e in greedy.models} == {None}
    assert {e.config.prompt for e in greedy.models} == {"controlled"} and greedy.runs_dir != load_params(PARAMS / "paper.yaml").runs_dir
    assert not (PARAMS / "paper_reference.yaml").exists()
