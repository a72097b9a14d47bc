// The status tab: GET /v1/status about every second while the tab is shown. The queue, each
// in-flight request's size, service tier, tenant, status (paused for a higher tier) and step, recent step latency and engine overhead, images per
// second, each device block's last step, errors by kind; a section per replica behind
// `serve --replicas`.

import { getJson } from "./api.js";
import { element, showError } from "./results.js";

const PERIOD_MS = 1000;

const ms = (value) => (value === null || value === undefined ? "–" : `${value.toFixed(1)} ms`);

function table(className, caption, headings, rows) {
  const t = element("table", className);
  t.append(element("caption", "", caption));
  const head = t.createTHead().insertRow();
  for (const h of headings) head.append(element("th", "", h));
  const body = t.createTBody();
  for (const row of rows) {
    const tr = body.insertRow();
    for (const cell of row) tr.append(cell instanceof Node ? cell : element("td", "", cell));
  }
  if (!rows.length) body.insertRow().append(Object.assign(element("td", "", "none"), { colSpan: headings.length }));
  return t;
}

function tiles(pairs) {
  const dl = element("dl", "tiles");
  for (const [term, value] of pairs) {
    const div = element("div");
    div.append(element("dt", "", term), element("dd", "", String(value)));
    dl.append(div);
  }
  return dl;
}

function stepCell(request) {
  const td = element("td");
  const bar = element("progress");
  bar.max = request.steps;
  bar.value = request.step;
  td.append(bar, ` ${request.step} / ${request.steps}`);
  return td;
}

// One engine's part of the answer (the whole answer, or one replica's).
function engineView(status, title) {
  const section = element("section", "engine");
  if (title) section.append(element("h3", "", title));
  if (status.alive === false) {
    section.append(element("p", "error", "not answering (restarting?)"));
    return section;
  }
  const steps = status.steps;
  section.append(
    tiles([
      ["status", status.status],
      ["waiting", status.waiting],
      ["running", status.running],
      ["finished", status.finished],
      ["failed", status.failed],
      ...(status.finished_videos === undefined ? [] : [["videos made", status.finished_videos],
        ["frames made", status.finished_frames]]),
      ["requests / s (1 min)", status.requests_per_s.toFixed(2)],
      ["images / s (1 min)", status.images_per_s.toFixed(2)],
      [`step latency (median of ${steps.recent})`, ms(steps.latency_ms_median)],
      ["engine overhead per step", ms(steps.overhead_ms_median)],
    ]),
    table("requests", "Requests in flight", ["request", "size", "tier", "tenant", "status", "step"],
      status.requests.map((r) => [r.id, r.frames ? `${r.size}x${r.frames}` : r.size, r.service_tier ?? "default", r.tenant || "–", r.status, stepCell(r)])),
    table("devices", "Devices (last step)", ["devices", "requests in batch", "step"],
      Object.entries(status.devices).map(([block, last]) => [block, String(last.requests), ms(last.step_ms)])),
  );
  return section;
}

function render(body, status) {
  const parts = [];
  if (status.replicas) {
    parts.push(tiles([["status", status.status], ["waiting", status.waiting], ["running", status.running],
      ["finished", status.finished], ["failed", status.failed]]));
    const replicas = element("div", "replicas");
    replicas.append(...status.replicas.map((replica) => engineView(replica, `replica ${replica.replica}`)));
    parts.push(replicas);
  } else {
    parts.push(engineView(status));
  }
  const errors = Object.entries(status.errors).sort((a, b) => b[1] - a[1]);
  parts.push(table("errors", "Errors answered since start", ["kind", "count"], errors.map(([kind, n]) => [kind, String(n)])));
  body.replaceChildren(...parts);
  body.dataset.updated = new Date().toISOString();
}

// Polls while shown: the next request goes a period after the last answer (never two at once),
// and one that takes longer than a period is given up.
export function statusTab(tab, onAuthError) {
  const body = tab.querySelector(".status-body");
  const errorLine = tab.querySelector(".error");
  let polling = null; // {timer} of the loop running now; null while hidden

  async function poll(loop) {
    try {
      const status = await getJson("/v1/status", AbortSignal.timeout(5 * PERIOD_MS));
      if (loop !== polling) return; // hidden meanwhile
      render(body, status);
      errorLine.hidden = true;
    } catch (error) {
      if (loop !== polling) return;
      showError(errorLine, error);
      if (error.status === 401) {
        hide();
        onAuthError(error);
        return;
      }
    }
    loop.timer = setTimeout(() => poll(loop), PERIOD_MS);
  }

  function hide() {
    if (polling) clearTimeout(polling.timer);
    polling = null;
  }

  function show() {
    if (polling) return;
    polling = {};
    poll(polling);
  }

  return { show, hide };
}
