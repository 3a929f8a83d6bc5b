// Drives Debian's Chromium (playwright-core, never a downloaded browser)
// against a running `cohort serve`, for tests/tests/e2e/browser.rs. Each step
// prints one JSON line the Rust test checks; screenshots go to the
// artifacts directory.
//
//   node web/tests/browser.mjs STEP 'JSON'
//
// Steps:
//   create     {url, adminToken, artifacts, form: {id: value}}
//              creates a task with the dashboard's form; prints {task, token, demo}
//   tabs       {url, task, token, shards: [k, ...], of, artifacts, name, close?: i}
//              opens one demo tab per shard, each in its own browser context
//              (its own storage: its own device); tab `close` is closed after
//              the coordinator accepted two of its stage messages and before
//              its masked input arrives (its third is held back), the other tabs
//              run until round 1 completes; prints {tabs: [{participant, state, reports}]};
//              with plain: true the tabs open /demo bare (shards only counts them)
//   learn      {url, artifacts, name, rounds}
//              the public demo task (cohort serve --demo) with three tabs that open a
//              bare /demo and train until each has measured the global model after
//              round `rounds`; prints {tabs: [{data, global: [[n, accuracy]], local, legend}]}
//   live       {url, adminToken, task, artifacts, name, ready, rounds}
//              opens /admin on the task, writes the file `ready` once it shows the
//              task, and records what the live panel shows (each stage, the stage
//              timeline's bars) and every request the page makes, until `rounds`
//              rounds are listed and 3 s more have passed; prints what it saw
//   bare       {url, artifacts, name}
//              opens a bare /demo (no task in the address) and prints whether the
//              join form shows and the page's problems (console errors included)
//   dropouts   {url, artifacts, name}
//              the public demo task (cohort serve --demo) with tabs that close as
//              people close them: tabs A, B, C open a bare /demo; C closes (its page,
//              as a person closes a tab) after its keys and shares were accepted and
//              before its masked input is sent; once A has completed round 1, B closes
//              between rounds; D and E open, and the step waits for A, D and E to
//              complete a round together; prints {tabs: {A, D, E}: {rounds, log}}
//   dashboard  {url, adminToken, task, artifacts, name, secrets: [..], controls?: bool,
//               buffer?: {version}} (an async task's panel, once at that version),
//               attempts?: n (waits for n rows of failed attempts and reads them)
//              opens /admin, selects the task, reads its rounds table and
//              charts; with controls, creates an enrollment token for an
//              application with the form, reads it once, dismisses it,
//              revokes it, then clicks pause, resume, stop and reads the
//              status the API reports after each; prints what it saw
//   projects   {url, artifacts, name, keys: {who: key}, quotas: {who: {form, quota, value, project}}}
//              signs in with each key (or the admin token) in its own context and
//              prints, per signer, what the dashboard shows: the session line, the
//              tasks listed, which controls that write are shown, the projects,
//              the keys and the audit log's rows; an owner also creates a viewer
//              key with the form and reads it once; a signer named in `quotas`
//              first sets that quota with that form (the admin token choosing
//              the project) and waits until the quotas table shows it
import { mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";

import { launchChromium } from "./chromium.mjs";

/** Stage messages' URLs, with or without a query (`?wait_ms=`). */
const STAGE_MESSAGE = /\/v1\/round\/message(\?.*)?$/;

const [step, json] = process.argv.slice(2);
const config = JSON.parse(json);
mkdirSync(config.artifacts, { recursive: true });
const TIMEOUT = Number(process.env.COHORT_BROWSER_TIMEOUT_MS ?? 180_000);

const browser = await launchChromium(["--disable-background-networking", "--disable-component-update",
  "--disable-sync"]);

/** A page that fails the step on any script error or CSP violation. */
async function newPage(context, label) {
  const page = await context.newPage();
  page.setDefaultTimeout(TIMEOUT);
  const problems = [];
  page.on("pageerror", (error) => problems.push(`${label}: ${error.message}`));
  page.on("console", (message) => {
    if (message.type() === "error") problems.push(`${label}: console: ${message.text()}`);
  });
  page.problems = problems;
  return page;
}

function shot(page, name) {
  return page.screenshot({ path: join(config.artifacts, `${name}.png`), fullPage: true });
}

async function login(page) {
  await page.goto(`${config.url}/admin`);
  await page.fill("#admin-token", config.adminToken);
  await page.click("#login-form button[type=submit]");
  await page.waitForSelector("#dashboard:not(.hidden)");
}

async function create() {
  const page = await newPage(await browser.newContext(), "admin");
  await login(page);
  await page.click("#show-create");
  for (const [id, value] of Object.entries(config.form)) {
    if (id === "create-model") await page.selectOption(`#${id}`, value);
    else await page.fill(`#${id}`, String(value));
  }
  await shot(page, "create-form");
  await page.click("#create-form button[type=submit]");
  await page.waitForFunction(() => !document.getElementById("created").classList.contains("hidden") ||
    document.getElementById("create-error").textContent);
  const refused = await page.textContent("#create-error");
  if (refused) throw new Error(`the dashboard refused the task: ${refused}`);
  const result = {
    task: await page.textContent("#created-id"),
    token: await page.textContent("#created-token"),
    demo: await page.getAttribute("#created-demo", "href"),
  };
  await page.click("#dismiss-created");
  result.token_after_dismiss = await page.textContent("#created-token");
  result.problems = page.problems;
  return result;
}

async function tabs() {
  const opened = [];
  for (const [index, shard] of config.shards.entries()) {
    const context = await browser.newContext();
    const page = await newPage(context, `tab ${index}`);
    let posts = 0;
    let held = null;
    const reachedHold = new Promise((resolve) => { held = resolve; });
    if (index === config.close) {
      // The worker's requests go through its page's context: let the first
      // two stage messages (keys, shares) through, never the third. (A
      // post asks to be held for the next message: `?wait_ms=`.)
      await context.route(STAGE_MESSAGE, async (route) => {
        if (route.request().method() !== "POST") return route.continue();
        posts += 1;
        if (posts < 3) return route.continue();
        held();
        return undefined; // left pending: the tab closes before it is sent
      });
    }
    if (config.plain) {
      // As a person would: no task, no token; the page finds the public demo task.
      await page.goto(`${config.url}/demo`);
    } else {
      const fragment = new URLSearchParams({ task: config.task, token: config.token, shard, shards: config.of });
      await page.goto(`${config.url}/demo#${fragment}`);
    }
    opened.push({ context, page, index, reachedHold });
  }
  const results = [];
  for (const tab of opened) {
    const { page, index } = tab;
    if (index === config.close) {
      await tab.reachedHold;
      await shot(page, `${config.name}-tab-${index}-before-close`);
      results.push({ closed: true, participant: await page.textContent("#participant"), problems: page.problems });
      await tab.context.close();
      continue;
    }
    try {
      await page.waitForFunction(() => Number(document.getElementById("rounds-done").textContent) >= 1 ||
        document.body.dataset.state?.startsWith("stopped"));
      // The metrics report follows the round's end.
      await page.waitForFunction(() => document.querySelectorAll("#chart circle").length >= 2);
    } catch (error) {
      await shot(page, `${config.name}-tab-${index}-failed`);
      const state = await page.evaluate(() => document.body.dataset.state);
      const log = await page.$$eval("#log li", (items) => items.map((i) => i.textContent));
      throw new Error(`tab ${index}: ${error.message}\nstate: ${state}\nlog: ${log.join("\n")}\n${page.problems.join("\n")}`);
    }
    await shot(page, `${config.name}-tab-${index}`);
    results.push({
      participant: await page.textContent("#participant"),
      state: await page.evaluate(() => document.body.dataset.state),
      data: await page.textContent("#data"),
      log: await page.$$eval("#log li", (items) => items.map((i) => i.textContent)),
      traffic: await page.textContent("#traffic"),
      points: await page.$$eval("#chart circle", (c) => c.map((p) => Number(p.dataset.x))),
      address: page.url(),
      problems: page.problems,
    });
    await tab.context.close();
  }
  return { tabs: results };
}

async function statusOf(task) {
  const response = await fetch(`${config.url}/admin/tasks/${task}`, {
    headers: { authorization: `Bearer ${config.adminToken}` },
  });
  return (await response.json()).status;
}

async function dashboard() {
  const page = await newPage(await browser.newContext(), "admin");
  page.on("dialog", (dialog) => dialog.accept());
  await login(page);
  // A finished task is listed under "Finished tasks", folded away.
  await page.waitForSelector(`tr[data-task="${config.task}"]`, { state: "attached" });
  await page.evaluate(() => { document.getElementById("finished-tasks").open = true; });
  await page.click(`tr[data-task="${config.task}"]`);
  await page.waitForSelector(`#detail[data-task="${config.task}"]`);
  const seen = { controls: [] };
  if (config.rounds) {
    await page.waitForFunction((n) => document.querySelectorAll("#rounds tbody tr").length >= n, config.rounds);
    await page.waitForFunction(() => document.querySelectorAll("#chart-accuracy circle").length >= 1);
    seen.rounds = await page.$$eval("#rounds tbody tr", (rows) => rows.map((row) => ({
      round: Number(row.dataset.round),
      cells: [...row.cells].map((c) => c.textContent),
      survivors: Number(row.querySelector("[data-field=survivors]").textContent),
      dropouts: row.querySelector("[data-field=dropouts]").textContent,
    })));
    seen.accuracy_points = await page.$$eval("#chart-accuracy circle", (c) => c.map((p) => [Number(p.dataset.x), Number(p.dataset.y)]));
    seen.loss_points = await page.$$eval("#chart-loss circle", (c) => c.map((p) => [Number(p.dataset.x), Number(p.dataset.y)]));
  }
  if (config.buffer) {
    await page.waitForSelector("#buffer:not(.hidden)");
    await page.waitForFunction((v) => document.getElementById("buffer-version").textContent === String(v), config.buffer.version);
    seen.buffer = await page.evaluate(() => ({
      version: document.getElementById("buffer-version").textContent,
      training: document.getElementById("buffer-training").textContent,
      waiting: document.getElementById("buffer-waiting").textContent,
      bound: document.getElementById("buffer-bound").textContent,
      groups: document.querySelectorAll("#buffer-groups tbody tr").length,
      histogram: [...document.querySelectorAll("#buffer-histogram .bar")].map((bar) => [
        bar.previousElementSibling.textContent, bar.nextElementSibling.textContent, bar.style.width,
      ]),
      clients: document.getElementById("detail-clients").textContent,
    }));
  }
  if (config.attempts) {
    await page.waitForFunction((n) => document.querySelectorAll("#attempts tbody tr").length >= n, config.attempts);
    seen.attempts = await page.$$eval("#attempts tbody tr", (rows) => rows.map((row) => [...row.cells].map((c) => c.textContent)));
  }
  seen.status = await page.textContent("#detail-status");
  // Fits the default 1280 px window: nothing wider than the page.
  seen.overflows = await page.evaluate(() => document.documentElement.scrollWidth > window.innerWidth);
  seen.privacy = await page.textContent("#detail-privacy");
  seen.epsilon = await page.textContent("#detail-epsilon");
  await shot(page, config.name);
  if (config.controls) {
    await page.fill("#token-name", "android");
    await page.fill("#token-rate", "30");
    await page.click("#token-form button[type=submit]");
    await page.waitForSelector("#token-new:not(.hidden)");
    const shown = await page.textContent("#token-new-value");
    await page.waitForSelector("#tokens tbody tr:nth-child(2)");
    const listed = await page.$$eval("#tokens tbody tr", (rows) => rows.map((r) => [...r.cells].slice(0, 3).map((c) => c.textContent)));
    await page.click("#token-new-done");
    const hidden = await page.evaluate(() => document.getElementById("token-new-value").textContent === "");
    const id = await page.$eval("#tokens tbody tr:nth-child(2)", (row) => row.dataset.token);
    await page.click(`#tokens tr[data-token="${id}"] button`);
    await page.waitForFunction((t) => document.querySelector(`#tokens tr[data-token="${t}"] [data-field=revoked]`).textContent !== "—", id);
    seen.token = { shown, listed, hidden, id };
    seen.delete_disabled_running = await page.isDisabled("#delete");
    for (const [button, expected] of [["pause", "paused"], ["resume", "active"], ["stop", "stopped"]]) {
      await page.click(`#${button}`);
      await page.waitForFunction((s) => document.getElementById("detail-status").textContent === s, expected);
      seen.controls.push({ button, shown: expected, api: await statusOf(config.task) });
    }
    seen.stop_disabled = await page.isDisabled("#stop");
    // A stopped task goes under "Finished tasks".
    await page.waitForSelector(`#finished tr[data-task="${config.task}"]`, { state: "attached" });
    seen.finished = await page.textContent("#finished-summary");
    await shot(page, `${config.name}-stopped`);
  }
  if (config.delete) {
    // Only a task that is over can be deleted; its row goes.
    await page.waitForSelector("#delete:not([disabled])");
    await page.click("#delete");
    await page.waitForSelector(`tr[data-task="${config.task}"]`, { state: "detached" });
    seen.deleted = (await fetch(`${config.url}/admin/tasks/${config.task}`, {
      headers: { authorization: `Bearer ${config.adminToken}` },
    })).status;
  }
  // Nothing secret on the page: not the enrollment token, not a credential.
  const text = await page.evaluate(() => document.documentElement.outerHTML);
  seen.leaked = [...(config.secrets ?? []), seen.token?.shown].filter((secret) => secret && text.includes(secret));
  seen.problems = page.problems;
  return seen;
}

/** A bare /demo tab in a context of its own; `holdThird` holds its masked input. */
async function demoTab(label, holdThird) {
  const context = await browser.newContext();
  const page = await newPage(context, label);
  let held = null;
  page.reachedHold = new Promise((resolve) => { held = resolve; });
  if (holdThird) {
    let posts = 0;
    await context.route(STAGE_MESSAGE, async (route) => {
      if (route.request().method() !== "POST") return route.continue();
      posts += 1;
      if (posts < 3) return route.continue();
      held();
      return undefined; // never sent: the tab closes first
    });
  }
  await page.goto(`${config.url}/demo`);
  page.context_ = context;
  return page;
}

async function roundsDone(page, atLeast, label) {
  try {
    await page.waitForFunction((n) => Number(document.getElementById("rounds-done").textContent) >= n, atLeast);
  } catch (error) {
    await shot(page, `${config.name}-${label}-failed`);
    const log = await page.$$eval("#log li", (items) => items.map((i) => i.textContent));
    throw new Error(`tab ${label}: ${error.message}\nlog: ${log.join("\n")}\n${page.problems.join("\n")}`);
  }
}

/** Closes a tab as a person does: the page unloads (pagehide runs). */
async function closeTab(page) {
  await page.close({ runBeforeUnload: true });
}

async function dropouts() {
  const a = await demoTab("A");
  const b = await demoTab("B");
  const c = await demoTab("C", true);
  await c.reachedHold;
  await closeTab(c);
  await roundsDone(a, 1, "A");
  await roundsDone(b, 1, "B");
  await closeTab(b);
  const d = await demoTab("D");
  const e = await demoTab("E");
  await roundsDone(a, 2, "A");
  await roundsDone(d, 1, "D");
  await roundsDone(e, 1, "E");
  await shot(a, `${config.name}-A`);
  const seen = {};
  for (const [label, page] of Object.entries({ A: a, D: d, E: e })) {
    seen[label] = {
      rounds: Number(await page.textContent("#rounds-done")),
      log: await page.$$eval("#log li", (items) => items.map((i) => i.textContent)),
      problems: page.problems,
    };
  }
  return { tabs: seen };
}

/** The points of one series of a tab's accuracy chart, as [[n, accuracy]]. */
function chartPoints(page, index) {
  return page.$$eval(`#chart .series-${index} circle`,
    (dots) => dots.map((dot) => [Number(dot.dataset.x), Number(dot.dataset.y)]));
}

async function learn() {
  const tabs = [];
  for (const label of ["A", "B", "C"]) tabs.push(await demoTab(label));
  const seen = [];
  for (const [index, page] of tabs.entries()) {
    // The global model after round n is measured when round n + 1 trains.
    try {
      await page.waitForFunction((n) => [...document.querySelectorAll("#chart .series-0 circle")]
        .some((dot) => Number(dot.dataset.x) >= n), config.rounds);
    } catch (error) {
      await shot(page, `${config.name}-${index}-failed`);
      throw new Error(`tab ${index}: ${error.message}\n${page.problems.join("\n")}`);
    }
    if (index === 0) await shot(page, config.name);
    seen.push({
      data: await page.textContent("#data"),
      global: await chartPoints(page, 0),
      local: await chartPoints(page, 1),
      legend: await page.$$eval("#chart .legend li", (items) => items.map((item) => item.textContent)),
      problems: page.problems,
    });
  }
  return { tabs: seen };
}

async function live() {
  const page = await newPage(await browser.newContext(), "admin");
  const requests = [];
  page.on("request", (request) => {
    const url = new URL(request.url());
    if (url.pathname.startsWith("/admin/") || url.pathname === "/admin") requests.push(`${request.method()} ${url.pathname}`);
  });
  await page.goto(`${config.url}/admin#task=${config.task}`);
  await page.fill("#admin-token", config.adminToken);
  await page.click("#login-form button[type=submit]");
  await page.waitForSelector(`#detail[data-task="${config.task}"]:not(.hidden)`);
  // Every change of the live stage, with the timeline's bars at that moment.
  await page.evaluate(() => {
    window.seenStages = [];
    const record = () => {
      const stage = document.getElementById("live-stage").textContent;
      const live = !document.getElementById("live").classList.contains("hidden");
      const bars = [...document.querySelectorAll("#live-stages span")].map((bar) => [bar.className, bar.textContent]);
      const last = window.seenStages.at(-1);
      if (live && stage && (!last || last.stage !== stage)) window.seenStages.push({ stage, bars });
    };
    new MutationObserver(record).observe(document.getElementById("detail"), { subtree: true, childList: true, characterData: true });
  });
  writeFileSync(config.ready, "ready");
  await page.waitForFunction((n) => document.querySelectorAll("#rounds tbody tr").length >= n, config.rounds);
  // Long enough for a once-a-second poll to show itself.
  await page.waitForTimeout(3000);
  await shot(page, config.name);
  return {
    stages: await page.evaluate(() => window.seenStages),
    requests,
    banner: await page.$$eval("#privacy-banner div", (lines) => lines.map((line) => line.textContent)),
    ratio: await page.textContent("#rounds tbody tr [data-field=ratio]"),
    bytes_points: await page.$$eval("#chart-bytes circle", (dots) => dots.length),
    live_hidden: await page.evaluate(() => document.getElementById("live").classList.contains("hidden")),
    enrolled: await page.textContent("#tokens tbody tr:first-child td:nth-child(2)"),
    connection: await page.textContent("#connection"),
    problems: page.problems,
  };
}

async function bare() {
  const page = await newPage(await browser.newContext(), "bare");
  await page.goto(`${config.url}/demo`);
  await page.waitForSelector("#join:not(.hidden)");
  await shot(page, config.name);
  return { join: await page.isVisible("#join-form"), client: await page.isVisible("#client"), problems: page.problems };
}

async function projects() {
  const seen = {};
  const problems = [];
  for (const [who, key] of Object.entries(config.keys)) {
    const page = await newPage(await browser.newContext(), who);
    await page.goto(`${config.url}/admin`);
    await page.fill("#admin-token", key);
    await page.click("#login-form button[type=submit]");
    await page.waitForSelector("#dashboard:not(.hidden)");
    await page.waitForFunction(() => document.querySelectorAll("#tasks tbody tr, #finished tbody tr").length > 0);
    const owner = await page.evaluate(() => !document.getElementById("keys-section").classList.contains("hidden"));
    if (owner) await page.waitForFunction(() => document.querySelectorAll("#audit tbody tr").length > 0);
    const shown = (id) => page.evaluate((id) => {
      const element = document.getElementById(id);
      return element.closest(".role-hidden, .hidden") === null;
    }, id);
    const rows = (id) => page.evaluate((id) =>
      [...document.querySelectorAll(`#${id} tbody tr`)].map((row) => [...row.cells].map((c) => c.textContent)), id);
    const result = {
      session: await page.textContent("#session"),
      tasks: await page.evaluate(() =>
        [...document.querySelectorAll("#tasks tbody tr, #finished tbody tr")].map((row) => row.dataset.task)),
      new_task: await shown("show-create"),
      token_form: await page.evaluate(() => document.getElementById("token-form").closest(".role-hidden") === null),
      projects: await shown("projects-section") ? await rows("projects") : null,
      keys: owner ? await rows("keys") : null,
      audit: owner ? await rows("audit") : null,
    };
    // The quotas: every role sees them; an owner sets the project's own
    // limits, the admin token (after choosing the project) its quotas.
    const quotaCell = (quota, column) => page.evaluate(([quota, column]) =>
      document.querySelector(`#quotas tr[data-quota="${quota}"]`)?.cells[column].textContent ?? null, [quota, column]);
    const setQuota = async (form, quota, value, column) => {
      await page.fill(`#${form} input[name=${quota}]`, value);
      await page.click(`#${form} button[type=submit]`);
      await page.waitForFunction(([quota, column, value]) =>
        document.querySelector(`#quotas tr[data-quota="${quota}"]`)?.cells[column].textContent === value,
        [quota, column, value]);
    };
    if (config.quotas?.[who]) {
      if (!(await shown("quotas-section"))) {
        await page.click(`#projects tbody tr:has(td:text-is("${config.quotas[who].project}"))`);
      }
      await page.waitForSelector("#quotas tbody tr");
      const { form, quota, value } = config.quotas[who];
      await setQuota(form, quota, value, form === "owner-quotas-form" ? 3 : 2);
    }
    result.quotas = await shown("quotas-section") ? await rows("quotas") : null;
    result.quota_forms = {
      operator: await shown("operator-quotas-form"),
      owner: await shown("owner-quotas-form"),
    };
    if (owner) {
      await page.fill("#key-name", "made in the dashboard");
      await page.selectOption("#key-role", "viewer");
      await page.click("#key-form button[type=submit]");
      await page.waitForSelector("#key-new:not(.hidden)");
      result.created_key = await page.textContent("#key-new-value");
      await page.click("#key-new-done");
      result.created_key_hidden = (await page.textContent("#key-new-value")) === "";
    }
    await shot(page, `${config.name}-${who}`);
    problems.push(...page.problems);
    seen[who] = result;
  }
  return { seen, problems };
}

const steps = { create, tabs, dashboard, dropouts, learn, live, bare, projects };
try {
  if (!steps[step]) throw new Error(`unknown step ${step}`);
  console.log(JSON.stringify(await steps[step]()));
} finally {
  await browser.close();
}
