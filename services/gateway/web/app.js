// rankscope web timeline: one swimlane per rank, grouped by instance; phase segments over
// time, a memory sparkline per rank, findings on the lanes they name, placement bars.
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

const LANE = 34, LABEL = 220, SPARK = 12;
const canvas = document.getElementById("lanes");
const ctx = canvas.getContext("2d");
let view = { lanes: [], start: 0, end: 1, findings: [] };

const seconds = (at) => Date.parse(at) / 1000;

async function json(path) {
  const reply = await fetch(path);
  if (!reply.ok) throw new Error(`${path}: ${reply.status} ${(await reply.json()).detail || ""}`);
  return reply.json();
}

function legend() {
  document.getElementById("legend").innerHTML = PHASES.map((p) =>
    `<span><span class="swatch" style="background:${COLORS[p]}"></span>${p}</span>`).join("");
}

// what a runner's lane lacks: history evicted before it was read, seqs that never came
function gaps(held) {
  if (!held) return "";
  const notes = [];
  if (held.firstSeq > 0) {
    const from = held.oldestAt ? new Date(held.oldestAt).toLocaleTimeString() : "?";
    notes.push(`history from ${from} (seq ${held.firstSeq})`);
  }
  if (held.missingSeqs) notes.push(`${held.missingSeqs} seqs lost`);
  if (held.unseenSeqs) notes.push(`${held.unseenSeqs} acknowledged seqs not received`);
  if (held.evictedEntries) notes.push(`${held.evictedEntries} entries evicted`);
  return notes.length ? ` · ${notes.join(", ")}` : "";
}

function build(timeline, findings, history) {
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
  const runners = [...timeline.runners].sort((a, b) =>
    a.instanceId.localeCompare(b.instanceId) || a.deviceRank - b.deviceRank);
  const lanes = runners.map((runner) => {
    const entries = byRunner.get(runner.runnerId) || [];
    const segments = entries.map((e, i) => ({
      entry: e, from: seconds(e.at),
      to: i + 1 < entries.length ? seconds(entries[i + 1].at) : now,
    }));
    const memory = entries.filter((e) => e.mlxMemory && e.mlxMemory.active)
      .map((e) => [seconds(e.at), e.mlxMemory.active.inBytes]);
    return {
      runner, segments, memory, finding: culprits.get(runner.runnerId),
      gaps: gaps(held.get(runner.runnerId)),
    };
  });
  return { lanes, start, end: now, findings };
}

function draw() {
  const width = canvas.clientWidth;
  const height = Math.max(view.lanes.length * LANE + 30, 120);
  const ratio = window.devicePixelRatio || 1;
  canvas.width = width * ratio; canvas.height = height * ratio; canvas.style.height = `${height}px`;
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const span = Math.max(view.end - view.start, 1e-3);
  const x = (t) => LABEL + ((t - view.start) / span) * (width - LABEL - 10);
  ctx.font = "12px system-ui"; ctx.textBaseline = "middle";
  let instance = null;
  view.lanes.forEach((lane, row) => {
    const y = row * LANE + 20;
    if (lane.runner.instanceId !== instance) {
      instance = lane.runner.instanceId;
      ctx.fillStyle = "#8a93a5"; ctx.fillText(`instance ${instance}`, 4, y - 8);
    }
    if (lane.finding) { ctx.fillStyle = "rgba(255,60,60,.18)"; ctx.fillRect(0, y, width, LANE - 6); }
    ctx.fillStyle = lane.finding ? "#ff5c5c" : "#d8dee9";
    ctx.fillText(`rank ${lane.runner.deviceRank} · ${lane.runner.nodeId} · ${lane.runner.phase}${lane.gaps}`, 4, y + 10);
    for (const s of lane.segments) {
      if (s.to < view.start) continue;
      const from = Math.max(x(s.from), LABEL), to = Math.max(x(s.to), from + 1);
      ctx.fillStyle = COLORS[s.entry.phase] || "#777";
      ctx.fillRect(from, y + 2, to - from, LANE - 14 - SPARK / 2);
    }
    if (lane.memory.length > 1) {
      const peak = Math.max(...lane.memory.map((m) => m[1])) || 1;
      ctx.strokeStyle = "#58d68d"; ctx.beginPath();
      lane.memory.forEach(([t, bytes], i) => {
        const px = Math.max(x(t), LABEL), py = y + LANE - 8 - (bytes / peak) * SPARK;
        if (i === 0) ctx.moveTo(px, py); else ctx.lineTo(px, py);
      });
      ctx.stroke();
    }
  });
}

function showFindings(findings) {
  document.getElementById("findings").innerHTML = findings.map((f) =>
    `<div class="finding"><b>${f.kind.replace("_", " ")}</b>instance ${f.instanceId}: ${escape(f.summary)}</div>`).join("");
}

function showPlacement(placement) {
  const byInstance = new Map();
  for (const p of placement) {
    const instance = p.runnerId.replace(/-a\d+-r\d+$/, "");
    if (!byInstance.has(instance)) byInstance.set(instance, []);
    byInstance.get(instance).push(p);
  }
  document.getElementById("placement").innerHTML = [...byInstance].map(([instance, ranks]) => {
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
  const row = Math.floor((event.clientY - rect.top - 20) / LANE);
  const lane = view.lanes[row];
  if (!lane) return;
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
    const fetched = performance.now();
    view = build(timeline, diagnosis.findings, history);
    showFindings(diagnosis.findings);
    showPlacement(placement);
    draw();
    const drawn = performance.now();
    const lost = timeline.unreachableNodes.map((u) => `${u.nodeId}: ${u.error}`).join("; ");
    document.getElementById("status").textContent =
      `${timeline.runners.length} ranks · ${timeline.timeline.length} entries · ` +
      `fetched in ${Math.round(fetched - started)} ms, drawn in ${Math.round(drawn - fetched)} ms · ` +
      new Date().toLocaleTimeString() +
      (lost ? ` · unreachable: ${lost}` : "");
  } catch (error) {
    document.getElementById("status").textContent = `error: ${error.message}`;
  }
}

legend();
window.addEventListener("resize", draw);
document.getElementById("window").addEventListener("change", refresh);
refresh();
setInterval(() => { if (document.getElementById("live").checked) refresh(); }, 1000);
