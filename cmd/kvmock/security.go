package main

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/internal/pki"
)

// registerTimeout is the registration client's timeout, registrar's own
// default (a replica answers a registration after one Raft commit).
const registerTimeout = 5 * time.Second

// busOptions are the credentials kvmock connects to the bus with: its
// worker certificate (identity spiffe://kvrouter/worker/<id>), with which a
// secure bus lets it publish its own kv.events.<id> subject and nothing
// else. None: plaintext and anonymous, for an insecure bus.
func (c config) busOptions() ([]eventbus.ConnectOption, error) {
	if c.NATSTLS.IsZero() {
		return nil, nil
	}
	b, err := pki.LoadBundle(c.NATSTLS)
	if err != nil {
		return nil, fmt.Errorf("--nats-tls-*: %w", err)
	}
	// A certificate for another worker would connect and then have every
	// publish refused: say so at start instead.
	if want := pki.Worker(c.ID); b.Identity() != want {
		return nil, fmt.Errorf("--nats-tls-cert %s names %s, but this worker is %s (kvrouter certs --workers %s)",
			c.NATSTLS.CertFile, b.Identity(), want, c.ID)
	}
	return []eventbus.ConnectOption{eventbus.WithBundle(b)}, nil
}

// registerClient is the HTTP client for --register: with a CA file
// (--register-ca, else --nats-tls-ca) it trusts that CA and accepts only a
// replica's certificate, for https:// replica URLs. Nil: registrar's
// default client (the system roots).
func (c config) registerClient() (*http.Client, error) {
	ca := c.RegisterCA
	if ca == "" {
		ca = c.NATSTLS.CAFile
	}
	if ca == "" {
		return nil, nil
	}
	pool, err := pki.LoadPool(ca)
	if err != nil {
		return nil, fmt.Errorf("--register-ca: %w", err)
	}
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.TLSClientConfig = pki.TrustOnlyTLS(pool, pki.AllowRoles(pki.RoleNode))
	return &http.Client{Transport: t, Timeout: registerTimeout}, nil
}

// checkSecurity checks the security flags for consistency.
func (c config) checkSecurity() error {
	var errs []error
	if !c.NATSTLS.IsZero() {
		if m := c.NATSTLS.Missing(); len(m) > 0 {
			errs = append(errs, fmt.Errorf("--nats-tls-ca, --nats-tls-cert and --nats-tls-key go together: missing %s", strings.Join(m, ", ")))
		}
		if c.NATS == "" {
			errs = append(errs, errors.New("--nats-tls-* without --nats: there is no bus to connect to"))
		}
	}
	return errors.Join(errs...)
}
