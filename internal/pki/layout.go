package pki

import (
	"crypto/x509"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"path/filepath"
	"regexp"
	"slices"
)

// Layout is the directory `kvrouter certs` (and `make certs`) writes and
// every component reads: ca.pem, ca-key.pem, and <role>-<id>.pem with
// <role>-<id>-key.pem per holder. One convention, so the Compose stack, the
// Kubernetes Secrets and the chaos suite name the same files.
type Layout struct{ Dir string }

func (l Layout) CACertFile() string { return filepath.Join(l.Dir, "ca.pem") }
func (l Layout) CAKeyFile() string  { return filepath.Join(l.Dir, "ca-key.pem") }

// Material is the files of id's certificate in this layout.
func (l Layout) Material(id Identity) Material {
	base := filepath.Join(l.Dir, string(id.Role)+"-"+id.ID)
	return Material{CAFile: l.CACertFile(), CertFile: base + ".pem", KeyFile: base + "-key.pem"}
}

// fileSafeID: ids that are file names as they are. Layout refuses the
// others rather than invent an escaping every reader must repeat.
var fileSafeID = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`)

// Holder is one certificate to issue.
type Holder struct {
	Identity Identity
	Hosts    []string // see Request.Hosts
}

// Ensure makes the layout hold a CA and a certificate for every holder. It
// is idempotent: an existing CA is reused (so adding a node later keeps
// every other certificate valid) and an existing holder's files are left
// alone unless they no longer do (expired, from another CA, missing one of
// the hosts asked for), in which case they are reissued. It returns the holders it (re)issued.
func (l Layout) Ensure(holders []Holder) ([]Identity, error) {
	for _, h := range holders {
		if err := h.Identity.Validate(); err != nil {
			return nil, err
		}
		if !fileSafeID.MatchString(h.Identity.ID) {
			return nil, fmt.Errorf("certs: id %q: use letters, digits, '.', '_' and '-' for ids that name files", h.Identity.ID)
		}
	}
	ca, err := LoadCA(l.CACertFile(), l.CAKeyFile())
	if errors.Is(err, fs.ErrNotExist) {
		if ca, err = NewCA(CAOptions{}); err == nil {
			err = ca.Save(l.CACertFile(), l.CAKeyFile())
		}
	}
	if err != nil {
		return nil, fmt.Errorf("certs: CA in %s: %w", l.Dir, err)
	}
	var issued []Identity
	for _, h := range holders {
		m := l.Material(h.Identity)
		if b, err := LoadBundle(m); err == nil && b.Identity() == h.Identity && coversHosts(b.cert.Load().Leaf, h.Hosts) {
			continue
		}
		kp, err := ca.Issue(Request{Identity: h.Identity, Hosts: h.Hosts})
		if err != nil {
			return issued, fmt.Errorf("certs: %w", err)
		}
		if err := kp.Save(m.CertFile, m.KeyFile); err != nil {
			return issued, fmt.Errorf("certs: %s: %w", h.Identity, err)
		}
		issued = append(issued, h.Identity)
	}
	return issued, nil
}

func coversHosts(leaf *x509.Certificate, hosts []string) bool {
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			if !slices.ContainsFunc(leaf.IPAddresses, ip.Equal) {
				return false
			}
		} else if h != "" && !slices.Contains(leaf.DNSNames, h) {
			return false
		}
	}
	return true
}
