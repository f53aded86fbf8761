package api

import (
	"net/http"

	"github.com/kvrouter/kvrouter/router"
)

// What the replica's other callers of the workers borrow from the proxy, so
// they reach a worker exactly as the proxy does. The tokenizer self-check
// is one: with its own default transport it sent no worker API key and
// went past the dial guard, so on a secured deployment (workers started
// with --api-key) it read "unavailable" on every worker.

// WorkerTransport is the proxy's transport to the workers: its dial guard
// (no loopback or link-local addresses unless AllowLoopbackWorkers), its
// timeouts and TLS settings, and its connection pool.
func (s *Server) WorkerTransport() http.RoundTripper { return s.client.Transport }

// WorkerKey is the bearer token the proxy sends to worker id (any of its
// ranks): its own key (WorkerAPIKeys), else WorkerAPIKey, else "".
func (s *Server) WorkerKey(id string) string { return s.workerKey(router.WorkerID(id)) }
