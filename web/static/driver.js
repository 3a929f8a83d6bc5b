// Drives a WebClient (cohort-web's wasm facade) over fetch: the browser's
// Web Worker and the Node end-to-end test share this loop. The wasm side
// decides every request; this file only moves bytes and keeps time.

import { hostWork, webCryptoAvailable } from "./webcrypto.js";

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/**
 * Runs `client` until one round it was selected for ends (or the task
 * finishes); resolves with that `round_ended` / `finished` action.
 *
 * @param {WebClient} client
 * @param {string} baseUrl  the coordinator, e.g. "https://coordinator.example" or "" (same origin)
 * @param {{onTrain: function(WebClient, object): void, onAction?: function(object): void,
 *          shouldStop?: function(): boolean, webCrypto?: boolean}} hooks
 *   onTrain must call client.train() or client.submit(delta, examples);
 *   onAction sees every action (progress display); shouldStop, when it
 *   returns true, makes the client vanish from the round; webCrypto: false
 *   keeps the round's agreements and key streams in wasm (by default they
 *   go to WebCrypto where the page has it: webcrypto.js).
 */
export async function runRound(client, baseUrl, hooks) {
  client.set_host_crypto(hooks.webCrypto !== false && webCryptoAvailable());
  for (;;) {
    if (hooks.shouldStop && hooks.shouldStop()) {
      client.vanish("stopped by the page");
    }
    const action = JSON.parse(client.next(performance.now()));
    if (hooks.onAction) hooks.onAction(action);
    switch (action.kind) {
      case "send": {
        const headers = {};
        if (action.bearer) headers.authorization = `Bearer ${action.bearer}`;
        if (action.content_type) headers["content-type"] = action.content_type;
        const body = action.method === "POST" ? client.request_body() : undefined;
        let response;
        try {
          const reply = await fetch(baseUrl + action.path, { method: action.method, headers, body });
          response = { status: reply.status, bytes: new Uint8Array(await reply.arrayBuffer()) };
        } catch (error) {
          // No response: the participant schedules a retry (or gives up,
          // throwing a typed error).
          client.transport_failed(performance.now(), String(error));
          break;
        }
        client.handle(performance.now(), response.status, response.bytes);
        break;
      }
      case "wait":
        await sleep(Math.min(action.ms, 1000));
        break;
      case "train":
        hooks.onTrain(client, action);
        break;
      case "host_work":
        await hostWork(client, action);
        break;
      case "round_ended":
      case "finished":
        return action;
      default:
        throw new Error(`unknown action ${action.kind}`);
    }
  }
}
