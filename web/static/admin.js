// The coordinator dashboard: a view over the admin API, pushed by the
// server as it changes (Server-Sent Events: /admin/events for the task
// list, /admin/tasks/{id}/events for the selected task), never polled.
// The streams are read with fetch, since EventSource cannot send the
// admin token. The token stays in this tab's sessionStorage and travels
// only in the Authorization header. Everything the server returns is
// written as text (textContent), never parsed as markup.
//
// Signed in with a project's key, the page shows that project only and
// hides what the key's role may not do (elements marked `data-role`); the
// server refuses it anyway. Every role sees its project's quotas and use;
// an owner also sets the project's own limits within them, its keys and
// reads its audit log. The admin token also sees the projects and sets
// their quotas.

import { lineChart } from "/web/chart.js";

const $ = (id) => document.getElementById(id);
const TOKEN_KEY = "cohort.admin-token";
// A round's stages in order; the consistency check only in the active protocol.
const STAGES = ["advertise-keys", "share-keys", "masked-input-collection", "consistency-check", "unmasking"];
const STAGE_LABELS = {
  "advertise-keys": "keys", "share-keys": "shares", "masked-input-collection": "inputs", "consistency-check": "check",
  unmasking: "unmask",
};
// The rounds table's dropouts column.
const DROPOUT_STAGES = ["advertise-keys", "share-keys", "masked-input-collection", "unmasking"];

let token = sessionStorage.getItem(TOKEN_KEY);
// Who signed in (GET /admin/session): the role, and the key's project.
let session = null;
const RANK = { viewer: 0, operator: 1, owner: 2, admin: 3 };
// The project whose keys and audit log are shown (a key: its own).
let keysProject = null;
let selected = new URLSearchParams(location.hash.slice(1)).get("task");
// Statuses after which no round runs again.
const FINAL = ["stopped", "completed", "budget_spent"];
// What the selected task's stream sent last: its view, rounds, attempts.
let current = { task: null, rounds: [], attempts: [] };

class ApiError extends Error {}

async function api(method, path, body) {
  const headers = { authorization: `Bearer ${token}` };
  if (body !== undefined) headers["content-type"] = "application/json";
  const response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const text = await response.text();
  let json = null;
  try { json = text ? JSON.parse(text) : null; } catch { /* not JSON */ }
  if (!response.ok) {
    const error = new ApiError(json?.message ?? `${response.status} ${response.statusText}`);
    error.status = response.status;
    throw error;
  }
  return json;
}

function cell(row, text, className) {
  const td = document.createElement("td");
  td.textContent = text ?? "";
  if (className) td.className = className;
  row.append(td);
  return td;
}

const number = (value, digits = 0) => (Number.isFinite(value) ? value.toFixed(digits) : "—");
const seconds = (ms) => (Number.isFinite(ms) ? `${(ms / 1000).toFixed(1)} s` : "—");
function bytes(value) {
  if (!Number.isFinite(value)) return "—";
  const units = ["B", "KiB", "MiB", "GiB"];
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit++; }
  return `${value.toFixed(unit ? 1 : 0)} ${units[unit]}`;
}

// --- login ---------------------------------------------------------------

function showLogin(message) {
  $("login").classList.remove("hidden");
  $("dashboard").classList.add("hidden");
  $("login-error").textContent = message ?? "";
}

$("login-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  token = $("admin-token").value.trim();
  $("admin-token").value = "";
  try {
    session = await api("GET", "/admin/session");
    sessionStorage.setItem(TOKEN_KEY, token);
    start();
  } catch (error) {
    token = null;
    showLogin(error.status === 401 ? `Refused: ${error.message}.` : `Cannot reach the coordinator: ${error.message}`);
  }
});

$("logout").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  token = null;
  session = null;
  stopStreams();
  showLogin();
});

// --- session, projects, keys, audit ------------------------------------------

const allowed = (role) => session !== null && RANK[session.role] >= RANK[role];
const when = (ms) => (ms == null ? "—" : new Date(ms).toLocaleString());

/** Hides what the signed-in role may not do. */
function applyRole() {
  for (const element of document.querySelectorAll("[data-role]")) {
    element.classList.toggle("role-hidden", !allowed(element.dataset.role));
  }
}

function renderSession() {
  if (session.role === "admin") {
    $("session").textContent = "Signed in with the admin token: every project.";
  } else {
    const expiry = session.expires_at ? `; the key expires ${when(session.expires_at)}` : "";
    $("session").textContent =
      `Signed in to project ${session.project.name} as ${session.role} (key ${session.name})${expiry}.`;
  }
}

async function loadProjects() {
  if (!allowed("admin")) return;
  try {
    const projects = await api("GET", "/admin/projects");
    $("projects").tBodies[0].replaceChildren(...projects.map((p) => {
      const row = document.createElement("tr");
      row.classList.toggle("chosen", p.id === keysProject);
      cell(row, p.name);
      cell(row, p.id);
      const limit = (used, most) => (most == null ? `${used}` : `${used} / ${most}`);
      // What holds: the lower of the operator's quota and the owners' limit.
      cell(row, limit(p.usage.unfinished_tasks, p.effective_quotas.unfinished_tasks), "num");
      cell(row, limit(p.usage.parameters, p.effective_quotas.parameters), "num");
      cell(row, `${p.usage.keys}`, "num");
      const quotas = Object.entries(p.effective_quotas).filter(([, v]) => v != null).map(([k, v]) => `${k} ${v}`);
      cell(row, quotas.join(", ") || "none");
      row.addEventListener("click", () => { keysProject = p.id; loadProjects(); loadQuotas(); loadKeys(); loadAudit(); });
      return row;
    }));
  } catch (error) {
    if (error.status === 401) return refused();
    $("project-error").textContent = `projects: ${error.message}`;
  }
}

$("project-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  $("project-error").textContent = "";
  const quotas = {};
  if ($("project-tasks").value !== "") quotas.unfinished_tasks = Number($("project-tasks").value);
  if ($("project-parameters").value !== "") quotas.parameters = Number($("project-parameters").value);
  try {
    const created = await api("POST", "/admin/projects", { name: $("project-name").value, quotas });
    $("project-form").reset();
    keysProject = created.id;
    await loadProjects();
    loadQuotas();
    loadKeys();
    loadAudit();
  } catch (error) {
    $("project-error").textContent = `new project: ${error.message}`;
  }
});

// The quotas a project has, in the order the dashboard shows them, each
// with its label and the least value it takes.
const QUOTAS = [
  ["unfinished_tasks", "Unfinished tasks", 0], ["parameters", "Parameters", 0],
  ["enrollments_per_minute", "Enrollments a minute", 1], ["connections", "Event streams open", 0],
];

// Each quota form gets a field per quota, before its button.
for (const form of document.querySelectorAll(".quota-form")) {
  for (const [name, label, least] of QUOTAS) {
    const input = document.createElement("input");
    Object.assign(input, { name, type: "number", min: `${least}`, placeholder: "no limit" });
    const wrapper = document.createElement("label");
    wrapper.append(`${label} `, input);
    form.insertBefore(wrapper, form.querySelector("button"));
  }
}
async function loadQuotas() {
  const show = keysProject !== null;
  $("quotas-section").classList.toggle("hidden", !show);
  if (!show) return;
  const project = keysProject;
  try {
    const view = await api("GET", `/admin/projects/${encodeURIComponent(project)}`);
    if (project !== keysProject) return;
    $("quotas-project").textContent = view.name;
    const shown = (value) => (value == null ? "—" : `${value}`);
    $("quotas").tBodies[0].replaceChildren(...QUOTAS.map(([name, label]) => {
      const row = document.createElement("tr");
      row.dataset.quota = name;
      cell(row, label);
      cell(row, shown(view.usage[name]), "num");
      cell(row, shown(view.quotas[name]), "num");
      cell(row, shown(view.owner_quotas[name]), "num");
      cell(row, shown(view.effective_quotas[name]), "num");
      return row;
    }));
    for (const form of document.querySelectorAll(".quota-form")) {
      for (const [name] of QUOTAS) form.elements[name].value = view[form.dataset.quotas][name] ?? "";
    }
  } catch (error) {
    if (error.status === 401) return refused();
    $("quota-error").textContent = `quotas: ${error.message}`;
  }
}

for (const form of document.querySelectorAll(".quota-form")) {
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    $("quota-error").textContent = "";
    const quotas = {};
    for (const [name] of QUOTAS) {
      if (form.elements[name].value !== "") quotas[name] = Number(form.elements[name].value);
    }
    const path = form.dataset.quotas === "quotas" ? "quotas" : "owner-quotas";
    try {
      await api("PUT", `/admin/projects/${encodeURIComponent(keysProject)}/${path}`, quotas);
    } catch (error) {
      if (error.status === 401) return refused();
      $("quota-error").textContent = `${path}: ${error.message}`;
    }
    loadQuotas();
    loadProjects();
    loadAudit();
  });
}

async function loadKeys() {
  const show = allowed("owner") && keysProject !== null;
  $("keys-section").classList.toggle("hidden", !show);
  if (!show) return;
  const project = keysProject;
  try {
    const [view, keys] = await Promise.all([
      api("GET", `/admin/projects/${encodeURIComponent(project)}`),
      api("GET", `/admin/projects/${encodeURIComponent(project)}/keys`),
    ]);
    if (project !== keysProject) return;
    $("keys-project").textContent = view.name;
    $("keys").tBodies[0].replaceChildren(...keys.map((k) => {
      const row = document.createElement("tr");
      cell(row, k.name);
      cell(row, k.role);
      cell(row, k.id);
      cell(row, when(k.created_at));
      cell(row, when(k.expires_at));
      cell(row, when(k.revoked_at));
      const actions = cell(row, "");
      if (k.revoked_at == null) {
        const button = document.createElement("button");
        button.type = "button";
        button.textContent = "Revoke";
        button.addEventListener("click", () => revokeKey(k));
        actions.append(button);
      }
      return row;
    }));
  } catch (error) {
    if (error.status === 401) return refused();
    $("key-error").textContent = `keys: ${error.message}`;
  }
}

async function revokeKey(k) {
  if (!confirm(`Revoke the key ${k.name}? Every request with it is refused from now on.`)) return;
  $("key-error").textContent = "";
  try {
    await api("POST", `/admin/projects/${encodeURIComponent(keysProject)}/keys/${encodeURIComponent(k.id)}/revoke`);
  } catch (error) {
    if (error.status === 401) return refused();
    $("key-error").textContent = `revoke: ${error.message}`;
  }
  loadKeys();
  loadAudit();
}

$("key-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  $("key-error").textContent = "";
  const body = { name: $("key-name").value, role: $("key-role").value };
  const days = Number($("key-days").value);
  if (days > 0) body.expires_in_s = Math.round(days * 86_400);
  try {
    const created = await api("POST", `/admin/projects/${encodeURIComponent(keysProject)}/keys`, body);
    $("key-new-name").textContent = `${created.name} (${created.role})`;
    $("key-new-value").textContent = created.key;
    $("key-new").classList.remove("hidden");
    $("key-form").reset();
  } catch (error) {
    $("key-error").textContent = `new key: ${error.message}`;
  }
  loadKeys();
  loadAudit();
});

$("key-new-done").addEventListener("click", () => {
  $("key-new-value").textContent = "";
  $("key-new").classList.add("hidden");
});

// The audit page shown: entries before this seq (null: the newest).
let auditBefore = null;
let auditNext = null;

async function loadAudit() {
  const show = allowed("owner") && keysProject !== null;
  $("audit-section").classList.toggle("hidden", !show);
  if (!show) return;
  const query = new URLSearchParams({ project: keysProject, limit: "50" });
  if (auditBefore !== null) query.set("before", `${auditBefore}`);
  try {
    const page = await api("GET", `/admin/audit?${query}`);
    auditNext = page.next_before;
    $("audit-older").disabled = auditNext === null;
    $("audit").tBodies[0].replaceChildren(...page.entries.map((e) => {
      const row = document.createElement("tr");
      cell(row, when(e.at));
      cell(row, e.actor);
      cell(row, e.role);
      cell(row, e.action);
      cell(row, e.resource);
      cell(row, e.address ?? "—");
      cell(row, e.outcome === "ok" ? `ok (${e.status})` : `${e.outcome} (${e.status}): ${e.message}`,
        e.outcome === "ok" ? "" : "error");
      return row;
    }));
  } catch (error) {
    if (error.status === 401) return refused();
    $("audit-error").textContent = `audit log: ${error.message}`;
  }
}

$("audit-newest").addEventListener("click", () => { auditBefore = null; loadAudit(); });
$("audit-older").addEventListener("click", () => {
  if (auditNext !== null) { auditBefore = auditNext; loadAudit(); }
});

// --- server push ----------------------------------------------------------

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/**
 * Calls `onEvent(name, data)` for each event of a `text/event-stream`
 * body (the SSE wire format: `event:` and `data:` lines, a blank line
 * ending each event, `:` lines comments), until the stream ends.
 */
async function readEvents(body, onEvent) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "event") name = text;
        else if (field === "data") data.push(text);
      }
      if (data.length) onEvent(name, JSON.parse(data.join("\n")));
    }
  }
}

/**
 * Follows the event stream at `path` until `stop()` is called: each event
 * goes to `handlers[name]`; a stream that ends or fails is opened again
 * (after `retry_after_ms` when the server said, at once when the task
 * moved to another replica or the key is to be checked again, else after
 * a second). Returns `stop`.
 */
function follow(path, handlers) {
  const controller = new AbortController();
  (async () => {
    while (!controller.signal.aborted) {
      let wait = 1000;
      try {
        const response = await fetch(path, {
          headers: { authorization: `Bearer ${token}`, accept: "text/event-stream" }, signal: controller.signal,
        });
        if (response.status === 401) {
          refused();
          return;
        }
        if (!response.ok) throw new ApiError(`${response.status} ${response.statusText}`);
        connection(`live since ${new Date().toLocaleTimeString()}`);
        await readEvents(response.body, (name, data) => {
          // A key's stream ends now and then to check the key again.
          if (name === "moved" || name === "reauthenticate") wait = 0;
          else if (name === "unavailable") wait = data.retry_after_ms ?? wait;
          handlers[name]?.(data);
        });
      } catch (error) {
        if (controller.signal.aborted) return;
        connection(`coordinator unreachable: ${error.message}; reconnecting`, true);
      }
      await sleep(wait);
    }
  })();
  return () => controller.abort();
}

function connection(text, failed = false) {
  $("connection").textContent = text;
  $("connection").className = failed ? "note error" : "note";
}

function refused() {
  session = null;
  stopStreams();
  sessionStorage.removeItem(TOKEN_KEY);
  token = null;
  showLogin("The token was refused.");
}

let stopList = null;
let stopTask = null;

function stopStreams() {
  stopList?.();
  stopTask?.();
  stopList = stopTask = null;
}

/** Follows the selected task (none: hides its panel). */
function followSelected() {
  stopTask?.();
  stopTask = null;
  current = { task: null, rounds: [], attempts: [] };
  $("detail").classList.add("hidden");
  if (!selected) return;
  const base = `/admin/tasks/${encodeURIComponent(selected)}`;
  stopTask = follow(`${base}/events`, {
    task(task) {
      const first = !current.task;
      current.task = task;
      renderDetail();
      if (first) renderHistory();
    },
    rounds(rounds) {
      // The first event of a connection lists every round, then new ones.
      const last = current.rounds.at(-1)?.round ?? 0;
      const fresh = rounds.length && rounds[0].round <= last;
      current.rounds = fresh ? rounds : current.rounds.concat(rounds);
      renderHistory();
    },
    attempts(attempts) {
      current.attempts = attempts;
      renderAttempts(attempts);
    },
    tokens: renderTokens,
  });
}

function select(id) {
  if (id === selected) return;
  selected = id;
  roundsPage = 0;
  history.replaceState(null, "", `#task=${encodeURIComponent(id)}`);
  for (const row of document.querySelectorAll("tr.selectable")) row.classList.toggle("selected", row.dataset.task === id);
  followSelected();
}

// --- task list -------------------------------------------------------------

/**
 * Running and paused tasks in the main table; stopped, completed and
 * budget-spent ones (earlier demo tasks among them) folded away under
 * "Finished tasks". With nothing selected, the newest running task opens.
 */
function renderTasks(tasks) {
  const open = tasks.filter((task) => !FINAL.includes(task.status));
  const finished = tasks.filter((task) => FINAL.includes(task.status));
  if (!selected && open.length) {
    const newest = open.reduce((a, b) => (b.created_at > a.created_at ? b : a));
    select(newest.id);
  }
  const none = document.createElement("tr");
  cell(none, "No running or paused task: create one with New task…").colSpan = 7;
  $("tasks").tBodies[0].replaceChildren(...(open.length ? taskRows(open) : [none]));
  $("finished").tBodies[0].replaceChildren(...taskRows(finished));
  $("finished-tasks").classList.toggle("hidden", finished.length === 0);
  $("finished-summary").textContent = `Finished tasks (${finished.length})`;
  if (finished.some((task) => task.id === selected)) $("finished-tasks").open = true;
}

function taskRows(tasks) {
  return tasks.map((task) => {
    const row = document.createElement("tr");
    row.className = "selectable" + (task.id === selected ? " selected" : "");
    row.dataset.task = task.id;
    cell(row, task.name);
    cell(row, task.status, `status-${task.status}`);
    cell(row, `${task.completed_rounds} / ${task.rounds}`, "num");
    cell(row, task.current_round ?? "—");
    cell(row, task.stage ?? "—");
    cell(row, task.available_clients, "num");
    cell(row, new Date(task.created_at).toLocaleString());
    row.title = "Show this task's rounds";
    row.addEventListener("click", () => select(task.id));
    return row;
  });
}

// --- one task ------------------------------------------------------------------

function renderLive(task) {
  const progress = task.progress;
  $("live").classList.toggle("hidden", !progress);
  $("live-none").classList.toggle("hidden", Boolean(progress));
  if (!progress) return;
  $("live-round").textContent = `${progress.round} (${progress.attempt})`;
  $("live-stage").textContent = progress.stage;
  $("live-selected").textContent = progress.selected;
  $("live-received").textContent = `${progress.received} / ${progress.eligible}`;
  $("live-waiting").textContent = waitingFor(progress);
  const groups = progress.groups || 1;
  $("live-groups").textContent =
    `${groups} of ${Math.round(progress.selected / groups)} (${progress.groups_completed || 0}, ${progress.groups_failed || 0})`;
  $("live-traffic").textContent = `${bytes(progress.bytes_up)} up, ${bytes(progress.bytes_down)} down`;
  tickLive();
  $("live-stage-table").tBodies[0].replaceChildren(...progress.stages.map((s) => {
    const row = document.createElement("tr");
    cell(row, s.stage);
    cell(row, s.eligible, "num");
    cell(row, s.received, "num");
    cell(row, s.dropouts, "num");
    cell(row, seconds(s.duration_ms), "num");
    return row;
  }));
}

/**
 * The live round's clocks and stage timeline: one bar per stage, as wide
 * as it lasted (the stage in progress so far), redrawn by this page's own
 * clock between the server's events.
 */
function tickLive() {
  const progress = current.task?.progress;
  if (!progress) return;
  const now = Date.now();
  $("live-deadline").textContent = seconds(Math.max(0, progress.deadline - now));
  $("live-elapsed").textContent = seconds(now - progress.started_at);
  const closed = new Map(progress.stages.map((s) => [s.stage, s]));
  const active = current.task.spec?.secure_aggregation?.variant === "active";
  const stages = STAGES.filter((stage) => active || stage !== "consistency-check");
  const spans = stages.map((stage) => {
    const done = closed.get(stage);
    const running = stage === progress.stage;
    const ms = done ? done.duration_ms : running ? Math.max(0, now - progress.stage_started_at) : 0;
    const span = document.createElement("span");
    span.dataset.stage = stage;
    span.className = running ? "current" : done ? "done" : "";
    span.style.flexGrow = String(Math.max(ms, 1));
    span.textContent = done || running ? `${STAGE_LABELS[stage]} ${seconds(ms)}` : STAGE_LABELS[stage];
    span.title = done
      ? `${stage}: ${done.received} of ${done.eligible} answered, ${done.dropouts} dropped out, ${seconds(ms)}`
      : running ? `${stage}: ${progress.received} of ${progress.eligible} answered so far` : `${stage}: not yet`;
    return span;
  });
  $("live-stages").replaceChildren(...spans);
}
setInterval(tickLive, 500);

/**
 * How many answers the stage still waits for, how many clients left, and
 * whether the stage can still reach its threshold.
 */
function waitingFor(p) {
  const left = p.left ? `, ${p.left} left` : "";
  const needs = p.threshold ? `; needs ${p.threshold}` : "";
  const doomed = p.threshold && p.received + p.awaited < p.threshold ? " (cannot complete)" : "";
  return `${p.awaited ?? p.eligible - p.received} more answer${p.awaited === 1 ? "" : "s"}${left}${needs}${doomed}`;
}

/** The attempts that ended without a new model, newest first, with why. */
function renderAttempts(attempts) {
  $("attempts").classList.toggle("hidden", attempts.length === 0);
  $("attempts-none").classList.toggle("hidden", attempts.length > 0);
  $("attempts").tBodies[0].replaceChildren(...attempts.map((a) => {
    const row = document.createElement("tr");
    row.dataset.round = a.round;
    cell(row, `${a.round} (${a.attempt})`, "num");
    cell(row, a.outcome, `outcome-${a.outcome}`);
    cell(row, a.stage);
    cell(row, a.reason).dataset.field = "reason";
    cell(row, a.selected, "num");
    cell(row, seconds(a.ended_at - a.started_at), "num");
    cell(row, new Date(a.ended_at).toLocaleTimeString());
    return row;
  }));
}

/**
 * Per round: the means of the clients' metrics over the survivors, which
 * the coordinator computed from their sums under the masks (it never saw
 * one client's value).
 */
function clientMeans(round) {
  const means = round.metrics?.client_means ?? {};
  return {
    accuracy: means.global_accuracy?.mean ?? means.eval_accuracy?.mean,
    loss: means.train_loss?.mean,
  };
}

// The rounds table shows this many rounds a page, newest first.
const ROUNDS_PER_PAGE = 20;
let roundsPage = 0;

function renderRounds(rounds) {
  const pages = Math.max(1, Math.ceil(rounds.length / ROUNDS_PER_PAGE));
  roundsPage = Math.min(roundsPage, pages - 1);
  const newestFirst = rounds.slice().reverse();
  const shown = newestFirst.slice(roundsPage * ROUNDS_PER_PAGE, (roundsPage + 1) * ROUNDS_PER_PAGE);
  $("rounds-pager").classList.toggle("hidden", pages === 1);
  $("rounds-page").textContent = `rounds ${shown.at(-1)?.round ?? 0}–${shown[0]?.round ?? 0} of ${rounds.length} (page ${roundsPage + 1} of ${pages})`;
  $("rounds-newer").disabled = roundsPage === 0;
  $("rounds-older").disabled = roundsPage >= pages - 1;
  const rows = shown.map((round) => {
    const m = round.metrics ?? {};
    const means = clientMeans(round);
    const row = document.createElement("tr");
    row.dataset.round = round.round;
    cell(row, round.round, "num");
    cell(row, round.selected, "num");
    cell(row, round.survivors, "num").dataset.field = "survivors";
    const dropouts = DROPOUT_STAGES.map((stage) => (m.stages ?? []).find((s) => s.stage === stage)?.dropouts ?? "—");
    cell(row, dropouts.join(" · ")).dataset.field = "dropouts";
    cell(row, seconds(round.finished_at - round.started_at), "num");
    cell(row, bytes(m.bytes_up_per_client), "num");
    cell(row, bytes(m.bytes_down_per_client), "num");
    const ratio = Number.isFinite(m.compression_ratio) ? `${(100 * m.compression_ratio).toFixed(1)} %` : "—";
    // A fitted ring's scale is what the round's sum was sized for.
    const ring = m.ring_scale ? `${m.modulus_bits}-bit ring fitted at ${number(m.ring_scale, 1)} steps per unit` : `${m.modulus_bits}-bit ring`;
    cell(row, m.modulus_bits ? `${ratio} (${ring})` : ratio, "num").dataset.field = "ratio";
    cell(row, m.total_examples ?? "—", "num");
    cell(row, number(means.accuracy, 3), "num");
    cell(row, number(means.loss, 3), "num");
    const rejected = m.rejected_groups ? `${m.rejected_groups} group${m.rejected_groups === 1 ? "" : "s"} left out by the group rule` : "";
    const wrapped = m.overflowed_groups ? `${m.overflowed_groups} group${m.overflowed_groups === 1 ? "" : "s"} wrapped in the fitted ring, left out` : "";
    const suspects = m.suspects?.length ? `sum check failed: ${m.suspects.length} suspects` : "";
    const excluded = m.excluded?.length ? `excluded ${m.excluded.join(", ")}` : "";
    cell(row, [(m.refused_inputs ?? []).join(", "), rejected, wrapped, suspects, excluded].filter(Boolean).join("; ") || "—").dataset.field = "refused";
    return row;
  });
  $("rounds").tBodies[0].replaceChildren(...rows);
  const points = (key) => rounds.map((r) => [r.round, clientMeans(r)[key]]).filter(([, y]) => Number.isFinite(y));
  lineChart($("chart-accuracy").querySelector(".plot"), [{ name: "accuracy", points: points("accuracy") }], { xLabel: "round", yMax: 1 });
  lineChart($("chart-loss").querySelector(".plot"), [{ name: "training loss", points: points("loss") }], { xLabel: "round" });
  const traffic = (key) => rounds.map((r) => [r.round, r.metrics?.[key] / 1024]).filter(([, y]) => Number.isFinite(y));
  lineChart($("chart-bytes").querySelector(".plot"), [
    { name: "up per client", points: traffic("bytes_up_per_client") },
    { name: "down per client", points: traffic("bytes_down_per_client") },
  ], { xLabel: "round" });
}


/**
 * What protects the clients of this task, at the top of its panel: the
 * protocol and what this coordinator can learn, the threshold, and the
 * differential privacy spent.
 */
function renderBanner(task) {
  const secagg = task.spec?.secure_aggregation ?? {};
  const active = secagg.variant === "active";
  const threshold = task.progress?.threshold || secagg.threshold;
  $("privacy-banner").className = `panel banner variant-${active ? "active" : "semi-honest"}`;
  $("banner-variant").textContent = active
    ? "Active secure aggregation: updates stay hidden even from this coordinator"
    : "Semi-honest secure aggregation: this coordinator is trusted to follow the protocol";
  // A round larger than a group is summed group by group.
  const grouped = secagg.group_size && task.spec?.clients_per_round > secagg.group_size;
  $("banner-threshold").textContent = threshold
    ? `The coordinator only ever learns sums of at least ${threshold} clients' updates${grouped ? `, in groups of at most ${secagg.group_size}` : ""}.`
    : "The coordinator only ever learns sums over the round's threshold of clients.";
  const p = task.privacy;
  $("banner-dp").textContent = p
    ? `Differential privacy: ε = ${number(p.epsilon_spent, 3)} spent${p.budget == null ? "" : ` of a budget of ${p.budget}`} (δ = ${p.delta}).`
    : "No differential privacy: the sums are exact.";
  const v = task.spec?.validation;
  $("banner-validation").textContent = v?.norm === "l2"
    ? `Input validation: every update is proven, in zero knowledge, to have an L2 norm of at most ${number(v.l2_clip, 4)}; a client whose proof fails is left out and named.`
    : "No input validation: a client's update is summed unchecked.";
  const rule = v?.group_rule;
  if (rule) {
    const what = { norm: `groups whose mean is longer than ${rule.max} are left out`, median: "the coordinate-wise median of the groups' means", trimmed_mean: `the groups' means trimmed by ${rule.trim} at each end` }[rule.kind];
    $("banner-validation").textContent += ` Across groups: ${what}.`;
  }
  if (task.excluded?.length) {
    $("banner-validation").textContent += ` Excluded for masking another update than they proved: ${task.excluded.join(", ")}.`;
  }
  if (task.suspected?.length) {
    $("banner-validation").textContent += ` Suspected after a failed sum check: ${task.suspected.length} clients.`;
  }
}

function renderPrivacy(task) {
  const p = task.privacy;
  renderBanner(task);
  if (!p) {
    $("detail-privacy").textContent = "off: sums are exact";
    $("detail-epsilon").textContent = "—";
    return;
  }
  const sampling = p.sample_rate < 1 ? `, sampling ${number(p.sample_rate, 4)}` : "";
  $("detail-privacy").textContent =
    `${p.mechanism.replace("_", " ")} noise ×${number(p.noise_multiplier, 3)}, clip ${p.clip_norm}${sampling}`;
  const budget = p.budget == null ? "no budget" : `of ${p.budget}`;
  $("detail-epsilon").textContent = `${number(p.epsilon_spent, 3)} ${budget} (δ = ${p.delta})`;
}

/** ε after each round, against the budget (hidden without DP). */
function renderEpsilon(task, rounds) {
  const chart = $("chart-epsilon");
  const points = rounds.map((r) => [r.round, r.metrics?.epsilon]).filter(([, y]) => Number.isFinite(y));
  chart.classList.toggle("hidden", !task.privacy || points.length === 0);
  if (task.privacy && points.length) {
    lineChart(chart.querySelector(".plot"), [{ name: "ε spent", points }], { xLabel: "round", yMax: task.privacy.budget ?? undefined });
  }
}

/**
 * An async task's schedule: the model version, the training slots and the
 * buffer, the groups in flight, and how stale the applied updates were.
 */
function renderBuffer(task) {
  const b = task.buffer;
  $("buffer").classList.toggle("hidden", !b);
  if (!b) return;
  $("buffer-version").textContent = b.version;
  $("buffer-training").textContent = `${b.training} / ${b.concurrency}` +
    (b.training_on ? ` (+${b.training_on} past their slot)` : "");
  $("buffer-waiting").textContent = `${b.waiting} / ${b.buffer_size}`;
  $("buffer-bound").textContent = `${b.max_staleness} versions, slot ${b.slot_lag}`;
  $("buffer-refused").textContent = b.refused_stale;
  $("buffer-failed").textContent = b.groups_failed;
  const now = Date.now();
  $("buffer-groups").tBodies[0].replaceChildren(...b.groups.map((g) => {
    const row = document.createElement("tr");
    cell(row, g.number, "num");
    cell(row, g.stage);
    cell(row, g.clients, "num");
    cell(row, g.received, "num");
    cell(row, seconds(now - g.started_at), "num");
    return row;
  }));
  const most = Math.max(1, ...b.staleness_histogram);
  $("buffer-histogram").replaceChildren(...b.staleness_histogram.flatMap((count, staleness) => {
    const label = document.createElement("span");
    label.textContent = `${staleness} behind`;
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.style.width = `${(100 * count) / most}%`;
    bar.dataset.staleness = staleness;
    const value = document.createElement("span");
    value.className = "num";
    value.textContent = count;
    return [label, bar, value];
  }));
}

/** The selected task as its last `task` event showed it. */
function renderDetail() {
  const { task } = current;
  if (!task || task.id !== selected) return;
  $("detail").classList.remove("hidden");
  $("detail").dataset.task = task.id;
  $("detail-name").textContent = task.name;
  $("detail-status").textContent = task.status;
  $("detail-status").className = `value status-${task.status}`;
  $("detail-completed").textContent = `${task.completed_rounds} / ${task.rounds}`;
  $("detail-clients").textContent =
    task.spec?.mode === "async" ? `${task.spec.clients_per_round} per buffer (async)` : task.spec?.clients_per_round ?? "—";
  const secagg = task.spec?.secure_aggregation ?? {};
  $("detail-secagg").textContent = `${secagg.threshold ?? "derived"} / ${secagg.graph ?? "complete"}`;
  const active = secagg.variant === "active";
  $("detail-variant").textContent = active
    ? "active: updates stay hidden from this coordinator"
    : "semi-honest: this coordinator is trusted";
  $("detail-variant").className = `value variant-${active ? "active" : "semi-honest"}`;
  $("detail-available").textContent = task.available_clients;
  $("detail-groups").textContent = secagg.group_size ?? "one group per round";
  $("detail-leader").textContent = task.leader ?? "—";
  const final = FINAL.includes(task.status);
  $("pause").disabled = final || task.status === "paused";
  $("resume").disabled = final || task.status !== "paused";
  $("stop").disabled = final;
  $("delete").disabled = !final;
  // Why the task makes no progress (too few clients, no leader), if so.
  $("detail-stalled").textContent = task.stalled ?? "";
  $("detail-stalled").classList.toggle("hidden", !task.stalled);
  $("token-form").querySelector("button").disabled = final;
  renderBuffer(task);
  renderLive(task);
  renderPrivacy(task);
}

/** The selected task's completed rounds: the table's page and the charts. */
function renderHistory() {
  const { task, rounds } = current;
  if (!task || task.id !== selected) return;
  renderRounds(rounds);
  renderEpsilon(task, rounds);
}

async function control(action) {
  if (!selected) return;
  if (action === "stop" && !confirm("Stop this task for good? Its round in progress is abandoned.")) return;
  $("action-error").textContent = "";
  try {
    await api("POST", `/admin/tasks/${encodeURIComponent(selected)}/${action}`);
  } catch (error) {
    $("action-error").textContent = `${action}: ${error.message}`;
  }
}
for (const action of ["pause", "resume", "stop"]) $(action).addEventListener("click", () => control(action));
$("delete").addEventListener("click", async () => {
  if (!selected || !confirm("Delete this task with its checkpoints, rounds and enrollments? This cannot be undone.")) return;
  $("action-error").textContent = "";
  try {
    await api("DELETE", `/admin/tasks/${encodeURIComponent(selected)}`);
    selected = null;
    history.replaceState(null, "", "#");
    followSelected();
  } catch (error) {
    $("action-error").textContent = `delete: ${error.message}`;
  }
});

// --- enrollment tokens ---------------------------------------------------

/**
 * The selected task's tokens again, after this page changed them (the
 * stream sends them when enrollments change them).
 */
async function loadTokens() {
  const task = selected;
  if (!task) return;
  try {
    const tokens = await api("GET", `/admin/tasks/${encodeURIComponent(task)}/tokens`);
    if (task === selected) renderTokens(tokens);
  } catch (error) {
    if (error.status === 401) refused();
    else $("token-error").textContent = `tokens: ${error.message}`;
  }
}

function renderTokens(tokens) {
  $("tokens").tBodies[0].replaceChildren(...tokens.map((t) => {
    const row = document.createElement("tr");
    row.dataset.token = t.id;
    cell(row, t.name);
    cell(row, t.enrolled, "num");
    cell(row, t.rate ? t.rate.per_minute : "default", "num");
    cell(row, new Date(t.created_at).toLocaleString());
    cell(row, t.revoked_at ? new Date(t.revoked_at).toLocaleString() : "—").dataset.field = "revoked";
    const actions = document.createElement("td");
    if (!t.revoked_at) {
      const revoke = document.createElement("button");
      revoke.type = "button";
      revoke.className = "danger";
      revoke.textContent = "Revoke";
      revoke.addEventListener("click", () => revokeToken(t));
      actions.append(revoke);
    }
    row.append(actions);
    return row;
  }));
}

async function revokeToken(t) {
  if (!selected || !confirm(`Revoke the token for ${t.name}? Its clients' credentials end too.`)) return;
  $("token-error").textContent = "";
  try {
    await api("POST", `/admin/tasks/${encodeURIComponent(selected)}/tokens/${encodeURIComponent(t.id)}/revoke`);
  } catch (error) {
    $("token-error").textContent = `revoke: ${error.message}`;
  }
  loadTokens();
}

$("token-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  if (!selected) return;
  $("token-error").textContent = "";
  const perMinute = Number($("token-rate").value);
  const body = { name: $("token-name").value };
  // A burst of a minute's worth: the sustained rate, allowed at once.
  if (perMinute > 0) body.rate = { per_minute: perMinute, burst: perMinute };
  try {
    const created = await api("POST", `/admin/tasks/${encodeURIComponent(selected)}/tokens`, body);
    $("token-new-name").textContent = created.name;
    $("token-new-value").textContent = created.token;
    $("token-new").classList.remove("hidden");
    $("token-form").reset();
  } catch (error) {
    $("token-error").textContent = `new token: ${error.message}`;
  }
  loadTokens();
});
$("token-new-done").addEventListener("click", () => {
  $("token-new-value").textContent = "";
  $("token-new").classList.add("hidden");
});

// --- task creation ------------------------------------------------------------

const LAYOUTS = {
  logreg: [["fc.weight", [10, 784]], ["fc.bias", [10]]],
  "2nn": [["fc1.weight", [200, 784]], ["fc1.bias", [200]], ["fc2.weight", [200, 200]], ["fc2.bias", [200]],
    ["fc3.weight", [10, 200]], ["fc3.bias", [10]]],
};

function specFromForm() {
  const architecture = $("create-model").value;
  const deadline = Number($("create-deadline").value) * 1000;
  return {
    name: $("create-name").value,
    model: {
      architecture,
      layout: { tensors: LAYOUTS[architecture].map(([name, shape]) => ({ name, shape })) },
      init: { kind: "fan_in", seed: 1 },
    },
    rounds: Number($("create-rounds").value),
    clients_per_round: Number($("create-clients").value),
    secure_aggregation: {
      variant: $("create-variant").value,
      graph: "complete",
      threshold: Number($("create-threshold").value),
    },
    deadlines: { advertise_keys_ms: deadline, share_keys_ms: deadline, masked_input_ms: deadline, unmasking_ms: deadline },
    optimizer: { kind: "fedavg", learning_rate: Number($("create-lr").value) },
  };
}

function syncSpec() {
  $("create-spec").value = JSON.stringify(specFromForm(), null, 2);
}
for (const input of $("create-form").querySelectorAll("input, select")) input.addEventListener("input", syncSpec);

$("show-create").addEventListener("click", () => {
  syncSpec();
  $("create").classList.remove("hidden");
  $("created").classList.add("hidden");
});
$("cancel-create").addEventListener("click", () => $("create").classList.add("hidden"));
$("dismiss-created").addEventListener("click", () => {
  // The token is not kept anywhere once dismissed.
  $("created-token").textContent = "";
  $("created-demo").removeAttribute("href");
  $("created").classList.add("hidden");
});

$("create-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  $("create-error").textContent = "";
  let spec;
  try {
    spec = JSON.parse($("create-spec").value);
  } catch (error) {
    $("create-error").textContent = `The specification is not JSON: ${error.message}`;
    return;
  }
  try {
    const created = await api("POST", "/admin/tasks", spec);
    $("create").classList.add("hidden");
    $("created").classList.remove("hidden");
    $("created-id").textContent = created.id;
    $("created-token").textContent = created.enrollment_token;
    const fragment = new URLSearchParams({ task: created.id, token: created.enrollment_token });
    $("created-demo").href = `/demo#${fragment}`;
    select(created.id);
  } catch (error) {
    $("create-error").textContent = error.message;
  }
});

// --- start -----------------------------------------------------------------------

$("rounds-newer").addEventListener("click", () => { roundsPage = Math.max(0, roundsPage - 1); renderHistory(); });
$("rounds-older").addEventListener("click", () => { roundsPage += 1; renderHistory(); });

async function start() {
  if (session === null) {
    try {
      session = await api("GET", "/admin/session");
    } catch (error) {
      if (error.status === 401) return refused();
      return showLogin(`Cannot reach the coordinator: ${error.message}`);
    }
  }
  keysProject = session.project?.id ?? keysProject;
  $("login").classList.add("hidden");
  $("dashboard").classList.remove("hidden");
  applyRole();
  renderSession();
  loadProjects();
  loadQuotas();
  loadKeys();
  loadAudit();
  stopStreams();
  stopList = follow("/admin/events", { tasks: renderTasks });
  followSelected();
}

if (token) start(); else showLogin();
