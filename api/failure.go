package api

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"

	"github.com/gin-gonic/gin"

	"github.com/kvrouter/kvrouter/router"
)

// statusClientClosed is nginx's 499, recorded (never really sent) for a
// client that went away before its answer.
const statusClientClosed = 499

// errClientGone marks a request the client cancelled: never retried, never
// a worker's fault (no cool-down), counted as client_gone.
var errClientGone = errors.New("client went away")

// failureKind says how far a request got with a worker before the attempt
// failed, which decides whether another worker may be tried: only when
// this one cannot have started generating.
type failureKind int

const (
	// failNoAddress: the registry has no address for the worker; nothing
	// was sent.
	failNoAddress failureKind = iota + 1
	// failConnect: the request never reached the worker whole (dial error,
	// connection refused, TLS handshake, a failed write). A worker cannot
	// act on a body it did not get.
	failConnect
	// failUnavailable: the worker answered 503 or 529: it refused the work.
	failUnavailable
	// failDropped: the whole request was written, then the connection
	// failed before the first answer byte. The worker may be generating:
	// sending the request elsewhere could run the generation twice.
	failDropped
)

func (k failureKind) String() string {
	switch k {
	case failNoAddress:
		return "no_address"
	case failConnect:
		return "connect"
	case failUnavailable:
		return "unavailable"
	case failDropped:
		return "dropped"
	}
	return "unknown"
}

// workerError is an attempt that failed on a worker.
type workerError struct {
	worker router.WorkerID
	kind   failureKind
	status int // the worker's answer, for failUnavailable
	err    error
}

func (e *workerError) Error() string {
	return fmt.Sprintf("worker %s: %s: %v", e.worker, e.kind, e.err)
}

func (e *workerError) Unwrap() error { return e.err }

// coolsDown: a worker whose connection failed is tried last for a while. One
// that answered 503/529 is alive and said so: the router's load view, not a
// blanket cool-down, decides when it gets work again.
func (e *workerError) coolsDown() bool { return e.kind == failConnect || e.kind == failDropped }

// refusedWork reports a worker answer that means "not started, try
// elsewhere": Dynamo's 529 (overloaded) and 503 (unavailable).
func refusedWork(status int) bool {
	return status == http.StatusServiceUnavailable || status == 529
}

// retryable is the proxy loop's one retry rule: attempt (counting from 0)
// failed with err; may the request go to another worker? Only if the
// failed worker cannot have started work on it, and within the configured
// retries. A worker without an address was never contacted: retrying it
// costs nothing and the exclusion list bounds the loop. A routing error, a
// client that went away, or a worker that had the whole request is never
// retried.
func (s *Server) retryable(err error, attempt int) bool {
	var we *workerError
	if errors.Is(err, errClientGone) || !errors.As(err, &we) {
		return false
	}
	switch we.kind {
	case failNoAddress:
		return true
	case failConnect, failUnavailable:
		return attempt < s.cfg.Retries
	}
	return false
}

// failureReply is what the client is told about a failed request: the one
// place that maps the proxy's failures to an HTTP status and OpenAI error.
// busyStatus is the configured all-busy status (529 or 503).
func failureReply(err error, model string, busyStatus int) (status int, typ, msg string) {
	var we *workerError
	switch {
	case errors.Is(err, errClientGone):
		return statusClientClosed, "client_closed_request", err.Error()
	case errors.As(err, &we):
		return workerReply(we)
	case errors.Is(err, router.ErrAllBusy):
		return busyStatus, "service_overloaded", "all workers are busy; retry later"
	case errors.Is(err, router.ErrNoWorkers):
		return http.StatusServiceUnavailable, "no_workers", fmt.Sprintf("no workers registered for model %q", model)
	}
	return http.StatusInternalServerError, "internal_error", err.Error()
}

func workerReply(we *workerError) (status int, typ, msg string) {
	switch we.kind {
	case failUnavailable:
		if we.status == 529 {
			return 529, "service_overloaded", we.Error()
		}
		return http.StatusServiceUnavailable, "worker_unavailable", we.Error()
	case failDropped:
		return http.StatusBadGateway, "worker_connection_lost",
			we.Error() + " (not retried elsewhere: the worker had the request and may have started generating)"
	}
	return http.StatusBadGateway, "worker_unavailable", we.Error()
}

// answerFailure answers the client for a request the loop gave up on. err
// ended the loop at attempt; prev is the last worker failure retried
// before it, if any. When the retry found no other worker, the client
// hears why the last one failed rather than "all busy".
func (s *Server) answerFailure(c *gin.Context, p *prepared, err, prev error, attempt int) {
	switch {
	case attempt > 0 && prev != nil && errors.Is(err, router.ErrAllBusy):
		err = fmt.Errorf("no other worker could take the request after %w", prev)
	case errors.Is(err, router.ErrAllBusy):
		s.metrics.rejected.WithLabelValues("all_busy").Inc()
	case errors.Is(err, router.ErrNoWorkers):
		s.metrics.rejected.WithLabelValues("no_workers").Inc()
	}
	status, typ, msg := failureReply(err, p.model, s.cfg.BusyStatus)
	if status == statusClientClosed {
		s.metrics.requests.WithLabelValues(p.model, "client_gone").Inc()
		c.AbortWithStatus(status)
		return
	}
	s.metrics.requests.WithLabelValues(p.model, strconv.Itoa(status)).Inc()
	openAIError(c, status, typ, msg)
}
