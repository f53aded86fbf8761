package chaos

import (
	"fmt"
	"os"
	"strings"
)

// The test network: a bridge in the root namespace (10.77.0.1/24) and one
// namespace per replica (kvc1.. with 10.77.0.11..), joined by veth pairs.
// Workers, HAProxy and the harness stay in the root namespace and reach
// every replica over the bridge; faults between replicas are iptables rules
// inside a replica's namespace, so the host's own firewall is not touched
// (except one FORWARD accept rule when the host's FORWARD policy would drop
// bridged traffic; it is removed again).
const (
	bridgeName = "kvcbr0"
	subnet     = "10.77.0"
	hostIP     = subnet + ".1"
	nsPrefix   = "kvc"
	maxNodes   = 4
)

func nsName(i int) string   { return fmt.Sprintf("%s%d", nsPrefix, i) }
func nodeIP(i int) string   { return fmt.Sprintf("%s.%d", subnet, 10+i) }
func vethHost(i int) string { return fmt.Sprintf("%s%dh", nsPrefix, i) }
func vethNS(i int) string   { return fmt.Sprintf("%s%dn", nsPrefix, i) }

// Ports every replica uses on its own namespace address.
const (
	httpPort  = 8080
	raftPort  = 7000
	natsPort  = 4222
	routePort = 6222

	lbPort    = 8000
	statsPort = 8404
	mockBase  = 9100

	// ledgerModel is served by the replicas (--model) for the ledger
	// workers and the admin clients' thresholds, so neither touches the
	// routing of the route clients' model.
	routeModel  = "kvmock"
	ledgerModel = "ledger"
	blockSize   = 16
)

func replicaURL(i int) string { return fmt.Sprintf("http://%s:%d", nodeIP(i), httpPort) }

// haproxyConfig derives the harness's HAProxy configuration from the
// deployed one (deploy/haproxy/haproxy.cfg), changing only the listen
// addresses and the servers, so the checks under test are the real ones.
func haproxyConfig(template string, members []int) (string, error) {
	data, err := os.ReadFile(template)
	if err != nil {
		return "", err
	}
	var out []string
	serversDone := false
	for _, line := range strings.Split(string(data), "\n") {
		t := strings.TrimSpace(line)
		switch {
		case strings.HasPrefix(t, "bind :8000"):
			line = fmt.Sprintf("    bind %s:%d", hostIP, lbPort)
		case strings.HasPrefix(t, "bind :8404"):
			line = fmt.Sprintf("    bind %s:%d", hostIP, statsPort)
		case strings.HasPrefix(t, "server r"):
			if serversDone {
				continue
			}
			serversDone = true
			var lines []string
			for _, i := range members {
				lines = append(lines, fmt.Sprintf("    server r%d %s:%d check", i, nodeIP(i), httpPort))
			}
			line = strings.Join(lines, "\n")
		}
		out = append(out, line)
	}
	cfg := strings.Join(out, "\n")
	if !serversDone || !strings.Contains(cfg, fmt.Sprintf("%s:%d", hostIP, lbPort)) {
		return "", fmt.Errorf("%s: bind :8000 or server lines not found; the harness cannot derive its config", template)
	}
	return cfg, nil
}
