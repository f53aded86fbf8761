package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/kvrouter/kvrouter/internal/pki"
)

// runCerts is `kvrouter certs`: a private CA and one certificate per node
// and worker in a directory (pki.Layout), for `make certs`, `make run`, the
// Compose stack and the Kubernetes Secrets. It is idempotent: the CA is
// kept, and a holder's files are reissued only when they no longer do
// (expired, another CA, a host missing), so adding a node later leaves the
// others' certificates valid.
func runCerts(_ context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("certs", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("dir", "certs", "directory for ca.pem, ca-key.pem and <role>-<id>.pem / <role>-<id>-key.pem")
	nodes := fs.String("nodes", "", "replicas and the hosts peers dial them at: id=host[,host…][,id=host…] — a comma item without '=' is another host (DNS name or IP) of the node before it, e.g. r1=node1.example,10.0.0.1,r2=node2.example,10.0.0.2")
	workers := fs.String("workers", "", "worker ids, comma separated (each may publish only its own KV events)")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: kvrouter certs --dir DIR --nodes r1=host[,ip],r2=host… [--workers w1,w2…]\n\nCreates (once) a private CA and issues what is missing. Keep ca-key.pem off the replicas: only this command needs it.")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kvrouter certs: unexpected arguments %q\n", fs.Args())
		return 2
	}
	holders, err := certHolders(*nodes, *workers)
	if err != nil {
		fmt.Fprintf(stderr, "kvrouter certs: %v\n", err)
		return 2
	}
	layout := pki.Layout{Dir: *dir}
	issued, err := layout.Ensure(holders)
	if err != nil {
		fmt.Fprintf(stderr, "kvrouter certs: %v\n", err)
		return 1
	}
	fmt.Fprintf(stdout, "certs in %s: CA %s; %d issued, %d already valid\n", *dir, layout.CACertFile(), len(issued), len(holders)-len(issued))
	for _, id := range issued {
		m := layout.Material(id)
		fmt.Fprintf(stdout, "  issued %s  %s  %s\n", id, m.CertFile, m.KeyFile)
	}
	return 0
}

// certHolders parses --nodes and --workers. A node needs at least one host
// (cluster.New refuses a certificate that does not name the advertised
// Raft and HTTP hosts).
func certHolders(nodes, workers string) ([]pki.Holder, error) {
	var out []pki.Holder
	seen := map[pki.Identity]bool{}
	add := func(id pki.Identity) error {
		if seen[id] {
			return fmt.Errorf("%s given twice", id)
		}
		seen[id] = true
		out = append(out, pki.Holder{Identity: id})
		return nil
	}
	for _, item := range splitList(nodes) {
		id, host, ok := strings.Cut(item, "=")
		if !ok {
			if len(out) == 0 {
				return nil, fmt.Errorf("--nodes: %q: start with id=host", item)
			}
			last := &out[len(out)-1]
			last.Hosts = append(last.Hosts, item)
			continue
		}
		if id == "" || host == "" {
			return nil, fmt.Errorf("--nodes: %q: want id=host", item)
		}
		if err := add(pki.Node(id)); err != nil {
			return nil, fmt.Errorf("--nodes: %w", err)
		}
		out[len(out)-1].Hosts = []string{host}
	}
	if len(out) == 0 && workers == "" {
		return nil, errors.New("nothing to issue: give --nodes and/or --workers")
	}
	for _, w := range splitList(workers) {
		if err := add(pki.Worker(w)); err != nil {
			return nil, fmt.Errorf("--workers: %w", err)
		}
	}
	return out, nil
}
