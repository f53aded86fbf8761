package main

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
)

// Data-parallel ranks behind one URL (--dp-ranks N), as a vLLM or SGLang
// server started with data parallelism: each rank is a whole Mock of its
// own (engine, cache, event queue, its own publisher whose events carry its
// dp_rank), and rank 0 owns the HTTP server, the registration (with
// dp_ranks N) and the worker's resync subject. A request names its rank in
// the X-data-parallel-rank header, the way the router sends the rank it
// booked; without one, or with a rank this worker does not serve, the
// request is refused with 400 and counted, loudly: an engine's own
// balancer would quietly serve it on another rank and make the router's
// per-rank bookings and cache predictions wrong. Every answer says which
// rank served it (X-Kvmock-Dp-Rank), so tests can compare it with the
// router's booking.

// maxDPRanks bounds --dp-ranks (each rank is a whole simulated engine).
const maxDPRanks = 64

// rankHeader is the header vLLM and SGLang read the data-parallel rank from.
const rankHeader = "X-Data-Parallel-Rank"

// rankCounters count refused requests.
type rankCounters struct {
	missing, unknown atomic.Uint64
}

// registeredRanks is the registration's dp_ranks: 0 (left out) for one.
func registeredRanks(n int) int {
	if n <= 1 {
		return 0
	}
	return n
}

// rank returns the Mock of rank r (m itself for 0), nil if not served.
func (m *Mock) rank(r int) *Mock {
	switch {
	case r == 0:
		return m
	case r > 0 && r <= len(m.ranks):
		return m.ranks[r-1]
	}
	return nil
}

// front is rank 0's HTTP handler: the API of the rank a request names, the
// worker's other endpoints from rank 0.
func (m *Mock) front() http.Handler {
	own := m.Handler()
	if len(m.ranks) == 0 {
		return own
	}
	handlers := []http.Handler{own}
	for _, r := range m.ranks {
		handlers = append(handlers, r.Handler())
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasPrefix(r.URL.Path, "/v1/") || r.Method != http.MethodPost {
			own.ServeHTTP(w, r)
			return
		}
		v := r.Header.Get(rankHeader)
		if v == "" {
			m.rankCtr.missing.Add(1)
			m.log.Warn("request without a data-parallel rank refused", "path", r.URL.Path, "dp_ranks", len(handlers))
			writeError(w, http.StatusBadRequest, "invalid_request_error", "missing_dp_rank",
				"this worker serves "+strconv.Itoa(len(handlers))+" data-parallel ranks: the request must name one in the "+rankHeader+" header")
			return
		}
		n, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil || n < 0 || n >= len(handlers) {
			m.rankCtr.unknown.Add(1)
			m.log.Warn("request for a data-parallel rank not served refused", "path", r.URL.Path, "rank", v, "dp_ranks", len(handlers))
			writeError(w, http.StatusBadRequest, "invalid_request_error", "unknown_dp_rank",
				"data-parallel rank "+strconv.Quote(v)+" is not served here (ranks 0-"+strconv.Itoa(len(handlers)-1)+")")
			return
		}
		w.Header().Set("X-Kvmock-Dp-Rank", strconv.Itoa(n))
		handlers[n].ServeHTTP(w, r)
	})
}

// startRanks starts the other ranks' engines, links and event publishing
// (after ready, rank 0's first registration); the returned stop ends them,
// publishing what they queued within ctx.
func (m *Mock) startRanks(ready <-chan struct{}) (stop func(ctx context.Context)) {
	type running struct {
		r                        *Mock
		stopDrv, stopLink, stopB context.CancelFunc
		busDone                  chan struct{}
	}
	var all []running
	for _, r := range m.ranks {
		r.advertise = m.advertise
		run := running{r: r, busDone: make(chan struct{})}
		var dctx, lctx, bctx context.Context
		dctx, run.stopDrv = context.WithCancel(context.Background())
		lctx, run.stopLink = context.WithCancel(context.Background())
		bctx, run.stopB = context.WithCancel(context.Background())
		go r.drv.run(dctx)
		go r.link.run(lctx)
		r.drv.send(func() { r.drv.snapshot("startup") })
		if r.q != nil {
			go func() { defer close(run.busDone); r.runBus(bctx, ready) }()
		} else {
			close(run.busDone)
		}
		all = append(all, run)
	}
	return func(ctx context.Context) {
		for _, run := range all {
			run.stopDrv()
			<-run.r.drv.done
			run.stopLink()
			<-run.r.link.done
			if pub := run.r.publisher(); pub != nil && isClosed(ready) {
				if err := run.r.q.waitEmpty(ctx); err != nil {
					run.r.log.Error("KV events not published before the shutdown timeout", "queued", run.r.q.len())
				}
				_ = pub.Flush(ctx)
			}
			run.stopB()
			<-run.busDone
			run.r.pullClient.CloseIdleConnections()
		}
	}
}
