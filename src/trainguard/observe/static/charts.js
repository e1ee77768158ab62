// trainguard's charts, drawn as SVG by this file alone (no library, nothing fetched): line
// charts with a hover read-out, horizontal stacked bars and a donut. The job page
// (view.html) calls TG.lines, TG.bars and TG.donut; `trainguard report --html` inlines this
// file, so a report opens offline. Each chart is an SVG element of class tg-chart that replaces the
// contents of its container (a fixed-height element) and counts itself in
// document.body.dataset.charts.
"use strict";
const TG = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                   "#7f7f7f", "#bcbd22", "#17becf"];
  const MUTED = "#6b7585", GRID = "#eef0f3", AXIS = "#b8bec8";
  const CHAR_W = 6.6;  // px per character of 11px text (labels are measured by this)

  function el(tag, attrs, parent, text) {
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    if (text !== undefined) e.textContent = String(text);
    if (parent) parent.appendChild(e);
    return e;
  }
  // A number as people read it: 3 significant digits, no trailing zeros, k/M past 10^4.
  function fmt(v) {
    if (v === null || v === undefined || !Number.isFinite(v)) return String(v);
    const a = Math.abs(v);
    if (a >= 1e6) return +(v / 1e6).toPrecision(3) + "M";
    if (a >= 1e4) return +(v / 1e3).toPrecision(3) + "k";
    if (a !== 0 && a < 1e-3) return v.toExponential(1);
    return String(+v.toPrecision(a >= 1000 ? 4 : 3));
  }
  // About n "nice" ticks (1, 2, 5 × 10^k apart) covering [lo, hi].
  function ticks(lo, hi, n) {
    if (!(hi > lo)) { hi = lo + 1; lo = lo - (lo === 0 ? 0 : 1); }
    const raw = (hi - lo) / Math.max(1, n);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw) || 10 * mag;
    const out = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(+t.toPrecision(12));
    return {lo: Math.min(lo, out[0] ?? lo), hi: Math.max(hi, out[out.length - 1] ?? hi), ticks: out};
  }
  function frame(id) {
    const box = document.getElementById(id);
    box.replaceChildren();
    const w = Math.max(240, box.clientWidth || 560), h = Math.max(160, box.clientHeight || 260);
    const svg = el("svg", {class: "tg-chart", width: w, height: h, viewBox: `0 0 ${w} ${h}`,
                           "font-family": "system-ui, sans-serif", "font-size": 11}, box);
    document.body.dataset.charts = String(Number(document.body.dataset.charts || 0) + 1);
    return {svg, w, h};
  }
  function note(svg, w, h, text) {
    el("text", {x: w / 2, y: h / 2, "text-anchor": "middle", fill: MUTED, "font-size": 13}, svg, text);
  }
  // A legend row (wrapping) at the bottom; returns the height it took.
  function legend(svg, w, h, items) {
    const rows = [[]];
    let x = 0;
    for (const it of items) {
      const width = 22 + CHAR_W * it.name.length;
      if (x + width > w - 10 && rows[rows.length - 1].length) { rows.push([]); x = 0; }
      rows[rows.length - 1].push([it, x]);
      x += width + 12;
    }
    const tall = 16 * rows.length;
    rows.forEach((row, i) => {
      const used = row.length ? row[row.length - 1][1] + 22 + CHAR_W * row[row.length - 1][0].name.length : 0;
      const left = Math.max(4, (w - used) / 2), y = h - tall + 16 * i + 10;
      for (const [it, dx] of row) {
        el("rect", {x: left + dx, y: y - 6, width: 14, height: 4, fill: it.color}, svg);
        el("text", {x: left + dx + 18, y: y, fill: "#3a4658"}, svg, it.name);
      }
    });
    return tall + 4;
  }
  function search(xs, x) {  // index of the value of sorted xs nearest x
    let lo = 0, hi = xs.length - 1;
    while (hi - lo > 1) { const m = (lo + hi) >> 1; if (xs[m] < x) lo = m; else hi = m; }
    return Math.abs(xs[lo] - x) <= Math.abs(xs[hi] - x) ? lo : hi;
  }

  // Line charts. series: [{name, x: [...], y: [...], mode: "lines" | "markers" |
  // "lines+markers", color, text: [...] (hover text per point)}], x ascending.
  // o: {xTitle, yTitle, note (shown when there is no point)}.
  function lines(id, series, o = {}) {
    const {svg, w, h} = frame(id);
    series = series.filter(s => s.x.length);
    series.forEach((s, i) => { s.color = s.color || PALETTE[i % PALETTE.length]; });
    if (!series.length) { note(svg, w, h, o.note || "no data yet"); return; }
    const bottom = legend(svg, w, h, series) + (o.xTitle ? 30 : 18);
    const xs = series.flatMap(s => s.x), ys = series.flatMap(s => s.y).filter(v => Number.isFinite(v));
    if (!ys.length) { svg.replaceChildren(); note(svg, w, h, o.note || "no data yet"); return; }
    const X = ticks(Math.min(...xs), Math.max(...xs), Math.max(4, Math.floor(w / 110)));
    const Y = ticks(Math.min(...ys), Math.max(...ys), 5);
    const left = 12 + CHAR_W * Math.max(...Y.ticks.map(t => fmt(t).length)) + (o.yTitle ? 14 : 0);
    const pw = w - left - 12, ph = h - bottom - 8;
    const sx = v => left + (v - X.lo) / (X.hi - X.lo) * pw;
    const sy = v => 8 + ph - (v - Y.lo) / (Y.hi - Y.lo) * ph;
    for (const t of Y.ticks) {
      el("line", {x1: left, x2: left + pw, y1: sy(t), y2: sy(t), stroke: GRID}, svg);
      el("text", {x: left - 4, y: sy(t) + 4, "text-anchor": "end", fill: MUTED}, svg, fmt(t));
    }
    for (const t of X.ticks) el("text", {x: sx(t), y: 8 + ph + 14, "text-anchor": "middle", fill: MUTED}, svg, fmt(t));
    el("line", {x1: left, x2: left + pw, y1: 8 + ph, y2: 8 + ph, stroke: AXIS}, svg);
    if (o.xTitle) el("text", {x: left + pw / 2, y: 8 + ph + 28, "text-anchor": "middle", fill: "#3a4658"}, svg, o.xTitle);
    if (o.yTitle) el("text", {x: 10, y: 8 + ph / 2, "text-anchor": "middle", fill: "#3a4658",
                              transform: `rotate(-90 10 ${8 + ph / 2})`}, svg, o.yTitle);
    for (const s of series) {
      const mode = s.mode || "lines";
      if (mode.includes("lines")) {
        let d = "", pen = "M";
        s.x.forEach((x, i) => {
          if (!Number.isFinite(s.y[i])) { pen = "M"; return; }  // a gap, not a line through it
          d += `${pen}${sx(x).toFixed(1)},${sy(s.y[i]).toFixed(1)}`; pen = "L";
        });
        el("path", {d, fill: "none", stroke: s.color, "stroke-width": 1.6}, svg);
      }
      if (mode.includes("markers") && s.x.length <= 2000) {
        s.x.forEach((x, i) => {
          if (Number.isFinite(s.y[i])) el("circle", {cx: sx(x), cy: sy(s.y[i]), r: 2.5, fill: s.color}, svg);
        });
      }
    }
    // Hover: a rule at the nearest x and each series' value there.
    const rule = el("line", {y1: 8, y2: 8 + ph, stroke: AXIS, visibility: "hidden"}, svg);
    const tip = el("g", {visibility: "hidden"}, svg);
    const pad = el("rect", {x: left, y: 8, width: pw, height: ph, fill: "transparent"}, svg);
    pad.addEventListener("mouseleave", () => { rule.setAttribute("visibility", "hidden"); tip.setAttribute("visibility", "hidden"); });
    pad.addEventListener("mousemove", ev => {
      const r = svg.getBoundingClientRect(), x = X.lo + (ev.clientX - r.left - left) / pw * (X.hi - X.lo);
      const lines = series.map(s => {
        const i = search(s.x, x);
        return [s, i, `${s.name}: ${fmt(s.y[i])} at ${fmt(s.x[i])}${s.text ? " · " + s.text[i] : ""}`];
      });
      const at = sx(lines[0][0].x[lines[0][1]]);
      rule.setAttribute("x1", at); rule.setAttribute("x2", at); rule.setAttribute("visibility", "visible");
      tip.replaceChildren();
      const width = 12 + CHAR_W * Math.max(...lines.map(l => l[2].length));
      const tx = at + width + 12 > w ? Math.max(2, at - width - 8) : at + 8;
      el("rect", {x: tx, y: 10, width, height: 6 + 14 * lines.length, fill: "#fff", stroke: AXIS, rx: 3}, tip);
      lines.forEach(([s, , text], k) => el("text", {x: tx + 6, y: 24 + 14 * k, fill: s.color}, tip, text));
      tip.setAttribute("visibility", "visible");
    });
  }

  // Horizontal stacked bars. rows: [{label, segments: [{name, base, width}]}] (seconds);
  // a segment's colour follows its name; o: {xTitle, note}.
  function bars(id, rows, o = {}) {
    const {svg, w, h} = frame(id);
    if (!rows.length) { note(svg, w, h, o.note || "no data yet"); return; }
    const names = [...new Set(rows.flatMap(r => r.segments.map(s => s.name)))];
    const color = Object.fromEntries(names.map((n, i) => [n, PALETTE[i % PALETTE.length]]));
    const bottom = legend(svg, w, h, names.map(n => ({name: n, color: color[n]}))) + (o.xTitle ? 30 : 18);
    const longest = Math.max(...rows.map(r => r.label.length));
    const left = Math.min(w * 0.45, 10 + CHAR_W * longest);
    const ends = rows.flatMap(r => r.segments.map(s => s.base + s.width));
    const starts = rows.flatMap(r => r.segments.map(s => s.base));
    const X = ticks(Math.min(...starts), Math.max(...ends), Math.max(4, Math.floor((w - left) / 110)));
    const pw = w - left - 12, ph = h - bottom - 8, band = ph / rows.length;
    const sx = v => left + (v - X.lo) / (X.hi - X.lo) * pw;
    for (const t of X.ticks) {
      el("line", {x1: sx(t), x2: sx(t), y1: 8, y2: 8 + ph, stroke: GRID}, svg);
      el("text", {x: sx(t), y: 8 + ph + 14, "text-anchor": "middle", fill: MUTED}, svg, fmt(t));
    }
    if (o.xTitle) el("text", {x: left + pw / 2, y: 8 + ph + 28, "text-anchor": "middle", fill: "#3a4658"}, svg, o.xTitle);
    rows.forEach((r, i) => {
      const y = 8 + band * i, bh = Math.min(28, band * 0.7);
      const label = r.label.length * CHAR_W > left - 8 ? r.label.slice(0, Math.floor((left - 8) / CHAR_W) - 1) + "…" : r.label;
      el("title", {}, el("text", {x: left - 6, y: y + band / 2 + 4, "text-anchor": "end", fill: "#3a4658"}, svg, label), r.label);
      for (const s of r.segments) {
        const bar = el("rect", {x: sx(s.base), y: y + (band - bh) / 2, width: Math.max(1, sx(s.base + s.width) - sx(s.base)),
                                height: bh, fill: color[s.name]}, svg);
        el("title", {}, bar, `${s.name}: ${s.width.toFixed(2)} s`);
      }
    });
  }

  // A donut. slices: [{label, value, color}]; slices of 0 are left out.
  function donut(id, slices) {
    const {svg, w, h} = frame(id);
    slices = slices.filter(s => s.value > 0);
    const total = slices.reduce((a, s) => a + s.value, 0);
    if (!total) { note(svg, w, h, "no time yet"); return; }
    const cx = w / 2, cy = h / 2, R = Math.min(h / 2 - 24, w / 4), r = R * 0.55;
    let a = -Math.PI / 2;
    for (const s of slices) {
      const b = a + 2 * Math.PI * s.value / total, large = b - a > Math.PI ? 1 : 0;
      const p = (rad, ang) => `${(cx + rad * Math.cos(ang)).toFixed(2)},${(cy + rad * Math.sin(ang)).toFixed(2)}`;
      const full = slices.length === 1;  // one slice: a ring (an arc cannot close on itself)
      const d = full
        ? `M${p(R, 0)}A${R},${R} 0 1 1 ${p(R, Math.PI)}A${R},${R} 0 1 1 ${p(R, 0)}M${p(r, 0)}A${r},${r} 0 1 0 ${p(r, Math.PI)}A${r},${r} 0 1 0 ${p(r, 0)}Z`
        : `M${p(R, a)}A${R},${R} 0 ${large} 1 ${p(R, b)}L${p(r, b)}A${r},${r} 0 ${large} 0 ${p(r, a)}Z`;
      el("title", {}, el("path", {d, fill: s.color, stroke: "#fff", "fill-rule": "evenodd"}, svg),
         `${s.label}: ${s.value.toFixed(1)} s (${(100 * s.value / total).toFixed(0)}%)`);
      if (s.value / total >= 0.03) {  // a label outside the ring, on its side
        const mid = (a + b) / 2, lx = cx + (R + 10) * Math.cos(mid), ly = cy + (R + 10) * Math.sin(mid);
        const t = el("text", {x: lx, y: ly, "text-anchor": Math.cos(mid) >= 0 ? "start" : "end", fill: "#3a4658"}, svg);
        el("tspan", {x: lx, dy: 0}, t, s.label);
        el("tspan", {x: lx, dy: 12, fill: MUTED}, t, `${s.value.toFixed(1)}s`);
      }
      a = b;
    }
  }
  return {lines, bars, donut, fmt, ticks};
})();
