// Measures the browser client's secure-aggregation time per round in
// Debian's Chromium (playwright-core, never a downloaded browser): serves
// web/pkg (scripts/build-web.sh) on a loopback port, opens a page that runs
// `benchSecagg` of the wasm build (web/src/bench.rs: one round of CLIENTS
// clients in the complete graph, k = CLIENTS − 1, over DIM coordinates, all
// on the page's thread) and prints its report as one JSON line, with the
// browser's version.
//
//   node web/tests/bench.mjs '{"clients": 75, "dim": 100000, "t": 50, "bits": 32}'
//
// With "prove": m, it times one client's input-validation proof over m
// values instead (`benchProve`).
//
//   node web/tests/bench.mjs '{"prove": 100000}'
import { readFile } from "node:fs/promises";
import { dirname, join, normalize } from "node:path";
import { fileURLToPath } from "node:url";

import { launchChromium, serveOnLoopback } from "./chromium.mjs";

const config = { clients: 75, dim: 100000, t: 50, bits: 32, ...JSON.parse(process.argv[2] ?? "{}") };
const pkg = join(dirname(fileURLToPath(import.meta.url)), "..", "pkg");
const page = `<!doctype html><meta charset="utf-8"><title>bench</title>
<script type="module">
import init, { benchProve, benchSecagg } from "/pkg/cohort_web.js";
await init();
window.report = JSON.parse(${config.prove ? `benchProve(${config.prove})` : `benchSecagg(${config.clients}, ${config.dim}, ${config.t}, ${config.bits})`});
</script>`;
const types = { ".js": "text/javascript", ".wasm": "application/wasm" };

const server = await serveOnLoopback(async (request, response) => {
  const path = new URL(request.url, "http://localhost").pathname;
  if (path === "/") {
    response.writeHead(200, { "content-type": "text/html" });
    response.end(page);
    return;
  }
  const file = normalize(path).replace(/^\/pkg\//, "");
  const type = types[file.slice(file.lastIndexOf("."))];
  if (!path.startsWith("/pkg/") || file.includes("..") || !type) {
    response.writeHead(404).end();
    return;
  }
  try {
    const body = await readFile(join(pkg, file));
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
  await tab.waitForFunction(() => window.report || null, null, { timeout: 600_000, polling: 500 })
    .catch((error) => { throw new Error(`${error.message}; page: ${problems.join("; ")}`); });
  const report = await tab.evaluate(() => window.report);
  console.log(JSON.stringify({ browser: `chromium ${browser.version()}`, ...report }));
} finally {
  await browser.close();
  server.close();
}
