// Measures, in Debian's Chromium (playwright-core, never a downloaded
// browser), what the browser's own WebCrypto takes for the two costs that
// dominate the wasm client's masking step at a given m and k: k + 1 mask key
// streams of 4m bytes (AES-128-CTR of zeros from counter 0, the mask PRG's
// definition) and k X25519 agreements. It does not use the wasm build; it
// tells what a client that handed these to WebCrypto could reach (issue
// 20's goal 4), against `cohort bench secagg` natively. Before timing
// anything it checks WebCrypto's AES-CTR against the first and last block of
// the key stream of the key 0x01 0x02 … 0x10 computed in Node (`node:crypto`,
// OpenSSL) and, when the caller passes them (`"expect": {"first": hex,
// "last": hex}`, as tests/tests/e2e/browser.rs does from `MaskPrg`), against
// those, so a wrong counter layout cannot pass; and it checks that AES-GCM
// gives the same key stream from block 2 on (below).
//
//   node web/tests/webcrypto.mjs '{"k": 74, "dim": 100000, "runs": 5}'
//
// Prints one JSON line per run: milliseconds for the key streams with every
// request in flight at once (`aes_parallel_ms`) and one after another
// (`aes_serial_ms`), the same streams from AES-GCM with every request in
// flight (`gcm_parallel_ms`: GCM's ciphertext of zeros under a zero 96-bit
// IV is the AES-CTR key stream from block 2 on, since GCM counts
// 0^96 ‖ 2, 3, …; checked before timing, so a browser whose GCM runs on a
// faster path than its CTR would show it), for the agreements in flight at
// once (`x25519_ms`, importing each peer's public key included), and for
// adding the key streams into one vector of 32-bit words in JavaScript
// (`add_ms`, a stand-in for the copy into wasm memory and the addition
// there).
import { createCipheriv } from "node:crypto";

import { launchChromium, serveOnLoopback } from "./chromium.mjs";

const config = { k: 74, dim: 100000, runs: 5, ...JSON.parse(process.argv[2] ?? "{}") };
const bytes = config.dim * 4;
if (!(config.dim >= 9)) {
  throw new Error("dim must be at least 9: the GCM check compares the key stream after its first two blocks");
}

// The reference: the first and last 16 bytes of AES-128-CTR of zeros under
// the key 0x01 0x02 … 0x10 with a 128-bit big-endian counter from zero.
const referenceKey = Uint8Array.from({ length: 16 }, (_, i) => i + 1);
const cipher = createCipheriv("aes-128-ctr", referenceKey, Buffer.alloc(16));
const referenceStream = Buffer.concat([cipher.update(Buffer.alloc(bytes)), cipher.final()]);
const reference = {
  first: referenceStream.subarray(0, 16).toString("hex"),
  last: referenceStream.subarray(bytes - 16).toString("hex"),
};

const page = `<!doctype html><meta charset="utf-8"><title>webcrypto</title>
<script type="module">
const subtle = crypto.subtle;
const hex = (view) => Array.from(view, (b) => b.toString(16).padStart(2, "0")).join("");
const ctr = { name: "AES-CTR", counter: new Uint8Array(16), length: 128 };
const gcm = { name: "AES-GCM", iv: new Uint8Array(12) };
window.check = async (keyBytes, bytes) => {
  const key = await subtle.importKey("raw", Uint8Array.from(keyBytes), "AES-CTR", false, ["encrypt"]);
  const stream = new Uint8Array(await subtle.encrypt(ctr, key, new Uint8Array(bytes)));
  const gcmKey = await subtle.importKey("raw", Uint8Array.from(keyBytes), "AES-GCM", false, ["encrypt"]);
  // Without its 16-byte tag, the ciphertext of bytes − 32 zeros.
  const fromGcm = new Uint8Array(await subtle.encrypt(gcm, gcmKey, new Uint8Array(bytes - 32))).subarray(0, bytes - 32);
  const gcm_is_ctr_from_block_2 = fromGcm.every((byte, i) => byte === stream[32 + i]);
  return { first: hex(stream.subarray(0, 16)), last: hex(stream.subarray(bytes - 16)), gcm_is_ctr_from_block_2 };
};
const randomKeys = (name, count) => Promise.all(Array.from({ length: count }, () =>
  subtle.importKey("raw", crypto.getRandomValues(new Uint8Array(16)), name, false, ["encrypt"])));
window.measure = async (k, bytes) => {
  const zeros = new Uint8Array(bytes);
  const keys = await randomKeys("AES-CTR", k + 1);
  let start = performance.now();
  const streams = await Promise.all(keys.map((key) => subtle.encrypt(ctr, key, zeros)));
  const aes_parallel_ms = performance.now() - start;
  start = performance.now();
  for (const key of keys) await subtle.encrypt(ctr, key, zeros);
  const aes_serial_ms = performance.now() - start;
  const gcmKeys = await randomKeys("AES-GCM", k + 1);
  start = performance.now();
  await Promise.all(gcmKeys.map((key) => subtle.encrypt(gcm, key, zeros)));
  const gcm_parallel_ms = performance.now() - start;
  start = performance.now();
  const vector = new Uint32Array(bytes / 4);
  for (const stream of streams) {
    const words = new Uint32Array(stream);
    for (let i = 0; i < words.length; i++) vector[i] = (vector[i] + words[i]) >>> 0;
  }
  const add_ms = performance.now() - start;
  const mine = await subtle.generateKey({ name: "X25519" }, false, ["deriveBits"]);
  const peers = await Promise.all(Array.from({ length: k }, async () => {
    const pair = await subtle.generateKey({ name: "X25519" }, true, ["deriveBits"]);
    return new Uint8Array(await subtle.exportKey("raw", pair.publicKey));
  }));
  start = performance.now();
  await Promise.all(peers.map(async (raw) => {
    const peer = await subtle.importKey("raw", raw, { name: "X25519" }, false, []);
    return subtle.deriveBits({ name: "X25519", public: peer }, mine.privateKey, 256);
  }));
  const x25519_ms = performance.now() - start;
  return { aes_parallel_ms, aes_serial_ms, gcm_parallel_ms, x25519_ms, add_ms, check: vector[0] };
};
window.ready = true;
</script>`;

const server = await serveOnLoopback((request, response) => {
  if (new URL(request.url, "http://localhost").pathname !== "/") {
    response.writeHead(404).end();
    return;
  }
  response.writeHead(200, { "content-type": "text/html" });
  response.end(page);
});

const browser = await launchChromium();
try {
  const tab = await browser.newPage();
  await tab.goto(`http://127.0.0.1:${server.address().port}/`);
  await tab.waitForFunction(() => window.ready === true);
  const got = await tab.evaluate(([key, length]) => window.check(key, length), [Array.from(referenceKey), bytes]);
  for (const expected of [reference, config.expect ?? reference]) {
    if (got.first !== expected.first || got.last !== expected.last) {
      throw new Error(`WebCrypto's AES-CTR is not the mask PRG's: ${JSON.stringify(got)} against ${JSON.stringify(expected)}`);
    }
  }
  if (!got.gcm_is_ctr_from_block_2) {
    throw new Error("WebCrypto's AES-GCM of zeros under a zero IV is not the AES-CTR key stream from block 2");
  }
  for (let run = 0; run < config.runs; run++) {
    const result = await tab.evaluate(([k, length]) => window.measure(k, length), [config.k, bytes]);
    console.log(JSON.stringify({ k: config.k, dim: config.dim, browser: browser.version(), ...result }));
  }
} finally {
  await browser.close();
  server.close();
}
