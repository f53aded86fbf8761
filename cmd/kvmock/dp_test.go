package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/router"
)

// kvmock --dp-ranks refuses, loudly and counted, a request that names no
// rank or one it does not serve, and serves each named rank from that
// rank's own cache.
func TestMockDPRankHeader(t *testing.T) {
	tm := startMock(t, func(c *config) { c.DPRanks = 3 }, true)
	body := chatBody(words("rank", 40), 2, false)
	cases := []struct {
		name   string
		rank   string
		status int
		code   string
	}{
		{"no rank", "", http.StatusBadRequest, "missing_dp_rank"},
		{"rank beyond", "3", http.StatusBadRequest, "unknown_dp_rank"},
		{"negative rank", "-1", http.StatusBadRequest, "unknown_dp_rank"},
		{"not a number", "one", http.StatusBadRequest, "unknown_dp_rank"},
		{"rank 2", "2", http.StatusOK, ""},
		{"rank 2 again: cached there", "2", http.StatusOK, ""},
		{"rank 1: its own cache, cold", "1", http.StatusOK, ""},
	}
	for _, c := range cases {
		h := map[string]string{}
		if c.rank != "" {
			h["X-Data-Parallel-Rank"] = c.rank
		}
		resp, out := send(t, tm.url+"/v1/chat/completions", body, h)
		if resp.StatusCode != c.status || (c.code != "" && !strings.Contains(string(out), c.code)) {
			t.Fatalf("%s: HTTP %d %s, want %d %s", c.name, resp.StatusCode, out, c.status, c.code)
		}
		if c.status != http.StatusOK {
			continue
		}
		if got := resp.Header.Get("X-Kvmock-Dp-Rank"); got != c.rank {
			t.Fatalf("%s: served by rank %q", c.name, got)
		}
		var doc responseDoc
		if err := json.Unmarshal(out, &doc); err != nil || doc.Usage == nil {
			t.Fatalf("%s: %v %s", c.name, err, out)
		}
		cached := doc.Usage.PromptTokensDetails.CachedTokens
		if warm := strings.Contains(c.name, "cached there"); warm != (cached > 0) {
			t.Fatalf("%s: %d cached tokens", c.name, cached)
		}
	}
	st := statsOf(t, tm.url)
	if st.Requests.DPRankMissing != 1 || st.Requests.DPRankUnknown != 3 {
		t.Fatalf("refusals counted missing %d unknown %d, want 1 and 3", st.Requests.DPRankMissing, st.Requests.DPRankUnknown)
	}
}

// Through the real API server: kvmock registers one URL with three ranks,
// the router books a rank and sends it in X-data-parallel-rank, the rank
// that served is the one booked; that rank's events (its dp_rank in each)
// make the router see the prompt cached there, and the same request goes
// back to the same rank and hits its cache.
func TestMockDPRanksThroughRouter(t *testing.T) {
	rep := newOneReplica(t, "kvmock")
	srv := api.New(api.Config{Tokenizer: tokenize.Builtin(), ChatTemplate: tokenize.Plain, Logger: testLog(t), AllowLoopbackWorkers: true}, rep)
	front := httptest.NewServer(srv.Handler())
	defer front.Close()
	tm := startMock(t, func(c *config) { c.DPRanks = 3; c.Register = []string{front.URL} }, false)
	checkFor(t, 5*time.Second, 5*time.Millisecond, func() error {
		if len(rep.rt.Workers()) != 3 {
			return io.EOF
		}
		return nil
	})
	pubs := append([]*fakePublisher{tm.pub}, tm.rankPubs...)
	// Every rank announces its empty cache first.
	for r, p := range pubs {
		evs := waitEvents(t, p, 1)
		if evs[0].DPRank != uint32(r) || evs[0].Kind != eventbus.KindCleared {
			t.Fatalf("rank %d's first event %+v", r, evs[0])
		}
	}

	body := chatBody(words("dp", 120), 4, false)
	served := func(want router.WorkerID) (router.WorkerID, int) {
		t.Helper()
		resp, out := send(t, front.URL+"/v1/chat/completions", body, nil)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("through the router: HTTP %d %s", resp.StatusCode, out)
		}
		booked := router.WorkerID(resp.Header.Get("X-Worker-Id"))
		rank, err := strconv.Atoi(resp.Header.Get("X-Kvmock-Dp-Rank"))
		if err != nil || router.WorkerKey("mock-1", uint32(rank)) != booked {
			t.Fatalf("router booked %s, rank %q served", booked, resp.Header.Get("X-Kvmock-Dp-Rank"))
		}
		if want != "" && booked != want {
			t.Fatalf("booked %s, want %s (its cache)", booked, want)
		}
		var doc responseDoc
		if err := json.Unmarshal(out, &doc); err != nil || doc.Usage == nil {
			t.Fatalf("answer %s: %v", out, err)
		}
		return booked, doc.Usage.PromptTokensDetails.CachedTokens
	}
	first, cached := served("")
	if cached != 0 {
		t.Fatalf("first request: %d cached tokens", cached)
	}
	rank, _ := rep.DPRank(first)
	// Apply every rank's events as the cluster's consumer would: only the
	// serving rank stored blocks.
	waitEvents(t, pubs[rank], 2)
	for r, p := range pubs {
		for _, ev := range p.snapshot() {
			if ev.DPRank != uint32(r) {
				t.Fatalf("rank %d published an event of rank %d", r, ev.DPRank)
			}
			if err := rep.index.Apply(ev.WorkerID(), ev.KVEvent()); err != nil {
				t.Fatal(err)
			}
			if ev.Kind == eventbus.KindStored && r != rank {
				t.Fatalf("rank %d stored blocks; rank %d served", r, rank)
			}
		}
	}
	again, cached := served(first)
	if again != first || cached == 0 {
		t.Fatalf("second request on %s with %d cached tokens, want %s with a hit", again, cached, first)
	}
	if st := statsOf(t, tm.url); st.Requests.DPRankMissing+st.Requests.DPRankUnknown != 0 {
		t.Fatal(fmt.Sprintf("refusals through the router: %+v", st.Requests))
	}
}
