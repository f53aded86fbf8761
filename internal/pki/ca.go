package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"time"
)

// Default lifetimes. Node and worker certificates are short enough that a
// stolen one ages out within a release cycle, long enough that nobody has
// to renew them by hand during a test run; the CA outlives them all.
const (
	DefaultCAValidity   = 10 * 365 * 24 * time.Hour
	DefaultCertValidity = 365 * 24 * time.Hour
	// clockSkew backdates NotBefore so that a peer whose clock is a little
	// behind accepts a certificate issued a moment ago.
	clockSkew = 5 * time.Minute
)

// CA is a private certificate authority: one per kvrouter deployment. Its
// key signs node and worker certificates; only its certificate is
// distributed.
type CA struct {
	cert    *x509.Certificate
	key     crypto.Signer
	certPEM []byte
}

// CAOptions configures NewCA.
type CAOptions struct {
	// Name is the CA's common name (default "kvrouter CA").
	Name string
	// Validity (default DefaultCAValidity) counts from Now.
	Validity time.Duration
	// Now is the issuing time (default time.Now()); tests move it.
	Now time.Time
}

// NewCA creates a CA with a fresh ECDSA P-256 key. P-256 rather than
// Ed25519: every TLS stack a worker might bring (Python, Rust, older Go)
// speaks it.
func NewCA(opts CAOptions) (*CA, error) {
	if opts.Name == "" {
		opts.Name = "kvrouter CA"
	}
	if opts.Validity <= 0 {
		opts.Validity = DefaultCAValidity
	}
	if opts.Now.IsZero() {
		opts.Now = time.Now()
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("new CA: generate key: %w", err)
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, fmt.Errorf("new CA: %w", err)
	}
	ski, err := subjectKeyID(key.Public())
	if err != nil {
		return nil, fmt.Errorf("new CA: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: opts.Name, Organization: []string{"kvrouter"}},
		NotBefore:             opts.Now.Add(-clockSkew),
		NotAfter:              opts.Now.Add(opts.Validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		// MaxPathLenZero: the CA signs leaves only, never another CA, so a
		// leaked leaf key can never mint certificates.
		MaxPathLen:     0,
		MaxPathLenZero: true,
		SubjectKeyId:   ski,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("new CA: sign: %w", err)
	}
	return newCA(der, key)
}

func newCA(der []byte, key crypto.Signer) (*CA, error) {
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("CA certificate: %w", err)
	}
	if !cert.IsCA {
		return nil, errors.New("CA certificate: not a CA (basic constraints)")
	}
	if !publicKeysEqual(cert.PublicKey, key.Public()) {
		return nil, errors.New("CA certificate: key does not match certificate")
	}
	return &CA{cert: cert, key: key, certPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}, nil
}

// Certificate is the CA's certificate.
func (ca *CA) Certificate() *x509.Certificate { return ca.cert }

// CertPEM is the CA certificate in PEM: what every node and worker trusts.
func (ca *CA) CertPEM() []byte { return append([]byte(nil), ca.certPEM...) }

// Pool is a pool holding only this CA: the trust anchor for peers.
func (ca *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.cert)
	return p
}

// Request describes a leaf certificate.
type Request struct {
	// Identity goes into the URI SAN; it decides what the holder may do.
	Identity Identity
	// Hosts are DNS names or IP addresses the holder serves on (Raft, NATS
	// and HTTP addresses, for clients that verify host names). Workers,
	// which only dial out, need none.
	Hosts []string
	// Validity (default DefaultCertValidity) counts from Now.
	Validity time.Duration
	// Now is the issuing time (default time.Now()); tests move it to mint
	// expired or not-yet-valid certificates.
	Now time.Time
}

// KeyPair is an issued certificate and its private key, PEM encoded.
type KeyPair struct {
	CertPEM []byte
	KeyPEM  []byte
}

// Issue signs a certificate for req with a fresh ECDSA P-256 key. Node
// certificates can serve and dial (routes and Raft do both); worker
// certificates can only dial.
func (ca *CA) Issue(req Request) (*KeyPair, error) {
	if err := req.Identity.Validate(); err != nil {
		return nil, fmt.Errorf("issue: %w", err)
	}
	if req.Validity <= 0 {
		req.Validity = DefaultCertValidity
	}
	if req.Now.IsZero() {
		req.Now = time.Now()
	}
	notAfter := req.Now.Add(req.Validity)
	if notAfter.After(ca.cert.NotAfter) {
		// A leaf that outlives its CA would fail verification on the day
		// the CA expires, with an error naming the leaf: cap it instead.
		notAfter = ca.cert.NotAfter
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("issue %s: generate key: %w", req.Identity, err)
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, fmt.Errorf("issue %s: %w", req.Identity, err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:   serial,
		Subject:        pkix.Name{CommonName: req.Identity.ID, OrganizationalUnit: []string{string(req.Identity.Role)}, Organization: []string{"kvrouter"}},
		NotBefore:      req.Now.Add(-clockSkew),
		NotAfter:       notAfter,
		KeyUsage:       x509.KeyUsageDigitalSignature,
		URIs:           []*url.URL{req.Identity.URI()},
		AuthorityKeyId: ca.cert.SubjectKeyId,
	}
	switch req.Identity.Role {
	case RoleNode:
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
	default:
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	}
	for _, h := range req.Hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else if h != "" {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, key.Public(), ca.key)
	if err != nil {
		return nil, fmt.Errorf("issue %s: sign: %w", req.Identity, err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("issue %s: encode key: %w", req.Identity, err)
	}
	return &KeyPair{
		CertPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		KeyPEM:  pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}),
	}, nil
}

// TLSCertificate parses the pair for a tls.Config.
func (kp *KeyPair) TLSCertificate() (tls.Certificate, error) {
	c, err := tls.X509KeyPair(kp.CertPEM, kp.KeyPEM)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("key pair: %w", err)
	}
	return c, nil
}

func randomSerial() (*big.Int, error) {
	// 128 random bits: unique without bookkeeping, as CAs must do.
	s, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		return nil, fmt.Errorf("serial: %w", err)
	}
	return s, nil
}

func subjectKeyID(pub crypto.PublicKey) ([]byte, error) {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return nil, fmt.Errorf("subject key id: %w", err)
	}
	sum := sha256.Sum256(der)
	return sum[:20], nil
}

func publicKeysEqual(a, b crypto.PublicKey) bool {
	ea, ok := a.(interface{ Equal(crypto.PublicKey) bool })
	return ok && ea.Equal(b)
}
