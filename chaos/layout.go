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
	// raftGroupPortStep: with --raft-groups G > 1 (G1), data group g's Raft
	// port is raftPort + g × this (7100, 7200, 7300 for G = 3), clear of
	// every port above inside a replica's namespace. isolate drops by
	// address, so it covers them without knowing them.
	raftGroupPortStep = 100

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

// replicaURL is node i's HTTP port: https (the secure default off
// loopback), or http for a scenario that runs insecure on purpose.
func replicaURL(scheme string, i int) string {
	return fmt.Sprintf("%s://%s:%d", scheme, nodeIP(i), httpPort)
}

// haproxyConfig derives the harness's HAProxy configuration from the
// deployed one (deploy/haproxy/haproxy.cfg), changing only the listen
// addresses, the servers and how the checks reach them, so the checks under
// test are the real ones. Every backend's block of server lines (the
// deployed file has one per backend: replicas, checked on /ready, and
// survivors, on /health) becomes the members' servers, with the options of
// the block's first line.
//
// HAProxy balances TCP (L4): TLS passes through to the replicas untouched,
// but its health checks are its own connections. checkTLS(i) gives server
// i's check TLS options ("" for plain HTTP checks); whatever TLS options
// the deployed file carries for its own setting (its CA path, its SNI) are
// dropped from server and default-server lines first, so the derived file
// never mixes the two.
func haproxyConfig(template string, members []int, checkTLS func(i int) string) (string, error) {
	data, err := os.ReadFile(template)
	if err != nil {
		return "", err
	}
	var out []string
	blocks, inBlock := 0, false
	for _, line := range strings.Split(string(data), "\n") {
		t := strings.TrimSpace(line)
		if strings.HasPrefix(t, "server r") {
			if inBlock {
				continue
			}
			inBlock = true
			blocks++
			opts := "check"
			if f := strings.Fields(t); len(f) > 3 {
				opts = strings.Join(withoutTLSOptions(f[3:]), " ")
			}
			for _, i := range members {
				o := opts
				if checkTLS != nil {
					if extra := checkTLS(i); extra != "" {
						o += " " + extra
					}
				}
				out = append(out, fmt.Sprintf("    server r%d %s:%d %s", i, nodeIP(i), httpPort, o))
			}
			continue
		}
		inBlock = false
		switch {
		case strings.HasPrefix(t, "bind :8000"):
			line = fmt.Sprintf("    bind %s:%d", hostIP, lbPort)
		case strings.HasPrefix(t, "bind :8404"):
			line = fmt.Sprintf("    bind %s:%d", hostIP, statsPort)
		case strings.HasPrefix(t, "default-server "):
			line = "    " + strings.Join(withoutTLSOptions(strings.Fields(t)), " ")
		}
		out = append(out, line)
	}
	cfg := strings.Join(out, "\n")
	if blocks == 0 || !strings.Contains(cfg, fmt.Sprintf("%s:%d", hostIP, lbPort)) {
		return "", fmt.Errorf("%s: bind :8000 or server lines not found; the harness cannot derive its config", template)
	}
	return cfg, nil
}

// HAProxy server options about TLS: those without an argument and those
// taking one.
var (
	tlsFlagOptions = map[string]bool{"ssl": true, "no-ssl": true, "check-ssl": true, "no-check-ssl": true, "no-verifyhost": true}
	tlsArgOptions  = map[string]bool{"verify": true, "ca-file": true, "crl-file": true, "crt": true, "verifyhost": true,
		"sni": true, "check-sni": true, "ciphers": true, "ciphersuites": true, "ssl-min-ver": true, "ssl-max-ver": true, "alpn": true, "check-alpn": true}
)

// withoutTLSOptions drops the TLS options (and their arguments) from a
// server or default-server line's words.
func withoutTLSOptions(words []string) []string {
	var out []string
	for k := 0; k < len(words); k++ {
		switch w := words[k]; {
		case tlsFlagOptions[w]:
		case tlsArgOptions[w]:
			k++
		default:
			out = append(out, w)
		}
	}
	return out
}
