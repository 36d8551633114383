#!/usr/bin/env bash
# Sharded data parallel across two "hosts": two network namespaces joined by a veth pair, one
# rank in each, started by scripts/launch as on two machines (--nnodes 2 --node-rank K), the
# rendezvous at rank 0's namespace's address over TCP (MASTER_ADDR), Gloo on the veth
# (GLOO_SOCKET_IFNAME). The traffic stays between the two namespaces, which the test makes
# and removes. Exit 77 (ctest: not run) where namespaces cannot be made. Three runs: ZeRO-3 and
# ZeRO-1 training; a sharded checkpoint saved; and resumed with the ranks' namespaces swapped.
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
launch() {  # CASE NAMESPACE NODE INTERFACE MASTER PORT: one rank per node, as on two machines
  ip netns exec "$2" env GLOO_SOCKET_IFNAME="$4" OMP_NUM_THREADS=1 timeout 300 \
    "$launch" -n 1 --nnodes 2 --node-rank "$3" --master-addr "$5" --port "$6" -- \
    "$binary" --launched "$1" "$dir" > "$dir/$1.rank$3.log" 2>&1
}
passed=0
failed=0
# pair CASE NS0 IF0 ADDR0 NS1 IF1 PORT: rank 0 in NS0 (the rendezvous at its ADDR0), rank 1 in NS1.
pair() {
  launch "$1" "$2" 0 "$3" "$4" "$7" &
  local rank0=$!
  launch "$1" "$5" 1 "$6" "$4" "$7" &
  local rank1=$!
  wait "$rank0"; local status0=$?
  wait "$rank1"; local status1=$?
  for r in 0 1; do echo "---- $1, rank $r"; cat "$dir/$1.rank$r.log"; done
  if [ "$status0" -eq 0 ] && [ "$status1" -eq 0 ] && grep -q "case $1 passed" "$dir/$1.rank0.log" &&
     grep -q "case $1 passed" "$dir/$1.rank1.log"; then
    passed=$((passed + 1))
  else
    echo "netns_test: $1: rank 0 exited $status0, rank 1 exited $status1"
    failed=$((failed + 1))
  fi
}
pair zero_netns "$a" veth0 10.231.0.1 "$b" veth1 29531
# A sharded checkpoint saved with rank 0 on the first "host", resumed with rank 0 on the second
# (another host layout): the same state, bit for bit.
pair ckpt_netns_save "$a" veth0 10.231.0.1 "$b" veth1 29532
pair ckpt_netns_resume "$b" veth1 10.231.0.2 "$a" veth0 29533
count "$passed" "$failed" 0
[ "$failed" -eq 0 ]
