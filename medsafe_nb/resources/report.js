(function () {
  "use strict";
  var meta = JSON.parse(document.getElementById("report-data").textContent);
  var N = meta.n, K = {}, D = null, P = null, pending = null, PAGE = 50, page = 0, shown = new Uint32Array(0), nShown = 0, low = {};
  var FILTERS = ["model", "source", "condition", "status", "flipped", "content", "provenance"];
  var SEARCHED = ["item_id", "raw", "model", "pred", "method"];
  var count = document.getElementById("count");
  function el(tag, text, cls) { var e = document.createElement(tag); if (text !== undefined && text !== null) e.textContent = String(text); if (cls) e.className = cls; return e; }
  function gunzip(id) {
    var s = atob(document.getElementById(id).textContent), b = new Uint8Array(s.length);
    for (var i = 0; i < s.length; i++) b[i] = s.charCodeAt(i);
    return new Response(new Blob([b]).stream().pipeThrough(new DecompressionStream("gzip"))).arrayBuffer();
  }
  function parse(buf) { return JSON.parse(new TextDecoder().decode(buf)); }
  function val(i, c) { var v = D[c][K[c][i]]; return v === null || v === undefined ? "" : String(v); }
  function prompts() {                                  // the prompt texts: decoded once, after the rows are on screen
    if (!pending) pending = gunzip("rows-prompts").then(function (b) { P = parse(b); document.body.setAttribute("data-prompts", "ready"); });
    return pending;
  }
  function lowered(name, list) { if (!low[name]) low[name] = list.map(function (v) { return v === null ? "" : String(v).toLowerCase(); }); return low[name]; }
  function hits(name, list, q) { var l = lowered(name, list), m = new Uint8Array(l.length); for (var j = 0; j < l.length; j++) m[j] = l[j].indexOf(q) >= 0 ? 1 : 0; return m; }
  function searchTest(q) {                              // per column, which distinct values contain q; a row matches if any of its values does
    var tests = SEARCHED.map(function (c) { return [K[c], hits(c, D[c], q)]; });
    var t = hits("texts", P.texts, q), pm = new Uint8Array(P.prompts.length);
    for (var j = 0; j < P.prompts.length; j++) { var f = P.prompts[j]; for (var k = 1; k < f.length; k += 2) if (t[f[k]]) { pm[j] = 1; break; } }
    tests.push([K.prompt, pm]);
    return function (i) { for (var x = 0; x < tests.length; x++) if (tests[x][1][tests[x][0][i]]) return true; return false; };
  }
  var search = document.getElementById("search"), timer = null;
  function apply() {
    var tests = [];
    FILTERS.forEach(function (f) {
      var v = document.getElementById("f-" + f).value; if (v === "*") return;
      var m = new Uint8Array(D[f].length); D[f].forEach(function (x, j) { m[j] = (x === null ? "" : String(x)) === v ? 1 : 0; });
      tests.push([K[f], m]);
    });
    var q = search.value.trim().toLowerCase();
    function run() {
      var qt = q ? searchTest(q) : null, out = new Uint32Array(N), n = 0;
      rows: for (var i = 0; i < N; i++) {
        for (var x = 0; x < tests.length; x++) if (!tests[x][1][tests[x][0][i]]) continue rows;
        if (qt && !qt(i)) continue;
        out[n++] = i;
      }
      shown = out; nShown = n; count.setAttribute("data-q", q); draw();
    }
    if (q && !P) return prompts().then(run);
    run();
  }
  function detail(i) {
    var td = el("td"); td.colSpan = 12;
    td.appendChild(el("div", "Prompt", "role"));
    var box = el("div"); td.appendChild(box);
    function fill() {
      var f = P.prompts[K.prompt[i]] || [];
      if (!f.length) box.appendChild(el("pre", "(prompt not in this report)"));
      for (var k = 0; k < f.length; k += 2) { box.appendChild(el("div", P.roles[f[k]], "role")); box.appendChild(el("pre", P.texts[f[k + 1]])); }
    }
    if (P) fill(); else { box.appendChild(el("pre", "(decoding the prompts…)")); prompts().then(function () { box.textContent = ""; fill(); }); }
    td.appendChild(el("div", val(i, "status") === "error" ? "Error" : "Reply", "role"));
    td.appendChild(el("pre", val(i, "raw")));
    td.appendChild(el("div", "Answer " + (val(i, "pred") || "–") + " (read by: " + val(i, "method") + "), gold " + val(i, "gold") + ", target " + (val(i, "target") || "–"), "role"));
    var tr = el("tr", null, "detail"); tr.appendChild(td); return tr;
  }
  function draw() {
    var body = document.getElementById("rows-body"); body.textContent = "";
    var pages = Math.max(1, Math.ceil(nShown / PAGE)); if (page >= pages) page = pages - 1;
    count.textContent = nShown + " of " + N + " rows";
    count.setAttribute("data-n", String(nShown));
    document.getElementById("page").textContent = "page " + (page + 1) + " / " + pages;
    for (var s = page * PAGE; s < Math.min(nShown, (page + 1) * PAGE); s++) (function (i) {
      var tr = el("tr", null, "item"), flip = val(i, "flipped") === "true"; tr.setAttribute("data-row", String(i));
      ["model", "item_id", "condition", "target", "gold", "pred", "method", "status"].forEach(function (c) { tr.appendChild(el("td", val(i, c))); });
      tr.appendChild(el("td", flip ? "flipped" : "", flip ? "flip" : ""));
      tr.appendChild(el("td", val(i, "content"))); tr.appendChild(el("td", val(i, "provenance")));
      var raw = val(i, "raw"); tr.appendChild(el("td", raw.length > 160 ? raw.slice(0, 160) + "…" : raw, "reply"));
      tr.addEventListener("click", function () {
        var next = tr.nextSibling;
        if (next && next.className === "detail") body.removeChild(next); else body.insertBefore(detail(i), next);
      });
      body.appendChild(tr);
    })(shown[s]);
  }
  function start() {
    FILTERS.forEach(function (f) {
      var sel = document.getElementById("f-" + f), k = K[f], n = new Uint32Array(D[f].length), seen = {};
      for (var i = 0; i < N; i++) n[k[i]]++;
      D[f].forEach(function (x, j) { var v = x === null ? "" : String(x); if (n[j]) seen[v] = (seen[v] || 0) + n[j]; });
      Object.keys(seen).sort().forEach(function (v) { var o = el("option", (v === "" ? "(none)" : v) + " (" + seen[v] + ")"); o.value = v; sel.appendChild(o); });
      sel.addEventListener("change", function () { page = 0; apply(); });
    });
    search.addEventListener("input", function () { clearTimeout(timer); timer = setTimeout(function () { page = 0; apply(); }, 150); });
    document.getElementById("prev").addEventListener("click", function () { if (page > 0) { page--; draw(); } });
    document.getElementById("next").addEventListener("click", function () { if ((page + 1) * PAGE < nShown) { page++; draw(); } });
    apply();
    document.body.setAttribute("data-rows", "ready");
    setTimeout(prompts, 0);
  }
  Promise.all([gunzip("rows-codes"), gunzip("rows-values")]).then(function (r) {
    var T = {u8: Uint8Array, u16: Uint16Array, u32: Uint32Array};
    meta.columns.forEach(function (c) { K[c[0]] = new T[c[1]](r[0], c[2], N); });
    D = parse(r[1]); start();
  }).catch(function (e) { count.textContent = "the rows could not be decoded in this browser (" + e + "); a current Chrome, Firefox or Safari reads them"; });
})();
