package api

import (
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gin-gonic/gin"
	"github.com/prometheus/client_golang/prometheus"
)

// The loopback exemption (Config.AdminOpenToLoopback, kvrouter serve
// --admin-open-to-loopback): admin paths a replica with an admin token
// still serves without it to callers on its own host. It exists for
// `make run`, whose contract (docs/CONTRACTS.md) tunes thresholds at run
// time with a plain `POST /busy_threshold`, as the live-cluster
// acceptance check does. It is narrow on purpose:
//   - only LoopbackExemptPaths may be named: tuning and read-only views.
//     Registering, deregistering, moving or draining workers always take
//     the token: a stranger's "worker" would receive other users' prompts
//     (and the worker API key);
//   - only callers whose connection comes from a loopback address (the
//     socket's, never X-Forwarded-For);
//   - every use is logged (a warning at most once a minute, with the count
//     since the last) and counted, and the replica warns at start.

// LoopbackExemptPaths are the admin paths Config.AdminOpenToLoopback may
// name: GET and POST /busy_threshold (Dynamo's runtime tuning), GET
// /workers (the registry, read-only) and POST /debug/route (a dry run that
// changes nothing).
var LoopbackExemptPaths = []string{"/busy_threshold", "/workers", "/debug/route"}

// CheckAdminOpenToLoopback returns an error naming the first path not in
// LoopbackExemptPaths.
func CheckAdminOpenToLoopback(paths []string) error {
	for _, p := range paths {
		if !slices.Contains(LoopbackExemptPaths, p) {
			return fmt.Errorf("admin path %q cannot be left open to loopback callers (possible: %v; worker registration, moves, /debug/decisions and /cluster/* always need their credential)", p, LoopbackExemptPaths)
		}
	}
	return nil
}

// loopbackExemption is a Server's exemption state.
type loopbackExemption struct {
	paths   []string
	log     *slog.Logger
	counter prometheus.Counter

	mu      sync.Mutex // guards lastLog and since
	lastLog time.Time
	since   int
	used    atomic.Uint64
}

func newLoopbackExemption(paths []string, log *slog.Logger, reg prometheus.Registerer) *loopbackExemption {
	if err := CheckAdminOpenToLoopback(paths); err != nil {
		log.Error("--admin-open-to-loopback ignored", "err", err) // kvrouter serve refuses it first
		return nil
	}
	if len(paths) == 0 {
		return nil
	}
	log.Warn("admin paths open WITHOUT the admin token to callers on this host (--admin-open-to-loopback): any local user may call them",
		"paths", paths)
	e := &loopbackExemption{paths: paths, log: log,
		counter: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_admin_loopback_exempt_total",
			Help: "Admin requests served without the admin token because they came from loopback to a path of --admin-open-to-loopback."})}
	reg.MustRegister(e.counter)
	return e
}

// loopbackExempt reports whether c may skip the admin token: its route
// is one of Config.AdminOpenToLoopback and its connection comes from a
// loopback address. It logs and counts the use.
func (s *Server) loopbackExempt(c *gin.Context) bool {
	e := s.exempt
	if e == nil || !slices.Contains(e.paths, c.FullPath()) || !loopbackCaller(c.Request) {
		return false
	}
	e.counter.Inc()
	e.used.Add(1)
	now := time.Now()
	e.mu.Lock()
	e.since++
	logIt := now.Sub(e.lastLog) >= time.Minute
	n := e.since
	if logIt {
		e.lastLog, e.since = now, 0
	}
	e.mu.Unlock()
	if logIt {
		e.log.Warn("admin endpoint served WITHOUT the admin token to a loopback caller (--admin-open-to-loopback)",
			"method", c.Request.Method, "path", c.FullPath(), "remote", c.Request.RemoteAddr, "such_requests_since_last_warning", n)
	}
	return true
}

// loopbackCaller: the request's connection comes from a loopback address.
func loopbackCaller(r *http.Request) bool {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return false
	}
	a, err := netip.ParseAddr(host)
	return err == nil && a.Unmap().IsLoopback()
}
