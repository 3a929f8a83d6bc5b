// Driven by tests/tests/e2e/web.rs against a running `cohort serve`: two wasm
// clients (the browser build, under Node) take part in an async task with
// a native client. Each is told to train, submits a fixed update (mirrored
// by the Rust test, which checks the aggregate), waits with it until the
// buffer of three fills, and completes the group it is offered.
//
// Usage: node web/tests/async.mjs URL TASK TOKEN POLICY_JSON
import { readFileSync } from "node:fs";
import init, { WebClient } from "../pkg/cohort_web.js";
import { runRound } from "../static/driver.js";

const [url, task, token, policy] = process.argv.slice(2);
await init({ module_or_path: readFileSync(new URL("../pkg/cohort_web_bg.wasm", import.meta.url)) });

const check = (condition, message) => {
  if (!condition) throw new Error(`check failed: ${message}`);
};

const trained = [];
const client = (scale) =>
  runRound(new WebClient(task, token, undefined, policy), url, {
    onTrain: (c, action) => {
      trained.push(action.round);
      const delta = new Float32Array(action.parameters);
      for (let j = 0; j < delta.length; j++) delta[j] = scale * ((j % 5) - 2);
      c.submit(delta, 7);
    },
  });
const ends = await Promise.all([client(0.02), client(-0.01)]);
for (const end of ends) {
  console.log(JSON.stringify(end));
  check(end.kind === "round_ended" && end.outcome === "completed" && end.round > 0, JSON.stringify(end));
}
check(trained.length === 2 && trained.every((version) => version === 0), `trained from ${trained}`);
console.log("ASYNC WEB OK");
