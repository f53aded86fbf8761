package sim

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/internal/peerpolicy"
	"github.com/kvrouter/kvrouter/router"
)

// leastBusy is a peer policy for tests: the pod with the fewest waiting +
// running requests in the metrics it is given, the first by name on ties;
// it records what it saw.
type leastBusy struct {
	seen [][]peerpolicy.Pod
}

func (p *leastBusy) Pick(req peerpolicy.Request) (string, error) {
	p.seen = append(p.seen, slices.Clone(req.Pods))
	best := req.Pods[0]
	for _, x := range req.Pods[1:] {
		if x.WaitingQueue+x.Running < best.WaitingQueue+best.Running {
			best = x
		}
	}
	return best.Name, nil
}

type badPeer struct{}

func (badPeer) Pick(peerpolicy.Request) (string, error) { return "w9", nil }

// A peer routes on metrics as scraped: with a scrape interval longer than
// the run it sees the idle fleet of the first scrape at every decision and
// piles everything on one worker; with fresh metrics it spreads the load.
func TestSimPeerSeesScrapedMetrics(t *testing.T) {
	w := synthetic(t, workload.SyntheticSpec{Prefixes: 4, PrefixTokens: 256, TailTokens: 32, OutputTokens: 64, Requests: 60,
		Concurrency: 1, Seed: 2, ArrivalRate: 40})
	perWorker := func(interval time.Duration) (map[int]int, *leastBusy) {
		p := &leastBusy{}
		cfg := config(router.ModeRoundRobin, 3, 1000)
		cfg.Peer, cfg.ScrapeInterval = p, interval
		res, s := run(t, w, cfg)
		if s.Errors != 0 || len(p.seen) != 60 {
			t.Fatalf("interval %v: %d errors, %d decisions", interval, s.Errors, len(p.seen))
		}
		n := map[int]int{}
		for _, rr := range res.Requests {
			n[rr.Worker]++
		}
		return n, p
	}
	stale, p := perWorker(time.Hour)
	if stale[0] != 60 {
		t.Fatalf("stale metrics: requests per worker %v, want all 60 on w0", stale)
	}
	for _, pods := range p.seen {
		for _, x := range pods {
			if x.Running != 0 || x.WaitingQueue != 0 || x.KVCacheUsage != 0 {
				t.Fatalf("a decision saw %+v: metrics newer than the only scrape", x)
			}
		}
	}
	fresh, p := perWorker(0)
	if len(fresh) != 3 {
		t.Fatalf("fresh metrics: requests per worker %v, want all three used", fresh)
	}
	busy := false
	for _, pods := range p.seen {
		for _, x := range pods {
			busy = busy || x.Running > 0 && x.KVCacheUsage > 0
		}
	}
	if !busy {
		t.Fatal("fresh metrics never showed a running request")
	}
	mid, _ := perWorker(50 * time.Millisecond)
	if len(mid) < 2 {
		t.Fatalf("50 ms scrapes: requests per worker %v", mid)
	}
}

func TestSimPeerBadAnswer(t *testing.T) {
	w := synthetic(t, workload.SyntheticSpec{Prefixes: 1, PrefixTokens: 64, OutputTokens: 4, Requests: 3, Concurrency: 1, Seed: 1})
	cfg := config(router.ModeRoundRobin, 2, 100)
	cfg.Peer = badPeer{}
	_, s := run(t, w, cfg)
	if s.Errors != 3 {
		t.Fatalf("%d errors, want every request failed (the peer named no worker of the fleet)", s.Errors)
	}
}

// PeerPrompt: two prompts share text exactly as far as they share blocks,
// each block is 4 characters per token, and the partial block is the
// request's own.
func TestSimPeerPrompt(t *testing.T) {
	a := PeerPrompt([]uint64{1, 2, 3}, 3*16+5, "a", 16)
	b := PeerPrompt([]uint64{1, 2, 7}, 3*16+5, "b", 16)
	if len(a) != 4*(3*16+5) || len(b) != len(a) {
		t.Fatalf("lengths %d %d, want %d", len(a), len(b), 4*(3*16+5))
	}
	if a[:128] != b[:128] || a[128:192] == b[128:192] || a[192:] == b[192:] {
		t.Fatalf("prompts share the wrong text:\n%s\n%s", a, b)
	}
	if !strings.HasPrefix(a, fmt.Sprintf("%016x%016x", 1, 1)) {
		t.Fatalf("block text %q", a[:64])
	}
	if got := PeerPrompt(nil, 3, "x", 16); got != "|x||x||x||x|" {
		t.Fatalf("tail only: %q", got)
	}
}
