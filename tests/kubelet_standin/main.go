// A kubelet stand-in for gpu-agent's device plugin tests: grpc-go, as the kubelet itself.
//
// It serves Registration on <dir>/kubelet.sock. On each Register it dials the plugin's socket as the
// kubelet's device manager does: GetDevicePluginOptions, then ListAndWatch, printing every list it
// receives. Commands come on stdin, one JSON object per line; every event goes to stdout as one JSON
// object per line:
//
//	{"op": "allocate", "resource": "nvidia.com/gpu", "ids": ["GPU-..."]}
//	{"op": "preferred", "resource": "nvidia.com/gpu", "available": [...], "must": [...], "size": 2}
//	{"op": "restart"}   the kubelet restarts: every socket in <dir> is deleted, kubelet.sock made anew
//	{"op": "quit"}
//
// Built offline in GOPATH mode from Debian's golang-google-grpc-dev and golang-goprotobuf-dev, with
// stubs generated from tests/kubelet_api/deviceplugin.proto (see tests/test_plugin_kubelet.py).
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"google.golang.org/grpc"
	api "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

var (
	out   = json.NewEncoder(os.Stdout)
	outMu sync.Mutex
)

func emit(event map[string]interface{}) {
	outMu.Lock()
	defer outMu.Unlock()
	_ = out.Encode(event)
}

type kubelet struct {
	dir       string
	mu        sync.Mutex
	endpoints map[string]string // resource name: socket path
	server    *grpc.Server
}

func dial(path string) (*grpc.ClientConn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return grpc.DialContext(ctx, path, grpc.WithInsecure(), grpc.WithBlock(),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", addr)
		}))
}

func (k *kubelet) Register(ctx context.Context, request *api.RegisterRequest) (*api.Empty, error) {
	path := filepath.Join(k.dir, request.Endpoint)
	k.mu.Lock()
	k.endpoints[request.ResourceName] = path
	k.mu.Unlock()
	emit(map[string]interface{}{"event": "register", "resource": request.ResourceName, "endpoint": request.Endpoint,
		"version": request.Version,
		"preferred_allocation": request.Options != nil && request.Options.GetPreferredAllocationAvailable})
	go k.watch(request.ResourceName, path)
	return &api.Empty{}, nil
}

// watch does what the device manager does after a registration: options, then ListAndWatch.
func (k *kubelet) watch(resource, path string) {
	conn, err := dial(path)
	if err != nil {
		emit(map[string]interface{}{"event": "error", "resource": resource, "error": err.Error()})
		return
	}
	defer conn.Close()
	client := api.NewDevicePluginClient(conn)
	options, err := client.GetDevicePluginOptions(context.Background(), &api.Empty{})
	if err != nil {
		emit(map[string]interface{}{"event": "error", "resource": resource, "error": err.Error()})
		return
	}
	emit(map[string]interface{}{"event": "options", "resource": resource,
		"preferred_allocation": options.GetPreferredAllocationAvailable, "pre_start": options.PreStartRequired})
	stream, err := client.ListAndWatch(context.Background(), &api.Empty{})
	if err != nil {
		emit(map[string]interface{}{"event": "error", "resource": resource, "error": err.Error()})
		return
	}
	for {
		response, err := stream.Recv()
		if err != nil {
			emit(map[string]interface{}{"event": "list-closed", "resource": resource, "error": err.Error()})
			return
		}
		devices := []map[string]interface{}{}
		for _, device := range response.Devices {
			numa := []int64{}
			if device.Topology != nil {
				for _, node := range device.Topology.Nodes {
					numa = append(numa, node.ID)
				}
			}
			devices = append(devices, map[string]interface{}{"id": device.ID, "health": device.Health, "numa": numa})
		}
		emit(map[string]interface{}{"event": "list", "resource": resource, "devices": devices})
	}
}

func (k *kubelet) client(resource string) (api.DevicePluginClient, *grpc.ClientConn, error) {
	k.mu.Lock()
	path, ok := k.endpoints[resource]
	k.mu.Unlock()
	if !ok {
		path = filepath.Join(k.dir, "nvidia-"+resource+".sock")
	}
	conn, err := dial(path)
	if err != nil {
		return nil, nil, err
	}
	return api.NewDevicePluginClient(conn), conn, nil
}

func (k *kubelet) allocate(resource string, ids []string) {
	client, conn, err := k.client(resource)
	if err != nil {
		emit(map[string]interface{}{"event": "allocate", "resource": resource, "ok": false, "error": err.Error()})
		return
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	response, err := client.Allocate(ctx, &api.AllocateRequest{
		ContainerRequests: []*api.ContainerAllocateRequest{{DevicesIds: ids}}})
	if err != nil {
		emit(map[string]interface{}{"event": "allocate", "resource": resource, "ok": false, "error": err.Error()})
		return
	}
	container := response.ContainerResponses[0]
	names := []string{}
	for _, device := range container.CdiDevices {
		names = append(names, device.Name)
	}
	emit(map[string]interface{}{"event": "allocate", "resource": resource, "ok": true, "cdi_devices": names,
		"envs": container.Envs, "annotations": container.Annotations, "containers": len(response.ContainerResponses)})
}

func (k *kubelet) preferred(resource string, available, must []string, size int32) {
	client, conn, err := k.client(resource)
	if err != nil {
		emit(map[string]interface{}{"event": "preferred", "resource": resource, "ok": false, "error": err.Error()})
		return
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	response, err := client.GetPreferredAllocation(ctx, &api.PreferredAllocationRequest{
		ContainerRequests: []*api.ContainerPreferredAllocationRequest{
			{AvailableDeviceIDs: available, MustIncludeDeviceIDs: must, AllocationSize: size}}})
	if err != nil {
		emit(map[string]interface{}{"event": "preferred", "resource": resource, "ok": false, "error": err.Error()})
		return
	}
	emit(map[string]interface{}{"event": "preferred", "resource": resource, "ok": true,
		"ids": response.ContainerResponses[0].DeviceIDs})
}

func (k *kubelet) serve() error {
	path := filepath.Join(k.dir, "kubelet.sock")
	_ = os.Remove(path)
	listener, err := net.Listen("unix", path)
	if err != nil {
		return err
	}
	server := grpc.NewServer()
	api.RegisterRegistrationServer(server, k)
	k.server = server
	go func() { _ = server.Serve(listener) }()
	return nil
}

// restart is what a kubelet restart does to the plugins: its device manager deletes every socket
// in the directory, then listens on a new kubelet.sock.
func (k *kubelet) restart() error {
	k.server.Stop()
	sockets, _ := filepath.Glob(filepath.Join(k.dir, "*.sock"))
	for _, path := range sockets {
		_ = os.Remove(path)
	}
	k.mu.Lock()
	k.endpoints = map[string]string{}
	k.mu.Unlock()
	return k.serve()
}

func main() {
	dir := flag.String("dir", "", "the kubelet's device-plugins directory")
	flag.Parse()
	// Sockets by name relative to the directory: a test's directory is deeper than a socket address allows.
	if err := os.Chdir(*dir); err != nil {
		emit(map[string]interface{}{"event": "fatal", "error": err.Error()})
		os.Exit(1)
	}
	k := &kubelet{dir: ".", endpoints: map[string]string{}}
	if err := k.serve(); err != nil {
		emit(map[string]interface{}{"event": "fatal", "error": err.Error()})
		os.Exit(1)
	}
	emit(map[string]interface{}{"event": "ready"})
	scanner := bufio.NewScanner(os.Stdin)
	scanner.Buffer(make([]byte, 1<<20), 1<<20)
	for scanner.Scan() {
		var command struct {
			Op        string   `json:"op"`
			Resource  string   `json:"resource"`
			IDs       []string `json:"ids"`
			Available []string `json:"available"`
			Must      []string `json:"must"`
			Size      int32    `json:"size"`
		}
		if err := json.Unmarshal(scanner.Bytes(), &command); err != nil {
			emit(map[string]interface{}{"event": "bad-command", "error": err.Error()})
			continue
		}
		switch command.Op {
		case "allocate":
			k.allocate(command.Resource, command.IDs)
		case "preferred":
			k.preferred(command.Resource, command.Available, command.Must, command.Size)
		case "restart":
			if err := k.restart(); err != nil {
				emit(map[string]interface{}{"event": "fatal", "error": err.Error()})
				os.Exit(1)
			}
			emit(map[string]interface{}{"event": "restarted"})
		case "quit":
			k.server.Stop()
			return
		default:
			emit(map[string]interface{}{"event": "bad-command", "error": "unknown op " + command.Op})
		}
	}
}
