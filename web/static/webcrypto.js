// A client step's X25519 agreements and mask key streams, computed with the
// browser's WebCrypto for a WebClient that leaves them to its page
// (`client.set_host_crypto(true)`; the `host_work` action). Chromium's
// WebCrypto runs AES on AES-NI and X25519 in BoringSSL's 64-bit code, where
// the wasm build has neither (docs/BENCHMARKS.md, the browser against the
// native client). What is computed is defined in cohort-crypto's
// `client::deferred`: X25519 (RFC 7748) of the client's secret key with each
// peer's public key, and for each mask AES-128-CTR of zeros under its key
// with a 128-bit big-endian counter from zero, read as little-endian 32-bit
// words. Anything WebCrypto cannot do (no X25519, a key it refuses, a
// big-endian machine, no WebCrypto outside a secure context) is left to the
// client, which computes it itself: the messages are the same either way.
//
// The keys reach this file as byte arrays, which are wiped once WebCrypto
// has imported them (non-extractable); the shared secrets are wiped once the
// client has taken them.

const subtle = globalThis.crypto?.subtle;
const littleEndian = new Uint8Array(new Uint32Array([1]).buffer)[0] === 1;
// PKCS #8 for an X25519 private key (RFC 8410): this prefix, then the 32 bytes.
const PKCS8_X25519 = [0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x6e, 0x04, 0x22, 0x04, 0x20];
const CTR = { name: "AES-CTR", counter: new Uint8Array(16), length: 128 };
// Key streams in flight at once: as fast as all of them in Chromium
// (docs/BENCHMARKS.md), and a bound on the memory they hold (4m bytes each).
const STREAMS_IN_FLIGHT = 4;

/** Whether this page can take a client's work (WebCrypto, a little-endian machine). */
export function webCryptoAvailable() {
  return Boolean(subtle) && littleEndian;
}

/**
 * Does the work of a `host_work` action for `client` (a WebClient, or
 * anything with its host methods) and hands it back; the step goes on.
 * Work whose step is gone meanwhile (the page paused or left the round
 * while WebCrypto ran) is dropped, never handed to a later step.
 *
 * @param {WebClient} client
 * @param {{step: number, work: string, peers?: number, masks?: number, words?: number}} action
 */
export async function hostWork(client, action) {
  const current = () => client.host_step() === action.step;
  try {
    if (webCryptoAvailable() && action.work === "agreements") {
      await agreements(client, action.peers, current);
    } else if (webCryptoAvailable() && action.work === "key_streams") {
      await keyStreams(client, action.masks, action.words, current);
    } else if (current()) {
      client.complete_host_work();
    }
  } catch {
    // Anything that escaped below (memory for the streams, say): the
    // client does the rest of its step itself. A client that has stopped
    // throws again here, and the driver reports it.
    if (current()) client.complete_host_work();
  }
}

async function agreements(client, count, current) {
  const secret = client.host_secret();
  const peers = client.host_peers();
  if (!secret || !peers) return;
  const shared = new Uint8Array(32 * count);
  const supplied = new Uint8Array(count);
  const pkcs8 = new Uint8Array(48);
  let privateKey = null;
  try {
    pkcs8.set(PKCS8_X25519);
    pkcs8.set(secret, 16);
    privateKey = await subtle.importKey("pkcs8", pkcs8, { name: "X25519" }, false, ["deriveBits"]);
  } catch {
    privateKey = null; // No X25519 here: the client agrees itself.
  } finally {
    pkcs8.fill(0);
    secret.fill(0);
  }
  try {
    if (privateKey) {
      await Promise.all(Array.from({ length: count }, async (_, i) => {
        try {
          const raw = peers.subarray(32 * i, 32 * i + 32);
          const peer = await subtle.importKey("raw", raw, { name: "X25519" }, false, []);
          const bits = new Uint8Array(await subtle.deriveBits({ name: "X25519", public: peer }, privateKey, 256));
          shared.set(bits, 32 * i);
          bits.fill(0);
          supplied[i] = 1;
        } catch {
          // A key WebCrypto refuses (or an all-zero result): the client
          // computes this one, and refuses it exactly as it would natively.
        }
      }));
    }
    if (current()) client.agreed(shared, supplied);
  } finally {
    shared.fill(0);
  }
}

async function keyStreams(client, count, words, current) {
  const zeros = new Uint8Array(words * 4);
  let next = 0;
  const worker = async () => {
    while (next < count && current()) {
      const i = next++;
      const raw = client.host_key(i);
      if (!raw) continue;
      let stream = null;
      try {
        const key = await subtle.importKey("raw", raw, "AES-CTR", false, ["encrypt"]);
        raw.fill(0);
        stream = new Uint32Array(await subtle.encrypt(CTR, key, zeros));
        if (current()) client.add_key_stream(i, stream);
      } catch {
        // Left to the client (which also refuses a stream whose first or
        // last block is not the mask's).
      } finally {
        raw.fill(0);
        stream?.fill(0);
      }
    }
  };
  await Promise.all(Array.from({ length: Math.min(STREAMS_IN_FLIGHT, count) }, worker));
  if (current()) client.complete_host_work();
}
