// The cluster rig's consumer module for crictl (tests/e2e/cluster/components.py builds from here): the
// pinned upstream version below, every module's checksum in go.sum. No Go source of ours or theirs here.
module gpu-agent.test/cluster/crictl

go 1.24.1

require sigs.k8s.io/cri-tools v1.34.0
