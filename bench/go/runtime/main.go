// Command nribench-runtime is the runtime side of the project's side-by-side benchmark: NRI's own
// runtime library (pkg/adaptation, as containerd uses it) listening on one socket per plugin under
// test, sending asking CreateContainer requests and timing each round trip.
//
// Usage: nribench-runtime -socket NAME=PATH [-socket NAME=PATH ...]
//
// It prints "ready NAME" once a plugin has connected and synchronized on that socket, then reads
// commands on stdin, one a line:
//
//	create NAME FIRST COUNT   one asking CreateContainer for each pod FIRST..FIRST+COUNT-1 (its
//	                          container app-0, the first of the pod), one after the other; prints
//	                          "done NAME" and the round trips in nanoseconds, space separated
//	quit
//
// Pod n's cgroup parent is /kubepods/pod<uid(n)>; the caller makes those cgroups beforehand.
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	nri "github.com/containerd/nri/pkg/adaptation"
	"github.com/containerd/nri/pkg/api"
	"github.com/sirupsen/logrus"
)

type sockets map[string]string

func (s sockets) String() string { return fmt.Sprint(map[string]string(s)) }
func (s sockets) Set(v string) error {
	name, path, ok := strings.Cut(v, "=")
	if !ok {
		return fmt.Errorf("want NAME=PATH, got %q", v)
	}
	s[name] = path
	return nil
}

func uid(n int) string { return fmt.Sprintf("%08x-1b2c-4d5e-8f90-%012x", n, n) }

// pod and container mirror bench/workload.py's realistic_pod and realistic_container: the labels,
// annotations, mounts and environment kubelet and containerd fill in; app-0 asks.
func pod(n int) *api.PodSandbox {
	u := uid(n)
	p := &api.PodSandbox{
		Id:        fmt.Sprintf("%064x", n),
		Uid:       u,
		Name:      fmt.Sprintf("workload-%d-7d9f8c6b5-x2x4q", n),
		Namespace: fmt.Sprintf("team-%d", n%40),
		Labels:    map[string]string{"app": fmt.Sprintf("workload-%d", n), "pod-template-hash": "7d9f8c6b5", "tier": "backend"},
		Annotations: map[string]string{
			"kubernetes.io/config.seen":        "2026-11-21T04:00:00.000000000Z",
			"kubernetes.io/config.source":      "api",
			"workload.openshift.io/management": `{"effect": "PreferredDuringScheduling"}`,
			"cpu-shared.crio.io/app-0":         "enable",
		},
		RuntimeHandler: "runc",
		Linux: &api.LinuxPodSandbox{
			CgroupParent: "/kubepods/pod" + u,
			CgroupsPath:  fmt.Sprintf("/kubepods/pod%s/%064x", u, n),
		},
		Ips: []string{fmt.Sprintf("10.128.%d.%d", n/250, n%250)},
	}
	return p
}

func reverse(s string) string {
	b := []byte(s)
	for i, j := 0, len(b)-1; i < j; i, j = i+1, j-1 {
		b[i], b[j] = b[j], b[i]
	}
	return string(b)
}

func container(p *api.PodSandbox, n int) *api.Container {
	cid := reverse(fmt.Sprintf("%064x", n))
	c := &api.Container{
		Id:           cid,
		PodSandboxId: p.Id,
		Name:         fmt.Sprintf("app-%d", n%5),
		State:        api.ContainerState_CONTAINER_CREATED,
		Labels: map[string]string{
			"io.kubernetes.container.name": fmt.Sprintf("app-%d", n%5),
			"io.kubernetes.pod.name":       p.Name,
			"io.kubernetes.pod.namespace":  p.Namespace,
			"io.kubernetes.pod.uid":        p.Uid,
		},
		Annotations: map[string]string{
			"io.kubernetes.container.hash":                   "9f2c4e1a",
			"io.kubernetes.container.restartCount":           "0",
			"io.kubernetes.container.terminationMessagePath": "/dev/termination-log",
		},
		Args: []string{"/usr/bin/app", "--config=/etc/app/config.yaml", "--log-level=info"},
		Env: []string{
			"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
			"HOSTNAME=" + p.Name,
			"KUBERNETES_SERVICE_HOST=172.30.0.1",
			"KUBERNETES_SERVICE_PORT=443",
		},
		Linux: &api.LinuxContainer{
			CgroupsPath: p.Linux.CgroupParent + "/" + cid,
			Resources: &api.LinuxResources{
				Cpu: &api.LinuxCPU{
					Shares: api.UInt64(2048),
					Quota:  api.Int64(200000),
					Period: api.UInt64(100000),
					Cpus:   fmt.Sprintf("%d-%d", 2+n%60, 3+n%60),
					Mems:   "0",
				},
				Memory: &api.LinuxMemory{Limit: api.Int64(1 << 30)},
			},
		},
	}
	for _, dest := range []string{"/etc/hosts", "/dev/termination-log", "/var/run/secrets/kubernetes.io/serviceaccount"} {
		c.Mounts = append(c.Mounts, &api.Mount{
			Destination: dest, Type: "bind",
			Source:  "/var/lib/kubelet/pods/" + p.Uid + dest,
			Options: []string{"rbind", "rprivate", "ro"},
		})
	}
	return c
}

func main() {
	socks := sockets{}
	flag.Var(socks, "socket", "NAME=PATH: a socket for one plugin under test (repeat)")
	empty := flag.String("empty-dir", os.TempDir()+"/nribench-none", "a directory without plugins or their configs")
	flag.Parse()
	logrus.SetLevel(logrus.WarnLevel)
	os.MkdirAll(*empty, 0o700)

	runtimes := map[string]*nri.Adaptation{}
	ready := make(chan string, len(socks))
	for name, path := range socks {
		name := name
		started := &atomic.Bool{} // the first call is Start's, for pre-installed plugins (none)
		sync := func(ctx context.Context, cb nri.SyncCB) error {
			_, err := cb(ctx, nil, nil)
			if err == nil && started.Load() {
				go func() { time.Sleep(200 * time.Millisecond); ready <- name }()
			}
			return err
		}
		update := func(context.Context, []*nri.ContainerUpdate) ([]*nri.ContainerUpdate, error) { return nil, nil }
		r, err := nri.New("nribench", "v0", sync, update,
			nri.WithSocketPath(path), nri.WithPluginPath(*empty), nri.WithPluginConfigPath(*empty))
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		if err := r.Start(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		started.Store(true)
		runtimes[name] = r
	}
	fmt.Println("listening")
	go func() {
		for name := range ready {
			fmt.Println("ready", name)
		}
	}()

	ctx := context.Background()
	in := bufio.NewScanner(os.Stdin)
	out := bufio.NewWriter(os.Stdout)
	for in.Scan() {
		f := strings.Fields(in.Text())
		if len(f) == 0 {
			continue
		}
		if f[0] == "quit" {
			break
		}
		if f[0] != "create" || len(f) != 4 {
			fmt.Fprintln(os.Stderr, "unknown command:", in.Text())
			os.Exit(2)
		}
		r := runtimes[f[1]]
		first, _ := strconv.Atoi(f[2])
		count, _ := strconv.Atoi(f[3])
		reqs := make([]*nri.CreateContainerRequest, count)
		for i := range reqs {
			p := pod(first + i)
			reqs[i] = &nri.CreateContainerRequest{Pod: p, Container: container(p, (first+i)*5)}
		}
		took := make([]int64, count)
		for i, req := range reqs {
			start := time.Now()
			rpl, err := r.CreateContainer(ctx, req)
			took[i] = int64(time.Since(start))
			if err != nil {
				fmt.Fprintln(os.Stderr, "CreateContainer:", err)
				os.Exit(1)
			}
			if rpl.GetAdjust().GetLinux().GetResources().GetCpu().GetCpus() == "" {
				fmt.Fprintf(os.Stderr, "CreateContainer of pod %d: no shared CPUs given (%v)\n", first+i, rpl)
				os.Exit(1)
			}
		}
		fmt.Fprint(out, "done ", f[1])
		for _, t := range took {
			fmt.Fprint(out, " ", t)
		}
		fmt.Fprintln(out)
		out.Flush()
	}
	for _, r := range runtimes {
		r.Stop()
	}
}
