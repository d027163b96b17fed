// kiln status page: polls /api/status and redraws. Every string from the topics goes through textContent.
"use strict";

const KEEP_UP_MINUTES = 5; // Cm, the autoscaler's default: a queue that takes longer to drain is "behind"

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function fmt(v, digits = 1) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  return Number.isInteger(v) ? String(v) : v.toFixed(digits);
}

function seconds(v) {
  if (v === null || v === undefined) return "–";
  return v < 1 ? `${Math.round(v * 1000)} ms` : `${fmt(v)} s`;
}

function sparkline(points) {
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("viewBox", "0 0 100 24");
  svg.setAttribute("preserveAspectRatio", "none");
  const values = points.filter((v) => v !== null && v !== undefined);
  if (values.length > 1) {
    const max = Math.max(...values, 1e-9);
    const line = document.createElementNS(svg.namespaceURI, "polyline");
    line.setAttribute("points", points.map((v, i) =>
      `${(i / (points.length - 1)) * 100},${22 - ((v ?? 0) / max) * 20}`).join(" "));
    svg.append(line);
  }
  return svg;
}

function number(stage, field, label, value, trend) {
  const box = el("div", { class: "num" },
    el("span", { class: "label" }, label),
    el("span", { class: "value", "data-stage": stage, "data-field": field }, value));
  if (trend) box.append(sparkline(trend));
  return box;
}

function table(stage, title, field, rows, headers) {
  if (!rows.length) return null;
  const body = rows.map(([name, ...cells]) => el("tr", {}, el("td", {}, name),
    ...cells.map((c, i) => el("td", { "data-stage": stage, "data-field": `${field}.${name}.${i}` }, fmt(c, 2)))));
  return el("div", { class: "group" }, el("h3", {}, title),
    el("table", {}, el("thead", {}, el("tr", {}, ...headers.map((h) => el("th", {}, h)))), el("tbody", {}, ...body)));
}

function stageCard(name, s) {
  const history = s.history || [];
  const trend = (key) => history.map((h) => h[key]);
  const drain = s.queue_length && s.completions_per_min ? s.queue_length / s.completions_per_min : null;
  let badge = el("span", { class: "badge", "data-stage": name, "data-field": "keeping_up" }, "keeping up");
  if (s.queue_length > 0 && (drain === null || drain > KEEP_UP_MINUTES)) {
    badge = el("span", { class: "badge behind", "data-stage": name, "data-field": "keeping_up" },
      drain === null ? "stuck" : `behind: ${fmt(drain)} min to drain`);
  } else if (!s.workers_now && !s.queue_length) {
    badge = el("span", { class: "badge idle", "data-stage": name, "data-field": "keeping_up" }, "idle");
  }
  const card = el("div", { class: "stage", "data-stage-card": name }, el("h2", {}, name, badge),
    el("div", { class: "numbers" },
      number(name, "queue_length", "queue", fmt(s.queue_length), trend("queue_length")),
      number(name, "completions_per_min", "completions / min", fmt(s.completions_per_min), trend("completions_per_min")),
      number(name, "busy_slots", "busy / slots", `${s.busy_now} / ${s.slots_now}`, trend("busy_now")),
      number(name, "workers_now", "workers alive", fmt(s.workers_now)),
      number(name, "completions_total", "completions", fmt(s.completions_total)),
      number(name, "job_seconds", "p50 / p99 job", `${seconds(s.job_seconds_p50)} / ${seconds(s.job_seconds_p99)}`,
        trend("job_seconds_p99")),
      number(name, "dead_letters_total", "dead letters", fmt(s.dead_letters_total), trend("dead_letters_per_min")),
      number(name, "failures_per_min_sum", "failures / min",
        fmt(Object.values(s.failures_per_min || {}).reduce((a, b) => a + b, 0)))));
  const reasons = new Set([...Object.keys(s.failures_total || {}), ...Object.keys(s.failures_per_min || {})]);
  const groups = [
    table(name, "failures by reason", "failures", [...reasons].sort().map((r) =>
      [r, (s.failures_per_min || {})[r] || 0, (s.failures_total || {})[r] || 0]), ["reason", "per min", "total"]),
  ];
  for (const [facet, counts] of Object.entries(s.facets_total || {}).sort()) {
    const recent = (s.facets_per_min || {})[facet] || {};
    groups.push(table(name, `by ${facet}`, `facets.${facet}`, Object.entries(counts).sort()
      .map(([value, total]) => [value, recent[value] || 0, total]), [facet, "per min", "total"]));
  }
  const valueNames = [...new Set([...Object.keys(s.values || {}), ...Object.keys(s.values_last || {})])].sort();
  groups.push(table(name, "values", "values", valueNames.map((v) =>
    [v, (s.values || {})[v] ?? null, (s.values_last || {})[v] ?? null]), ["name", "minute mean", "newest"]));
  groups.push(table(name, "worker gauges (sum)", "gauges", Object.entries(s.gauges || {}).sort(), ["gauge", "now"]));
  for (const g of groups) if (g) card.append(g);
  return card;
}

function idle(s) {
  return !s.workers_now && !s.queue_length && !s.completions_total && !s.dead_letters_total;
}

function render(data) {
  const entries = Object.entries(data.stages);
  const quiet = entries.filter(([, s]) => idle(s)).map(([name]) => name);
  document.getElementById("stages").replaceChildren(
    ...entries.filter(([, s]) => !idle(s)).map(([name, s]) => stageCard(name, s)));
  document.getElementById("idle").textContent = quiet.length ? `idle (no workers, no jobs): ${quiet.join(", ")}` : "";
  const rows = data.workers.map((w) => el("tr", { "data-worker": w.worker }, el("td", {}, w.worker),
    el("td", {}, w.stage), el("td", {}, w.mode), el("td", {}, w.state), el("td", {}, `${w.busy} / ${w.slots}`),
    el("td", {}, Object.entries(w.gauges || {}).map(([k, v]) => `${k}=${fmt(v)}`).join(" ")),
    el("td", {}, `${fmt(data.at - w.at)} s ago`)));
  document.querySelector("#workers tbody").replaceChildren(...rows);
  const sources = Object.entries(data.task_sources || {});
  document.getElementById("task-health").hidden = !sources.length;
  document.querySelector("#task-sources tbody").replaceChildren(...sources.map(([name, t]) => {
    const cell = (field, value) => el("td", { "data-source": name, "data-field": field }, value);
    return el("tr", {}, el("td", {}, name), cell("tasks", fmt(t.tasks)), cell("healthy", fmt(t.healthy)),
      cell("quarantined", fmt(t.quarantined)), cell("unchecked", fmt(t.unchecked)),
      cell("healthy_share", `${Math.round(t.healthy_share * 100)} %`),
      cell("reasons", Object.entries(t.reasons).sort().map(([r, n]) => `${r} ${n}`).join(", ") || "–"),
      cell("kiln_failures", fmt(t.kiln_failures)));
  }));
  const behind = document.querySelectorAll(".badge.behind").length;
  document.getElementById("summary").textContent =
    `${Object.keys(data.stages).length} stages · ${data.workers.length} workers · ` +
    (behind ? `${behind} behind` : "all keeping up") + (data.caught_up ? "" : " · catching up…");
  document.getElementById("updated").textContent =
    `${data.prefix ? `prefix ${data.prefix} · ` : ""}updated ${new Date(data.at * 1000).toLocaleTimeString()}`;
  document.body.dataset.caughtUp = String(data.caught_up);
}

async function poll() {
  let wait = 2;
  try {
    const response = await fetch("/api/status", { cache: "no-store" });
    const data = await response.json();
    wait = data.refresh_s;
    render(data);
  } catch (e) {
    document.getElementById("summary").textContent = `status unavailable: ${e}`;
  }
  setTimeout(poll, wait * 1000);
}

poll();
