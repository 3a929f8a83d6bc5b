#!/usr/bin/env bash
# Sets up what `cohort demo` needs and runs it: Fashion-MNIST from Debian's
# package dataset-fashion-mnist when it is missing, a release build of the
# `cohort` tool, then `cohort demo` with the arguments given (see
# `cohort demo --help`). Safe to run any number of times.
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/cohort-target}"

if ! dpkg-query -W -f='${Status}' dataset-fashion-mnist 2>/dev/null | grep -q "install ok installed"; then
    echo "==> installing Fashion-MNIST (Debian package dataset-fashion-mnist)"
    sudo_cmd=()
    [[ $(id -u) -eq 0 ]] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq dataset-fashion-mnist >/dev/null
fi

echo "==> building cohort (release)"
cargo build --release --locked -p cohort-cli --bin cohort

exec "$CARGO_TARGET_DIR/release/cohort" demo "$@"
