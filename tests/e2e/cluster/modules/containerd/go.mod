// The cluster rig's consumer module for containerd (tests/e2e/cluster/components.py builds from here): the
// pinned upstream version below, every module's checksum in go.sum. No Go source of ours or theirs here.
module gpu-agent.test/cluster/containerd

go 1.26.6

require github.com/containerd/containerd/v2 v2.4.2
