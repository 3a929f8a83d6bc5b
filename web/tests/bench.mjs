// Measures the browser client's secure-aggregation time per round in
// Debian's Chromium (playwright-core, never a downloaded browser), beside
// the native client's: serves web/pkg (scripts/build-web.sh) and
// web/static on a loopback port, opens a page that drives a `BenchRound` of
// the wasm build (web/src/bench.rs: one round of CLIENTS clients in the
// complete graph, k = CLIENTS − 1, over DIM coordinates, every client on
// the page's thread, one at a time) twice with the same seeds: once with
// every agreement and key stream in wasm (`wasm`), once with them handed
// to WebCrypto (`webcrypto`, web/static/webcrypto.js, as the browser
// client does). The two runs must send the same messages: every client's
// transcript (FNV-1a of the messages it sent) is compared, and the script
// fails if any differs, a sum is wrong or WebCrypto left any work to the
// client. With "native": the path of a release `cohort`, each run is
// followed by `cohort bench secagg` at the same settings, and the report
// gives each run's ratio to the native run beside it and their median.
// Prints one JSON line.
//
//   node web/tests/bench.mjs '{"clients": 75, "dim": 100000, "t": 50, "bits": 32, "runs": 7,
//                              "native": "/var/tmp/cohort-target/release/cohort"}'
//
// With "prove": m, it times one client's input-validation proof over m
// values instead (`benchProve`).
//
//   node web/tests/bench.mjs '{"prove": 100000}'
import { execFileSync } from "node:child_process";
import { readFile } from "node:fs/promises";
import { dirname, join, normalize } from "node:path";
import { fileURLToPath } from "node:url";

import { launchChromium, serveOnLoopback } from "./chromium.mjs";

const config = { clients: 75, dim: 100000, t: 50, bits: 32, runs: 1, seed: 5, ...JSON.parse(process.argv[2] ?? "{}") };
const web = join(dirname(fileURLToPath(import.meta.url)), "..");
const page = `<!doctype html><meta charset="utf-8"><title>bench</title>
<script type="module">
import init, { BenchRound, benchProve } from "/pkg/cohort_web.js";
import { hostWork } from "/static/webcrypto.js";
await init();
// Client i of round r, as webcrypto.js sees a WebClient; the time wasm
// takes to add the key streams it is handed, and to go on with the step
// from the agreements, is counted apart.
let adding = 0;
let taking = 0;
const host = (r, i) => ({
  host_step: () => r.host_step(i),
  host_secret: () => r.host_secret(i),
  host_peers: () => r.host_peers(i),
  host_key: (mask) => r.host_key(i, mask),
  agreed: (shared, supplied) => {
    const start = performance.now();
    r.agreed(i, shared, supplied);
    taking += performance.now() - start;
  },
  add_key_stream: (mask, stream) => {
    const start = performance.now();
    r.add_key_stream(i, mask, stream);
    adding += performance.now() - start;
  },
  complete_host_work: () => r.complete_host_work(i),
});
const round = async ({ clients, dim, t, bits, seed }, hostCrypto) => {
  const r = new BenchRound(clients, dim, t, bits, seed);
  const busy = new Float64Array(clients);
  // Where a client's time goes, summed over the clients: each stage's step
  // in wasm (decoding, checking, sealing, encoding) and each kind of work
  // handed to the page (WebCrypto, and wasm taking its results).
  const phases = {};
  const account = (name, ms) => { phases[name] = (phases[name] ?? 0) + ms; };
  const started = performance.now();
  for (let i = 0; i < clients; i++) {
    const start = performance.now();
    r.start(i);
    busy[i] += performance.now() - start;
  }
  for (let stage = 1; r.advance(); stage++) {
    for (let i = 0; i < clients; i++) {
      const start = performance.now();
      let action = r.step(i, hostCrypto);
      let at = performance.now();
      account("stage_" + stage + "_step_ms", at - start);
      while (action) {
        const work = JSON.parse(action);
        await hostWork(host(r, i), work);
        const now = performance.now();
        account("stage_" + stage + "_" + work.work + "_ms", now - at);
        at = now;
        action = r.hostAction(i);
      }
      busy[i] += performance.now() - start;
    }
  }
  if (hostCrypto) {
    account("adding_key_streams_ms", adding);
    account("taking_agreements_ms", taking);
  }
  adding = 0;
  taking = 0;
  for (const name of Object.keys(phases)) phases[name] /= clients;
  const times = Array.from(busy);
  const report = {
    client_ms_mean: times.reduce((a, b) => a + b, 0) / clients,
    client_ms_min: Math.min(...times),
    client_ms_max: Math.max(...times),
    total_ms: performance.now() - started,
    sum_correct: r.sum_correct(),
    transcripts: times.map((_, i) => r.transcript(i)),
    host: JSON.parse(r.host_counts()),
    phases,
  };
  r.free();
  return report;
};
// One run: the round in wasm, then through WebCrypto.
window.run = async (config) => ({ wasm: await round(config, false), webcrypto: await round(config, true) });
window.prove = (m) => JSON.parse(benchProve(m));
window.ready = true;
</script>`;
const types = { ".js": "text/javascript", ".wasm": "application/wasm" };

const server = await serveOnLoopback(async (request, response) => {
  const path = normalize(new URL(request.url, "http://localhost").pathname);
  if (path === "/") {
    response.writeHead(200, { "content-type": "text/html" });
    response.end(page);
    return;
  }
  const type = types[path.slice(path.lastIndexOf("."))];
  const root = path.startsWith("/pkg/") ? "pkg" : path.startsWith("/static/") ? "static" : null;
  if (!root || path.includes("..") || !type) {
    response.writeHead(404).end();
    return;
  }
  try {
    const body = await readFile(join(web, root, path.slice(root.length + 2)));
    response.writeHead(200, { "content-type": type });
    response.end(body);
  } catch {
    response.writeHead(404).end();
  }
});

const browser = await launchChromium();
try {
  const tab = await browser.newPage();
  const problems = [];
  tab.on("pageerror", (error) => problems.push(error.message));
  tab.on("console", (message) => {
    if (message.type() === "error") problems.push(message.text());
  });
  await tab.goto(`http://127.0.0.1:${server.address().port}/`);
  await tab.waitForFunction(() => window.ready === true, null, { timeout: 60_000 })
    .catch((error) => { throw new Error(`${error.message}; page: ${problems.join("; ")}`); });
  const browserName = `chromium ${browser.version()}`;
  if (config.prove) {
    const report = await tab.evaluate((m) => window.prove(m), config.prove);
    console.log(JSON.stringify({ browser: browserName, ...report }));
  } else {
    // Each run: the round in wasm, the round through WebCrypto, then (with
    // "native") the native bench, so that the machine's drift touches the
    // three alike.
    const median = (list) => [...list].sort((a, b) => a - b)[Math.floor(list.length / 2)];
    const runs = { wasm: [], webcrypto: [] };
    const native = [];
    for (let run = 0; run < config.runs; run++) {
      const one = await tab.evaluate((c) => window.run(c), config)
        .catch((error) => { throw new Error(`${error.message}; page: ${problems.join("; ")}`); });
      runs.wasm.push(one.wasm);
      runs.webcrypto.push(one.webcrypto);
      if (config.native) {
        const out = execFileSync(config.native, ["bench", "secagg", "--clients", String(config.clients),
          "--dim", String(config.dim), "--graph", "complete", "--dropout", "0", "--t", String(config.t),
          "--modulus-bits", String(config.bits), "--variant", "semi-honest", "--threads", "1", "--json"],
          { encoding: "utf8" });
        native.push(JSON.parse(out.trim().split("\n").pop()).client_ms_mean);
      }
    }
    // WebCrypto must have done all of the work: the client would do
    // whatever it left, and the transcripts would match anyway.
    for (const run of runs.webcrypto) {
      const h = run.host;
      if (h.agreements_supplied !== h.agreements_asked || h.key_streams_supplied !== h.key_streams_asked) {
        throw new Error(`WebCrypto left work to the client: ${JSON.stringify(h)}`);
      }
    }
    const expected = runs.wasm[0].transcripts;
    for (const [path, list] of Object.entries(runs)) {
      for (const run of list) {
        if (run.sum_correct !== true) throw new Error(`the ${path} round's sum is wrong`);
        const differ = run.transcripts.findIndex((t, i) => t !== expected[i]);
        if (differ >= 0) {
          throw new Error(`client ${differ + 1} sent other messages with ${path}: ${run.transcripts[differ]} against ${expected[differ]}`);
        }
      }
    }
    const summary = (list) => ({
      client_ms_mean: list.map((r) => r.client_ms_mean),
      client_ms_min: Math.min(...list.map((r) => r.client_ms_min)),
      client_ms_max: Math.max(...list.map((r) => r.client_ms_max)),
      total_ms: list.map((r) => r.total_ms),
      host: list[0].host,
      phases_ms_per_client: list[list.length - 1].phases,
    });
    const report = {
      browser: browserName, clients: config.clients, dim: config.dim, k: config.clients - 1, t: config.t,
      modulus_bits: config.bits, runs: config.runs, same_messages: true, transcripts: expected,
      wasm: summary(runs.wasm), webcrypto: summary(runs.webcrypto),
    };
    if (config.native) {
      report.native = { client_ms_mean: native };
      // Each run's ratio to the native run beside it; their median.
      const ratios = (path) => report[path].client_ms_mean.map((ms, i) => ms / native[i]);
      report.ratio = { wasm: median(ratios("wasm")), webcrypto: median(ratios("webcrypto")) };
      report.ratios = { wasm: ratios("wasm"), webcrypto: ratios("webcrypto") };
    }
    console.log(JSON.stringify(report));
  }
} finally {
  await browser.close();
  server.close();
}
