package pki

import (
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"unicode"
	"unicode/utf8"
)

// TrustDomain is the host part of every identity URI: one private CA, one
// trust domain. A certificate naming another domain is not ours, whoever
// signed it.
const TrustDomain = "kvrouter"

// Role says what a certificate's holder is. Permissions hang on the role
// (a replica may write the Raft log and use the JetStream API; a worker may
// publish its own events), so the role is part of the identity, not a
// separate attribute somebody could forget to check.
type Role string

const (
	// RoleNode is a replica: Raft peer, NATS route, NATS client with full
	// rights on the bus.
	RoleNode Role = "node"
	// RoleWorker is an engine worker (or its publisher): a NATS client that
	// may publish only its own KV events.
	RoleWorker Role = "worker"
	// RoleClient is an inference client of the HTTP API (when a replica
	// requires client certificates there): no Raft, bus or cluster rights.
	RoleClient Role = "client"
)

func (r Role) valid() bool { return r == RoleNode || r == RoleWorker || r == RoleClient }

// Identity is who a certificate names: spiffe://kvrouter/<role>/<id>.
type Identity struct {
	Role Role
	ID   string
}

// Node is the identity of replica id.
func Node(id string) Identity { return Identity{Role: RoleNode, ID: id} }

// Worker is the identity of worker id.
func Worker(id string) Identity { return Identity{Role: RoleWorker, ID: id} }

// Client is the identity of API client id.
func Client(id string) Identity { return Identity{Role: RoleClient, ID: id} }

// ErrNoIdentity: the certificate names no kvrouter identity (or more than
// one, which is as good as none: we would not know which one to believe).
var ErrNoIdentity = errors.New("certificate names no kvrouter identity")

// Validate checks that the identity can be written into a certificate and
// read back unchanged.
func (i Identity) Validate() error {
	if !i.Role.valid() {
		return fmt.Errorf("identity: unknown role %q", i.Role)
	}
	if i.ID == "" || len(i.ID) > 255 {
		return fmt.Errorf("identity: id must be 1-255 bytes, got %d", len(i.ID))
	}
	if !utf8.ValidString(i.ID) {
		return errors.New("identity: id is not valid UTF-8")
	}
	for _, r := range i.ID {
		if unicode.IsControl(r) {
			return errors.New("identity: id contains a control character")
		}
	}
	return nil
}

// URI is the SAN URI naming the identity. The id is path-escaped, so any
// worker name (eventbus allows any bytes) survives the round trip.
func (i Identity) URI() *url.URL {
	return &url.URL{Scheme: "spiffe", Host: TrustDomain, Path: "/" + string(i.Role) + "/" + i.ID,
		RawPath: "/" + string(i.Role) + "/" + url.PathEscape(i.ID)}
}

// String is the URI form, for logs and errors (identities are not secret).
func (i Identity) String() string { return i.URI().String() }

// ParseIdentity reads spiffe://kvrouter/<role>/<id>.
func ParseIdentity(s string) (Identity, error) {
	u, err := url.Parse(s)
	if err != nil {
		return Identity{}, fmt.Errorf("identity %q: %w", s, err)
	}
	return identityFromURI(u)
}

func identityFromURI(u *url.URL) (Identity, error) {
	if u.Scheme != "spiffe" || u.Host != TrustDomain || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
		return Identity{}, fmt.Errorf("identity %q: not spiffe://%s/<role>/<id>", u.Redacted(), TrustDomain)
	}
	// Split the escaped path so an escaped "/" inside an id stays inside it.
	parts := strings.Split(strings.TrimPrefix(u.EscapedPath(), "/"), "/")
	if len(parts) != 2 {
		return Identity{}, fmt.Errorf("identity %q: path must be /<role>/<id>", u.String())
	}
	id, err := url.PathUnescape(parts[1])
	if err != nil {
		return Identity{}, fmt.Errorf("identity %q: %w", u.String(), err)
	}
	ident := Identity{Role: Role(parts[0]), ID: id}
	if err := ident.Validate(); err != nil {
		return Identity{}, fmt.Errorf("identity %q: %w", u.String(), err)
	}
	return ident, nil
}

// IdentityOf is the one kvrouter identity a certificate names in its URI
// SANs. It does not verify the certificate: call it on a verified chain's
// leaf only (PeerIdentity does).
func IdentityOf(cert *x509.Certificate) (Identity, error) {
	var found []Identity
	for _, u := range cert.URIs {
		if u.Scheme != "spiffe" || u.Host != TrustDomain {
			continue // another trust domain's name is not a claim on ours
		}
		ident, err := identityFromURI(u)
		if err != nil {
			return Identity{}, err
		}
		found = append(found, ident)
	}
	if len(found) != 1 {
		return Identity{}, ErrNoIdentity
	}
	return found[0], nil
}
