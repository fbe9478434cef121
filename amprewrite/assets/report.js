// amprewrite report page: summary, per-module table, graph collapsed by module with search.
// The data is the JSON in #amp-data (amprewrite.report_html.page_data). No dependencies.
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("amp-data").textContent);
  const S = D.summary, COL = D.colors;
  const app = document.getElementById("app");
  app.textContent = "";

  const esc = (s) => String(s == null ? "" : s).replace(/[&<>"']/g,
    (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  const num = (x) => (typeof x === "number" ? x : Number(x));
  function bytes(b) {
    if (b == null) return "–";
    const u = ["B", "KB", "MB", "GB"]; let i = 0; let v = b;
    while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
    return (i ? v.toFixed(v < 10 ? 2 : 1) : v) + " " + u[i];
  }
  function err(e) {
    if (e == null) return "–";
    const v = num(e);
    return isFinite(v) ? v.toExponential(2) : '<span class="bad">' + esc(e) + "</span>";
  }
  function color(p, rewritten) {
    if (rewritten && p !== "cast") return COL.rewritten;
    return COL[p] || "#ffffff";
  }
  function add(html) { const d = document.createElement("div"); d.innerHTML = html; app.appendChild(d.firstElementChild); return app.lastElementChild; }

  // ------------------------------------------------------------------ header and summary
  add(`<header><h1>${esc(D.title)}</h1><p class="sub">dtype ${esc(S.dtype)} · captured by ${esc(S.capture)} · ${S.nodes} nodes</p></header>`);
  const C = S.counts, n = (k) => C[k] || 0;
  const ops = n("low") + n("fp32") + n("promote") + n("neutral") + n("cast");
  const what = {
    low: "run in " + S.dtype, fp32: "kept in fp32", promote: "follow the widest input",
    neutral: "follow their input", cast: "casts inserted", param: "parameters, buffers",
    input: "graph inputs", nonfloat: "integer or other", output: "output",
  };
  const order = ["low", "fp32", "promote", "neutral", "cast", "nonfloat", "param", "input", "output"];
  const keys = order.filter((k) => k in C).concat(Object.keys(C).filter((k) => !order.includes(k)));
  let answer = `<b>${n("low")}</b> of ${ops} float ops run in <b>${esc(S.dtype)}</b>, <b>${n("fp32")}</b> are kept in fp32` +
    `; <b data-summary="casts">${S.casts}</b> casts move <b data-summary="cast-bytes">${bytes(S.cast_bytes)}</b>` +
    (S.cast_bytes_unknown ? ` (+${S.cast_bytes_unknown} of unknown size)` : "") +
    `; <b data-summary="rewrites">${S.rewrites.length}</b> rewrites.`;
  if (S.check) answer += ` Output error against fp32: <b data-summary="output-error">${err(S.check.output_error)}</b>` +
    (S.check.finite ? "" : ' — <span class="bad">not finite</span>') + ".";
  const sec = add(`<section id="summary"><h2>Summary</h2><p class="answer">${answer}</p><div class="cards">` +
    keys.map((k) => `<div class="card" data-class="${esc(k)}"><span class="num" data-count="${esc(k)}">${C[k]}</span>` +
      `<span class="what"><span class="sw" style="background:${COL[k] || "#fff"}"></span>${esc(k)}: ${esc(what[k] || "")}</span></div>`).join("") +
    `</div></section>`);
  function table(head, rows) {
    return `<table><tr>${head.map((h) => `<th>${h}</th>`).join("")}</tr>${rows.join("")}</table>`;
  }
  const link = (name) => `<a class="lk mono" data-node="${esc(name)}">${esc(name)}</a>`;
  if (S.check) {
    const c = S.check;
    sec.insertAdjacentHTML("beforeend", `<h3>Error against fp32 (amprewrite check)</h3>` +
      (c.first_nonfinite ? `<p class="bad">first non-finite node: ${link(c.first_nonfinite)}</p>` : "") +
      table(["node", "relative error", "class", "family", "module"], c.worst.map((w) =>
        `<tr><td>${link(w.node)}</td><td class="n">${err(w.error)}</td><td>${esc(w.precision)}</td><td>${esc(w.family)}</td><td class="mono">${esc(w.module || "–")}</td></tr>`)));
  }
  if (S.fp32_regions.length) {
    sec.insertAdjacentHTML("beforeend", `<h3>Largest fp32 regions</h3>` +
      table(["bytes", "ops", "modules", "families", "first node", "why"], S.fp32_regions.map((r) =>
        `<tr><td class="n">${bytes(r.bytes)}</td><td class="n">${r.ops}</td><td class="mono">${r.modules.map((m) => esc(m || "(model)")).join(", ")}</td>` +
        `<td>${esc(r.families.join(", "))}</td><td>${link(r.first)}</td><td>${esc(r.reason)}</td></tr>`)));
  }
  if (S.rewrites.length) {
    const rows = S.rewrites.map((r) => `<tr><td>${esc(r.pass)}</td><td>${link(r.node)}</td><td class="mono">${esc(r.module || "–")}</td><td>${esc(r.action)}</td><td>${esc(r.reason)}</td></tr>`);
    sec.insertAdjacentHTML("beforeend", `<h3>Rewrites</h3><div class="modwrap" style="max-height:240px">` +
      table(["pass", "node", "module", "action", "reason"], rows) + `</div>`);
  }
  if (S.notes.length) sec.insertAdjacentHTML("beforeend", `<h3>Notes</h3><ul>${S.notes.map((x) => `<li>${esc(x)}</li>`).join("")}</ul>`);

  // ------------------------------------------------------------------ per-module table
  const M = D.modules;
  const hasErr = M.some((r) => r.max_error != null);
  const msec = add(`<section id="modules"><h2>Per module</h2><div class="toolbar">expand to depth: ` +
    [1, 2, 3, 4].map((d) => `<button class="btn" data-depth="${d}">${d}</button>`).join("") +
    `<button class="btn" data-depth="99">all</button></div><div class="modwrap"></div></section>`);
  const mwrap = msec.querySelector(".modwrap");
  const mOpen = new Set();
  const mParent = {};
  M.forEach((r, i) => { for (let j = i - 1; j >= 0; j--) if (M[j].depth === r.depth - 1) { mParent[i] = j; break; } });
  const mHasKids = M.map((r, i) => i + 1 < M.length && M[i + 1].depth > r.depth);
  function mVisible(i) { for (let p = mParent[i]; p != null; p = mParent[p]) if (!mOpen.has(p)) return false; return true; }
  function drawModules() {
    const rows = [];
    M.forEach((r, i) => {
      if (!mVisible(i)) return;
      const tog = mHasKids[i] ? `<span class="tog" data-mrow="${i}">${mOpen.has(i) ? "▾" : "▸"}</span>` : `<span class="tog"></span>`;
      rows.push(`<tr data-module="${esc(r.path)}"><td style="padding-left:${6 + 14 * r.depth}px">${tog}<a class="lk mono" data-group="${r.group}">${esc(r.path ? r.path : "(model)")}</a></td>` +
        `<td class="n">${r.ops}</td><td class="n" style="background:${r.low ? COL.low : ""}">${r.low}</td><td class="n" style="background:${r.fp32 ? COL.fp32 : ""}">${r.fp32}</td>` +
        `<td class="n">${r.casts}</td><td class="n">${bytes(r.cast_bytes)}</td><td class="n">${bytes(r.fp32_bytes)}</td>` +
        (hasErr ? `<td class="n">${err(r.max_error)}</td>` : "") + `</tr>`);
    });
    mwrap.innerHTML = table(["module", "ops", "low", "fp32", "casts", "bytes cast", "fp32 bytes"].concat(hasErr ? ["max error"] : []), rows);
  }
  function mDepth(d) { mOpen.clear(); M.forEach((r, i) => { if (r.depth < d) mOpen.add(i); }); drawModules(); }
  msec.addEventListener("click", (ev) => {
    const t = ev.target;
    if (t.dataset.depth) mDepth(+t.dataset.depth);
    else if (t.dataset.mrow) { const i = +t.dataset.mrow; mOpen.has(i) ? mOpen.delete(i) : mOpen.add(i); drawModules(); }
    else if (t.dataset.group) { G.tab("after"); G.revealGroup(+t.dataset.group); }
  });
  mDepth(2);

  // ------------------------------------------------------------------ graph
  const gsec = add(`<section id="graph"><h2>Graph</h2><div class="toolbar">` +
    `<button class="btn" data-tab="after">after</button><button class="btn" data-tab="before">before</button>` +
    `<input type="search" placeholder="search nodes and modules (name, op, module, family, reason)">` +
    `<label><input type="checkbox" data-act="params"> parameters</label>` +
    `<label><input type="checkbox" data-act="ints"> integer/bool ops</label>` +
    `<button class="btn" data-act="collapse">collapse all</button><button class="btn" data-act="expand">expand all</button>` +
    `<button class="btn" data-act="zout">−</button><button class="btn" data-act="zin">+</button>` +
    `<span class="legend">${["low", "fp32", "cast", "rewritten", "promote", "neutral"].map((k) => `<span style="background:${COL[k]}">${k}</span>`).join("")}` +
    `<span style="border-style:dashed">module: click to open</span></span></div>` +
    `<div class="chips"></div><div class="results"></div>` +
    `<div class="gwrap"><div class="canvas"></div><aside class="details">Click a node for its details, a dashed box to open a module.</aside></div></section>`);
  const canvas = gsec.querySelector(".canvas"), details = gsec.querySelector(".details");
  const chips = gsec.querySelector(".chips"), results = gsec.querySelector(".results");
  const search = gsec.querySelector("input[type=search]");

  function prepare(g) {
    const idx = {}; g.nodes.forEach((v, i) => { idx[v.n] = i; });
    const users = g.nodes.map(() => []);
    g.nodes.forEach((v, i) => v.i.forEach((a) => { if (a in idx) users[idx[a]].push(i); }));
    const chain = g.groups.map(() => null);
    const chainOf = (k) => {
      if (chain[k]) return chain[k];
      chain[k] = k === 0 ? [] : chainOf(g.parents[k]).concat([k]);
      return chain[k];
    };
    g.groups.forEach((_, k) => chainOf(k));
    const kids = g.groups.map(() => []);
    g.parents.forEach((p, k) => { if (p >= 0) kids[p].push(k); });
    const tot = g.groups.map(() => ({ ops: 0, low: 0, fp32: 0, cast: 0, nodes: 0 }));
    g.nodes.forEach((v) => {
      const isOp = v.o.startsWith("call_");
      for (const k of [0].concat(chain[v.g])) {
        const t = tot[k]; t.nodes++;
        if (isOp) { t.ops++; if (v.p === "low") t.low++; else if (v.p === "fp32") t.fp32++; else if (v.p === "cast") t.cast++; }
      }
    });
    return { g, idx, users, chain, kids, tot, open: new Set([0]), params: false, ints: false, sel: null, hits: new Set(), zoom: 1 };
  }
  const graphs = { after: prepare(D.graphs.after), before: prepare(D.graphs.before) };
  let cur = graphs.after;
  // Open modules level by level while the picture stays small: the first view shows structure.
  function visibleCount(st) {
    const seen = new Set();
    st.g.nodes.forEach((v, i) => { const k = rep(st, i); if (k[0] === "g" || !hidden(st, v)) seen.add(k); });
    return seen.size;
  }
  function autoOpen(st, limit) {
    let frontier = [0];
    for (;;) {
      const next = [];
      for (const k of frontier) for (const c of st.kids[k]) next.push(c);
      if (!next.length) break;
      next.forEach((k) => st.open.add(k));
      if (visibleCount(st) > limit) { next.forEach((k) => st.open.delete(k)); break; }
      frontier = next;
    }
  }

  function rep(st, i) {
    const ch = st.chain[st.g.nodes[i].g];
    for (const k of ch) if (!st.open.has(k)) return "g" + k;
    return "n" + i;
  }
  function rel(st, k) {
    const p = st.g.parents[k], full = st.g.groups[k], par = p > 0 ? st.g.groups[p] : "";
    return par && full.startsWith(par + ".") ? full.slice(par.length + 1) : full;
  }
  function short(v) {
    if (v.p === "cast") return "cast → " + v.d;
    return v.t.length > 28 ? v.t.slice(0, 27) + "…" : v.t;
  }

  autoOpen(graphs.after, 120); autoOpen(graphs.before, 120);

  // Parameters and integer/bool arithmetic (shapes, masks, positions) are hidden unless asked for.
  function hidden(st, v) {
    if (v.o === "get_attr") return !st.params;
    return !st.ints && v.o.startsWith("call_") && (v.p === "nonfloat" || (!v.p && !v.d));
  }

  function layout(st) {
    const g = st.g, items = new Map(), order = [];
    g.nodes.forEach((v, i) => {
      const key = rep(st, i);
      if (key[0] === "n" && hidden(st, v)) return;
      if (!items.has(key)) { items.set(key, { key, order: order.length, preds: new Set(), succs: new Set() }); order.push(key); }
    });
    const edges = new Map();
    g.nodes.forEach((v, i) => {
      const ku = rep(st, i); if (!items.has(ku)) return;
      for (const a of v.i) {
        const j = st.idx[a]; if (j == null) continue;
        const kv = rep(st, j); if (kv === ku || !items.has(kv)) continue;
        const ek = kv + ">" + ku;
        if (!edges.has(ek)) { edges.set(ek, { from: kv, to: ku }); items.get(ku).preds.add(kv); items.get(kv).succs.add(ku); }
      }
    });
    const layers = [];
    for (const key of order) {
      const it = items.get(key);
      let L = 0;
      for (const p of it.preds) { const q = items.get(p); if (q.order < it.order) L = Math.max(L, q.layer + 1); }
      it.layer = L; (layers[L] = layers[L] || []).push(it);
      if (key[0] === "g") {
        const k = +key.slice(1), t = st.tot[k];
        it.l1 = rel(st, k) + "  ▸"; it.l2 = `${t.ops} ops · ${t.low} low · ${t.fp32} fp32 · ${t.cast} casts`; it.h = 46;
      } else {
        const v = g.nodes[+key.slice(1)];
        it.l1 = short(v); it.l2 = [v.d, v.sh].filter(Boolean).join(" ") || v.o; it.h = 34;
      }
      it.w = Math.min(260, Math.max(76, 14 + 6.3 * Math.max(it.l1.length, it.l2.length)));
    }
    // Sources (parameter casts, constants) sit just above their first user, not at the top.
    for (let r = order.length - 1; r >= 0; r--) {
      const it = items.get(order[r]);
      if ([...it.preds].some((p) => items.get(p).order < it.order)) continue;
      let L = Infinity;
      for (const s of it.succs) { const q = items.get(s); if (q.order > it.order) L = Math.min(L, q.layer - 1); }
      if (L !== Infinity && L > it.layer) {
        layers[it.layer].splice(layers[it.layer].indexOf(it), 1);
        it.layer = L; (layers[L] = layers[L] || []).push(it);
      }
    }
    const GAP = 18, RANK = 34;
    let y = 10;
    for (const layer of layers) {
      if (!layer) continue;
      const h = Math.max(...layer.map((it) => it.h));
      let x = 10;
      for (const it of layer) { it.x = x; x += it.w + GAP; it.y = y; }
      y += h + RANK;
    }
    // Two downward sweeps: each item moves towards the mean centre of its earlier predecessors.
    for (let sweep = 0; sweep < 2; sweep++) {
      for (const layer of layers) {
        if (!layer) continue;
        for (const it of layer) {
          let s = 0, c = 0;
          for (const p of it.preds) { const q = items.get(p); if (q.layer < it.layer) { s += q.x + q.w / 2; c++; } }
          it.want = c ? s / c - it.w / 2 : it.x;
        }
        layer.sort((a, b) => a.want - b.want);
        let right = 10;
        for (const it of layer) { it.x = Math.max(it.want, right); right = it.x + it.w + GAP; }
      }
    }
    let W = 0, H = y;
    for (const it of items.values()) W = Math.max(W, it.x + it.w + 10);
    return { items, edges, W, H };
  }

  function draw() {
    const st = cur, g = st.g, lay = layout(st), z = st.zoom;
    const out = [`<svg xmlns="http://www.w3.org/2000/svg" width="${lay.W * z}" height="${lay.H * z}" viewBox="0 0 ${lay.W} ${lay.H}">`];
    for (const e of lay.edges.values()) {
      const a = lay.items.get(e.from), b = lay.items.get(e.to);
      const x1 = a.x + a.w / 2, y1 = a.y + a.h, x2 = b.x + b.w / 2, y2 = b.y;
      const back = y2 <= y1;
      const my = (y1 + y2) / 2;
      out.push(`<path class="e${back ? " back" : ""}" d="M${x1},${y1} C${x1},${back ? y1 + 30 : my} ${x2},${back ? y2 - 30 : my} ${x2},${y2}"/>`);
    }
    const groupHits = new Set();
    for (const i of st.hits) for (const k of st.chain[g.nodes[i].g]) groupHits.add(k);
    for (const it of lay.items.values()) {
      const key = it.key;
      if (key[0] === "g") {
        const k = +key.slice(1), t = st.tot[k], w = it.w - 8;
        const seg = [[t.low, COL.low], [t.fp32, COL.fp32], [t.cast, COL.cast], [t.ops - t.low - t.fp32 - t.cast, "#e0e0e0"]];
        let bx = it.x + 4; const bars = [];
        for (const [c, col] of seg) { if (!t.ops || !c) continue; const bw = (w * c) / t.ops; bars.push(`<rect x="${bx}" y="${it.y + it.h - 10}" width="${bw}" height="6" fill="${col}"/>`); bx += bw; }
        out.push(`<g class="nd gr${groupHits.has(k) ? " hit" : ""}" data-key="${key}"><title>${esc(g.groups[k])}: click to open</title>` +
          `<rect class="box" x="${it.x}" y="${it.y}" width="${it.w}" height="${it.h}" rx="6" fill="#fbfbfb"/>` +
          `<text x="${it.x + 8}" y="${it.y + 15}" font-weight="600">${esc(it.l1)}</text><text x="${it.x + 8}" y="${it.y + 29}" fill="#555">${esc(it.l2)}</text>${bars.join("")}</g>`);
      } else {
        const i = +key.slice(1), v = g.nodes[i];
        const cls = (st.sel === i ? " sel" : "") + (st.hits.has(i) ? " hit" : "");
        out.push(`<g class="nd${cls}" data-key="${key}"><title>${esc(v.n)} (${esc(v.m || "model")})</title>` +
          `<rect x="${it.x}" y="${it.y}" width="${it.w}" height="${it.h}" rx="3" fill="${color(v.p, v.w)}"/>` +
          `<text x="${it.x + 7}" y="${it.y + 14}">${esc(it.l1)}</text><text x="${it.x + 7}" y="${it.y + 27}" fill="#444">${esc(it.l2)}</text></g>`);
      }
    }
    out.push("</svg>");
    canvas.innerHTML = out.join("");
    st.last = lay;
    const open = [...st.open].filter((k) => k !== 0);
    chips.innerHTML = open.length ? "open modules (click to close): " + open.slice(0, 16).map((k) => `<span class="chip" data-close="${k}">${esc(g.groups[k])} ×</span>`).join("") + (open.length > 16 ? ` … ${open.length - 16} more` : "") : "";
    gsec.querySelectorAll("[data-tab]").forEach((b) => b.classList.toggle("on", graphs[b.dataset.tab] === cur));
    gsec.querySelector("[data-act=params]").checked = st.params;
    gsec.querySelector("[data-act=ints]").checked = st.ints;
  }

  function showDetails(i) {
    const st = cur, v = st.g.nodes[i];
    const row = (k, val) => (val === "" || val == null ? "" : `<dt>${k}</dt><dd>${val}</dd>`);
    details.innerHTML = `<b class="mono">${esc(v.n)}</b><dl>` +
      row("op", esc(v.o)) + row("target", `<span class="mono">${esc(v.t)}</span>`) +
      row("module", v.m ? `<a class="lk mono" data-group="${v.g}">${esc(v.m)}</a>` : "(model)") +
      row("family", esc(v.f)) + row("class", v.p ? `<span class="sw" style="display:inline-block;width:10px;height:10px;background:${color(v.p, v.w)}"></span> ${esc(v.p)}` : "") +
      row("dtype", esc(v.d)) + row("shape", esc(v.sh)) + row("bytes", v.b == null ? "" : bytes(v.b)) +
      row("reason", esc(v.r)) + row("source", `<span class="mono">${esc(v.s)}</span>`) +
      row("error vs fp32", v.e == null ? "" : err(v.e)) +
      row("inputs", v.i.map(link).join(", ")) + row("users", st.users[i].map((j) => link(st.g.nodes[j].n)).join(", ")) + `</dl>`;
  }
  function scrollTo(key) {
    const it = cur.last && cur.last.items.get(key); if (!it) return;
    const z = cur.zoom;
    canvas.scrollLeft = Math.max(0, (it.x + it.w / 2) * z - canvas.clientWidth / 2);
    canvas.scrollTop = Math.max(0, (it.y + it.h / 2) * z - canvas.clientHeight / 2);
  }
  const G = {
    tab(name) { if (graphs[name] !== cur) { cur = graphs[name]; runSearch(); } },
    revealNode(name) {
      const i = cur.idx[name]; if (i == null) return;
      for (const k of cur.chain[cur.g.nodes[i].g]) cur.open.add(k);
      if (cur.g.nodes[i].o === "get_attr") cur.params = true;
      else if (hidden(cur, cur.g.nodes[i])) cur.ints = true;
      cur.sel = i; draw(); showDetails(i); scrollTo("n" + i);
      gsec.scrollIntoView({ block: "start" });
    },
    revealGroup(k) {
      for (const a of cur.chain[k]) if (a !== k) cur.open.add(a);
      draw(); scrollTo(cur.open.has(k) ? null : "g" + k);
      gsec.scrollIntoView({ block: "start" });
    },
  };
  window.ampReport = { data: D, reveal: (name) => G.revealNode(name), visibleItems: () => cur.last ? cur.last.items.size : 0 };

  let timer = null;
  function runSearch() {
    const q = search.value.trim().toLowerCase();
    cur.hits = new Set();
    if (!q) { results.style.display = "none"; draw(); return; }
    const found = [];
    cur.g.groups.forEach((p, k) => { if (k && p.toLowerCase().includes(q)) found.push(`<div data-group="${k}">module <b class="mono">${esc(p)}</b> (${cur.tot[k].ops} ops)</div>`); });
    cur.g.nodes.forEach((v, i) => {
      if ([v.n, v.t, v.m, v.f, v.r, v.p].some((s) => s && s.toLowerCase().includes(q))) {
        cur.hits.add(i);
        if (found.length < 200) found.push(`<div data-node="${esc(v.n)}"><b class="mono">${esc(v.n)}</b> — ${esc(v.t)} · ${esc(v.m || "(model)")} · ${esc(v.p || v.d)}</div>`);
      }
    });
    results.innerHTML = `<div style="color:#666">${cur.hits.size} nodes match${found.length >= 200 ? " (first 200 listed)" : ""}; matches are outlined in yellow</div>` + found.join("");
    results.style.display = "block";
    draw();
  }
  search.addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(runSearch, 150); });
  search.addEventListener("keydown", (ev) => {
    if (ev.key !== "Enter") return;
    const first = results.querySelector("[data-node],[data-group]"); if (first) first.click();
  });

  document.addEventListener("click", (ev) => {
    const t = ev.target.closest("[data-node],[data-key],[data-close],[data-tab],[data-act],[data-group]");
    if (!t || !document.body.contains(t)) return;
    if (t.closest("#modules") && t.dataset.group) return; // handled by the module table
    if (t.dataset.node) G.revealNode(t.dataset.node);
    else if (t.dataset.group) G.revealGroup(+t.dataset.group);
    else if (t.dataset.key) {
      const key = t.dataset.key;
      if (key[0] === "g") { cur.open.add(+key.slice(1)); draw(); scrollTo(null); }
      else { cur.sel = +key.slice(1); draw(); showDetails(cur.sel); }
    } else if (t.dataset.close) { cur.open.delete(+t.dataset.close); draw(); }
    else if (t.dataset.tab) { G.tab(t.dataset.tab); draw(); }
    else if (t.dataset.act) {
      const a = t.dataset.act;
      if (a === "params") cur.params = t.checked;
      else if (a === "ints") cur.ints = t.checked;
      else if (a === "collapse") cur.open = new Set([0]);
      else if (a === "expand") cur.open = new Set(cur.g.groups.map((_, k) => k));
      else if (a === "zin") cur.zoom = Math.min(2.5, cur.zoom * 1.25);
      else if (a === "zout") cur.zoom = Math.max(0.2, cur.zoom / 1.25);
      draw();
    }
  });
  draw();
  if (D.report) app.insertAdjacentHTML("beforeend", `<section><details class="raw"><summary>full report (text)</summary><pre>${esc(D.report)}</pre></details></section>`);
  document.body.dataset.ready = "1";
})();
