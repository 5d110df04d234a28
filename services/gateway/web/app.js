// rankscope web timeline: one swimlane per rank, grouped by instance and incarnation
// (ended incarnations folded into one row); phase segments over a time axis, each rank's
// MLX memory (active, peak, cache) and work per step (a heat strip) on the same axis,
// open findings with the culprit
// first, past incidents as bands and as a list to open, placement bars. Every time is
// UTC, labelled Z; how long ago is computed when drawn.
"use strict";

const PHASES = ["created", "idle", "connect_group", "load_model", "warmup", "task_submission",
  "task_agreement", "prompt_build", "vision_preprocess", "kv_cache_lookup", "prefill_barrier",
  "prefill_pipeline", "prefill_stream", "decode_barrier", "decode_wait_first_token",
  "decode_stream", "parser", "cancel_requested", "cancel_observed", "completion", "error",
  "shutdown_cleanup"];
const COLORS = {};
PHASES.forEach((phase, i) => { COLORS[phase] = `hsl(${(i * 137.5) % 360} 60% 55%)`; });
COLORS.idle = "#3a4150"; COLORS.error = "#ff3b3b"; COLORS.decode_stream = "#4aa3ff";
COLORS.prefill_pipeline = "#b084ff";

// a recorded job's lanes (`rankscope record`) tell what the program did, not a runner's phases
const RECORDED = { group_ready: "hsl(137 60% 55%)", steps: "#4aa3ff", collective_resumed: "#4aa3ff",
  collective_done: "#4aa3ff", collective_wait: "#ffb347", program_exit: "#3a4150" };
const LANE = 30, LABEL = 330, AXIS = 26, MEMORY_ROW = 46, PACE_ROW = 18, WAIT_FRAMES = 4;
const MEMORY = { active: "#58d68d", peak: "#ffb347", cache: "#7fb3ff" };
const canvas = document.getElementById("lanes");
const ctx = canvas.getContext("2d");
const memoryCanvas = document.getElementById("memory");
const memoryCtx = memoryCanvas.getContext("2d");
const paceCanvas = document.getElementById("pace");
const paceCtx = paceCanvas.getContext("2d");
let view = { lanes: [], start: 0, end: 1, findings: [], incidents: [] };
let incidents = [];
let memory = [];
let pace = [];
let waitedOn = new Map();  // runnerId -> its history's waitedOn and lastArrival
let refreshes = 0;
const unfolded = new Set();  // ended incarnations the operator opened

// UTC, labelled: the CLI and the logs say the same
const clock = (t) => `${new Date(t * 1000).toISOString().slice(11, 19)}Z`;
function ago(t) {
  const s = Math.max(0, Math.round(Date.now() / 1000 - t));
  return s < 120 ? `${s}s ago` : s < 7200 ? `${Math.round(s / 60)}m ago` : `${Math.round(s / 3600)}h ago`;
}
const when = (at) => `${clock(seconds(at))} (${ago(seconds(at))})`;
function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(n < 10 && i ? 1 : 0)} ${units[i]}`;
}
// a runner id ends in -a<attempt>-r<rank> (rankscope's runners) or -<run>-<rank> (a recorded
// job's ranks): the attempt, or the run, is the instance's incarnation
function incarnation(runnerId) {
  const attempt = runnerId.match(/-(a\d+)-r\d+$/);
  if (attempt) return attempt[1];
  const run = runnerId.match(/-(\d+)-\d+$/);
  return run ? `run ${run[1]}` : "";
}

const seconds = (at) => Date.parse(at) / 1000;

// the API token, when reads need one: from the address's fragment (#token=..., never
// sent to the server), else asked for once; kept for this tab only
let token = sessionStorage.getItem("rankscope-token");
let asked = false;
const given = new URLSearchParams(location.hash.slice(1)).get("token");
if (given) {
  token = given;
  sessionStorage.setItem("rankscope-token", given);
  history.replaceState(null, "", location.pathname + location.search);
}

async function json(path) {
  const reply = await fetch(path, { headers: token ? { Authorization: `Bearer ${token}` } : {} });
  if ((reply.status === 401 || reply.status === 403) && !asked) {
    asked = true;
    const typed = window.prompt("This gateway needs its API token (RANKSCOPE_API_TOKEN) for reads:");
    if (typed) {
      token = typed;
      sessionStorage.setItem("rankscope-token", typed);
      asked = false;
      return json(path);
    }
  }
  if (!reply.ok) throw new Error(`${path}: ${reply.status} ${(await reply.json()).detail || ""}`);
  return reply.json();
}

function legend() {
  const swatch = (color, text, style = "") =>
    `<span><span class="swatch" style="background:${color};${style}"></span>${text}</span>`;
  document.getElementById("legend").innerHTML =
    `<span class="legend-title">phases</span>` + PHASES.map((p) => swatch(COLORS[p], p)).join("") +
    `<span class="legend-title">marks</span>` +
    swatch("rgba(255,60,60,.5)", "incident: the lane of its culprit") +
    swatch("rgba(255,180,70,.3)", "incident: a rank waiting on it") +
    swatch(COLORS.idle, "faded: its last phase, said before the window and held since", "opacity:.35") +
    `<span class="legend-title">recorded jobs</span>` +
    swatch(RECORDED.group_ready, "joined its group") + swatch(RECORDED.steps, "stepping (collectives issued)") +
    swatch(RECORDED.collective_wait, "waiting in a collective") + swatch(RECORDED.program_exit, "ended") +
    `<span class="legend-title">memory</span>` +
    swatch(MEMORY.active, "active") + swatch(MEMORY.peak, "peak") + swatch(MEMORY.cache, "cache");
}

// what a runner's lane lacks: history evicted before it was read, seqs that never came
function gaps(held) {
  if (!held) return "";
  const notes = [];
  if (held.firstSeq > 0) {
    const from = held.oldestAt ? clock(seconds(held.oldestAt)) : "?";
    notes.push(`history from ${from} (seq ${held.firstSeq})`);
  }
  if (held.missingSeqs) notes.push(`${held.missingSeqs} seqs lost`);
  if (held.unseenSeqs) notes.push(`${held.unseenSeqs} acknowledged seqs not received`);
  if (held.evictedEntries) notes.push(`${held.evictedEntries} entries evicted`);
  return notes.length ? ` · ${notes.join(", ")}` : "";
}

function build(timeline, findings, history, past, placed) {
  const windowSeconds = Number(document.getElementById("window").value);
  const now = seconds(timeline.generatedAt);
  const start = now - windowSeconds;
  const byRunner = new Map();
  for (const entry of timeline.timeline) {
    if (!byRunner.has(entry.runnerId)) byRunner.set(entry.runnerId, []);
    byRunner.get(entry.runnerId).push(entry);
  }
  const held = new Map(history.map((h) => [h.runnerId, h]));
  const culprits = new Map();
  for (const f of findings) for (const id of f.culpritRunnerIds) culprits.set(id, f);
  const live = new Set(placed.map((p) => p.runnerId));
  const runners = [...timeline.runners].sort((a, b) =>
    a.instanceId.localeCompare(b.instanceId) ||
    incarnation(b.runnerId).localeCompare(incarnation(a.runnerId), undefined, { numeric: true }) ||
    a.deviceRank - b.deviceRank);
  const lanes = [];
  for (const runner of runners) {
    const group = `${runner.instanceId} ${incarnation(runner.runnerId)}`;
    const ended = !live.has(runner.runnerId);
    if (ended && !unfolded.has(group)) {
      const folded = lanes.find((l) => l.folded && l.group === group);
      if (folded) { folded.ranks += 1; continue; }
      lanes.push({ folded: true, group, runner, ranks: 1, segments: [] });
      continue;
    }
    const entries = byRunner.get(runner.runnerId) || [];
    const segments = entries.map((e, i) => ({
      entry: e, from: seconds(e.at),
      to: i + 1 < entries.length ? seconds(entries[i + 1].at) : now,
    }));
    const finding = culprits.get(runner.runnerId);
    const last = runner.lastProgressAt ? seconds(runner.lastProgressAt) : null;
    // silent: named as frozen, or nothing said within the window at all
    const silent = last !== null && ((finding && finding.kind === "stalled_rank") || last < start)
      ? ` · no progress since ${clock(last)}` : "";
    lanes.push({
      group, ended, runner, segments, finding, silent,
      gaps: gaps(held.get(runner.runnerId)),
    });
  }
  const byIncident = new Map(past.map((f) => [f.incidentId || `${f.instanceId} ${f.kind} ${f.since}`, f]));
  const bands = [...byIncident.values()].map((f) => ({
    finding: f, from: seconds(f.since), to: f.clearedAt ? seconds(f.clearedAt) : now,
  })).filter((b) => b.to >= start);
  return { lanes, start, end: now, findings, incidents: bands };
}

function axis(width, height, x) {
  const span = view.end - view.start;
  const step = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600]
    .find((s) => span / s <= 8) || 3600;
  ctx.fillStyle = "#8a93a5"; ctx.strokeStyle = "#262b35";
  for (let t = Math.ceil(view.start / step) * step; t <= view.end; t += step) {
    const px = x(t);
    ctx.beginPath(); ctx.moveTo(px, AXIS - 6); ctx.lineTo(px, height); ctx.stroke();
    ctx.fillText(clock(t), px - 24, 10);
  }
}

// what a rank does now: a runner's phase, or a recorded rank's own words (its newest entry)
const doing = (runner) => runner.recorded ? (runner.phaseDetail || "joined its group") : runner.phase;
const colorOf = (entry, runner) =>
  (runner.recorded ? RECORDED[entry.event] : COLORS[entry.phase]) || COLORS[entry.phase] || "#777";
const instanceWord = (runner) => runner.recorded ? "job" : "instance";

function label(lane) {
  const runner = lane.runner;
  if (lane.folded) return `${instanceWord(runner)} ${runner.instanceId} ${incarnation(runner.runnerId)}: ${lane.ranks} ranks, ended`;
  return `rank ${runner.deviceRank} · ${runner.nodeId} · ${doing(runner)}${lane.silent}${lane.gaps}`;
}

function draw() {
  // the lanes in words too, for screen readers (and anything else that cannot see a canvas)
  canvas.textContent = view.lanes.map(label).join("\n");
  const width = canvas.clientWidth;
  const height = Math.max(view.lanes.length * LANE + AXIS + 10, 120);
  const ratio = window.devicePixelRatio || 1;
  canvas.width = width * ratio; canvas.height = height * ratio; canvas.style.height = `${height}px`;
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const span = Math.max(view.end - view.start, 1e-3);
  const x = (t) => LABEL + ((t - view.start) / span) * (width - LABEL - 10);
  ctx.font = "12px system-ui"; ctx.textBaseline = "middle";
  axis(width, height, x);
  let group = null;
  view.lanes.forEach((lane, row) => {
    const y = row * LANE + AXIS + 10;
    if (lane.group !== group) {
      group = lane.group;
      ctx.fillStyle = "#8a93a5";
      const runner = lane.runner;
      ctx.fillText(`${instanceWord(runner)} ${runner.instanceId} · ${incarnation(runner.runnerId)}` +
        (runner.recorded ? " (recorded)" : "") + (lane.ended ? " (ended)" : ""), 4, y - 8);
    }
    for (const band of view.incidents) {  // past and open incidents of this instance
      if (band.finding.instanceId !== lane.runner.instanceId) continue;
      const named = band.finding.culpritRunnerIds.includes(lane.runner.runnerId);
      const from = Math.max(x(band.from), LABEL), to = Math.max(x(band.to), from + 2);
      ctx.fillStyle = named ? "rgba(255,60,60,.28)" : "rgba(255,180,70,.10)";
      ctx.fillRect(from, y - 2, to - from, LANE - 4);
    }
    if (lane.folded) {
      ctx.fillStyle = "#6b7384";
      ctx.fillText(`▸ ${lane.ranks} rank${lane.ranks > 1 ? "s" : ""} of an ended incarnation (click to open)`, 4, y + 10);
      return;
    }
    if (lane.finding) { ctx.fillStyle = "rgba(255,60,60,.18)"; ctx.fillRect(0, y, LABEL - 4, LANE - 6); }
    ctx.fillStyle = lane.finding ? "#ff5c5c" : (lane.ended ? "#6b7384" : "#d8dee9");
    ctx.fillText(label(lane), 4, y + 10);
    if (!lane.segments.length && lane.silent) {  // its last word left the window: its phase since
      ctx.fillStyle = COLORS[lane.runner.phase] || "#777"; ctx.globalAlpha = 0.35;
      ctx.fillRect(LABEL, y + 2, x(view.end) - LABEL, LANE - 10);
      ctx.globalAlpha = 1;
    }
    for (const s of lane.segments) {
      if (s.to < view.start) continue;
      const from = Math.max(x(s.from), LABEL), to = Math.max(x(s.to), from + 1);
      ctx.fillStyle = colorOf(s.entry, lane.runner);
      ctx.fillRect(from, y + 2, to - from, LANE - 10);
    }
  });
  drawMemory(width, x);
  drawPace(width, x);
}

// a canvas sized to `rows` rows of `row` pixels, cleared, its context ready to draw in;
// with no rows, `empty` said on it instead (and null)
function sized(target, context, width, rows, row, empty) {
  const height = Math.max(rows * row + 8, 40);
  const ratio = window.devicePixelRatio || 1;
  target.width = width * ratio; target.height = height * ratio;
  target.style.height = `${height}px`;
  context.setTransform(ratio, 0, 0, ratio, 0, 0);
  context.clearRect(0, 0, width, height);
  context.font = "12px system-ui"; context.textBaseline = "middle";
  if (rows) return context;
  context.fillStyle = "#8a93a5"; context.fillText(empty, 4, 20);
  target.textContent = empty;
  return null;
}

// each rank's work per sampled step on the lanes' time axis, one row per rank, colored by
// how far it strays from its own median: green within 1.25× (what a busy machine's noise
// does to a healthy rank), red at 2× or more. Ranks differ by design, so each is held to
// itself; a rank that turns slow turns red while its peers stay green (they wait longer,
// they do not work longer). Where a job's ranks sample the same steps, each row says how
// much of the job's time is spent waiting for that rank: the straggler's stands out
function drawPace(width, x) {
  const rows = pace.filter((p) => p.points.length);
  const c = sized(paceCanvas, paceCtx, width, rows.length, PACE_ROW, "no decode steps in this window");
  if (!c) return;
  const said = [];
  rows.forEach((series, row) => {
    const y = row * PACE_ROW + 4, works = series.points.map((p) => p.workMs).sort((a, b) => a - b);
    const median = works[Math.floor(works.length / 2)] || works[0];
    const last = series.points[series.points.length - 1];
    const waits = waitedOn.get(series.runnerId);
    const words = `${series.instanceId} rank ${series.deviceRank} · ${series.nodeId}: ` +
      `${last.workMs.toFixed(2)} ms work, ${last.waitMs.toFixed(2)} ms wait a step` +
      (waits && waits.layers
        ? ` · the pipeline loses ${Math.round(100 * waits.waitedOn)}% of its work a step to it, ` +
          `the most per layer in ${Math.round(100 * waits.lastArrival)}% of the span`
        : waits ? ` · the job loses ${Math.round(100 * waits.waitedOn)}% of its time waiting for it, ` +
          `last in ${Math.round(100 * waits.lastArrival)}% of steps` : "");
    said.push(words);
    c.fillStyle = "#d8dee9"; c.fillText(words, 4, y + PACE_ROW / 2 - 2);
    const points = series.points.filter((p) => seconds(p.at) >= view.start);
    points.forEach((point, i) => {
      const from = x(seconds(point.at));
      const to = i + 1 < points.length ? x(seconds(points[i + 1].at)) : from + 3;
      const slower = Math.min(Math.max((point.workMs / median - 1.25) / 0.75, 0), 1);
      c.fillStyle = `hsl(${120 - 120 * slower} 70% ${45 + 10 * slower}%)`;
      c.fillRect(from, y, Math.max(to - from, 2), PACE_ROW - 4);
    });
  });
  paceCanvas.textContent = said.join("\n");
}

// each rank's MLX memory on the lanes' time axis, one row per rank, scaled to the
// highest peak of all: who holds how much, and since when
function drawMemory(width, x) {
  const rows = memory.filter((m) => m.samples.length);
  const c = sized(memoryCanvas, memoryCtx, width, rows.length, MEMORY_ROW, "no memory samples in this window");
  if (!c) return;
  const top = Math.max(...rows.flatMap((m) => m.samples.map((p) => Math.max(p.peak || 0, p.active || 0, p.cache || 0)))) || 1;
  const said = [];
  rows.forEach((series, row) => {
    const y = row * MEMORY_ROW + 4, last = series.samples[series.samples.length - 1];
    const words = `rank ${series.deviceRank} · ${series.nodeId}: active ${bytes(last.active || 0)}, ` +
      `peak ${bytes(last.peak || 0)}, cache ${bytes(last.cache || 0)}`;
    said.push(`${series.instanceId} ${words}`);
    c.fillStyle = "#d8dee9";
    c.fillText(`${series.instanceId} rank ${series.deviceRank} · ${series.nodeId}`, 4, y + 10);
    c.fillStyle = "#8a93a5";
    c.fillText(`${bytes(last.active || 0)} active`, 4, y + 24);
    c.fillText(`${bytes(last.peak || 0)} peak · ${bytes(last.cache || 0)} cache`, 4, y + 37);
    c.strokeStyle = "#262b35"; c.strokeRect(LABEL, y, width - LABEL - 10, MEMORY_ROW - 6);
    for (const kind of ["cache", "peak", "active"]) {
      c.strokeStyle = MEMORY[kind]; c.lineWidth = kind === "active" ? 2 : 1; c.beginPath();
      let started = false;
      for (const point of series.samples) {
        if (point[kind] === null || point[kind] === undefined) continue;
        const t = seconds(point.at);
        if (t < view.start) continue;
        const px = x(t), py = y + MEMORY_ROW - 8 - (point[kind] / top) * (MEMORY_ROW - 12);
        if (started) c.lineTo(px, py); else { c.moveTo(px, py); started = true; }
      }
      c.stroke();
    }
    c.lineWidth = 1;
  });
  c.fillStyle = "#8a93a5"; c.fillText(`scale: ${bytes(top)}`, width - 90, 10);
  memoryCanvas.textContent = said.join("\n");
}

// the innermost frames of a stack's first thread (the main one): where the rank waits
function waitsIn(stack) {
  const lines = stack.trim().split("\n\n")[0].split("\n");
  const cut = lines.slice(0, WAIT_FRAMES + 1);
  return cut.join("\n") + (lines.length > cut.length ? `\n  … ${lines.length - cut.length} more frames` : "");
}

function evidence(rank, culprit) {
  const said = ["phase", "step", "waitingIn", "gaveUp", "exitReason", "process"]
    .filter((k) => rank[k] !== null && rank[k] !== undefined)
    .map((k) => `${k} ${escape(rank[k])}`)
    .concat(rank.pace && rank.pace.waitedOn != null && rank.pace.layers
      ? [`the pipeline loses ${Math.round(100 * rank.pace.waitedOn)}% of its work a step to it, ` +
        `the most per layer in ${Math.round(100 * rank.pace.lastArrival)}% of the span, ` +
        `work per layer ${rank.pace.workVsPeers.toFixed(2)}× its peers'`]
      : rank.pace && rank.pace.waitedOn != null
      ? [`the job loses ${Math.round(100 * rank.pace.waitedOn)}% of its time waiting for it, last in ` +
        `${Math.round(100 * rank.pace.lastArrival)}% of steps, ` +
        `work ${rank.pace.workVsPeers.toFixed(2)}× its peers'`] : [])
    .join(" · ");
  const stack = rank.stack
    ? `<pre>${escape(waitsIn(rank.stack))}</pre><details class="full"><summary>full stack, every thread</summary><pre>${escape(rank.stack)}</pre></details>`
    : culprit ? `<p class="why">${escape(noStack(rank))}</p>` : "";
  const role = culprit ? "culprit" : "waiting";
  return `<details class="${role}"${culprit ? " open" : ""}><summary><span class="role">${role}</span> ` +
    `rank ${rank.deviceRank} ${escape(rank.nodeId)}: ${said || "no data"}</summary>${stack}</details>`;
}

// why a culprit shows no stack or memory: what the capture could see of it
function noStack(rank) {
  if (rank.process === "stopped") return "no stack or memory: its process is stopped (SIGSTOP or a debugger) and runs no code, not even to write them; continue it (kill -CONT) to see where it was";
  if (rank.process === "gone" || rank.processAlive === false) return "no stack or memory: its process has ended";
  if (!rank.capturedAt) return "no stack or memory yet: its node has not answered the capture (asked as the incident opened; at most 5 s)";
  return "no stack: its node captured none (the process did not answer the stack signal in time)";
}

// the culprits and their evidence first, open; the ranks waiting on them after, closed
function evidenceOf(finding) {
  const ranks = finding.evidence || [];
  const culprits = new Set(finding.culpritRunnerIds);
  return [...ranks.filter((r) => culprits.has(r.runnerId)).map((r) => evidence(r, true)),
    ...ranks.filter((r) => !culprits.has(r.runnerId)).map((r) => evidence(r, false))].join("");
}

function headline(f) {
  const where = f.instanceId ? `instance ${escape(f.instanceId)}` : "installation";
  const culprits = f.culpritRanks.length ? ` · culprit rank ${f.culpritRanks.join(", ")}` : "";
  return `<b>${f.kind.replaceAll("_", " ")}</b>${where}${culprits} · since ${when(f.since)}`;
}

function showFindings(findings) {
  document.getElementById("findings").innerHTML = findings.map((f) =>
    `<div class="finding">${headline(f)}<div class="summary">${escape(f.summary)}</div>` +
    `${evidenceOf(f)}</div>`).join("");
}

// how long an incident was seen open: the time rankscope did not watch it left out
function watched(f) {
  const total = seconds(f.clearedAt) - seconds(f.since);
  if (!f.unwatchedSince) return Math.round(total);
  const back = f.unwatchedUntil ? seconds(f.unwatchedUntil) : seconds(f.clearedAt);
  return Math.round(total - Math.max(back - seconds(f.unwatchedSince), 0));
}

// past incidents, newest first, each opening to its last word and evidence
function showIncidents(past) {
  const shown = [...past].reverse().slice(0, 20);
  document.getElementById("incidents").innerHTML = shown.length
    ? `<h2>incidents (${past.length})</h2>` + shown.map((f) => {
      const end = (f.open === false ? `cleared ${when(f.clearedAt)}, after ${watched(f)}s` : "open") +
        (f.unwatchedSince ? ` · not watched ${clock(seconds(f.unwatchedSince))}–${f.unwatchedUntil ? clock(seconds(f.unwatchedUntil)) : "now"} (rankscope stopped)` : "");
      const seen = f.seenBefore
        ? ` · <b class="seen">seen ${f.seenBefore.count}× before</b>, first ${when(f.seenBefore.first)}`
        : "";
      return `<details class="incident"><summary>${headline(f)} · ${end}${seen}</summary>` +
        `<div class="summary">${escape(f.summary)}</div>${evidenceOf(f)}</details>`;
    }).join("")
    : "<h2>incidents</h2><p>none in the diagnosis stream</p>";
}

function showPlacement(placement, recorded) {
  const byInstance = new Map();
  for (const p of placement) {
    const instance = p.instanceId || p.runnerId.replace(/-a\d+-r\d+$/, "");
    if (!byInstance.has(instance)) byInstance.set(instance, []);
    byInstance.get(instance).push(p);
  }
  document.getElementById("placement").innerHTML = [...byInstance].map(([instance, ranks]) => {
    if (recorded.has(instance)) {  // a program's ranks hold no layers rankscope placed
      const nodes = [...new Set(ranks.map((r) => r.nodeId))].join(", ");
      return `<span class="bar-label">job ${escape(instance)} (recorded): ${ranks.length} ranks on ${escape(nodes)}</span>`;
    }
    const cells = ranks.map((r) => `<div style="flex:${r.endLayer - r.startLayer};background:hsl(${r.deviceRank * 67} 45% 35%)"
      title="${r.nodeId}: layers [${r.startLayer}, ${r.endLayer})">${r.nodeId} [${r.startLayer}, ${r.endLayer})</div>`).join("");
    return `<span class="bar-label">${instance}: ${ranks[0].nLayers} layers</span><div class="bar">${cells}</div>`;
  }).join("");
}

function escape(text) {
  return String(text).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
}

canvas.addEventListener("click", (event) => {
  const rect = canvas.getBoundingClientRect();
  const row = Math.floor((event.clientY - rect.top - AXIS - 10) / LANE);
  const lane = view.lanes[row];
  if (!lane) return;
  if (lane.folded || (lane.ended && event.clientX - rect.left < LABEL)) {
    if (unfolded.has(lane.group)) unfolded.delete(lane.group); else unfolded.add(lane.group);
    refresh();
    return;
  }
  const span = Math.max(view.end - view.start, 1e-3);
  const t = view.start + ((event.clientX - rect.left - LABEL) / (canvas.clientWidth - LABEL - 10)) * span;
  const hit = lane.segments.find((s) => s.from <= t && t <= s.to);
  if (hit) document.getElementById("detail").innerHTML = `<pre>${escape(JSON.stringify(hit.entry, null, 2))}</pre>`;
});

async function refresh() {
  const started = performance.now();
  try {
    const windowSeconds = Number(document.getElementById("window").value);
    const since = new Date(Date.now() - windowSeconds * 1000).toISOString();
    const [timeline, diagnosis, placement, history] = await Promise.all([
      json(`/v1/cluster/timeline?limit=50000&since=${encodeURIComponent(since)}`),
      json("/v1/cluster/diagnosis"), json("/v1/placement/runners"), json("/v1/cluster/history")]);
    if (refreshes++ % 5 === 0) {  // past incidents and memory change slowly: every fifth refresh
      const [past, held, paced] = await Promise.all([
        json("/v1/cluster/diagnosis/history?limit=200"),
        json(`/v1/cluster/memory?since=${encodeURIComponent(since)}&points=300`),
        json(`/v1/cluster/pace?since=${encodeURIComponent(since)}&points=150`)]);
      incidents = past.findings;
      memory = held.runners;
      pace = paced.runners;
      showIncidents(incidents);
    }
    const fetched = performance.now();
    view = build(timeline, diagnosis.findings, history, [...incidents, ...diagnosis.findings], placement);
    waitedOn = new Map(history.filter((h) => h.waitedOn != null).map((h) => [h.runnerId, h]));
    showFindings(diagnosis.findings);
    showPlacement(placement, new Set(timeline.runners.filter((r) => r.recorded).map((r) => r.instanceId)));
    draw();
    const drawn = performance.now();
    const lost = timeline.unreachableNodes.map((u) => `${u.nodeId}: ${u.error}`).join("; ");
    const partial = (timeline.missingPartitions || []).map((m) => `${m.partition}: ${m.reason}`).join("; ");
    document.getElementById("status").textContent =
      `${timeline.runners.length} ranks · ${timeline.timeline.length} entries · ` +
      `fetched in ${Math.round(fetched - started)} ms, drawn in ${Math.round(drawn - fetched)} ms · ` +
      clock(Date.now() / 1000) +
      (lost ? ` · unreachable: ${lost}` : "") +
      (partial ? ` · partial, partitions missing: ${partial}` : "");
  } catch (error) {
    document.getElementById("status").textContent = `error: ${error.message}`;
  }
}

legend();
window.addEventListener("resize", draw);
document.getElementById("window").addEventListener("change", () => { refreshes = 0; refresh(); });
refresh();
setInterval(() => { if (document.getElementById("live").checked) refresh(); }, 1000);
