#!/usr/bin/env bash
# A two-node cluster on one machine: two network namespaces joined by a veth pair with
# link-local addresses (169.254.77.1 and .2: the testbed's own hosts, nothing else is ever
# dialled), the link rate-limited in both directions by a tbf qdisc on each end, a hostname
# of its own in each (so zrun sees two hosts and sends node-to-node traffic over the link,
# not through shared memory), and ranks of one node talking over that namespace's loopback.
# One `zrun --nnodes 2` launcher runs in each namespace; the namespaces go on every exit.
#
#   scripts/testbed.sh [--rate 200mbit] [--nproc 2] [--burst 256kb] [--] ZRUN-ARGS...
#
#   scripts/testbed.sh --rate 1gbit -- configs/tiny-cpu.toml --set train.steps=20
#   scripts/testbed.sh --rate 200mbit -- exec -- "$PWD/target/release/zrun" bench comm --sizes 1M,16M
#
# ZRUN-ARGS go to both launchers, followed by --nnodes 2 --node-rank K --master-addr
# 169.254.77.1 --nproc N (for `exec`, before its `--`). Node 0's output is printed as it comes, node 1's is in
# $TESTBED_LOG_DIR/node1.log (default: a temporary directory, printed at the end). Exit code:
# node 0's, or node 1's where node 0 succeeded; 77 where namespaces cannot be made (not
# root, no iproute2): the reason is one line on stderr. Needs root.
set -euo pipefail

rate=200mbit
nproc=2
burst=256kb
while [[ $# -gt 0 ]]; do
    case "$1" in
        --rate) rate="$2"; shift 2 ;;
        --nproc) nproc="$2"; shift 2 ;;
        --burst) burst="$2"; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) break ;;
    esac
done
[[ $# -gt 0 ]] || { echo "testbed: give zrun's arguments, e.g. configs/tiny-cpu.toml" >&2; exit 2; }

root="$(cd "$(dirname "$0")/.." && pwd)"
zrun="${ZRUN:-$root/target/release/zrun}"
[[ -x "$zrun" ]] || { echo "testbed: $zrun is missing: run make build (or set ZRUN)" >&2; exit 2; }
# shellcheck source=scripts/env.sh
source "$root/scripts/env.sh"

if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null || ! command -v tc >/dev/null \
    || ! command -v unshare >/dev/null; then
    echo "testbed: skipped: needs root with ip, tc (iproute2) and unshare (util-linux)" >&2
    exit 77
fi

tag="zrtb$$"
ns=("$tag-0" "$tag-1")
veth=("${tag}a" "${tag}b")
addr=(169.254.77.1 169.254.77.2)
log_dir="${TESTBED_LOG_DIR:-$(mktemp -d -t zrun-testbed-XXXXXX)}"
mkdir -p "$log_dir"
pids=()

cleanup() {
    local p
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    # Deleting a namespace takes its end of the veth pair, and so the pair, with it.
    ip netns del "${ns[0]}" 2>/dev/null || true
    ip netns del "${ns[1]}" 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if ! err=$(ip netns add "${ns[0]}" 2>&1 && ip netns add "${ns[1]}" 2>&1 \
    && ip link add "${veth[0]}" type veth peer name "${veth[1]}" 2>&1); then
    echo "testbed: skipped: cannot make network namespaces: ${err//$'\n'/ }" >&2
    exit 77
fi
for k in 0 1; do
    ip link set "${veth[$k]}" netns "${ns[$k]}"
    ip -n "${ns[$k]}" link set lo up
    ip -n "${ns[$k]}" addr add "${addr[$k]}/30" dev "${veth[$k]}"
    ip -n "${ns[$k]}" link set "${veth[$k]}" up
    # Each end shapes what it sends: the link is limited in both directions.
    ip netns exec "${ns[$k]}" tc qdisc add dev "${veth[$k]}" root tbf \
        rate "$rate" burst "$burst" latency 200ms
done

export ZRUN_JOB_TOKEN="${ZRUN_JOB_TOKEN:-$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
node() {
    local k="$1"
    shift
    local flags=(--nnodes 2 --node-rank "$k" --master-addr "${addr[0]}" --nproc "$nproc")
    local args=("$@" "${flags[@]}")
    # `exec -- PROGRAM ...` takes the layout flags before its `--`.
    [[ "$1" == exec ]] && args=(exec "${flags[@]}" "${@:2}")
    ip netns exec "${ns[$k]}" unshare --uts sh -c 'hostname "$0" && exec "$@"' \
        "testbed-node$k" "$zrun" "${args[@]}"
}
node 1 "$@" >"$log_dir/node1.log" 2>&1 &
pids+=($!)
node 0 "$@" &
pids+=($!)
rc0=0
wait "${pids[1]}" || rc0=$?
rc1=0
wait "${pids[0]}" || rc1=$?
pids=()
echo "testbed: $rate between the nodes, $nproc rank(s) each; node 1's output: $log_dir/node1.log" >&2
if [[ $rc0 -ne 0 ]]; then exit "$rc0"; fi
exit "$rc1"
