package pki

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"
)

// Material names the files of one holder's TLS material. Paths, not
// contents: a Material can be logged.
type Material struct {
	CAFile   string // PEM certificates of the trusted CA
	CertFile string // PEM certificate of the holder
	KeyFile  string // PEM private key of the holder
}

// IsZero reports whether no file is named at all.
func (m Material) IsZero() bool { return m == Material{} }

// Missing names the files that are not set, for errors such as "TLS needs a
// CA file, a key file".
func (m Material) Missing() []string {
	var out []string
	if m.CAFile == "" {
		out = append(out, "CA file")
	}
	if m.CertFile == "" {
		out = append(out, "certificate file")
	}
	if m.KeyFile == "" {
		out = append(out, "key file")
	}
	return out
}

// Bundle is one holder's loaded TLS material: whom it trusts, what it
// presents, and who it is. The certificate it presents can be replaced
// while connections are served (Reload): every configuration it made
// picks the current one at each handshake.
type Bundle struct {
	roots    *x509.CertPool
	identity Identity
	material Material // the files Reload rereads (zero for in-memory bundles)
	cert     atomic.Pointer[tls.Certificate]
}

// LoadBundle reads m and checks it is usable: the certificate matches the
// key, chains to the CA, is valid now and names one kvrouter identity. A
// replica with broken material should fail at startup, not at its first
// handshake.
func LoadBundle(m Material) (*Bundle, error) {
	if missing := m.Missing(); len(missing) > 0 {
		return nil, fmt.Errorf("TLS material incomplete: missing %v", missing)
	}
	pool, err := LoadPool(m.CAFile)
	if err != nil {
		return nil, err
	}
	cert, err := tls.LoadX509KeyPair(m.CertFile, m.KeyFile)
	if err != nil {
		// LoadX509KeyPair's errors describe the problem without quoting
		// key material.
		return nil, fmt.Errorf("load %s / %s: %w", m.CertFile, m.KeyFile, err)
	}
	b, err := newBundle(pool, cert, time.Now())
	if err != nil {
		return nil, err
	}
	b.material = m
	return b, nil
}

// NewBundle builds a bundle from PEM in memory (tests, and `kvrouter certs`
// checking what it wrote).
func NewBundle(caPEM []byte, kp *KeyPair) (*Bundle, error) {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return nil, errors.New("bundle: no CA certificate in PEM")
	}
	cert, err := kp.TLSCertificate()
	if err != nil {
		return nil, fmt.Errorf("bundle: %w", err)
	}
	return newBundle(pool, cert, time.Now())
}

func newBundle(pool *x509.CertPool, cert tls.Certificate, now time.Time) (*Bundle, error) {
	leaf := cert.Leaf
	if leaf == nil {
		var err error
		if leaf, err = x509.ParseCertificate(cert.Certificate[0]); err != nil {
			return nil, fmt.Errorf("bundle: parse certificate: %w", err)
		}
		cert.Leaf = leaf
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: pool, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		return nil, fmt.Errorf("bundle: own certificate does not verify against the CA: %w", err)
	}
	ident, err := IdentityOf(leaf)
	if err != nil {
		return nil, fmt.Errorf("bundle: own certificate: %w", err)
	}
	b := &Bundle{roots: pool, identity: ident}
	b.cert.Store(&cert)
	return b, nil
}

// Reload rereads the certificate and key files (not the CA: trusting a new
// CA is a new deployment) and, when they changed and still make a valid
// bundle naming the same identity under the same CA, presents the new
// certificate from the next handshake on. Open connections keep theirs.
// Anything wrong leaves the current certificate in place and says why, so
// a half-written file during a rotation never takes a replica down.
func (b *Bundle) Reload() (changed bool, err error) {
	if b.material.IsZero() {
		return false, errors.New("reload: bundle was not loaded from files")
	}
	cert, err := tls.LoadX509KeyPair(b.material.CertFile, b.material.KeyFile)
	if err != nil {
		return false, fmt.Errorf("reload %s / %s: %w", b.material.CertFile, b.material.KeyFile, err)
	}
	if cur := b.cert.Load(); bytes.Equal(cur.Certificate[0], cert.Certificate[0]) {
		return false, nil
	}
	nb, err := newBundle(b.roots, cert, time.Now())
	if err != nil {
		return false, fmt.Errorf("reload %s: %w", b.material.CertFile, err)
	}
	if nb.identity != b.identity {
		return false, fmt.Errorf("reload %s: names %s, this process is %s", b.material.CertFile, nb.identity, b.identity)
	}
	b.cert.Store(nb.cert.Load())
	return true, nil
}

// Certificate is the certificate (with its key) this bundle presents now.
func (b *Bundle) Certificate() *tls.Certificate { return b.cert.Load() }

// Identity is who this bundle's certificate names.
func (b *Bundle) Identity() Identity { return b.identity }

// NotAfter is when this bundle's current certificate expires.
func (b *Bundle) NotAfter() time.Time { return b.cert.Load().Leaf.NotAfter }

// Material is the files this bundle was loaded from (zero when built in
// memory).
func (b *Bundle) Material() Material { return b.material }

// Roots is the trusted CA pool.
func (b *Bundle) Roots() *x509.CertPool { return b.roots }

// ErrNotAllowed is wrapped by every refusal of a verified peer by an Allow
// policy: the certificate is ours, but its holder may not be here.
var ErrNotAllowed = errors.New("peer identity not allowed")

// Allow decides whether a verified peer identity may connect. It returns
// nil to accept and an error (wrapping ErrNotAllowed) to refuse.
type Allow func(Identity) error

// AllowRoles accepts any identity holding one of roles.
func AllowRoles(roles ...Role) Allow {
	return func(id Identity) error {
		if slices.Contains(roles, id.Role) {
			return nil
		}
		return fmt.Errorf("%s: role %q: %w", id, id.Role, ErrNotAllowed)
	}
}

// AllowNodes accepts only nodes for which isMember returns true: Raft asks
// its current configuration, so a node removed from the cluster is refused
// even though its certificate is still valid. A nil isMember accepts any
// node.
func AllowNodes(isMember func(nodeID string) bool) Allow {
	return func(id Identity) error {
		if id.Role != RoleNode {
			return fmt.Errorf("%s: not a node: %w", id, ErrNotAllowed)
		}
		if isMember != nil && !isMember(id.ID) {
			return fmt.Errorf("%s: not a cluster member: %w", id, ErrNotAllowed)
		}
		return nil
	}
}

// ServerTLS is a server configuration that requires a client certificate
// from this CA whose identity allow accepts (nil: any identity). The
// handshake fails before the application reads a byte, so a protocol that
// trusts its peers (Raft) never sees a stranger's input.
func (b *Bundle) ServerTLS(allow Allow) *tls.Config {
	c := b.base()
	c.ClientAuth = tls.RequireAndVerifyClientCert
	c.ClientCAs = b.roots
	c.VerifyConnection = verifyPeer(allow, true)
	return c
}

// ServerTLSOptionalClient verifies a client certificate when one is sent
// (a certificate from another CA still fails the handshake) but lets
// clients without one through: the application must then authenticate them
// otherwise (NATS: the replica credential) and refuse anonymous ones.
func (b *Bundle) ServerTLSOptionalClient(allow Allow) *tls.Config {
	c := b.base()
	c.ClientAuth = tls.VerifyClientCertIfGiven
	c.ClientCAs = b.roots
	c.VerifyConnection = verifyPeer(allow, false)
	return c
}

// ClientTLS is a client configuration that presents this bundle's
// certificate and accepts only a server whose certificate chains to the CA,
// matches the host name dialled (ServerName, set by the caller or derived
// from the address) and names an identity allow accepts (nil: any).
func (b *Bundle) ClientTLS(allow Allow) *tls.Config {
	c := b.base()
	c.RootCAs = b.roots
	c.VerifyConnection = verifyPeer(allow, true)
	return c
}

// PeerTLS is one configuration for a symmetric link whose ends both dial
// and accept with the same settings (NATS routes): client certificate
// required when accepting, server certificate checked when dialling, and
// allow applied to the peer either way.
func (b *Bundle) PeerTLS(allow Allow) *tls.Config {
	c := b.ServerTLS(allow)
	c.RootCAs = b.roots
	return c
}

// TrustOnlyTLS is a client configuration for a holder without a
// certificate of its own (a tool authenticating with a token): it checks
// the server exactly as ClientTLS does and presents nothing.
func TrustOnlyTLS(roots *x509.CertPool, allow Allow) *tls.Config {
	return &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: roots, VerifyConnection: verifyPeer(allow, true)}
}

func (b *Bundle) base() *tls.Config {
	return &tls.Config{
		// TLS 1.3 only: no downgrade, no renegotiation, no weak suites to
		// configure; every peer is ours or a worker we ship guidance for.
		MinVersion: tls.VersionTLS13,
		// The certificate is looked up per handshake (not Certificates,
		// which crypto/tls would prefer to GetCertificate for clients that
		// send no SNI — peers dialled by IP), so Reload takes effect on
		// every listener and dialer built from this bundle.
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return b.cert.Load(), nil },
		GetClientCertificate: func(cri *tls.CertificateRequestInfo) (*tls.Certificate, error) {
			// As crypto/tls does with Certificates: withhold a certificate
			// the server's list of acceptable CAs does not name (the
			// server then sees an anonymous client and decides).
			cert := b.cert.Load()
			if cri.SupportsCertificate(cert) != nil {
				return &tls.Certificate{}, nil
			}
			return cert, nil
		},
	}
}

// verifyPeer runs after the standard chain, expiry and key-usage checks
// (crypto/tls has filled VerifiedChains) and adds the identity check.
func verifyPeer(allow Allow, required bool) func(tls.ConnectionState) error {
	return func(cs tls.ConnectionState) error {
		if len(cs.PeerCertificates) == 0 {
			if required {
				return errors.New("peer sent no certificate")
			}
			return nil
		}
		id, err := PeerIdentity(cs)
		if err != nil {
			return err
		}
		if allow == nil {
			return nil
		}
		return allow(id)
	}
}

// PeerIdentity is the identity named by a connection's verified peer
// certificate. It refuses an unverified one: a certificate the peer merely
// sent proves nothing.
func PeerIdentity(cs tls.ConnectionState) (Identity, error) {
	if len(cs.VerifiedChains) == 0 || len(cs.VerifiedChains[0]) == 0 {
		return Identity{}, errors.New("peer certificate not verified")
	}
	id, err := IdentityOf(cs.VerifiedChains[0][0])
	if err != nil {
		return Identity{}, fmt.Errorf("peer certificate: %w", err)
	}
	return id, nil
}
