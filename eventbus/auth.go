package eventbus

import (
	"log/slog"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/kvrouter/kvrouter/internal/pki"
)

// clientAuth is the embedded server's authenticator for client
// connections (nats-server's CustomClientAuthentication). It runs after
// the TLS handshake has verified any client certificate against the CA and
// the identity allow-list, and maps the identity to permissions:
//
//   - node certificate, or the replica token: every subject;
//   - worker certificate: workerPermissions(id);
//   - anything else: refused.
//
// Permissions are computed per connection from the certificate, so a new
// worker needs a certificate, not a server reload (see DESIGN.md for why
// not static users or verify_and_map).
type clientAuth struct {
	token     pki.Secret
	allowNode pki.Allow
	log       *slog.Logger
}

func (a *clientAuth) Check(c server.ClientAuthentication) bool {
	if cs := c.GetTLSConnectionState(); cs != nil && len(cs.PeerCertificates) > 0 {
		id, err := pki.PeerIdentity(*cs)
		if err != nil {
			a.refuse(c, "certificate", err)
			return false
		}
		user := &server.User{Username: id.String(), ConnectionDeadline: cs.PeerCertificates[0].NotAfter}
		switch id.Role {
		case pki.RoleNode:
			if err := a.allowNode(id); err != nil {
				a.refuse(c, "node", err)
				return false
			}
			// nil Permissions: a replica writes the Raft log anyway, so
			// no subject on the bus is more powerful than it already is.
		case pki.RoleWorker:
			user.Permissions = workerPermissions(id.ID)
		default:
			a.refuse(c, "role", nil)
			return false
		}
		// The deadline disconnects a client when its certificate expires;
		// its reconnect then needs a valid one.
		c.RegisterUser(user)
		return true
	}
	if opts := c.GetOpts(); opts != nil && a.token.Equal(opts.Token) {
		c.RegisterUser(&server.User{Username: "replica-token"})
		return true
	}
	a.refuse(c, "anonymous", nil)
	return false
}

// refuse logs at Debug: NATS itself logs every authorization error, and
// an attacker must not be able to turn our logs into a flood. Never the
// token.
func (a *clientAuth) refuse(c server.ClientAuthentication, why string, err error) {
	a.log.Debug("nats client refused", "reason", why, "remote", remote(c), "err", err)
}

// routeAuth is the authenticator for route connections: only a node
// certificate admitted by allowNode. The route TLS configuration already
// requires one in the handshake; this check makes "authentication
// required" explicit to NATS and holds even if the TLS settings change.
type routeAuth struct {
	allowNode pki.Allow
	log       *slog.Logger
}

func (a *routeAuth) Check(c server.ClientAuthentication) bool {
	cs := c.GetTLSConnectionState()
	if cs == nil {
		a.log.Warn("nats route refused: no TLS", "remote", remote(c))
		return false
	}
	id, err := pki.PeerIdentity(*cs)
	if err == nil {
		err = a.allowNode(id)
	}
	if err != nil {
		a.log.Warn("nats route refused", "remote", remote(c), "err", err)
		return false
	}
	return true
}

func remote(c server.ClientAuthentication) string {
	if addr := c.RemoteAddress(); addr != nil {
		return addr.String()
	}
	return ""
}

// WorkerInboxPrefix is the inbox prefix a worker's connection must use
// (nats.CustomInboxPrefix): its reply subjects (JetStream publish acks) are
// the only ones it may subscribe to, so it cannot read replies meant for
// replicas or for other workers. Connect sets it for a worker certificate;
// a worker written in another language must set it itself.
func WorkerInboxPrefix(worker string) string { return "_INBOX.kvw." + SubjectToken(worker) }

// workerPermissions: a worker may publish its own events (and JetStream
// acks them to its inbox), serve its own resync requests (replying only to
// the requester, once) and nothing else: not another worker's events, not
// replica sync, not the JetStream API.
func workerPermissions(worker string) *server.Permissions {
	return &server.Permissions{
		Publish: &server.SubjectPermission{Allow: []string{EventSubject(worker)}},
		Subscribe: &server.SubjectPermission{Allow: []string{
			ResyncSubject(worker),
			WorkerInboxPrefix(worker) + ".>",
		}},
		Response: &server.ResponsePermission{MaxMsgs: 1, Expires: time.Minute},
	}
}
