// areal-kit view: the page. Plain JavaScript over the JSON of areal_kit/view/app.py; charts by uPlot.
"use strict";

const PANELS = [
  { title: "task_reward (raw, smoothed)", keys: ["task_reward"], smooth: true },
  { title: "KL", keys: ["ppo_approx_kl", "kl_reward"] },
  { title: "entropy", keys: ["entropy"] },
  { title: "answer length (tokens)", keys: ["avg_seq_len"] },
  { title: "no-eos ratio", keys: ["no_eos_ratio"] },
  { title: "zero-advantage share", keys: ["perc_zero_adv"] },
  { title: "staleness", keys: ["staleness"] },
  { title: "eval", prefix: "eval/", skip: ["eval/n_prompts"] },
  { title: "step time (s)", keys: ["e2e_time", "wait_time", "train_time", "sync_time"] },
];
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const PHASES = [  // lanes of the time view: [label, metric, where it starts]
  ["driver: waits for the rollout", "wait_time", "start"],
  ["engines: generation", "gen_time", "start"],
  ["reward", "reward_time", "start"],
  ["weight load on engines", "load_time", "start"],
  ["trainer: reference logprobs", "ref_logp_time", "train"],
  ["trainer: train step", "train_time", "train"],
  ["weight sync", "sync_time", "sync"],
  ["driver: step end to end", "e2e_time", "start"],
];

const S = window.__view = {
  status: null, trend: null, steps: [], step: null, stepData: null, sample: null, generation: -1,
  charts: [], extra: "", loads: 0,
};

const $ = (sel) => document.querySelector(sel);
const el = (tag, attrs = {}, ...kids) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  for (const k of kids) e.append(k);
  return e;
};
const fmt = (v, d = 3) => (v === null || v === undefined) ? "" :
  (typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toFixed(d)) : String(v));
async function get(url) {
  const r = await fetch(url);
  if (!r.ok) throw new Error(`${url}: ${r.status}`);
  return r.json();
}

// ------------------------------------------------------------------ tabs
function showTab(name) {
  for (const b of document.querySelectorAll("nav button")) b.classList.toggle("on", b.dataset.tab === name);
  for (const s of document.querySelectorAll("section.tab")) s.hidden = s.id !== `tab-${name}`;
  if (name === "run") loadRun();
  if (name === "time") drawTime();
  if (name === "main") S.charts.forEach((u) => u.setSize(chartSize(u.root.parentNode)));
}
document.querySelectorAll("nav button").forEach((b) => b.addEventListener("click", () => showTab(b.dataset.tab)));

// ------------------------------------------------------------------ status and polling
async function poll() {
  try {
    const st = await get("/api/status");
    S.status = st;
    $("#run-name").textContent = `${st.name}`;
    $("#run-name").title = st.log_dir;
    $("#run-steps").textContent = st.n_steps ? `${st.n_steps} steps (${st.first_step}..${st.last_step}), ` +
      `${st.sample_steps} with samples` : "no step yet";
    const ago = st.last_time ? Math.max(0, Date.now() / 1000 - st.last_time) : null;
    $("#live").textContent = ago === null ? "" : `last step ${ago < 90 ? Math.round(ago) + " s" : Math.round(ago / 60) + " min"} ago`;
    $("#notes").replaceChildren(...st.notes.map((n) => el("div", { class: "note", text: n })));
    if (st.generation !== S.generation) {
      S.generation = st.generation;
      await refresh(st);
    }
  } catch (e) {
    $("#live").textContent = `the page's server does not answer (${e.message})`;
  }
}

async function refresh(st) {
  const extra = $("#extra-key");
  const have = new Set([...extra.options].map((o) => o.value));
  for (const k of st.keys) if (!have.has(k)) extra.append(el("option", { value: k, text: k }));
  S.trend = await get("/api/trend?points=4000");
  drawTrend();
  const got = await get("/api/steps");
  S.steps = got.steps;
  const sel = $("#step-select");
  const current = sel.value;
  sel.replaceChildren(...S.steps.slice().reverse().slice(0, 5000).map((g) => el("option", { value: g, text: `global step ${g}` })));
  const cmp = $("#compare-select"), keep = cmp.value;
  cmp.replaceChildren(el("option", { value: "", text: "(none)" }),
    ...S.steps.slice().reverse().slice(0, 5000).map((g) => el("option", { value: g, text: `global step ${g}` })));
  cmp.value = keep;
  if (S.step !== null && !$("#follow").checked) sel.value = String(S.step); else if (current) sel.value = current;
  const last = S.steps.length ? S.steps[S.steps.length - 1] : null;
  if (last !== null && (S.step === null || $("#follow").checked) && S.step !== last) await openStep(last, false);
  else if (S.step !== null) sel.value = String(S.step);
}

// ------------------------------------------------------------------ trend
function ema(vals, a) {
  let m = null;
  return vals.map((v) => {
    if (v === null) return null;
    m = m === null ? v : a * m + (1 - a) * v;
    return m;
  });
}

function chartSize(box) {
  return { width: Math.max(300, box.clientWidth - 10), height: 160 };
}

function drawTrend() {
  const t = S.trend;
  const box = $("#trend");
  S.charts.forEach((u) => u.destroy());
  S.charts = [];
  box.replaceChildren();
  const panels = PANELS.slice();
  if (S.extra) panels.push({ title: S.extra, keys: [S.extra] });
  const alpha = parseFloat($("#smooth").value);
  for (const p of panels) {
    const keys = p.prefix ? Object.keys(t.series).filter((k) => k.startsWith(p.prefix) && !(p.skip || []).includes(k))
      : p.keys.filter((k) => k in t.series);
    const div = el("div", { class: "panel", "data-title": p.title, "data-n": String(t.steps.length) });
    box.append(div);
    if (!keys.length || !t.steps.length) {
      div.append(el("div", { class: "empty", text: `${p.title}: not logged by this run${t.steps.length ? "" : " yet"}` }));
      continue;
    }
    const data = [t.steps];
    const series = [{ label: "step" }];
    keys.forEach((k, i) => {
      data.push(t.series[k]);
      series.push({ label: k, stroke: COLORS[i % COLORS.length], width: p.smooth ? 1 : 1.5, spanGaps: true,
                    alpha: p.smooth ? 0.35 : 1, points: { show: t.steps.length < 60 } });
      if (p.smooth) {
        data.push(ema(t.series[k], alpha));
        series.push({ label: `${k} (smoothed)`, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true,
                      points: { show: false } });
      }
    });
    const opts = {
      title: p.title + (t.every > 1 ? ` (means of ${t.every} steps)` : ""), ...chartSize(div),
      scales: { x: { time: false } }, series, cursor: { sync: { key: "trend" } }, legend: { live: true },
      axes: [{ label: "global step" }, {}],
    };
    const u = new uPlot(opts, data, div);
    onPick(div, u, (i) => pickStep(t.steps[i]), t.steps.length);
    S.charts.push(u);
  }
}

function onPick(box, u, pick, n) {
  // A click on the plot picks the point under the pointer. Listened for on the chart's box, in the
  // capture phase: uPlot's own handlers inside it stop the click before it reaches the plot.
  if (box.__pick) box.removeEventListener("click", box.__pick, true);  // a box drawn again
  box.__pick = (e) => {
    const r = u.over.getBoundingClientRect();
    if (e.clientX < r.left || e.clientX > r.right || e.clientY < r.top || e.clientY > r.bottom) return;
    const i = u.posToIdx(e.clientX - r.left);
    if (i !== null && i >= 0 && i < n) pick(i);
  };
  box.addEventListener("click", box.__pick, true);
}

function nearestDumped(g) {
  const s = S.steps;
  if (!s.length) return null;
  let lo = 0, hi = s.length - 1;
  while (lo < hi) { const m = (lo + hi) >> 1; if (s[m] < g) lo = m + 1; else hi = m; }
  if (lo > 0 && Math.abs(s[lo - 1] - g) <= Math.abs(s[lo] - g)) lo -= 1;
  return s[lo];
}

function pickStep(g) {
  const d = nearestDumped(g);
  $("#follow").checked = false;
  S.timeStep = g;
  if (d !== null) openStep(d, true);
  else $("#step-metrics").textContent = `global step ${g}: no samples were dumped in this run`;
}

// ------------------------------------------------------------------ step
async function openStep(g, scroll) {
  S.step = g;
  $("#step-select").value = String(g);
  S.stepData = await get(`/api/step/${g}`);
  S.loads += 1;
  drawStep();
  if (scroll) $("#step-select").scrollIntoView({ behavior: "smooth", block: "start" });
}

function drawStep() {
  const d = S.stepData;
  if (!d) return;
  const m = d.metrics;
  const bits = [`global step ${d.step}`];
  for (const k of ["task_reward", "perc_zero_adv", "no_eos_ratio", "avg_seq_len", "staleness", "e2e_time"]) {
    if (k in m) bits.push(`${k} ${fmt(m[k])}`);
  }
  if (d.bad_lines) bits.push(`${d.bad_lines} line(s) of this step did not parse (cut mid-write) and are left out`);
  $("#step-metrics").textContent = bits.join(" · ");
  const f = { fail: $("#f-fail").checked, equal: $("#f-equal").checked, trunc: $("#f-trunc").checked, tool: $("#f-tool").checked };
  const out = [];
  for (const g of d.groups) {
    if (f.equal && !g.all_equal) continue;
    if (f.trunc && !g.truncated) continue;
    if (f.tool && !g.tool_calls) continue;
    const samples = g.samples.filter((s) => (!f.fail || !(s.task_reward > 0)) && (!f.trunc || s.no_eos) &&
      (!f.tool || s.tool_calls > 0));
    if (!samples.length) continue;
    const head = el("div", { class: "head" }, el("b", { text: g.id }), el("span", { class: "prompt", text: g.prompt }),
      el("span", { class: "muted", text: `mean reward ${fmt(g.mean_reward)}` }));
    if (g.all_equal) head.append(el("span", { class: "badge eq", text: "all equal: no signal" }));
    if (g.truncated) head.append(el("span", { class: "badge tr", text: "truncated" }));
    if (g.tool_calls) head.append(el("span", { class: "badge tool", text: "tool calls" }));
    const table = sampleTable(samples, d.step);
    const c = S.compareData;
    if (!c) { out.push(el("div", { class: "group", "data-id": String(g.id) }, head, table)); continue; }
    const other = c.groups.filter((x) => x.id === g.id);
    const right = other.length ? other.map((x) => sampleTable(x.samples, c.step)) :
      [el("div", { class: "muted", text: `this prompt is not among step ${c.step}'s dumped groups` })];
    out.push(el("div", { class: "group", "data-id": String(g.id) }, head, el("div", { class: "pair" },
      el("div", { class: "side" }, el("h5", { text: `global step ${d.step}` }), table),
      el("div", { class: "side compare", "data-step": String(c.step) }, el("h5", { text: `global step ${c.step}` + (other.length ?
        `: mean reward ${fmt(other[0].mean_reward)}` : "") }), ...right))));
  }
  if (!out.length) out.push(el("div", { class: "muted", text: d.groups.length ? "no group passes the filters" : "no samples in this step" }));
  $("#step-view").replaceChildren(...out);
}

function sampleTable(samples, step) {
  const table = el("table", { class: "samples" }, el("tr", {},
    ...["answer", "task_reward", "advantage", "final_reward", "tokens", "version", "eos", "tools"].map((h) => el("th", { text: h }))));
  for (const s of samples) {
    const ver = s.versions && s.versions[0] !== s.versions[1] ? `${s.versions[0]}-${s.versions[1]}` : fmt(s.version);
    const tr = el("tr", { class: "sample", "data-i": String(s.i) },
      el("td", { class: "answer", text: s.answer }),
      el("td", { class: "num " + (s.task_reward > 0 ? "good" : "bad"), text: fmt(s.task_reward) }),
      el("td", { class: "num", text: fmt(s.seq_reward) }),
      el("td", { class: "num", text: fmt(s.final_reward) }),
      el("td", { class: "num", text: fmt(s.n_tokens) + (s.masked ? ` (${s.masked} masked)` : "") }),
      el("td", { class: "num", text: ver }),
      el("td", { text: s.no_eos ? "no eos" : "" }),
      el("td", { class: "num", text: s.tool_calls ? String(s.tool_calls) : "" }));
    tr.addEventListener("click", () => openSample(step, s.i));
    table.append(tr);
  }
  return table;
}

$("#compare-select").addEventListener("change", async (e) => {
  const h = e.target.value;
  S.compareData = h === "" ? null : await get(`/api/step/${h}`);
  drawStep();
});

$("#follow").addEventListener("change", (e) => {
  if (e.target.checked && S.steps.length) openStep(S.steps[S.steps.length - 1], false);
});
["#f-fail", "#f-equal", "#f-trunc", "#f-tool"].forEach((id) => $(id).addEventListener("change", drawStep));
$("#step-select").addEventListener("change", (e) => { $("#follow").checked = false; openStep(parseInt(e.target.value, 10), false); });
$("#smooth").addEventListener("change", drawTrend);
$("#extra-key").addEventListener("change", (e) => { S.extra = e.target.value; drawTrend(); });

// ------------------------------------------------------------------ sample, token by token
async function openSample(g, i) {
  S.sample = await get(`/api/sample/${g}/${i}`);
  S.sample.__step = g;
  S.sample.__i = i;
  const sel = $("#color-by");
  const n = (S.sample.tokens || []).length;
  const fields = Object.keys(S.sample).filter((k) => k !== "tokens" && k !== "loss_mask" && Array.isArray(S.sample[k]) && S.sample[k].length === n);
  if (!("versions" in S.sample) && n) fields.push("version");
  const keep = sel.value;
  sel.replaceChildren(...fields.map((k) => el("option", { value: k, text: FIELD_NAMES[k] || k })),
    el("option", { value: "loss_mask", text: "loss mask" }));
  if ([...sel.options].some((o) => o.value === keep)) sel.value = keep;
  drawSample();
  showTab("sample");
}

// What the token picker calls a sample's per-token fields (any other is offered under its own name).
const FIELD_NAMES = { logprobs: "sampling logprob", trainer_logprob: "trainer logprob",
  ratio: "ratio (trainer / sampler)", ref_kl: "reference KL", entropy: "entropy", versions: "weight version" };
const LOGPROBS = ["logprobs", "trainer_logprob"];  // coloured as p = exp(logprob)

function scale(t) {  // 0 -> red, 1 -> green
  const h = 120 * Math.max(0, Math.min(1, t));
  return `hsl(${h}, 70%, 78%)`;
}

function drawSample() {
  const s = S.sample;
  if (!s) return;
  $("#sample-title").textContent = `global step ${s.__step}, ${s.id} answer ${s.__i}: task_reward ${fmt(s.task_reward)}, ` +
    `advantage ${fmt(s.seq_reward)}, ${fmt(s.n_tokens)} tokens, version ${fmt(s.version)}${s.no_eos ? ", no eos" : ""}`;
  $("#sample-prompt").textContent = s.prompt || "";
  const box = $("#sample-tokens");
  const toks = s.tokens;
  if (!toks) {
    box.replaceChildren(el("div", { class: "muted", text: "this run's samples have no per-token fields (it ran with " +
      "exp_ctrl.dump_sample_tokens=false, or an areal-kit from before the view); the answer as text:" }), el("div", { text: s.answer || "" }));
    $("#legend").replaceChildren();
    return;
  }
  const field = $("#color-by").value;
  const mask = s.loss_mask || toks.map(() => 1);
  let vals = field === "version" ? toks.map(() => s.version) : field === "loss_mask" ? mask : s[field];
  let lo = Infinity, hi = -Infinity;
  vals.forEach((v) => { if (typeof v === "number") { lo = Math.min(lo, v); hi = Math.max(hi, v); } });
  const norm = LOGPROBS.includes(field) ? (v) => Math.exp(v) : (v) => (hi > lo ? (v - lo) / (hi - lo) : 1);
  const spans = toks.map((t, j) => {
    const v = vals[j];
    const tip = [`token ${JSON.stringify(t)}`];
    if (s.logprobs) tip.push(`logprob ${fmt(s.logprobs[j], 4)} (p ${fmt(Math.exp(s.logprobs[j]))})`);
    tip.push(`version ${s.versions ? s.versions[j] : s.version}`, `loss mask ${mask[j]}`);
    for (const k of Object.keys(s)) if (!["tokens", "logprobs", "versions", "loss_mask"].includes(k) && Array.isArray(s[k]) && s[k].length === toks.length) tip.push(`${k} ${fmt(s[k][j], 4)}`);
    const sp = el("span", { class: "tok" + (mask[j] ? "" : " ctx"), title: tip.join(" | "), "data-mask": String(mask[j]),
      "data-value": String(v) }, t);
    if (mask[j] && typeof v === "number") sp.style.background = scale(norm(v));
    return sp;
  });
  box.replaceChildren(...spans);
  const what = LOGPROBS.includes(field) ? `${FIELD_NAMES[field]}, p = exp(logprob): 0 → 1` : `${FIELD_NAMES[field] || field}: ${fmt(lo)} → ${fmt(hi)}`;
  const sw = el("span", { class: "swatch" });
  sw.style.background = `linear-gradient(to right, ${scale(0)}, ${scale(0.5)}, ${scale(1)})`;
  $("#legend").replaceChildren(el("span", { text: what }), sw,
    el("span", { class: "tok ctx", text: "context (loss mask 0)" }));
  const rows = ["id", "group", "task_reward", "seq_reward", "final_reward", "n_tokens", "version", "no_eos", "turns", "tool_calls"]
    .filter((k) => k in s).map((k) => el("tr", {}, el("td", { class: "key", text: k }), el("td", { text: fmt(s[k], 4) })));
  $("#sample-fields").replaceChildren(...rows);
}
$("#color-by").addEventListener("change", drawSample);

// ------------------------------------------------------------------ time
let timeChart = null;
const SPAN_COLORS = { "wait for the rollout": "#9aa5b1", generate: "#1f77b4", reward: "#17becf", "train step": "#d62728",
  "weight sync": "#2ca02c", eval: "#9467bd", "reference logprobs": "#e377c2", "proximal logprobs": "#8c564b",
  "forward/backward/optimizer": "#d62728" };
async function drawTime() {
  const t = S.trend;
  if (!t || !t.steps.length) { $("#time-title").textContent = "no step yet"; return; }
  const g = S.timeStep ?? S.step ?? t.steps[t.steps.length - 1];
  let i = t.steps.indexOf(g);
  if (i < 0) i = t.steps.length - 1;
  const tl = await get(`/api/timeline/${t.every > 1 ? g : t.steps[i]}`);
  drawPhaseChart(t);
  if (tl.spans.length) { drawSpans(tl, t.series.e2e_time ? t.series.e2e_time[i] : null); return; }
  const at = (k) => (t.series[k] ? t.series[k][i] : null) || 0;
  const starts = { start: 0, train: at("wait_time"), sync: at("wait_time") + at("train_time") };
  const total = Math.max(1e-9, ...PHASES.map(([, k, from]) => starts[from] + at(k)));
  $("#time-title").textContent = `global step ${t.steps[i]}${t.every > 1 ? " (bucket mean)" : ""}: ${fmt(at("e2e_time"), 3)} s end to end; ` +
    "durations the run records, in its loop's order (batch mode generates ahead, during the steps before)";
  const lanes = PHASES.filter(([, k]) => k in t.series).map(([label, k, from], j) => {
    const seg = el("div", { class: "seg", text: `${fmt(at(k), 3)} s` });
    seg.style.left = `${100 * starts[from] / total}%`;
    seg.style.width = `${Math.max(0.3, 100 * at(k) / total)}%`;
    seg.style.background = COLORS[j % COLORS.length];
    return el("div", { class: "lane" }, el("span", { class: "name", text: label }), el("div", { class: "track" }, seg));
  });
  $("#lanes").replaceChildren(...lanes);
  $("#lanes").dataset.kind = "durations";
}

function drawSpans(tl, e2e) {
  // Lanes per process from timeline.jsonl: each span where it ran, in wall-clock time from the step's start.
  const t0 = Math.min(...tl.spans.map((s) => s[2])), t1 = Math.max(...tl.spans.map((s) => s[3]));
  const total = Math.max(1e-6, t1 - t0);
  $("#time-title").textContent = `global step ${tl.step}: ${fmt(total, 3)} s from the first span to the last` +
    (e2e !== null && e2e !== undefined ? ` (${fmt(e2e, 3)} s end to end)` : "") +
    "; lanes per process, as the run recorded them (an engine's spans on its own clock)";
  const lanes = tl.lanes.map((lane) => {
    const track = el("div", { class: "track" });
    for (const [, what, a, b] of tl.spans.filter((s) => s[0] === lane)) {
      const w = 100 * (b - a) / total;
      const seg = el("div", { class: "seg" + (w < 6 ? " thin" : ""), "data-what": what,
        title: `${lane}: ${what}, ${fmt(b - a, 3)} s (+${fmt(a - t0, 3)} s to +${fmt(b - t0, 3)} s)`, text: `${what} ${fmt(b - a, 2)} s` });
      seg.style.left = `${100 * (a - t0) / total}%`;
      seg.style.width = `${Math.max(0.3, w)}%`;
      seg.style.background = SPAN_COLORS[what] || "#ff7f0e";
      track.append(seg);
    }
    return el("div", { class: "lane", "data-lane": lane }, el("span", { class: "name", text: lane }), track);
  });
  const axis = el("div", { id: "time-axis" }, ...[0, 0.25, 0.5, 0.75, 1].map((f) => el("span", { text: `${fmt(f * total, 2)} s` })));
  $("#lanes").replaceChildren(...lanes, axis);
  $("#lanes").dataset.kind = "spans";
}

function drawPhaseChart(t) {
  const keys = PHASES.map(([, k]) => k).filter((k) => k in t.series);
  const box = $("#time-chart");
  if (timeChart) timeChart.destroy();
  timeChart = new uPlot({ title: "phase times per step (s)", ...chartSize(box), scales: { x: { time: false } },
    series: [{ label: "step" }, ...keys.map((k, j) => ({ label: k, stroke: COLORS[j % COLORS.length], spanGaps: true }))] },
  [t.steps, ...keys.map((k) => t.series[k])], box);
  onPick(box, timeChart, (j) => { S.timeStep = t.steps[j]; drawTime(); }, t.steps.length);
}
$("#slowest").addEventListener("click", () => {
  const t = S.trend, e = t && t.series.e2e_time;
  if (!e) return;
  let best = 0;
  e.forEach((v, j) => { if (v !== null && v > (e[best] ?? -1)) best = j; });
  S.timeStep = t.steps[best];
  drawTime();
});

// ------------------------------------------------------------------ run
async function loadRun() {
  const r = await get("/api/run");
  $("#run-summary").textContent = r.summary.join("\n");
  $("#driver").textContent = JSON.stringify(r.driver, null, 1);
  $("#config-note").textContent = r.config_note;
  $("#config-origin").textContent = r.preset ? `preset ${r.preset}` +
    (r.overrides && r.overrides.length ? `, overrides: ${r.overrides.join(" ")}` : ", no overrides") : "";
  S.config = r.options || [];
  drawConfig();
  const ev = r.events || [];
  $("#events").replaceChildren(el("tr", {}, ...["when", "what", ""].map((h) => el("th", { text: h }))),
    ...(ev.length ? ev.map((e) => el("tr", { class: `ev ev-${e.kind.split(" ")[0]}`, "data-kind": e.kind },
      el("td", { class: "muted", text: e.time ? new Date(e.time * 1000).toLocaleString() : "" }),
      el("td", { class: "key", text: e.kind }), el("td", { text: e.text })))
      : [el("tr", {}, el("td", { class: "muted", text: "no train.log lines of launches yet" }))]));
  const c = r.checkpoints || {};
  const rows = [];
  if (c.error) rows.push(el("tr", {}, el("td", { class: "muted", text: c.error })));
  for (const k of c.recover || []) {
    rows.push(el("tr", { class: "ckpt", "data-kind": "recover" }, el("td", { class: "key", text: `recover, global step ${k.global_step}` }),
      el("td", { text: `${k.written} · ${(k.bytes / 1e6).toFixed(1)} MB` }), el("td", { class: "muted", text: k.path })));
  }
  for (const k of c.saves || []) {
    rows.push(el("tr", { class: "ckpt", "data-kind": "save" }, el("td", { class: "key", text: `model save, global step ${k.global_step}` }),
      el("td", { text: "" }), el("td", { class: "muted", text: k.path })));
  }
  for (const p of c.set_aside || []) {
    rows.push(el("tr", {}, el("td", { class: "key", text: "set aside by a fresh start" }), el("td", { text: "" }),
      el("td", { class: "muted", text: p })));
  }
  if (!rows.length) rows.push(el("tr", {}, el("td", { class: "muted", text: `none yet (recover: ${c.recover_dir || "?"}, saves: ${c.ckpt_dir || "?"})` })));
  $("#ckpts").replaceChildren(...rows);
}
function drawConfig() {
  const q = $("#config-filter").value.trim(), show = $("#config-show").value;
  const rows = (S.config || []).filter((o) => (!q || o.key.includes(q)) &&
    (!show || (show === "changed" ? o.changed : o.source === show)))
    .map((o) => {
      const said = "preset" in o && o.source === "override" ? `; the preset said ${JSON.stringify(o.preset)}` :
        "preset" in o && typeof o.preset === "string" && o.preset.includes("${") ? ` (${o.preset})` : "";
      return el("tr", { class: (o.changed ? "changed " : "") + `src-${o.source}`, title: o.help, "data-source": o.source },
        el("td", { class: "key", text: o.key }),
        el("td", { class: "value", text: JSON.stringify(o.value) }),
        el("td", { class: "src", text: o.source }),
        el("td", { class: "muted", text: (o.changed ? `default ${JSON.stringify(o.default)}` : "default") + said }));
    });
  $("#config").replaceChildren(el("tr", {}, ...["option", "value", "from", ""].map((h) => el("th", { text: h }))), ...rows);
}
$("#config-filter").addEventListener("input", drawConfig);
$("#config-show").addEventListener("change", drawConfig);

poll();
setInterval(poll, 2000);
