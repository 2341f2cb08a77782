"""The trees page: ``RUN_DIR/trees/*.json`` (the learner's sample of trained groups,
learner/trees.py) drawn as one self-contained HTML file, ``RUN_DIR/analysis/trees.html``.

``python -m arpo_async.jobs.analyze trees RUN_DIR [--out FILE]``. The page needs nothing
else (inline CSS and JS, no network): each group is a tree of segments nested under the
segment it forked from, each model token coloured by its entropy (or, when the group
carries none, its surprisal -log p, as the legend says), tool results in their own boxes,
each branch decision with its dH, P and forks, each leaf's reward, each segment's
advantage as trained; selects filter the groups by task kind, reward and fork.

Every text of a run (model tokens, tool results, prompts) is hostile: the data travels as
JSON inside a ``<script type="application/json">`` element with every ``<`` written
``\\u003c`` (no text can close the element), and the script puts it in the page with
``textContent`` only, never as HTML.
"""

from __future__ import annotations

import html
import json
import logging
from pathlib import Path

import numpy as np

from learner.trees import FORMAT, TREES_DIR

log = logging.getLogger("arpo_async.jobs.trees_page")

TITLE = "ARPO trees"
EAGER_TOKENS = 200_000  # tokens drawn at load; groups past this draw when asked (a button)


def load_trees(run_dir: str | Path) -> tuple[list[dict], list[str]]:
    """(the tree records of ``RUN_DIR/trees``, oldest first; the files skipped, with why)."""
    trees, skipped = [], []
    for path in sorted((Path(run_dir) / TREES_DIR).glob("*.json")):
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:  # removed by the learner's pruning, or bad
            skipped.append(f"{path.name}: {exc}")
            continue
        if not isinstance(rec, dict) or rec.get("format") != FORMAT:
            skipped.append(f"{path.name}: not a format-{FORMAT} tree record")
            continue
        trees.append(rec)
    return trees, skipped


def scale_max(trees: list[dict]) -> float:
    """The colour scale's top: the 95th percentile of every model token's score."""
    scores = [s for t in trees for n in t["nodes"] for p in n["parts"]
              for s in p.get("score", []) if s is not None]
    return max(float(np.percentile(scores, 95)), 1e-6) if scores else 1.0


def _script_json(obj) -> str:
    """JSON that no text inside can end the script element it sits in."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def page_html(trees: list[dict], source: str = "") -> str:
    """The whole page for ``trees`` (``source``: where they came from, shown as text)."""
    payload = {"trees": trees, "scale_max": scale_max(trees), "source": source,
               "eager_tokens": EAGER_TOKENS}
    return (_HEAD.replace("@TITLE@", html.escape(TITLE)).replace("@CSS@", _CSS)
            + f'<script id="trees-data" type="application/json">{_script_json(payload)}</script>\n'
            + f"<script>{_JS}</script>\n</body>\n</html>\n")


def write_trees_page(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, int]:
    """Write the page of ``run_dir``'s trees; (its path, groups drawn)."""
    from arpo_async.core.files import atomic_write_text

    trees, skipped = load_trees(run_dir)
    for why in skipped:
        log.warning("skipped %s", why)
    path = Path(out) if out else Path(run_dir) / "analysis" / "trees.html"
    atomic_write_text(path, page_html(trees, str(run_dir)))
    return path, len(trees)


def cli(run_dir: str, out: str | None = None) -> int:
    """``analyze trees``: 0 with a page, 2 when the run kept no tree."""
    if not (Path(run_dir) / TREES_DIR).is_dir():
        print(f"error: {run_dir}: no {TREES_DIR}/ folder (the learner keeps one group in "
              "learner.trees_every there; 0 turns it off)")
        return 2
    path, n = write_trees_page(run_dir, out)
    print(f"wrote {path} ({n} groups)")
    return 0


_HEAD = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy"
 content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>@TITLE@</title>
<style>@CSS@</style>
</head>
<body>
<header id="top">
<h1>@TITLE@</h1>
<div id="source"></div>
<div id="filters">
<label>kind <select id="f-kind"><option value="">all</option></select></label>
<label>reward <select id="f-reward">
<option value="">all</option>
<option value="mixed">mixed (the group learns)</option>
<option value="some">some leaf rewarded</option>
<option value="none">no leaf rewarded</option>
<option value="all">every leaf rewarded</option>
</select></label>
<label>fork <select id="f-fork">
<option value="">all</option>
<option value="1">forked</option>
<option value="0">not forked</option>
</select></label>
<span id="shown"></span>
</div>
<div id="legend"><span id="legend-name"></span> <span id="legend-lo"></span><span
 id="legend-bar"></span><span id="legend-hi"></span> <span id="legend-note"></span></div>
</header>
<main id="groups"></main>
"""

_CSS = """
body{font:13px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
#top{position:sticky;top:0;background:#fff;border-bottom:1px solid #ccc;padding:6px 12px;z-index:1}
h1{font-size:16px;margin:0 0 4px}
#filters label{margin-right:12px}
#legend{margin-top:4px;font-size:12px}
#legend-bar{display:inline-block;width:160px;height:10px;margin:0 4px;vertical-align:middle;
 background:linear-gradient(90deg,hsl(60,100%,94%),hsl(30,100%,75%),hsl(0,100%,56%))}
#legend-note{color:#666}
main{padding:8px 12px}
.group{background:#fff;border:1px solid #bbb;border-radius:4px;margin:0 0 12px;padding:6px 8px}
.group>h2{font-size:13px;margin:0 0 4px}
.facts{color:#555;font-size:12px}
.node{border-left:3px solid #8aa;margin:4px 0 4px 6px;padding:2px 0 2px 8px}
.node>.nh{font-size:11px;color:#345}
.children{margin-left:14px}
.part{margin:2px 0}
.part.model{font-family:ui-monospace,monospace;white-space:pre-wrap;word-break:break-word}
.t{border-radius:2px}
.part.tool pre{margin:0;padding:3px 6px;background:#eef3ff;border:1px solid #aac;
 white-space:pre-wrap;word-break:break-word;max-height:14em;overflow:auto}
.lbl{font:11px system-ui,sans-serif;color:#777;margin-right:4px}
.dec{font-size:11px;margin:2px 0;padding:1px 6px;border-radius:3px;display:inline-block}
.dec.forked{background:#ffe2b3;border:1px solid #e90}
.dec.kept{background:#eee;border:1px solid #bbb}
.leafend{font-size:11px;margin:2px 0;padding:1px 6px;border-radius:3px;display:inline-block;
 background:#e6f4e6;border:1px solid #7b7}
.leafend.zero{background:#f8e6e6;border-color:#c88}
.adv-pos{color:#070}.adv-neg{color:#a00}
table.leaves{border-collapse:collapse;font-size:11px;margin-top:4px}
table.leaves td,table.leaves th{border:1px solid #ccc;padding:1px 5px;text-align:right}
pre.prompt{white-space:pre-wrap;max-height:10em;overflow:auto;background:#f4f4f4;margin:2px 0}
"""

_JS = r"""
(function () {
"use strict";
var DATA = JSON.parse(document.getElementById("trees-data").textContent);
var TREES = DATA.trees;

function el(tag, cls, text) {
  var e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}
function known(x) { return x !== null && x !== undefined; }
function num(x, d) { return known(x) ? x.toFixed(d === undefined ? 2 : d) : "?"; }
function signed(x) { return known(x) ? (x > 0 ? "+" : "") + x.toFixed(2) : "?"; }
function advSpan(x) { return el("span", x > 0 ? "adv-pos" : (x < 0 ? "adv-neg" : ""), signed(x)); }
function colour(s) {
  if (!known(s)) return "#ddd";
  var t = Math.max(0, Math.min(1, s / DATA.scale_max));
  return "hsl(" + (60 - 60 * t).toFixed(0) + ",100%," + (94 - 38 * t).toFixed(0) + "%)";
}

function facts(t) {  // what the filters select on
  var pos = 0, non = 0, forks = 0;
  t.leaves.forEach(function (l) {
    if (known(l.reward) && l.reward > 0) pos++; else non++;
    if (l.parent >= 0) forks++;
  });
  return {kind: t.kind || "(none)", reward: pos && non ? "mixed" : (pos ? "all" : "none"),
          some: pos > 0, forked: forks > 0, forks: forks};
}

function decision(d) {
  var txt = "decision of leaf " + d.leaf + ": dH " + (known(d.dh) ? signed(d.dh) : "?") +
            ", P " + num(d.p) + ", " + (d.forked ? "forked x" + d.forks : "no fork");
  return el("div", "dec " + (d.forked ? "forked" : "kept"), txt);
}

function leafEnd(t, i) {
  var l = t.leaves[i];
  var box = el("div", "leafend" + (known(l.reward) && l.reward > 0 ? "" : " zero"));
  box.appendChild(el("span", null, "leaf " + i + " ends (" + (l.finish_reason || "?") +
                     "): reward " + num(l.reward) + ", score " + num(l.score) + ", leaf A "));
  box.appendChild(advSpan(l.advantage));
  box.appendChild(el("span", null, ", " + l.tool_calls + " tool calls"));
  return box;
}

function modelPart(part, scoreName) {
  var div = el("div", "part model"), v = part.versions;
  div.appendChild(el("span", "lbl", "model v" + v[0] + (v[1] !== v[0] ? "-" + v[1] : "")));
  for (var k = 0; k < part.ids.length; k++) {
    var s = el("span", "t", part.pieces[k]);
    s.style.background = colour(part.score[k]);
    s.title = "token " + (part.start + k) + ", id " + part.ids[k] + ": " + scoreName + " " +
              num(part.score[k], 3);
    div.appendChild(s);
  }
  return div;
}

function toolPart(part) {
  var div = el("div", "part tool");
  div.appendChild(el("span", "lbl", "tool result"));
  div.appendChild(el("pre", null, part.text.replace(/^\n+|\n+$/g, "")));
  return div;
}

function partEnd(node, k) {  // offset in the node just past its part k
  var next = node.parts[k + 1];
  return (next ? next.start : node.end) - node.start;
}

function nodeBox(t, gi, node, kids) {
  var box = el("div", "node");
  box.id = "g" + gi + "-" + node.id;
  box.setAttribute("data-node", node.id);
  var h = el("div", "nh");
  h.appendChild(el("b", null, node.id));
  h.appendChild(el("span", null, " from leaf " + node.leaf + ", tokens [" + node.start + ", " +
                   node.end + "), through leaves " + node.leaves.join(", ") +
                   "; A as trained (" + t.advantage_mode + "):"));
  node.copies.forEach(function (c) {
    if (!c.trained) return;
    h.appendChild(el("span", null, " leaf " + c.leaf + " "));
    h.appendChild(advSpan(c.advantage));
  });
  box.appendChild(h);
  var decs = node.decisions.slice().sort(function (a, b) { return a.offset - b.offset; });
  var di = 0;
  node.parts.forEach(function (p, k) {
    box.appendChild(p.kind === "model" ? modelPart(p, t.score.name) : toolPart(p));
    while (di < decs.length && decs[di].offset <= partEnd(node, k)) {
      box.appendChild(decision(decs[di++]));
    }
  });
  while (di < decs.length) box.appendChild(decision(decs[di++]));
  node.ends.forEach(function (i) { box.appendChild(leafEnd(t, i)); });
  var ch = kids[node.id] || [];
  if (ch.length) {
    var c = el("div", "children");
    ch.forEach(function (n) { c.appendChild(nodeBox(t, gi, n, kids)); });
    box.appendChild(c);
  }
  return box;
}

function leafTable(t) {
  var tb = el("table", "leaves"), hr = el("tr");
  ["leaf", "parent", "branch point", "tokens", "reward", "score", "A", "tool calls", "finish"]
    .forEach(function (x) { hr.appendChild(el("th", null, x)); });
  tb.appendChild(hr);
  t.leaves.forEach(function (l) {
    var r = el("tr");
    [l.index, l.parent, l.branch_point, l.length, num(l.reward), num(l.score),
     signed(l.advantage), l.tool_calls, l.finish_reason]
      .forEach(function (x) { r.appendChild(el("td", null, x)); });
    tb.appendChild(r);
  });
  return tb;
}

function drawTree(t, gi, into) {
  var kids = {}, roots = [], tree = el("div", "tree");
  t.nodes.forEach(function (n) {
    if (n.parent === null) roots.push(n); else (kids[n.parent] = kids[n.parent] || []).push(n);
  });
  t.prompt.ends.forEach(function (i) { tree.appendChild(leafEnd(t, i)); });
  roots.forEach(function (n) { tree.appendChild(nodeBox(t, gi, n, kids)); });
  into.appendChild(tree);
  into.appendChild(leafTable(t));
}

function size(t) {
  var n = 0;
  t.nodes.forEach(function (nd) {
    nd.parts.forEach(function (p) { n += p.ids ? p.ids.length : 1; });
  });
  return n;
}

function section(t, gi, f) {
  var sec = el("section", "group");
  sec.id = "g" + gi;
  sec.setAttribute("data-kind", f.kind);
  sec.setAttribute("data-reward", f.reward);
  sec.setAttribute("data-forked", f.forked ? "1" : "0");
  sec.appendChild(el("h2", null, "step " + t.step + " - group " + t.group_id + " - prompt " +
                     t.prompt_id));
  var rewards = t.leaves.map(function (l) { return num(l.reward); }).join(" ");
  sec.appendChild(el("div", "facts", "kind " + f.kind + ", mode " + t.mode + ", " +
    t.leaves.length + " leaves, rewards " + rewards + ", " + f.forks + " forks, advantage " +
    t.advantage_mode + ", decisions " +
    (t.decisions_recorded ? "recorded" : "seen in the forks only (dH, P not recorded)")));
  var pr = el("details");
  pr.appendChild(el("summary", null, "prompt (" + t.prompt.tokens + " tokens)"));
  pr.appendChild(el("pre", "prompt", t.prompt.text));
  sec.appendChild(pr);
  return sec;
}

var sections = [], kinds = {}, budget = DATA.eager_tokens;
var main = document.getElementById("groups");
document.getElementById("source").textContent =
  TREES.length + " groups kept by the learner, from " + DATA.source;
TREES.forEach(function (t, gi) {
  var f = facts(t), sec = section(t, gi, f), n = size(t);
  kinds[f.kind] = true;
  if (n <= budget) {
    budget -= n;
    drawTree(t, gi, sec);
  } else {  // a large page stays quick: this tree is drawn when asked
    var b = el("button", null, "draw this tree (" + n + " tokens)");
    b.addEventListener("click", function () { b.remove(); drawTree(t, gi, sec); });
    sec.appendChild(b);
  }
  main.appendChild(sec);
  sections.push({sec: sec, f: f});
});

var kindSel = document.getElementById("f-kind");
Object.keys(kinds).sort().forEach(function (k) {
  var o = el("option", null, k);
  o.value = k;
  kindSel.appendChild(o);
});
function value(id) { return document.getElementById(id).value; }
function apply() {
  var k = value("f-kind"), r = value("f-reward"), fk = value("f-fork"), shown = 0;
  sections.forEach(function (s) {
    var ok = (!k || s.f.kind === k) && (!fk || (s.f.forked ? "1" : "0") === fk) &&
             (!r || (r === "some" ? s.f.some : s.f.reward === r));
    s.sec.style.display = ok ? "" : "none";
    if (ok) shown++;
  });
  document.getElementById("shown").textContent = "showing " + shown + " of " + sections.length;
}
["f-kind", "f-reward", "f-fork"].forEach(function (id) {
  document.getElementById(id).addEventListener("change", apply);
});
apply();

var score = TREES.length ? TREES[0].score : {name: "entropy", unit: "nats"};
document.getElementById("legend-name").textContent =
  "token colour: " + score.name + " (" + score.unit + ")";
document.getElementById("legend-lo").textContent = "0";
document.getElementById("legend-hi").textContent = num(DATA.scale_max) + "+";
document.getElementById("legend-note").textContent = score.note || "";
})();
"""
