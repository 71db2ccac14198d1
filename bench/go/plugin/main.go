// Command nribench-plugin is the Go side of the project's side-by-side benchmark: an NRI plugin on
// the Go library's stub that does the same work per asking CreateContainer as the Python daemon.
//
// A container asks when its pod carries cpu-shared.crio.io/<container name>: enable. Then: its
// cpuset is parsed, checked against the shared CPUs and joined with them; its CFS quota is set to
// the joined CPUs times its period; OPENSHIFT_SHARED_CPUS and OPENSHIFT_ISOLATED_CPUS are set; the
// pod's quota (cpu.cfs_quota_us under <cgroup-root>/cpu/<cgroup parent>) is read with its period
// and raised by the shared CPUs' worth, the pod's own quota kept in memory; one log line is written.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"
	"github.com/sirupsen/logrus"
)

const annotationPrefix = "cpu-shared.crio.io/"

type podQuota struct {
	baseline int64 // the pod's own quota, before any raise
	shared   int   // containers of the pod holding shared CPUs
}

type plugin struct {
	shared     []int
	sharedText string
	cgroupCPU  string
	log        *logrus.Logger

	mu   sync.Mutex
	pods map[string]*podQuota
}

func (p *plugin) Configure(_ context.Context, _, runtime, version string) (api.EventMask, error) {
	return api.MustParseEventMask("CreateContainer"), nil
}

func (p *plugin) Synchronize(context.Context, []*api.PodSandbox, []*api.Container) ([]*api.ContainerUpdate, error) {
	return nil, nil
}

func (p *plugin) CreateContainer(_ context.Context, pod *api.PodSandbox, ctr *api.Container) (*api.ContainerAdjustment, []*api.ContainerUpdate, error) {
	if pod.GetAnnotations()[annotationPrefix+ctr.GetName()] != "enable" {
		return nil, nil, nil
	}
	cpu := ctr.GetLinux().GetResources().GetCpu()
	exclusive, err := parseCPUs(cpu.GetCpus())
	if err != nil {
		return nil, nil, fmt.Errorf("container %s/%s: cpuset: %w", pod.GetName(), ctr.GetName(), err)
	}
	all := map[int]bool{}
	for _, c := range exclusive {
		all[c] = true
	}
	for _, c := range p.shared {
		if all[c] {
			return nil, nil, fmt.Errorf("container %s/%s: CPU %d is shared", pod.GetName(), ctr.GetName(), c)
		}
		all[c] = true
	}
	joined := make([]int, 0, len(all))
	for c := range all {
		joined = append(joined, c)
	}
	sort.Ints(joined)
	period := cpu.GetPeriod().GetValue()
	if period == 0 {
		period = 100000
	}
	adjust := &api.ContainerAdjustment{}
	adjust.SetLinuxCPUSetCPUs(formatCPUs(joined))
	if cpu.GetQuota().GetValue() > 0 {
		adjust.SetLinuxCPUQuota(int64(len(joined)) * int64(period))
	}
	adjust.AddEnv("OPENSHIFT_SHARED_CPUS", p.sharedText)
	adjust.AddEnv("OPENSHIFT_ISOLATED_CPUS", formatCPUs(exclusive))
	quota, err := p.raisePod(pod)
	if err != nil {
		return nil, nil, fmt.Errorf("pod %s: %w", pod.GetName(), err)
	}
	p.log.WithFields(logrus.Fields{"pod": pod.GetName(), "namespace": pod.GetNamespace(),
		"container": ctr.GetName(), "cpus": adjust.GetLinux().GetResources().GetCpu().GetCpus(),
		"pod_quota": quota}).Info("shared CPUs given")
	return adjust, nil, nil
}

// raisePod reads the pod's CFS quota and period and writes the quota raised by the shared CPUs.
func (p *plugin) raisePod(pod *api.PodSandbox) (int64, error) {
	dir := filepath.Join(p.cgroupCPU, filepath.Clean("/"+pod.GetLinux().GetCgroupParent()))
	quota, err := readInt(filepath.Join(dir, "cpu.cfs_quota_us"))
	if err != nil {
		return 0, err
	}
	period, err := readInt(filepath.Join(dir, "cpu.cfs_period_us"))
	if err != nil {
		return 0, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	q := p.pods[pod.GetUid()]
	if q == nil {
		q = &podQuota{baseline: quota}
		p.pods[pod.GetUid()] = q
	}
	q.shared++
	raised := q.baseline + int64(q.shared*len(p.shared))*period
	if raised != quota {
		if err := writeValue(filepath.Join(dir, "cpu.cfs_quota_us"), strconv.FormatInt(raised, 10)); err != nil {
			return 0, err
		}
	}
	return raised, nil
}

// writeValue writes value and a newline as the daemon does: without O_TRUNC (nothing on cgroupfs,
// a journalled truncation on a fake tree's ext4 file), then cuts a longer file to what was written.
func writeValue(path, value string) error {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	n, err := f.WriteString(value + "\n")
	if err != nil {
		return err
	}
	if info, err := f.Stat(); err == nil && info.Size() > int64(n) {
		return f.Truncate(int64(n))
	}
	return err
}

func readInt(path string) (int64, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
}

func parseCPUs(text string) ([]int, error) {
	var cpus []int
	for _, part := range strings.Split(text, ",") {
		if part == "" {
			continue
		}
		lo, hi, ranged := strings.Cut(part, "-")
		first, err := strconv.Atoi(lo)
		if err != nil {
			return nil, err
		}
		last := first
		if ranged {
			if last, err = strconv.Atoi(hi); err != nil {
				return nil, err
			}
		}
		for c := first; c <= last; c++ {
			cpus = append(cpus, c)
		}
	}
	return cpus, nil
}

func formatCPUs(cpus []int) string {
	var parts []string
	for i := 0; i < len(cpus); {
		j := i
		for j+1 < len(cpus) && cpus[j+1] == cpus[j]+1 {
			j++
		}
		if j == i {
			parts = append(parts, strconv.Itoa(cpus[i]))
		} else {
			parts = append(parts, strconv.Itoa(cpus[i])+"-"+strconv.Itoa(cpus[j]))
		}
		i = j + 1
	}
	return strings.Join(parts, ",")
}

func main() {
	socket := flag.String("socket", "", "the runtime's NRI socket")
	cgroupRoot := flag.String("cgroup-root", "", "the fake cgroup v1 root holding cpu/")
	sharedText := flag.String("shared", "0-1", "the shared CPUs")
	flag.Parse()
	shared, err := parseCPUs(*sharedText)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	logger := logrus.New()
	logger.SetFormatter(&logrus.JSONFormatter{})
	logger.SetOutput(os.Stderr)
	p := &plugin{shared: shared, sharedText: formatCPUs(shared), cgroupCPU: filepath.Join(*cgroupRoot, "cpu"),
		log: logger, pods: map[string]*podQuota{}}
	s, err := stub.New(p, stub.WithPluginName("mixed-cpu-go"), stub.WithPluginIdx("10"), stub.WithSocketPath(*socket))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if err := s.Run(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
