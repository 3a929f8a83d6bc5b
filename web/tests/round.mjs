// Driven by tests/tests/e2e/web.rs against a running `cohort serve`: two wasm
// clients (the browser build, under Node) take part in one secure round
// with native clients. Client A submits a fixed update, client B trains
// on supplied data with the built-in trainer; both mirrored by the Rust
// test, which checks the aggregate.
//
// Usage: node web/tests/round.mjs URL TASK TOKEN POLICY_JSON
import { readFileSync } from "node:fs";
import init, { WebClient, stoppedReason } from "../pkg/cohort_web.js";
import { runRound } from "../static/driver.js";

const [url, task, token, policy] = process.argv.slice(2);
await init({ module_or_path: readFileSync(new URL("../pkg/cohort_web_bg.wasm", import.meta.url)) });

const check = (condition, message) => {
  if (!condition) throw new Error(`check failed: ${message}`);
};

const a = new WebClient(task, token, undefined, policy);
const b = new WebClient(task, token, undefined, policy);
const rows = 30;
const features = new Float32Array(rows * 4);
const labels = new Uint8Array(rows);
for (let i = 0; i < rows; i++) {
  labels[i] = i % 3;
  for (let j = 0; j < 4; j++) features[i * 4 + j] = (((i % 3) * 5 + j * 3 + i) % 7) / 7;
}
b.set_training_data(features, 4, labels);
b.set_test_data(features, 4, labels);
b.set_training_config(2, 5, 0.1);

// Nothing has panicked; a paused client waits (and says so) until resumed.
check(stoppedReason() === undefined, "no stop reason while the clients run");
b.pause();
const paused = JSON.parse(b.next(0));
check(b.is_paused() && paused.kind === "wait" && paused.paused === true, `paused: ${JSON.stringify(paused)}`);
b.resume();
check(!b.is_paused(), "resumed");

const stages = new Set();
const reports = [];
// Client A hands its agreements and key streams to WebCrypto (driver.js's
// default, Node's WebCrypto here); client B keeps them in wasm. What
// WebCrypto supplied is counted: the client would compute what it left.
const hostWork = { a: [], b: [] };
const supplied = { agreements: 0, streams: 0 };
const agreed = a.agreed.bind(a);
a.agreed = (shared, given) => {
  supplied.agreements += given.reduce((sum, x) => sum + x, 0);
  return agreed(shared, given);
};
const addKeyStream = a.add_key_stream.bind(a);
a.add_key_stream = (index, stream) => {
  addKeyStream(index, stream);
  supplied.streams += 1;
};
const [endA, endB] = await Promise.all([
  runRound(a, url, {
    onTrain: (client, action) => {
      const delta = new Float32Array(action.parameters);
      for (let j = 0; j < delta.length; j++) delta[j] = 0.02 * ((j % 5) - 2);
      client.submit(delta, 7);
    },
    onAction: (action) => {
      if (action.stage) stages.add(action.stage);
      if (action.kind === "host_work") hostWork.a.push(action.work);
    },
  }),
  runRound(b, url, {
    onTrain: (client) => reports.push(JSON.parse(client.train())),
    onAction: (action) => action.kind === "host_work" && hostWork.b.push(action.work),
    webCrypto: false,
  }),
]);
// Two agreement steps (cipher keys, mask keys), then the key streams.
check(hostWork.a.join(",") === "agreements,agreements,key_streams" && hostWork.b.length === 0,
  JSON.stringify(hostWork));
// Five clients in the complete graph: four peers, two agreements each, and
// five masks (its own and one a peer).
check(supplied.agreements === 8 && supplied.streams === 5, JSON.stringify(supplied));
for (const end of [endA, endB]) {
  console.log(JSON.stringify(end));
  check(end.kind === "round_ended" && end.outcome === "completed" && end.round === 1, JSON.stringify(end));
  // Both ways; the upload carries the input's norm proof, so it may be the larger.
  check(end.bytes_up > 0 && end.bytes_down > 0, "traffic");
}
check(reports.length === 1 && reports[0].examples === rows, JSON.stringify(reports));
check(typeof reports[0].local_accuracy === "number", "local accuracy reported");
check(stages.has("advertise-keys") && stages.has("masked-input-collection") && stages.has("unmasking"),
  [...stages].join(","));
const saved = JSON.parse(a.saved_state());
check(saved.participant_id === a.participant_id() && saved.last_completed_round === 1, a.saved_state());
const resumed = new WebClient(task, token, a.saved_state(), policy);
check(resumed.participant_id() === a.participant_id(), "resumed as the same participant");
try {
  new WebClient(task, "");
  check(false, "an empty token is refused");
} catch (error) {
  check(String(error).includes("enrollment token"), String(error));
}
console.log("WEB OK");
