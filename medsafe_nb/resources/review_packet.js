(function(){
"use strict";
var META = JSON.parse(document.getElementById("packet-meta").textContent);
var KEY = "medsafe-review:" + META.packet + ":" + META.rater;
var cases = Array.prototype.slice.call(document.querySelectorAll("section.case"));
var codes = cases.map(function(s){ return s.getAttribute("data-code"); });
var cur = 0, focusIdx = 0;
function fresh(){ return {format: META.format, version: META.version, packet: META.packet, rater: META.rater, kind: META.kind, revision: 0, ratings: {}}; }
function load(){
  try { var s = JSON.parse(localStorage.getItem(KEY)); if (s && s.packet === META.packet && s.rater === META.rater && s.ratings) return s; }
  catch (e) {}
  return null;
}
var state = load() || fresh();
function say(msg){ document.getElementById("status").textContent = msg; }
function save(){
  state.saved_at = new Date().toISOString();
  try { localStorage.setItem(KEY, JSON.stringify(state)); say("Saved in this browser at " + state.saved_at.slice(11, 19) + " (revision " + state.revision + ")"); }
  catch (e) { say("NOT saved in this browser (" + e.message + "): use Export ratings now"); }
}
function complete(code){
  var r = state.ratings[code]; if (!r) return false;
  for (var i = 0; i < META.fields.length; i++) if (r[META.fields[i]] === undefined || r[META.fields[i]] === null) return false;
  return META.kind !== "harm" || !!r.tier;
}
function suggestion(code){
  var r = state.ratings[code] || {}, key = "";
  for (var i = 0; i < META.fields.length; i++) { var v = r[META.fields[i]]; if (v === undefined || v === null) return null; key += v; }
  return META.tier_table ? META.tier_table[key] : null;
}
function setValue(code, field, value){
  var r = state.ratings[code] || (state.ratings[code] = {});
  if (r[field] === value) return;
  r[field] = value; state.revision += 1; r.rev = state.revision; r.updated_at = new Date().toISOString();
  save(); render();
}
function render(){
  var done = 0;
  codes.forEach(function(code, i){
    var sec = cases[i], r = state.ratings[code] || {};
    sec.classList.toggle("active", i === cur);
    sec.querySelectorAll("input[type=radio]").forEach(function(inp){
      var f = inp.getAttribute("data-field"), v = f === "tier" ? inp.value : Number(inp.value);
      inp.checked = r[f] === v;
    });
    var ta = sec.querySelector("textarea");
    if (ta && document.activeElement !== ta) ta.value = r.comment || "";
    var sg = sec.querySelector(".sugg");
    if (sg) {
      var s = suggestion(code); sg.textContent = s || "(rate the four criteria first)";
      var d = sec.querySelector(".differs"); d.textContent = (s && r.tier && r.tier !== s) ? "your tier differs from the suggestion" : "";
    }
    var c = complete(code); if (c) done += 1;
    var nb = document.getElementById("nav-" + code); nb.classList.toggle("done", c); nb.classList.toggle("current", i === cur);
    sec.querySelectorAll("fieldset.crit").forEach(function(fs, j){ fs.classList.toggle("focus", i === cur && j === focusIdx); });
  });
  document.getElementById("progress").textContent = done + " / " + codes.length + " rated";
  document.getElementById("position").textContent = "case " + (cur + 1) + " of " + codes.length;
}
function go(i){ cur = Math.max(0, Math.min(codes.length - 1, i)); focusIdx = 0; state.cursor = cur; render(); window.scrollTo(0, 0); }
function fieldsets(){ return cases[cur].querySelectorAll("fieldset.crit"); }
document.addEventListener("change", function(ev){
  var t = ev.target;
  if (t.type === "radio" && t.hasAttribute("data-field")) {
    var f = t.getAttribute("data-field");
    var fs = t.closest("fieldset.crit"); focusIdx = Array.prototype.indexOf.call(fieldsets(), fs);
    setValue(t.getAttribute("data-code"), f, f === "tier" ? t.value : Number(t.value));
  }
});
document.addEventListener("input", function(ev){
  var t = ev.target;
  if (t.tagName === "TEXTAREA" && t.hasAttribute("data-code")) setValue(t.getAttribute("data-code"), "comment", t.value);
});
function confirmTier(code){ var s = suggestion(code); if (s) setValue(code, "tier", s); }
document.addEventListener("click", function(ev){
  var t = ev.target;
  if (t.classList.contains("confirm")) confirmTier(t.getAttribute("data-code"));
  if (t.hasAttribute("data-go")) go(Number(t.getAttribute("data-go")));
});
document.addEventListener("keydown", function(ev){
  var t = ev.target;
  if (t.tagName === "TEXTAREA" || (t.tagName === "INPUT" && t.type !== "radio")) { if (ev.key === "Escape") t.blur(); return; }
  if (ev.ctrlKey || ev.metaKey || ev.altKey) return;
  var code = codes[cur], fs = fieldsets(), k = ev.key, handled = true;
  if (k === "ArrowRight" || k === "n") go(cur + 1);
  else if (k === "ArrowLeft" || k === "p") go(cur - 1);
  else if (k === "ArrowDown" || k === "j") { focusIdx = Math.min(fs.length - 1, focusIdx + 1); render(); }
  else if (k === "ArrowUp" || k === "k") { focusIdx = Math.max(0, focusIdx - 1); render(); }
  else if (k === "0" || k === "1" || k === "2") {
    var f = fs[focusIdx].getAttribute("data-field");
    setValue(code, f, f === "tier" ? META.tiers[Number(k)] : Number(k));
    focusIdx = Math.min(fs.length - 1, focusIdx + 1); render();
  }
  else if (k === "Enter" && META.kind === "harm") confirmTier(code);
  else if (k === "c") { cases[cur].querySelector("textarea").focus(); }
  else handled = false;
  if (handled) ev.preventDefault();
});
document.getElementById("export").addEventListener("click", function(){
  state.exported_at = new Date().toISOString(); save();
  var blob = new Blob([JSON.stringify(state, null, 1)], {type: "application/json"});
  var a = document.createElement("a");
  a.href = URL.createObjectURL(blob); a.download = "ratings-" + META.packet + "-" + META.rater + ".json";
  document.body.appendChild(a); a.click(); a.remove();
  say("Exported " + Object.keys(state.ratings).length + " rated case(s): send the downloaded file to the study team");
});
document.getElementById("load").addEventListener("change", function(ev){
  var file = ev.target.files[0]; if (!file) return;
  var reader = new FileReader();
  reader.onload = function(){
    var got;
    try { got = JSON.parse(reader.result); } catch (e) { say("Not a ratings file: " + e.message); return; }
    if (!got || got.packet !== META.packet || got.rater !== META.rater || typeof got.ratings !== "object") {
      say("This file is for packet " + (got && got.packet) + ", rater " + (got && got.rater) + "; this page is " + META.packet + ", rater " + META.rater); return;
    }
    var n = 0;
    Object.keys(got.ratings).forEach(function(code){
      if (codes.indexOf(code) < 0) return;
      var mine = state.ratings[code], theirs = got.ratings[code];
      if (!mine || (theirs.rev || 0) > (mine.rev || 0)) { state.ratings[code] = theirs; n += 1; }
    });
    state.revision = Math.max(state.revision, got.revision || 0);
    save(); render(); say("Loaded " + n + " rating(s) from " + file.name + "; continuing at revision " + state.revision);
  };
  reader.readAsText(file);
});
document.getElementById("prev").addEventListener("click", function(){ go(cur - 1); });
document.getElementById("next").addEventListener("click", function(){ go(cur + 1); });
go(Math.min(state.cursor || 0, codes.length - 1));
if (state.revision) say("Restored your ratings from this browser (revision " + state.revision + ")");
})();
