// What the scripts that drive Chromium share: Debian's Chromium through
// playwright-core (never a downloaded browser; `COHORT_CHROMIUM` and
// `COHORT_NPM_PREFIX` override where they are), and an HTTP server on a
// loopback port for the page they open.
import { createServer } from "node:http";
import { createRequire } from "node:module";
import { join } from "node:path";

const require = createRequire(import.meta.url);
const npm = process.env.COHORT_NPM_PREFIX ?? "/var/tmp/cohort-npm";
const { chromium } = require(join(npm, "node_modules/playwright-core"));

/** Chromium, headless, with `args` added to the usual ones. */
export function launchChromium(args = []) {
  return chromium.launch({
    executablePath: process.env.COHORT_CHROMIUM ?? "/usr/bin/chromium",
    args: ["--headless", "--no-sandbox", "--disable-gpu", ...args],
  });
}

/** A server for `handle(request, response)` listening on 127.0.0.1 (any free port). */
export async function serveOnLoopback(handle) {
  const server = createServer(handle);
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  return server;
}
