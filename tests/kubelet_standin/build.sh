#!/bin/sh
# Builds the kubelet stand-in offline: GOPATH mode over Debian's Go sources (/usr/share/gocode), with
# the device plugin stubs generated from tests/kubelet_api/deviceplugin.proto by Debian's protoc-gen-go
# (1.3, grpc plugin).
# usage: build.sh OUTPUT_BINARY WORK_DIR
set -eu
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=$1
work=$2
pkg="$work/src/k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
mkdir -p "$pkg" "$work/src/kubelet_standin" "$work/cache"
cp "$repo/tests/kubelet_api/deviceplugin.proto" "$pkg/api.proto"
(cd "$pkg" && protoc -I . --go_out=plugins=grpc,paths=source_relative:. api.proto)
cp "$here/main.go" "$work/src/kubelet_standin/main.go"
cd "$work/src/kubelet_standin"
GO111MODULE=off GOPATH="$work:/usr/share/gocode" GOCACHE="$work/cache" GOFLAGS= GOPROXY=off \
  go build -o "$out" .
