#!/usr/bin/env bash
# The workspace's tests, then the ten slowest. Run by `make test` (after fmt and clippy) with
# scripts/env.sh sourced. The unit tests (each crate's library and the zrun binary's) run
# under cargo test, one process per crate; cargo-nextest runs every other test in its own
# process and the binaries side by side. Without nextest, cargo test runs them all, binary
# after binary.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if cargo nextest --version >/dev/null 2>&1; then
    # Two tests run at once, each with the ranks it starts: one libtorch thread per process,
    # or threads that spin waiting for a core (OpenMP) make the machine crawl.
    export OMP_NUM_THREADS=1
    set +e
    # Loading libtorch and unloading it cost a process ~0.55 s of CPU, more than most unit
    # tests take: in a process each, the ~300 of them added up to ~165 s; together, one
    # process per crate, they take under 10 s.
    cargo test --release --workspace --lib --bins
    unit=$?
    cargo nextest run --release --workspace --no-fail-fast --status-level pass \
        --final-status-level none -E 'not (kind(lib) | kind(bin))' 2>&1 | tee "$log"
    status=${PIPESTATUS[0]}
    [ "$status" -ne 0 ] || status=$unit
    set -e
    # nextest does not run doc tests.
    cargo test --release --workspace --doc
    echo
    echo "slowest tests:"
    # awk reads all of sort's output: a `head` that stops early would kill sort with SIGPIPE,
    # which pipefail turns into a failed run (it did, with every test passed).
    grep -E '^\s+PASS \[' "$log" | sed -E 's/^\s+PASS \[\s*([0-9.]+)s\]\s+/\1 /' \
        | sort -rn | awk 'NR <= 10 { printf "  %7.1f s  %s\n", $1, substr($0, length($1) + 2) }'
    exit "$status"
fi
echo "test: cargo-nextest not found (cargo install cargo-nextest); running cargo test, no timings"
cargo test --release --workspace
