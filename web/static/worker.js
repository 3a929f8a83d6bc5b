// The demo's Web Worker: loads the wasm client and this tab's digits, then
// takes part in rounds until the task finishes. The protocol runs in wasm;
// this file moves bytes (driver.js) and reports progress to the page.

import init, { WebClient, stoppedReason } from "/web/pkg/cohort_web.js";
import { runRound } from "/web/driver.js";

async function bytesOf(path) {
  const response = await fetch(path);
  if (!response.ok) throw new Error(`${path}: ${response.status} ${(await response.text()).trim()}`);
  return new Uint8Array(await response.arrayBuffer());
}

async function main({ task, token, shard, shards, saved, config, policy }) {
  postMessage({ type: "state", text: "loading the client" });
  await init();
  const client = new WebClient(task, token, saved ?? undefined, policy);
  const [images, labels] = await Promise.all([bytesOf("/web/pkg/digits-images.idx"), bytesOf("/web/pkg/digits-labels.idx")]);
  postMessage({ type: "data", summary: JSON.parse(client.use_digits(images, labels, shard, shards)) });
  // Settings the page did not give keep the client's defaults.
  client.set_training_config(config.epochs, config.batch, config.lr);
  let enrolled = null;
  // Tells the page once the client holds an enrollment (at once when it
  // resumed one).
  const announce = () => {
    if (enrolled || !client.participant_id()) return;
    enrolled = client.participant_id();
    // The request that tells the coordinator this tab left: the page sends
    // it as it closes (the worker does not outlive it).
    postMessage({
      type: "enrolled", participant: enrolled, saved: client.saved_state(), leave: JSON.parse(client.leave_request()),
    });
    postMessage({ type: "state", text: "waiting for a round" });
  };
  announce();
  if (!enrolled) postMessage({ type: "state", text: "enrolling" });
  let round = null;
  const hooks = {
    onAction(action) {
      announce();
      if (action.kind === "send" && action.stage) postMessage({ type: "stage", round, stage: action.stage });
    },
    onTrain(c, action) {
      round = action.round;
      postMessage({ type: "state", text: `training round ${action.round}` });
      postMessage({ type: "trained", report: JSON.parse(c.train()) });
    },
  };
  for (;;) {
    const ended = await runRound(client, "", hooks);
    if (ended.kind === "finished") {
      postMessage({ type: "finished" });
      return;
    }
    round = null;
    postMessage({ type: "round", action: ended });
    postMessage({ type: "state", text: "waiting for a round" });
  }
}

addEventListener("message", ({ data }) => {
  main(data).catch((error) => {
    // A panic in the client aborts the wasm call with a bare RuntimeError;
    // the client keeps the panic's message and refuses every later call.
    const stopped = stoppedReason();
    const message = stopped
      ? `the client stopped after an internal error (${stopped}); reload the page`
      : String(error?.message ?? error);
    postMessage({ type: "error", message });
  });
}, { once: true });
