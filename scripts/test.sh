#!/usr/bin/env bash
# Runs every test of the project: the workspace's unit, integration and
# end-to-end tests (the JVM and C bindings and the browser pages in Chromium
# included), the wasm32 build of the protocol core, the Android build of the
# mobile bindings, and a bounded smoke run of every fuzz target. Installs
# what it needs first.
#
#   FUZZ_SECONDS   seconds per fuzz target (default 20)
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/cohort-target}"
fuzz_seconds="${FUZZ_SECONDS:-20}"
# Each stage says when it started (seconds into the run), so that a slow
# CI log shows where its time went.
log() { printf '\n==> [%ss] %s\n' "$SECONDS" "$*"; }
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

scripts/setup.sh

log "workspace tests"
cargo test --workspace --locked 2>&1 | tee "$scratch/cargo-test.log"

log "cohort-crypto without its default features (serial unmasking, as in wasm32)"
cargo test --locked -p cohort-crypto --no-default-features --tests 2>&1 | tee -a "$scratch/cargo-test.log"

log "the TorchScript tests on libtorch (feature tch)"
# tch builds against the venv's PyTorch and loads its libraries at run time.
# The whole workspace is selected, as above, so that cargo resolves the same
# features and rebuilds only the crates that the feature changes; the
# torchscript tests of cohort-client and of the end-to-end suite run.
torch_venv="${COHORT_TORCH_VENV:-/var/tmp/cohort-torch-venv}"
LIBTORCH_USE_PYTORCH=1 PATH="$torch_venv/bin:$PATH" \
    LD_LIBRARY_PATH="$(echo "$torch_venv"/lib/python3*/site-packages/torch/lib)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test --locked --workspace --features cohort-client/tch,cohort-cli/tch,cohort-tests/tch \
    --test torchscript 2>&1 | tee -a "$scratch/cargo-test.log"

log "crypto/ for wasm32-unknown-unknown (Debian rustc-web, -Zbuild-std)"
# Debian's toolchain must come first on PATH; it gets its own target
# directory so that it never invalidates the native build.
PATH="/usr/bin:$PATH" RUSTC_BOOTSTRAP=1 CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_LINKER=wasm-ld \
    CARGO_TARGET_DIR="${CARGO_TARGET_DIR}-wasm32" \
    cargo build --locked -Zbuild-std=std,panic_abort --target wasm32-unknown-unknown \
    -p cohort-crypto --no-default-features --release

log "cohort-mobile for aarch64-linux-android (staticlib, Debian rustc-web, -Zbuild-std)"
# No NDK here, so nothing is linked: the check is that the bindings compile
# for Android and export every JNI and C entry point. clang builds ring's C
# code freestanding (no Android sysroot). Nothing runs, so nothing is
# optimised and no debug information is written: cold, the build (std
# included) took 2 min 35 s on two cores, against about 7 min with the dev
# profile's optimised dependencies.
android_lib="${CARGO_TARGET_DIR}-android/aarch64-linux-android/debug/libcohort_mobile.a"
PATH="/usr/bin:$PATH" RUSTC_BOOTSTRAP=1 CARGO_TARGET_DIR="${CARGO_TARGET_DIR}-android" \
    CC_aarch64_linux_android=clang AR_aarch64_linux_android=llvm-ar \
    CFLAGS_aarch64_linux_android="-ffreestanding -nostdlibinc -DRING_CORE_NOSTDLIBINC=1" \
    cargo rustc --locked --config 'profile.dev.package."*".opt-level=0' --config profile.dev.debug=0 \
    -Zbuild-std=std,panic_abort --target aarch64-linux-android \
    -p cohort-mobile --lib --crate-type staticlib
exported=$(llvm-nm --defined-only "$android_lib" 2>/dev/null | grep -cE ' T (Java_org_cohort_CohortClient_native|cohort_)')
declared=$(grep -cE '^pub (unsafe )?extern "(C|system)" fn' mobile/src/ffi.rs mobile/src/jni.rs | awk -F: '{s += $2} END {print s}')
if [[ "$exported" -ne "$declared" ]] || ! llvm-objdump -a "$android_lib" | grep elf64-littleaarch64 >/dev/null; then
    echo "the Android staticlib exports $exported of $declared entry points" >&2
    exit 1
fi
echo "aarch64-linux-android staticlib: $exported entry points exported"

log "fuzz smoke runs (${fuzz_seconds}s per target)"
fuzzed=0
for target in $(cd crypto/fuzz && cargo +nightly fuzz list); do
    if ! (cd crypto/fuzz && CARGO_TARGET_DIR="${CARGO_TARGET_DIR}-fuzz" \
        cargo +nightly fuzz run "$target" -- -max_total_time="$fuzz_seconds" -rss_limit_mb=4096) \
        >"$scratch/fuzz.log" 2>&1; then
        tail -n 60 "$scratch/fuzz.log"
        echo "fuzz target $target failed" >&2
        exit 1
    fi
    echo "$target: $(grep -E '^Done' "$scratch/fuzz.log" | tail -n 1)"
    fuzzed=$((fuzzed + 1))
done

passed=$(grep -Eo '^test result: ok\. [0-9]+ passed' "$scratch/cargo-test.log" | awk '{s += $4} END {print s + 0}')
failed=$(grep -Eo '[0-9]+ failed' "$scratch/cargo-test.log" | awk '{s += $1} END {print s + 0}')
log "summary: cargo tests (default and tch features), wasm32 and Android builds, ${fuzzed} fuzz targets"
echo "browser screenshots: ${CARGO_TARGET_DIR}/artifacts/browser/"
echo "tests: ${passed} passed, ${failed} failed"
