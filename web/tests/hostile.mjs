// Driven by tests/tests/e2e/hostile_clients.rs: CLIENTS wasm clients (the
// browser build, under Node) run against a scripted malicious coordinator
// until each has seen ROUNDS round outcomes, ended with an error, or
// PATIENCE_MS ran out (then the rest vanish). Each hands in a fixed update.
// Prints one JSON line: [{outcomes: [{outcome, rule}], error, rule}].
//
// Usage: node web/tests/hostile.mjs URL TASK TOKEN POLICY_JSON CLIENTS ROUNDS PATIENCE_MS
import { readFileSync } from "node:fs";
import init, { WebClient } from "../pkg/cohort_web.js";
import { runRound } from "../static/driver.js";

const [url, task, token, policy, clients, rounds, patience] = process.argv.slice(2);
await init({ module_or_path: readFileSync(new URL("../pkg/cohort_web_bg.wasm", import.meta.url)) });

let stopped = false;
const timer = setTimeout(() => { stopped = true; }, Number(patience));

async function client() {
  const ending = { outcomes: [], error: null, rule: null };
  try {
    const web = new WebClient(task, token, undefined, policy);
    while (ending.outcomes.length < Number(rounds) && !stopped) {
      const end = await runRound(web, url, {
        onTrain: (c, action) => c.submit(new Float32Array(action.parameters).fill(0.01), 3),
        shouldStop: () => stopped,
      });
      if (end.kind === "finished") break;
      ending.outcomes.push({ outcome: end.outcome, rule: end.rule ?? null });
    }
  } catch (error) {
    // A refusal that ends the participant names its rule ("rule min_clients").
    ending.error = String(error);
    ending.rule = /rule (\w+)/.exec(ending.error)?.[1] ?? null;
  }
  return ending;
}

const endings = await Promise.all(Array.from({ length: Number(clients) }, client));
clearTimeout(timer);
console.log(JSON.stringify(endings));
