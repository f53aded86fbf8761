package eventbus

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/kvrouter/kvrouter/internal/pki"
)

// Security is how the embedded server authenticates and authorizes
// connections. The zero value is the secure mode, and it needs this
// replica's TLS material: StartServer refuses to start without it, naming
// what is missing. Insecure is the explicit way back to an open bus.
//
// In the secure mode every client and route connection is TLS 1.3 with
// certificates from the deployment's CA; routes must present a node
// certificate; clients must present a node or worker certificate or the
// replica token; nothing anonymous gets in. A node may do everything; a
// worker may publish only its own kv.events.<worker> subject (see
// workerPermissions and DESIGN.md).
type Security struct {
	// Insecure turns all of that off: plaintext, anonymous, every subject
	// open to everyone (the bus before issue 16). Tests and --insecure only.
	Insecure bool
	// TLS names this replica's node certificate, key and CA. The client
	// port and the routes serve it; routes and the replica's own bus client
	// present it.
	TLS pki.Material
	// Bundle is already-loaded material; it wins over TLS (tests, or a
	// caller that loaded the files once for Raft, NATS and HTTPS).
	Bundle *pki.Bundle
	// ReplicaToken, when set, also admits a client without a certificate
	// that sends this token, with a replica's rights: for tools that cannot
	// hold a node key. Without it a client certificate is required at the
	// TLS handshake. Never logged (pki.Secret).
	ReplicaToken pki.Secret
	// IsMember, when set, admits only current cluster members as routes
	// and as node clients (the Raft configuration is the natural source).
	// Nil admits any node certificate of the CA.
	IsMember func(nodeID string) bool
}

// errInsecureHint is appended to every "secure mode needs ..." error: the
// operator must learn both what is missing and how to opt out on purpose.
const errInsecureHint = "or set Security.Insecure (kvrouter --insecure) to run an unauthenticated bus on purpose"

// bundle loads the material, or returns nil in the insecure mode.
func (s Security) bundle() (*pki.Bundle, error) {
	if s.Insecure {
		return nil, nil
	}
	b := s.Bundle
	if b == nil {
		if s.TLS.IsZero() {
			return nil, fmt.Errorf("secure mode needs TLS material (%s), %s", strings.Join(s.TLS.Missing(), ", "), errInsecureHint)
		}
		var err error
		if b, err = pki.LoadBundle(s.TLS); err != nil {
			return nil, fmt.Errorf("secure mode: %w", err)
		}
	}
	if b.Identity().Role != pki.RoleNode {
		return nil, fmt.Errorf("secure mode: the server's certificate names %s, not a node", b.Identity())
	}
	return b, nil
}

// applySecurity sets opts' TLS and authentication for the secure mode and
// returns the loaded material (nil when insecure). Clustered servers get
// route TLS and route authentication as well.
func applySecurity(opts *server.Options, sec Security, clustered bool, log *slog.Logger) (*pki.Bundle, error) {
	b, err := sec.bundle()
	if err != nil || b == nil {
		return nil, err
	}
	allowNode := pki.AllowNodes(sec.IsMember)
	// The client port accepts nodes (members only, when known) and
	// workers; what each may do is decided by clientAuth.
	allowClient := func(id pki.Identity) error {
		if id.Role == pki.RoleNode {
			return allowNode(id)
		}
		return pki.AllowRoles(pki.RoleWorker)(id)
	}
	if sec.ReplicaToken.IsZero() {
		opts.TLSConfig = b.ServerTLS(allowClient)
	} else {
		opts.TLSConfig = b.ServerTLSOptionalClient(allowClient)
	}
	opts.CustomClientAuthentication = &clientAuth{token: sec.ReplicaToken, allowNode: allowNode, log: log}
	if clustered {
		opts.Cluster.TLSConfig = b.PeerTLS(allowNode)
		opts.CustomRouterAuthentication = &routeAuth{allowNode: allowNode, log: log}
	}
	return b, nil
}

// ClientSecurity is how a client authenticates to the bus. Like Security,
// its zero value is secure and incomplete: Options fails until material,
// a token or Insecure is given.
type ClientSecurity struct {
	// Insecure connects in plaintext without credentials.
	Insecure bool
	// TLS names the client's certificate, key and CA. With Token, only
	// the CA file is needed (to check the server).
	TLS pki.Material
	// Bundle is already-loaded material; it wins over TLS.
	Bundle *pki.Bundle
	// Token is the replica token (Security.ReplicaToken).
	Token pki.Secret
	// External says the server is not a kvrouter replica (an external
	// NATS, BusConfig.ExternalURL): its certificate is checked against
	// the CA and the host name only, not for a node identity.
	External bool
	// ServerName, when set, is the name the server's certificate must
	// carry instead of the URL's host: a replica's own client dialling its
	// embedded server on loopback because it listens on a wildcard address
	// (Server.ClientSecurity).
	ServerName string
}

// Options turns the settings into Connect options.
func (cs ClientSecurity) Options() ([]ConnectOption, error) {
	if cs.Insecure {
		return nil, nil
	}
	serverAllow := pki.AllowRoles(pki.RoleNode)
	var opts []ConnectOption
	b := cs.Bundle
	if b == nil && cs.TLS.CertFile != "" {
		var err error
		if b, err = pki.LoadBundle(cs.TLS); err != nil {
			return nil, fmt.Errorf("bus client: %w", err)
		}
	}
	switch {
	case b != nil:
		opts = append(opts, withBundle(b, serverAllow, cs.External))
	case cs.TLS.CAFile != "" && !cs.Token.IsZero():
		roots, err := pki.LoadPool(cs.TLS.CAFile)
		if err != nil {
			return nil, fmt.Errorf("bus client: %w", err)
		}
		opts = append(opts, WithTLSConfig(trustOnly(roots, serverAllow, cs.External)))
	default:
		return nil, errors.New("bus client: secure mode needs a certificate and key, or a CA file and the replica token, " +
			"or ClientSecurity.Insecure for an unauthenticated bus")
	}
	if !cs.Token.IsZero() {
		opts = append(opts, WithToken(cs.Token))
	}
	if cs.ServerName != "" {
		opts = append(opts, func(o *connectOptions) { o.tls.ServerName = cs.ServerName })
	}
	return opts, nil
}
