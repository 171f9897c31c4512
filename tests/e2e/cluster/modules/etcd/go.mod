// The cluster rig's consumer module for etcd (tests/e2e/cluster/components.py builds from here): the
// pinned upstream version below, every module's checksum in go.sum. No Go source of ours or theirs here.
module gpu-agent.test/cluster/etcd

go 1.26.0

require go.etcd.io/etcd/server/v3 v3.6.16
