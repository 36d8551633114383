#!/usr/bin/env bash
# Sharded data parallel across two "hosts": two network namespaces joined by a veth pair, one
# rank in each, started by scripts/launch as on two machines (--nnodes 2 --node-rank K), the
# rendezvous at the first namespace's address over TCP (MASTER_ADDR), Gloo on the veth
# (GLOO_SOCKET_IFNAME). The traffic stays between the two namespaces, which the test makes
# and removes. Exit 77 (ctest: not run) where namespaces cannot be made.
#   tests/netns_test.sh BINARY DIR        BINARY: mixprec_distributed_tests
set -u
binary=$1
dir=$2
count() { echo "mixprec-tests: $1 passed, $2 failed, $3 skipped (netns_test.sh)"; }
skip() { echo "netns_test: not run: $1"; count 0 0 1; exit 77; }
command -v ip > /dev/null || skip "no iproute2 (ip)"
[ "$(id -u)" = 0 ] || skip "network namespaces need root"
a=mixprec_a_$$
b=mixprec_b_$$
cleanup() { ip netns del "$a" 2> /dev/null; ip netns del "$b" 2> /dev/null; }
trap cleanup EXIT
ip netns add "$a" 2> /dev/null && ip netns add "$b" 2> /dev/null || skip "cannot create namespaces"
set -e
ip -n "$a" link add veth0 type veth peer name veth1 netns "$b"
ip -n "$a" addr add 10.231.0.1/30 dev veth0
ip -n "$b" addr add 10.231.0.2/30 dev veth1
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set veth0 up
ip -n "$b" link set veth1 up
set +e
rm -rf "$dir" && mkdir -p "$dir"
launch="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/scripts/launch"
launch() {  # NAMESPACE NODE INTERFACE: one rank per node, as on two machines
  ip netns exec "$1" env GLOO_SOCKET_IFNAME="$3" OMP_NUM_THREADS=1 timeout 300 \
    "$launch" -n 1 --nnodes 2 --node-rank "$2" --master-addr 10.231.0.1 --port 29531 -- \
    "$binary" --launched zero_netns "$dir" > "$dir/rank$2.log" 2>&1
}
launch "$a" 0 veth0 &
rank0=$!
launch "$b" 1 veth1 &
rank1=$!
wait "$rank0"; status0=$?
wait "$rank1"; status1=$?
for r in 0 1; do echo "---- rank $r"; cat "$dir/rank$r.log"; done
if [ "$status0" -eq 0 ] && [ "$status1" -eq 0 ] && grep -q "case zero_netns passed" "$dir/rank1.log"; then
  count 1 0 0
  exit 0
fi
echo "netns_test: rank 0 exited $status0, rank 1 exited $status1"
count 0 1 0
exit 1
