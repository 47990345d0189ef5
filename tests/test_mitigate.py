"""Mitigations: bm25 on the demo corpus, offline replay byte for byte, the tool-loop limits, web-search
failures ending in a status, no key in any written file, tool calls in the OpenAI wire format against the local mock
server (and Anthropic / Gemini through their SDK types when installed), and `medsafe run --mitigation search` end to end."""
import io, json, shutil, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import pandas as pd
import pytest
from medsafe_nb.core import SEARCH_STATUSES, ConfigError
from medsafe_nb.items.release import load_medmisbench
from medsafe_nb.models.base import make_backend, GenRequest
from medsafe_nb.run.predict import run_benchmark
from medsafe_nb.run.runner import run
from medsafe_nb.testing.mockserver import MockServer
from medsafe_nb.mitigate import defences as M, search as S
from medsafe_nb.items import subset as SUB

FAKE_KEY = "srch" + "-" + "Zq7Xw2Lm9Pk4Rt6Yb1Nc8Vd3"   # a made-up key, assembled so no key-shaped literal sits in the source


@pytest.fixture(scope="module")
def sample():
    return load_medmisbench("all", "sample")


@pytest.fixture(scope="module")
def items(sample):
    return [it for it in sample if it.language == "en" and not it.is_multi][:8]


class JSONServer:
    "A 127.0.0.1 HTTP server whose replies come from `handler(method, path, headers, body) -> (status, dict, headers)`"
    def __init__(self, handler):
        self.handler, self.log = handler, []
        outer = self
        class H(BaseHTTPRequestHandler):
            def log_message(self, *a): pass
            def _go(self, method):
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(raw) if raw else None
                outer.log.append({"method": method, "path": self.path, "headers": dict(self.headers), "body": body})
                status, data, headers = outer.handler(method, self.path, self.headers, body, len(outer.log))
                out = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json"); self.send_header("Content-Length", str(len(out)))
                for k, v in (headers or {}).items(): self.send_header(k, v)
                self.end_headers(); self.wfile.write(out)
            def do_GET(self): self._go("GET")
            def do_POST(self): self._go("POST")
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    @property
    def url(self): return f"http://127.0.0.1:{self.httpd.server_address[1]}"
    def __enter__(self): self.thread.start(); return self
    def __exit__(self, *a): self.httpd.shutdown(); self.httpd.server_close()


def parquet_bytes(df):
    buf = io.BytesIO(); df.to_parquet(buf, index=False); return buf.getvalue()


# --- bm25 on the demo corpus -------------------------------------------------------------------------------------------

def test_bm25_demo_corpus_finds_relevant_passages(sample, tmp_path):
    corpus = tmp_path/"facts.jsonl"
    shutil.copy(S.demo_corpus_path(), corpus)
    bm = S.BM25Provider(corpus)
    assert len(bm.passages) >= 150 and not bm.cached
    assert (tmp_path/"facts.jsonl.bm25"/bm.sha[:16]/"params.index.json").exists()   # cached beside the corpus, keyed by its hash
    assert S.BM25Provider(corpus).cached
    from medsafe_nb.protocols import prompt_parts
    top5 = {it.id: [p.id for p in bm.search(M.search_query(prompt_parts(it, "clean")), 5).passages] for it in sample}
    assert {i: top5[i][0] for i in ("sample-p1-006", "sample-p1-002", "sample-p2-010", "sample-p1-047")} == \
           {"sample-p1-006": "hyperk-calcium", "sample-p1-002": "absence-ethosuximide", "sample-p2-010": "paracetamol-overdose", "sample-p1-047": "crao"}
    assert "anaphylaxis" in top5["sample-p2-018"] and "kawasaki-criteria" in top5["sample-p2-032"]
    corpus.write_text(corpus.read_text() + json.dumps({"id": "new", "title": "t", "text": "zebra unicorn"}) + "\n")
    assert not S.BM25Provider(corpus).cached                                       # an edited corpus gets a new index


def test_corpus_errors_name_file_line_field(tmp_path):
    bad = tmp_path/"c.jsonl"
    bad.write_text('{"id": "a", "title": "x", "text": "fine"}\n{"id": "a", "text": "again"}\n')
    with pytest.raises(Exception, match=r"c\.jsonl:2: field 'id': duplicate id"): S.load_corpus(bad)


# --- replay: byte-identical predictions, offline ------------------------------------------------------------------------

def test_retrieve_replay_is_byte_identical_offline(items, tmp_path):
    corpus = tmp_path/"facts.jsonl"
    shutil.copy(S.demo_corpus_path(), corpus)
    log = tmp_path/"a.search.jsonl"
    b1 = M.with_search(M.EvidenceReader(), "warning+search", f"bm25:{corpus}", items, log=log, mode="retrieve")
    df1 = M.search_columns(run_benchmark(items, b1, mitigation="warning", ledger=tmp_path/"a.sqlite", progress=False), b1)
    assert df1.search_status.isin(SEARCH_STATUSES).all() and (df1.passages > 0).all()
    assert set(df1.columns) >= set(M.SEARCH_COLUMNS)
    shutil.rmtree(tmp_path/"facts.jsonl.bm25"); corpus.unlink()                     # the corpus is gone: replay is offline
    b2 = M.with_search(M.EvidenceReader(), "warning+search", f"replay:{log}", items, mode="retrieve")
    assert b2.identity() == b1.identity()                                          # same ledger keys as the live run
    df2 = M.search_columns(run_benchmark(items, b2, mitigation="warning", ledger=tmp_path/"fresh.sqlite", progress=False), b2)
    assert parquet_bytes(df2) == parquet_bytes(df1)
    b3 = M.with_search(M.EvidenceReader(), "warning+search", f"replay:{log}", items, mode="retrieve")
    df3 = M.search_columns(run_benchmark(items, b3, mitigation="warning", ledger=tmp_path/"a.sqlite", progress=False), b3)
    assert parquet_bytes(df3) == parquet_bytes(df1)                                 # and through the first run's ledger


def test_replay_miss_is_a_search_error_not_a_crash(items, tmp_path):
    log = tmp_path/"a.search.jsonl"
    b1 = M.with_search(M.EvidenceReader(), "search", f"bm25:{S.demo_corpus_path()}", items[:2], log=log, mode="retrieve")
    run_benchmark(items[:2], b1, conditions="clean", progress=False)
    b2 = M.with_search(M.EvidenceReader(), "search", f"replay:{log}", items, mode="retrieve")
    df = M.search_columns(run_benchmark(items, b2, conditions="clean", progress=False), b2)
    assert df.search_status.tolist()[:2] != ["search_error"] * 2
    assert (df.search_status.iloc[2:] == "search_error").all() and (df.status == "ok").all()


# --- the tool loop: limits -----------------------------------------------------------------------------------------------

def ToolDouble(forever):
    "A backend double with tools: the scripted chat model, forever or not"
    return M.ScriptedToolModel(answer='{"answer": "B"}', searches=1, forever=forever)


def test_model_that_searches_forever_ends_at_the_limit(items, tmp_path):
    b = M.with_search(ToolDouble(forever=True), "search", f"bm25:{S.demo_corpus_path()}", items, log=tmp_path/"s.jsonl",
                      max_tool_calls=3, max_evidence_tokens=200)
    assert isinstance(b, M.ToolSearch)
    df = M.search_columns(run_benchmark(items, b, progress=False), b)
    assert (df.search_status == "tool_limit").all() and (df.search_calls == 3).all()
    assert (df.evidence_tokens <= 200).all()
    assert (df.pred == "B").all() and (df.status == "ok").all()                   # the answer is read as usual
    calm = M.with_search(ToolDouble(forever=False), "search", f"bm25:{S.demo_corpus_path()}", items, max_tool_calls=3)
    df2 = M.search_columns(run_benchmark(items, calm, progress=False), calm)
    assert (df2.search_calls == 1).all() and (df2.search_status != "tool_limit").all()


def test_slow_search_call_hits_the_time_limit():
    class Slow(S.SearchProvider):
        name = "slow"
        def search(self, q, k=5): time.sleep(2); return S.SearchResult(())
    s = M.SearchSettings(Slow(), call_timeout=0.2, max_tool_calls=1)
    from medsafe_nb.protocols import PromptParts
    parts = PromptParts("clean", "Which drug?", (("A", "x"), ("B", "y")), (), False, "en")
    t0 = time.perf_counter()
    req = GenRequest(({"role": "user", "content": "Which drug?"},), parts=parts)
    g, rec, msgs = M.run_tool_loop(M.backend_chat(M.ScriptedToolModel(searches=1), req), req.messages, parts, s)
    assert time.perf_counter() - t0 < 1.9
    assert rec["search_status"] == "search_error" and "longer than 0.2 s" in msgs[-1]["content"]


# --- web search APIs: wire formats, retries, statuses, keys --------------------------------------------------------------

def _web_reply(kind, query, k):
    rows = [(f"https://example.org/{i}", f"Result {i}", f"Snippet {i} about {query[:30]}") for i in range(k)]
    if kind == "serper": return {"organic": [{"title": t, "link": u, "snippet": s, "position": i} for i, (u, t, s) in enumerate(rows)]}
    if kind == "tavily": return {"query": query, "results": [{"title": t, "url": u, "content": s, "score": 0.9} for u, t, s in rows]}
    return {"type": "search", "web": {"results": [{"title": t, "url": u, "description": s} for u, t, s in rows]}}


@pytest.mark.parametrize("kind,env,header", [("serper", "SERPER_API_KEY", "X-API-KEY"), ("tavily", "TAVILY_API_KEY", "Authorization"),
                                             ("brave", "BRAVE_API_KEY", "X-Subscription-Token")])
def test_web_providers_wire_format_retries_and_status(kind, env, header, monkeypatch):
    monkeypatch.setenv(env, FAKE_KEY)
    plan = {"n": 0, "faults": []}
    def handler(method, path, headers, body, n):
        assert FAKE_KEY in (headers.get(header) or "")
        if plan["faults"]:
            f = plan["faults"].pop(0)
            if f == "slow": time.sleep(1.0)
            elif f: return f, {"error": "busy"}, {"Retry-After": "0"}
        if kind == "brave":
            assert method == "GET" and "q=" in path and "count=3" in path
            q = path
        else:
            assert method == "POST"
            q = body.get("q") or body.get("query")
            assert body.get("num", body.get("max_results")) == 3
        return 200, _web_reply(kind, q, 3), {}
    with JSONServer(handler) as srv:
        p = S.WEB_PROVIDERS[kind](endpoint=srv.url + "/search", max_retries=2, backoff=0.01, timeout=0.5)
        ok = p.search("calcium gluconate", 3)
        assert ok.status == "ok" and len(ok.passages) == 3 and ok.passages[0].url == "https://example.org/0"
        assert p.read("https://example.org/1").passages[0].title == "Result 1"
        plan["faults"] = [429, 503]                            # retried, then answered
        assert p.search("q2", 3).status == "ok"
        plan["faults"] = [500, 502, 500]                       # 1 try + 2 retries, all failing: a status, not an exception
        bad = p.search("q3", 3)
        assert bad.status == "error" and "HTTP 500" in bad.error and "3 tries" in bad.error and FAKE_KEY not in bad.error
        plan["faults"] = ["slow", "slow", "slow"]              # timeouts
        slow = p.search("q4", 3)
        assert slow.status == "error" and "Timeout" in slow.error
        plan["faults"] = [404]                                 # not transient: no retry
        n0 = len(srv.log); assert p.search("q5", 3).status == "error"; assert len(srv.log) == n0 + 1


def test_web_search_run_replays_offline_and_writes_no_key(items, tmp_path, monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", FAKE_KEY)
    def handler(method, path, headers, body, n):
        return 200, _web_reply("serper", body["q"], body["num"]), {}
    out = tmp_path/"run"
    with JSONServer(handler) as srv:
        provider = S.open_search("serper", M.search_log_path(out/"ledger.sqlite"), endpoint=srv.url + "/search", backoff=0.01)
        s = M.SearchSettings(provider, mode="retrieve", items=M.guard_items(items))
        b1 = M.RetrieveThenRead(M.EvidenceReader(), s)
        df1 = M.search_columns(run_benchmark(items, b1, ledger=out/"ledger.sqlite", progress=False), b1)
        df1.to_parquet(out/"predictions.parquet", index=False)
        (out/"run.json").write_text(json.dumps({"search": M.search_record(b1)}))
        assert len(srv.log) == len(items)                      # one search per item: clean, type1 and type2 share it
    # the server is gone: the replay reads the log only
    b2 = M.with_search(M.EvidenceReader(), "search", f"replay:{M.search_log_path(out/'ledger.sqlite')}", items, mode="retrieve")
    df2 = M.search_columns(run_benchmark(items, b2, ledger=tmp_path/"fresh.sqlite", progress=False), b2)
    assert parquet_bytes(df2) == parquet_bytes(df1)
    for f in [*out.rglob("*"), tmp_path/"fresh.sqlite"]:
        if f.is_file(): assert FAKE_KEY.encode() not in f.read_bytes(), f


# --- the tool loop in the OpenAI wire format, against the local mock server -----------------------------------------------

def test_openai_tool_round_trip_and_replay(items, tmp_path):
    with MockServer(policy="first", tools=2) as srv:
        backend = make_backend("openai:mock-model", base_url=srv.base_url, max_retries=0)
        b = M.with_search(backend, "search", f"bm25:{S.demo_corpus_path()}", items, log=tmp_path/"l.search.jsonl", mode="auto")
        assert isinstance(b, M.ToolSearch) and b.identity()["search"]["mode"] == "tools"
        df = M.search_columns(run_benchmark(items, b, ledger=tmp_path/"l.sqlite", progress=False), b)
        assert (df.status == "ok").all() and (df.search_calls == 2).all() and (df.search_mode == "tools").all()
        assert (df.passages > 0).all() and df.search_status.isin(["ok", "evidence_limit"]).all()
        bodies = [r["body"] for r in srv.completions()]
        assert len(bodies) == 3 * len(df) and all(b_["tools"][0]["function"]["name"] == "search" for b_ in bodies)
        last = bodies[-1]["messages"]                              # the round trip: our tool calls, then their results
        assert [m["role"] for m in last[-4:]] == ["assistant", "tool", "assistant", "tool"]
        assert last[-1]["tool_call_id"] == last[-2]["tool_calls"][0]["id"] and "[1] (" in last[-1]["content"]
        n_asked = len(srv.completions())
        # replay the search log through the same ledger: no new request reaches the server
        b2 = M.with_search(make_backend("openai:mock-model", base_url=srv.base_url, max_retries=0), "search",
                           f"replay:{tmp_path/'l.search.jsonl'}", items, mode="auto")
        df2 = M.search_columns(run_benchmark(items, b2, ledger=tmp_path/"l.sqlite", progress=False), b2)
        assert parquet_bytes(df2) == parquet_bytes(df) and len(srv.completions()) == n_asked


def test_mock_model_that_calls_forever_ends_at_the_limit(items, tmp_path):
    with MockServer(policy="first", tools="forever") as srv:
        b = M.with_search(make_backend("openai:mock-model", base_url=srv.base_url, max_retries=0), "search",
                          f"bm25:{S.demo_corpus_path()}", items[:3], max_tool_calls=3, max_evidence_tokens=150)
        df = M.search_columns(run_benchmark(items[:3], b, progress=False), b)
        choices = [r["body"]["tool_choice"] for r in srv.completions()]
    assert (df.search_status == "tool_limit").all() and (df.search_calls == 3).all() and (df.evidence_tokens <= 150).all()
    assert (df.status == "ok").all() and (df.pred == "A").all()                # the last turn, without tools, is read as usual
    assert choices.count("none") == len(df)


def test_anthropic_tool_calls_through_sdk_types():
    anthropic = pytest.importorskip("anthropic")
    from medsafe_nb.models.anthropic import anthropic_generation, anthropic_tools, anthropic_turns
    msg = anthropic.types.Message.model_validate({"id": "m", "type": "message", "role": "assistant", "model": "c", "stop_reason": "tool_use",
        "content": [{"type": "text", "text": "Let me check."}, {"type": "tool_use", "id": "toolu_1", "name": "search", "input": {"query": "QT"}}],
        "usage": {"input_tokens": 5, "output_tokens": 3}})
    g = anthropic_generation(msg)
    assert g.tool_calls == [{"id": "toolu_1", "name": "search", "arguments": {"query": "QT"}}] and g.text == "Let me check."
    turns = anthropic_turns([{"role": "user", "content": "Q"}, M.tool_call_message(g), {"role": "tool", "tool_call_id": "toolu_1", "content": "x"}])
    assert turns[1]["content"][1]["type"] == "tool_use" and turns[2]["content"][0]["tool_use_id"] == "toolu_1"
    assert anthropic_tools(M.search_tools())["tools"][1]["name"] == "read"


def test_gemini_tool_calls_through_sdk_types():
    pytest.importorskip("google.genai")
    from google.genai import types
    from medsafe_nb.models.gemini import gemini_generation, gemini_tools, gemini_contents
    r = types.GenerateContentResponse.model_validate({"candidates": [{"content": {"role": "model", "parts": [
        {"function_call": {"id": "fc1", "name": "search", "args": {"query": "QT"}}}]}, "finish_reason": "STOP"}]})
    g = gemini_generation(r)
    assert g.tool_calls == [{"id": "fc1", "name": "search", "arguments": {"query": "QT"}}]
    types.GenerateContentConfig.model_validate(gemini_tools(M.search_tools("none")))
    for c in gemini_contents([{"role": "user", "content": "Q"}, M.tool_call_message(g), {"role": "tool", "tool_call_id": "fc1", "content": "x"}]):
        types.Content.model_validate(c)


# --- run(): --mitigation search end to end, and its replay -----------------------------------------------------------------

def test_run_with_search_records_and_replays(tmp_path):
    corpus = f"bm25:{S.demo_corpus_path()}"
    with MockServer(policy="first", tools=1) as srv:
        opts = dict(data="sample", model="openai:mock-model", base_url=srv.base_url, limit=12, subset=6, subset_seed=3, progress=False)
        df = run(out=str(tmp_path/"live"), mitigation="warning+search", search=corpus, **opts)
        rec = json.loads((tmp_path/"live"/"run.json").read_text())
        n = len(srv.completions())
        log = tmp_path/"live"/"ledger.search.jsonl"
        df2 = run(out=str(tmp_path/"replay"), mitigation="warning+search", search=f"replay:{log}", ledger=str(tmp_path/"live"/"ledger.sqlite"), **opts)
        assert len(srv.completions()) == n                                          # answered from the ledger and the search log
        plain = run(out=str(tmp_path/"plain"), mitigation="warning", ledger=str(tmp_path/"live"/"ledger.sqlite"), **opts)
    assert set(M.SEARCH_COLUMNS) <= set(df.columns) and (df.search_mode == "tools").all() and (df.search_calls == 1).all()
    assert df.drop(columns="prompt_id").equals(df2.drop(columns="prompt_id")) and df.prompt_id.tolist() == df2.prompt_id.tolist()
    assert rec["search"]["mode"] == "tools" and rec["search"]["provider"]["provider"] == "bm25" and rec["identity"]["search"]["k"] == 5
    assert len(rec["subset_ids"]) == 6 and df.item_id.nunique() == 6
    assert not set(plain.prompt_id) & set(df.prompt_id)                         # the search is part of the ledger identity
    assert "search_mode" not in plain.columns


# --- config and subset --------------------------------------------------------------------------------------------------

def test_search_options_are_checked():
    from medsafe_nb.run.config import RunConfig
    with pytest.raises(ConfigError, match="unknown search provider 'bing'"): RunConfig(search="bing")
    with pytest.raises(ConfigError, match="max-tool-calls: expected an integer >= 1"): RunConfig(max_tool_calls=0)
    assert M.search_config_problem("none", "serper").startswith("search: 'serper' is set")
    assert "needs a search provider" in M.search_config_problem("warning+search", None)
    with pytest.raises(ConfigError, match="cannot call tools"):
        M.with_search(M.EvidenceReader(), "search", f"bm25:{S.demo_corpus_path()}", mode="tools")


def test_subset_is_stratified_and_deterministic(sample):
    sub = SUB.subset_items(sample, 30, seed=7)
    assert len(sub) == 30
    assert [it.id for it in sub] == [it.id for it in SUB.subset_items(list(reversed(sample)), 30, seed=7)][::-1]
    strata = lambda its: pd.Series([SUB._stratum(it) for it in its]).value_counts()
    full, part = strata(sample), strata(sub)
    quota = full * 30 / len(sample)
    assert ((part.reindex(full.index, fill_value=0) - quota).abs() < 1).all()       # largest remainders: within one of the quota
    assert SUB.subset_record(sub, 30, 7)["subset_ids"][:3] == [it.id for it in sub[:3]]
