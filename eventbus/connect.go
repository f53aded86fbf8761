package eventbus

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/internal/pki"
)

// ConnectOption adds credentials or TLS to Connect. Without any, Connect
// connects in plaintext and anonymously, which a secure server refuses.
type ConnectOption func(*connectOptions)

type connectOptions struct {
	tls         *tls.Config
	token       pki.Secret
	inboxPrefix string
	noEcho      bool
}

// WithTLSConfig connects over TLS with c as it is.
func WithTLSConfig(c *tls.Config) ConnectOption {
	return func(o *connectOptions) { o.tls = c }
}

// WithBundle connects over TLS presenting b's certificate, and accepts only
// a server whose certificate names a kvrouter node. A worker certificate
// also sets the worker's inbox prefix (WorkerInboxPrefix), without which
// its JetStream acks could not reach it.
func WithBundle(b *pki.Bundle) ConnectOption {
	return withBundle(b, pki.AllowRoles(pki.RoleNode), false)
}

func withBundle(b *pki.Bundle, serverAllow pki.Allow, external bool) ConnectOption {
	return func(o *connectOptions) {
		o.tls = b.ClientTLS(serverAllow)
		if external {
			o.tls.VerifyConnection = nil // chain and host name only: see ClientSecurity.External
		}
		if id := b.Identity(); id.Role == pki.RoleWorker {
			o.inboxPrefix = WorkerInboxPrefix(id.ID)
		}
	}
}

func trustOnly(roots *x509.CertPool, serverAllow pki.Allow, external bool) *tls.Config {
	c := pki.TrustOnlyTLS(roots, serverAllow)
	if external {
		c.VerifyConnection = nil
	}
	return c
}

// WithNoEcho asks the server not to deliver this connection's own
// publications to its own subscriptions (nats.NoEcho): for a connection
// that both publishes and subscribes on one subject and drops its own
// messages anyway (replica sync), this spares the server routing them back
// and the client reading and decoding them.
func WithNoEcho() ConnectOption {
	return func(o *connectOptions) { o.noEcho = true }
}

// WithToken authenticates with the replica token.
func WithToken(tok pki.Secret) ConnectOption {
	return func(o *connectOptions) { o.token = tok }
}

// Connect opens a client connection with the options every kvrouter client
// wants: reconnect forever, log connection changes to logger. url may list
// several servers separated by commas. Errors and logs show URLs redacted.
func Connect(url, name string, logger *slog.Logger, opts ...ConnectOption) (*nats.Conn, error) {
	if logger == nil {
		logger = slog.Default()
	}
	var co connectOptions
	for _, fn := range opts {
		fn(&co)
	}
	log := logger.With("component", "nats-client", "name", name)
	nopts := []nats.Option{
		nats.Name(name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.Timeout(5 * time.Second),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("nats disconnected", "err", err)
			}
		}),
		nats.ReconnectHandler(func(c *nats.Conn) { log.Info("nats reconnected", "url", c.ConnectedUrlRedacted()) }),
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
			subj := ""
			if sub != nil {
				subj = sub.Subject
			}
			log.Warn("nats async error", "subject", subj, "err", err)
		}),
	}
	if co.tls != nil {
		nopts = append(nopts, nats.Secure(co.tls))
	}
	if !co.token.IsZero() {
		nopts = append(nopts, nats.Token(co.token.Reveal()))
	}
	if co.inboxPrefix != "" {
		nopts = append(nopts, nats.CustomInboxPrefix(co.inboxPrefix))
	}
	if co.noEcho {
		nopts = append(nopts, nats.NoEcho())
	}
	nc, err := nats.Connect(url, nopts...)
	if err != nil {
		return nil, fmt.Errorf("connect %s: %w", RedactURL(url), err)
	}
	return nc, nil
}

// RedactURL hides the user information (user, password or token) of each
// URL in a comma-separated list, for logs, errors and status pages. It
// works on the text, not on url.Parse, so a URL without a scheme
// ("tok@host:4222") or one that does not parse is redacted too.
func RedactURL(urls string) string {
	parts := strings.Split(urls, ",")
	for i, p := range parts {
		p = strings.TrimSpace(p)
		start := 0
		if j := strings.Index(p, "://"); j >= 0 {
			start = j + 3
		}
		end := len(p)
		if j := strings.IndexAny(p[start:], "/?#"); j >= 0 {
			end = start + j
		}
		if at := strings.LastIndex(p[start:end], "@"); at >= 0 {
			p = p[:start] + "REDACTED" + p[start+at:]
		}
		parts[i] = p
	}
	return strings.Join(parts, ",")
}
