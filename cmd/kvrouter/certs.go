package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/kvrouter/kvrouter/internal/pki"
)

// runCerts is `kvrouter certs`: a private CA and one certificate per node
// and worker in a directory (pki.Layout), for `make certs`, `make run`, the
// Compose stack and the Kubernetes Secrets. It is idempotent: the CA is
// kept, and a holder's files are reissued only when they no longer do
// (expired, another CA, a host missing), so adding a node later leaves the
// others' certificates valid.
//
// Two options serve deployments that cannot run a shell around it (the
// Compose stack's one-shot service runs this binary alone, FROM scratch):
// --token-files creates the bearer tokens the replicas and workers read
// from files, and --export copies everything but the CA key into the
// directory they mount, so ca-key.pem stays where only this command sees it.
func runCerts(_ context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("certs", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("dir", "certs", "directory for ca.pem, ca-key.pem and <role>-<id>.pem / <role>-<id>-key.pem")
	nodes := fs.String("nodes", "", "replicas and the hosts peers dial them at: id=host[,host…][,id=host…] — a comma item without '=' is another host (DNS name or IP) of the node before it, e.g. r1=node1.example,10.0.0.1,r2=node2.example,10.0.0.2")
	workers := fs.String("workers", "", "worker ids, comma separated (each may publish only its own KV events)")
	clients := fs.String("clients", "", "API client ids, comma separated: certificates for the inference endpoints of replicas started with --api-client-certs (no Raft, bus or admin rights)")
	tokens := fs.String("token-files", "", "bearer tokens to create in --dir when missing, comma separated file names (e.g. admin-token,replica-token): 32 random bytes as hex, mode 0600; an existing file is kept as it is")
	export := fs.String("export", "", "also copy ca.pem, the certificates and keys of every holder named here (--nodes, --workers, --clients) and the --token-files into this directory (never ca-key.pem): what replicas and workers mount; a file is rewritten only when it differs")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: kvrouter certs --dir DIR --nodes r1=host[,ip],r2=host… [--workers w1,w2…] [--clients app1,…] [--token-files admin-token,…] [--export DIR]\n\nCreates (once) a private CA and issues what is missing. Keep ca-key.pem off the replicas: only this command needs it (--export copies everything else).")
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
	holders, err := certHolders(*nodes, *workers, *clients)
	if err == nil {
		err = checkExportDir(*dir, *export)
	}
	var tokenNames []string
	if err == nil {
		tokenNames, err = tokenFileNames(*tokens)
	}
	if err == nil && len(holders) == 0 && len(tokenNames) == 0 {
		err = errors.New("nothing to issue: give --nodes, --workers, --clients and/or --token-files")
	}
	if err != nil {
		fmt.Fprintf(stderr, "kvrouter certs: %v\n", err)
		return 2
	}
	layout := pki.Layout{Dir: *dir}
	var files []string // what --export copies
	if len(holders) > 0 {
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
		files = append(files, layout.CACertFile())
		for _, h := range holders {
			m := layout.Material(h.Identity)
			files = append(files, m.CertFile, m.KeyFile)
		}
	}
	for _, name := range tokenNames {
		path := filepath.Join(*dir, name)
		created, err := ensureToken(path)
		if err != nil {
			fmt.Fprintf(stderr, "kvrouter certs: %v\n", err)
			return 1
		}
		if created {
			fmt.Fprintf(stdout, "  token %s created (0600)\n", path)
		} else {
			fmt.Fprintf(stdout, "  token %s kept\n", path)
		}
		files = append(files, path)
	}
	if *export != "" {
		changed, err := exportFiles(*export, files)
		if err != nil {
			fmt.Fprintf(stderr, "kvrouter certs: --export: %v\n", err)
			return 1
		}
		fmt.Fprintf(stdout, "exported %d files to %s (%d changed, ca-key.pem not copied)\n", len(files), *export, changed)
	}
	return 0
}

// certHolders parses --nodes, --workers and --clients. A node needs at
// least one host (cluster.New refuses a certificate that does not name the
// advertised Raft and HTTP hosts).
func certHolders(nodes, workers, clients string) ([]pki.Holder, error) {
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
	for _, w := range splitList(workers) {
		if err := add(pki.Worker(w)); err != nil {
			return nil, fmt.Errorf("--workers: %w", err)
		}
	}
	for _, c := range splitList(clients) {
		if err := add(pki.Client(c)); err != nil {
			return nil, fmt.Errorf("--clients: %w", err)
		}
	}
	return out, nil
}

// tokenName: a plain file name in the directory. ".pem" names belong to
// the certificate layout, so a token can never overwrite a key.
var tokenName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`)

func tokenFileNames(list string) ([]string, error) {
	var out []string
	for _, n := range splitList(list) {
		switch {
		case !tokenName.MatchString(n):
			return nil, fmt.Errorf("--token-files: %q: a file name of letters, digits, '.', '_' and '-'", n)
		case strings.HasSuffix(n, ".pem"):
			return nil, fmt.Errorf("--token-files: %q: .pem names belong to the certificates", n)
		}
		for _, o := range out {
			if o == n {
				return nil, fmt.Errorf("--token-files: %q given twice", n)
			}
		}
		out = append(out, n)
	}
	return out, nil
}

// checkExportDir refuses an --export that is --dir itself (the copy would
// be the original).
func checkExportDir(dir, export string) error {
	if export == "" {
		return nil
	}
	a, err1 := filepath.Abs(dir)
	b, err2 := filepath.Abs(export)
	if err := errors.Join(err1, err2); err != nil {
		return err
	}
	if a == b {
		return fmt.Errorf("--export %s is --dir: give another directory (the one replicas mount, without ca-key.pem)", export)
	}
	return nil
}

// tokenBytes is the entropy of a created token (hex doubles its length).
const tokenBytes = 32

// ensureToken creates a random token at path unless a file is already
// there. The token is written 0600 under a temporary name, synced, and
// linked into place: a reader never sees half a token, and of two runs
// racing one token wins and neither overwrites it. Errors name the file,
// never its contents.
func ensureToken(path string) (created bool, err error) {
	if fi, err := os.Stat(path); err == nil {
		if !fi.Mode().IsRegular() || fi.Size() == 0 {
			return false, fmt.Errorf("token file %s exists but is not a non-empty regular file", path)
		}
		return false, nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return false, fmt.Errorf("token file: %w", err)
	}
	var raw [tokenBytes]byte
	if _, err := rand.Read(raw[:]); err != nil {
		return false, fmt.Errorf("token file %s: random bytes: %w", path, err)
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return false, fmt.Errorf("token file %s: %w", path, err)
	}
	tmp, err := writeTemp(dir, filepath.Base(path), []byte(hex.EncodeToString(raw[:])), 0o600)
	if err != nil {
		return false, fmt.Errorf("token file %s: %w", path, err)
	}
	defer os.Remove(tmp)
	if err := os.Link(tmp, path); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return false, nil // another run was first: keep its token
		}
		return false, fmt.Errorf("token file %s: %w", path, err)
	}
	return true, nil
}

// exportFiles copies files into dir with their modes (keys and tokens stay
// 0600), each through a temporary file and a rename. A file whose copy
// already has the same bytes and mode is left alone, so a rerun changes
// nothing (and no mount sees a rewrite). It returns how many it wrote.
func exportFiles(dir string, files []string) (int, error) {
	// 0755: the directory also holds ca.pem, which processes under other
	// users read (HAProxy's and Prometheus' checks); keys are 0600 anyway.
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return 0, err
	}
	changed := 0
	for _, src := range files {
		data, err := os.ReadFile(src)
		if err != nil {
			return changed, fmt.Errorf("read %w", err) // the PathError names the file only
		}
		fi, err := os.Stat(src)
		if err != nil {
			return changed, err
		}
		mode := fi.Mode().Perm()
		dst := filepath.Join(dir, filepath.Base(src))
		if old, err := os.ReadFile(dst); err == nil && bytes.Equal(old, data) {
			if ofi, err := os.Stat(dst); err == nil && ofi.Mode().Perm() == mode {
				continue
			}
		}
		tmp, err := writeTemp(dir, filepath.Base(dst), data, mode)
		if err != nil {
			return changed, fmt.Errorf("write %s: %w", dst, err)
		}
		if err := os.Rename(tmp, dst); err != nil {
			os.Remove(tmp)
			return changed, fmt.Errorf("write %s: %w", dst, err)
		}
		changed++
	}
	return changed, nil
}

// writeTemp writes data to a new temporary file in dir that has mode before
// it holds a byte, syncs it and returns its name.
func writeTemp(dir, base string, data []byte, mode os.FileMode) (string, error) {
	f, err := os.CreateTemp(dir, "."+base+".tmp*")
	if err != nil {
		return "", err
	}
	name := f.Name()
	err = f.Chmod(mode)
	if err == nil {
		_, err = f.Write(data)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(name)
		return "", err
	}
	return name, nil
}
