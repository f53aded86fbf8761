package replica

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/kvrouter/kvrouter/internal/netaddr"
)

// servePprof serves Go's profiler (/debug/pprof/) on addr until ctx ends: a
// debugging aid for measuring the replica live (a CPU profile during a load
// test), so it listens on loopback only, unauthenticated, on a port of its
// own and a mux of its own (nothing reaches it through the API's port). An
// address that is not loopback is refused before anything listens. It
// returns the address listened on (port 0 picks one).
func servePprof(ctx context.Context, addr string, log *slog.Logger) (net.Addr, error) {
	if !netaddr.LoopbackListen(addr) {
		return nil, fmt.Errorf("--pprof-addr %q: the profiler listens on loopback only", addr)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("pprof listen: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		_ = srv.Close()
	}()
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Warn("pprof server stopped", "err", err)
		}
	}()
	log.Info("profiler listening (loopback only)", "addr", ln.Addr().String())
	return ln.Addr(), nil
}
