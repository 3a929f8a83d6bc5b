// The demo page: reads the task and enrollment token from the URL fragment
// (never sent to the server), drops the token from the address bar, and
// runs the client in a Web Worker. The enrollment it gets back is kept in
// this tab's sessionStorage, so every tab is a device of its own and a
// reload resumes as the same participant.

import { lineChart } from "/web/chart.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.hash.slice(1));
const accuracy = { global: [], local: [] };
// Long runs stay readable: the newest points and log lines are kept.
const MAX_POINTS = 500;
const MAX_LOG = 300;
// Bytes this tab sent and received, over all its rounds.
const traffic = { up: 0, down: 0 };

function keep(points, point) {
  points.push(point);
  if (points.length > MAX_POINTS) points.shift();
}
let worker = null;
// POST /v1/leave with this tab's credential, once enrolled.
let leaveRequest = null;

/**
 * Tells the coordinator this tab is leaving, so that no round waits for
 * it and it is not selected again: a `keepalive` request outlives the page.
 */
function sayLeaving() {
  if (!leaveRequest) return;
  const { path, bearer } = leaveRequest;
  leaveRequest = null;
  fetch(path, { method: "POST", keepalive: true, headers: { authorization: `Bearer ${bearer}` } }).catch(() => {});
}
// A closed tab (or one navigated away) leaves; a round it was in goes on
// without it at once instead of at its deadline.
addEventListener("pagehide", sayLeaving);

function log(text) {
  const item = document.createElement("li");
  item.textContent = `${new Date().toLocaleTimeString()}  ${text}`;
  $("log").append(item);
  while ($("log").children.length > MAX_LOG) $("log").firstElementChild.remove();
  item.scrollIntoView({ block: "nearest" });
}

function setState(text, className = "") {
  $("state").textContent = text;
  $("state").className = `value ${className}`;
  document.body.dataset.state = text;
}

function drawChart() {
  lineChart($("chart").querySelector(".plot"), [
    {
      name: "global model after round n",
      description: "the sum of every tab's update, averaged: what all the tabs learned together",
      points: accuracy.global,
    },
    {
      name: "this tab alone after round n's local training",
      description: "trained from the global model on this tab's own digits, most of them of a few kinds: it " +
        "usually scores lower on all ten than the global model does, which is why the tabs train together",
      points: accuracy.local,
    },
  ], { xLabel: "round n", yMax: 1, legend: true });
}

// Weaker than the default policy so that three tabs make a round; the page
// says so (#policy). Fields left out keep their defaults.
const DEMO_POLICY = { min_clients: 3, min_threshold: 2, min_collusion_margin: 1, collusion: null };

/**
 * Joins `task` with `token`; trains on shard `dealt.shard` of `dealt.shards`
 * when the coordinator dealt one (the public demo), else on the address's
 * shard, else on a random one of 10.
 */
function start(task, token, dealt = {}) {
  const shards = Number(params.get("shards") ?? dealt.shards ?? 10);
  const shard = params.has("shard") ? Number(params.get("shard")) : dealt.shard ?? Math.floor(Math.random() * shards);
  const stateKey = `cohort.demo.${task}`;
  sessionStorage.setItem(`${stateKey}.token`, token);
  // Keep the task and shard in the address (a reload rejoins), not the token.
  history.replaceState(null, "", `#${new URLSearchParams({ task, shard, shards })}`);
  $("join").classList.add("hidden");
  $("client").classList.remove("hidden");
  $("task").textContent = task;
  drawChart();

  worker = new Worker("/web/worker.js", { type: "module" });
  // A worker whose scripts do not load (web/pkg not built) never answers.
  worker.addEventListener("error", (event) => {
    event.preventDefault();
    setState("stopped: error", "error");
    log("the client could not be loaded: is the browser build there (scripts/build-web.sh)?");
  });
  worker.addEventListener("message", ({ data }) => {
    switch (data.type) {
      case "data":
        $("data").textContent = `${data.summary.examples} digits (shard ${shard} of ${shards}, the commonest ` +
          `first: ${commonestFirst(data.summary.per_digit)})`;
        log(`loaded ${data.summary.examples} training and ${data.summary.test_examples} held-out digits`);
        break;
      case "enrolled":
        $("participant").textContent = data.participant;
        sessionStorage.setItem(stateKey, data.saved);
        leaveRequest = data.leave;
        break;
      case "state":
        setState(data.text);
        break;
      case "stage":
        setState(`round ${data.round}: ${data.stage}`);
        break;
      case "trained": {
        const r = data.report;
        // Round r trains from the global model of round r − 1 (round 0:
        // the initial model), so that is where its accuracy belongs.
        if (Number.isFinite(r.global_accuracy)) keep(accuracy.global, [r.round - 1, r.global_accuracy]);
        if (Number.isFinite(r.local_accuracy)) keep(accuracy.local, [r.round, r.local_accuracy]);
        drawChart();
        const from = r.round > 1 ? `the global model after round ${r.round - 1}` : "the initial model";
        log(`round ${r.round}: ${from} scores ${Number(r.global_accuracy).toFixed(3)} on the ` +
          `held-out digits; trained on this tab's ${r.examples} digits (loss ${Number(r.train_loss).toFixed(3)}), ` +
          `it scores ${Number(r.local_accuracy).toFixed(3)}`);
        break;
      }
      case "round": {
        const a = data.action;
        if (a.outcome === "completed") {
          $("rounds-done").textContent = Number($("rounds-done").textContent) + 1;
          setState(`round ${a.round} completed`, "ok");
          log(`round ${a.round} completed`);
        } else {
          setState(`round ${a.round} ${a.outcome}`);
          log(`round ${a.round} ${a.outcome}${a.reason ? `: ${a.reason}` : ""}`);
        }
        traffic.up += a.bytes_up;
        traffic.down += a.bytes_down;
        $("traffic").textContent =
          `${(traffic.up / 1024).toFixed(1)} KiB / ${(traffic.down / 1024).toFixed(1)} KiB in all`;
        break;
      }
      case "finished":
        setState("task finished", "ok");
        log("the task has finished");
        worker.terminate();
        break;
      case "error":
        setState("stopped: error", "error");
        log(`error: ${data.message}`);
        worker.terminate();
        break;
      default:
        break;
    }
  });
  worker.postMessage({
    task, token, shard, shards, saved: sessionStorage.getItem(stateKey), config: trainingConfig(),
    policy: JSON.stringify(DEMO_POLICY),
  });
}

/** "3×412 8×301 …": each digit with its count, the commonest first. */
function commonestFirst(perDigit) {
  return perDigit.map((n, d) => [d, n]).filter(([, n]) => n > 0).sort((a, b) => b[1] - a[1])
    .map(([d, n]) => `${d}×${n}`).join(" ");
}

function trainingConfig() {
  const config = {};
  for (const key of ["epochs", "batch", "lr"]) if (params.has(key)) config[key] = Number(params.get(key));
  return config;
}

$("leave").addEventListener("click", () => {
  if (!worker) return;
  worker.terminate();
  worker = null;
  sayLeaving();
  setState("left");
  log("left: this tab takes part in no further rounds");
  $("leave").disabled = true;
});

$("join-form").addEventListener("submit", (event) => {
  event.preventDefault();
  start($("join-task").value.trim(), $("join-token").value.trim());
});

/**
 * On the public demo task: how many devices are ready for a round and how
 * many it needs, with a link that opens another (a new tab is a new device:
 * `noopener` gives it storage of its own). Refreshed while this tab waits.
 */
async function showDevices() {
  const demo = await publicDemoTask();
  if (!demo || !Number.isFinite(demo.available)) return;
  const waiting = document.body.dataset.state === "waiting for a round";
  const needed = demo.clients_per_round;
  const here = Math.max(1, demo.available);
  // Only while waiting: during a round the selected tabs do not check in.
  $("onboarding").classList.toggle("hidden", !waiting);
  $("devices").textContent = here >= needed
    ? `${here} of ${needed} devices here: a round can start`
    : `${here} of ${needed} devices here — open ${needed - here} more`;
}

function followDevices() {
  showDevices();
  setInterval(showDevices, 2000);
}

/**
 * The coordinator's public demo task, if it runs one (`cohort serve --demo`);
 * with `join`, also the shard of the digits this tab is dealt.
 */
async function publicDemoTask(join = false) {
  try {
    const response = await fetch(join ? "/demo/task?join=true" : "/demo/task");
    // 204: this coordinator runs no public demo task.
    return response.status === 200 ? await response.json() : null;
  } catch {
    return null;
  }
}

const task = params.get("task");
const token = params.get("token") ?? (task && sessionStorage.getItem(`cohort.demo.${task}.token`));
if (task && token) {
  start(task, token);
  if (sessionStorage.getItem("cohort.demo.public") === task) followDevices();
} else {
  const demo = task ? null : await publicDemoTask(true);
  if (demo) {
    // Remembered so that a reload (which finds the task in the address)
    // still shows the devices line.
    sessionStorage.setItem("cohort.demo.public", demo.task);
    start(demo.task, demo.enrollment_token, { shard: demo.shard, shards: demo.shards });
    followDevices();
  }
  else {
    if (task) $("join-task").value = task;
    $("join").classList.remove("hidden");
  }
}
