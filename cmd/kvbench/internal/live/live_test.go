package live

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api/tokenize"
)

func status(workers ...Worker) *Status { return &Status{Workers: workers} }

func worker(id string, cursor uint64, blocks int) Worker {
	return Worker{ID: id, Ranks: []Rank{{LastEventID: cursor, Blocks: blocks}}}
}

func TestIngestTrackerVisibility(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	tr := NewTracker([]string{"a", "b"}, 2)
	if tr.MinCursor(0) != 0 {
		t.Fatal("min cursor before any poll")
	}
	tr.Observe(0, at(10), time.Millisecond, status(worker("a", 5, 20), worker("b", 1, 4), worker("other", 99, 1)))
	if tr.MinCursor(0) != 0 {
		t.Fatal("min cursor must wait for every replica")
	}
	tr.Observe(1, at(12), time.Millisecond, status(worker("a", 3, 12)))
	tr.Observe(0, at(20), time.Millisecond, status(worker("a", 9, 36), worker("b", 2, 8)))
	tr.Observe(1, at(25), time.Millisecond, nil) // failed poll
	tr.Observe(1, at(30), 2*time.Millisecond, status(worker("a", 9, 36), worker("b", 2, 8)))
	if got := tr.MinCursor(0); got != 9 {
		t.Fatalf("min cursor a = %d, want 9", got)
	}
	if got := tr.MinCursor(1); got != 2 {
		t.Fatalf("min cursor b = %d, want 2", got)
	}
	cases := []struct {
		w    int
		id   uint64
		want int // ms, -1 = not visible
	}{
		{0, 3, 12},  // replica 0 at 10, replica 1 at 12
		{0, 4, 30},  // replica 1 saw 3 at 12, 9 at 30
		{0, 5, 30},  // replica 0 at 10
		{0, 9, 30},  // both
		{0, 10, -1}, // nowhere
		{1, 1, 30},  // replica 1 never reported b before 30
		{1, 3, -1},
	}
	for _, c := range cases {
		got, ok := tr.Visible(c.w, c.id)
		if c.want < 0 {
			if ok {
				t.Errorf("worker %d id %d visible at %v, want not visible", c.w, c.id, got.Sub(t0))
			}
			continue
		}
		if !ok || !got.Equal(at(c.want)) {
			t.Errorf("worker %d id %d: visible %v (%v), want %d ms", c.w, c.id, got.Sub(t0), ok, c.want)
		}
	}
	ms, invisible := tr.Latencies([]Sample{{Worker: 0, ID: 4, Sent: at(5)}, {Worker: 0, ID: 9, Sent: at(15)}, {Worker: 1, ID: 3, Sent: at(1)}})
	if invisible != 1 || len(ms) != 2 || ms[0] != 25 || ms[1] != 15 {
		t.Fatalf("latencies %v, invisible %d; want [25 15], 1", ms, invisible)
	}
	p := tr.Polls()
	if p[1].Polls != 2 || p[1].Errors != 1 || p[1].MeanRTT() != 1500*time.Microsecond || p[1].MeanPeriod() != 18*time.Millisecond {
		t.Fatalf("poll stats %+v", p[1])
	}
}

func TestIngestLostCounting(t *testing.T) {
	names := []string{"r1", "r2", "r3"}
	exp := []Expectation{
		{Worker: "a", LastAcked: 10, AckedEvents: 10, Blocks: 40},
		{Worker: "b", LastAcked: 5, AckedEvents: 5, Blocks: 12},
	}
	// Everything everywhere (a replica ahead of the acks is fine).
	full := []*Status{
		status(worker("a", 10, 40), worker("b", 5, 12)),
		status(worker("a", 10, 40), worker("b", 5, 12)),
		status(worker("a", 11, 40), worker("b", 5, 12)),
	}
	if got := CountLost(exp, 4, names, full); got.Events != 0 || got.Blocks != 0 || got.ExtraBlocks != 0 || len(got.Detail) != 0 {
		t.Fatalf("nothing lost: %+v", got)
	}
	// r2 is 3 events behind on a; r3 has a's cursor but 5 blocks fewer
	// (two events' worth); the worst replica counts, once per worker.
	behind := []*Status{
		status(worker("a", 10, 40), worker("b", 5, 12)),
		status(worker("a", 7, 28), worker("b", 5, 12)),
		status(worker("a", 10, 35), worker("b", 5, 12)),
	}
	got := CountLost(exp, 4, names, behind)
	if got.Events != 3 || got.Blocks != 12 || len(got.Detail) != 2 {
		t.Fatalf("behind: %+v", got)
	}
	// A removal not applied: more blocks than expected is one lost event,
	// unless the worker has events of unknown outcome.
	extra := []*Status{
		status(worker("a", 10, 40), worker("b", 5, 16)),
		status(worker("a", 10, 40), worker("b", 5, 12)),
		status(worker("a", 10, 40), worker("b", 5, 12)),
	}
	if got := CountLost(exp, 4, names, extra); got.Events != 1 || got.ExtraBlocks != 4 {
		t.Fatalf("extra: %+v", got)
	}
	unsure := slices.Clone(exp)
	unsure[1].Unsure = true
	if got := CountLost(unsure, 4, names, extra); got.Events != 0 || got.ExtraBlocks != 4 {
		t.Fatalf("extra, unsure: %+v", got)
	}
	// An unreachable replica or a deregistered worker: all of it.
	gone := []*Status{nil, status(worker("a", 10, 40)), status(worker("a", 10, 40), worker("b", 5, 12))}
	got = CountLost(exp, 4, names, gone)
	if got.Events != 15 || got.Blocks != 52 {
		t.Fatalf("gone: %+v", got)
	}
	if !got.Detail[0].Unreachable || !slices.ContainsFunc(got.Detail, func(s Shortfall) bool { return s.Unregistered && s.Replica == "r2" }) {
		t.Fatalf("gone detail: %+v", got.Detail)
	}
}

// fakeReplica serves a /cluster/status whose raft port is its HTTP port
// minus offset.
func fakeReplica(t *testing.T, id string, offset int, peers *[]Peer, nodes *[]Node) *httptest.Server {
	t.Helper()
	var srv *httptest.Server
	srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/cluster/status" {
			http.NotFound(w, r)
			return
		}
		_, port, _ := net.SplitHostPort(strings.TrimPrefix(srv.URL, "http://"))
		p, _ := strconv.Atoi(port)
		st := Status{NodeID: id, HTTP: srv.URL, RaftAddr: "127.0.0.1:" + strconv.Itoa(p-offset),
			NATSURL: "nats://127.0.0.1:4222", Models: []string{"m"}, Peers: *peers}
		if nodes != nil {
			st.Nodes = *nodes
		}
		_ = json.NewEncoder(w).Encode(st)
	}))
	t.Cleanup(srv.Close)
	return srv
}

func raftOf(u string, offset int) string {
	_, port, _ := net.SplitHostPort(strings.TrimPrefix(u, "http://"))
	p, _ := strconv.Atoi(port)
	return "127.0.0.1:" + strconv.Itoa(p-offset)
}

func TestIngestDiscovery(t *testing.T) {
	const off = 1000
	var peers []Peer
	srvs := []*httptest.Server{}
	for _, id := range []string{"r1", "r2", "r3"} {
		srvs = append(srvs, fakeReplica(t, id, off, &peers, nil))
	}
	for i, s := range srvs {
		peers = append(peers, Peer{ID: fmt.Sprintf("r%d", i+1), RaftAddr: raftOf(s.URL, off)})
	}
	peers = append(peers, Peer{ID: "r4", RaftAddr: "127.0.0.1:1"}) // nobody there
	cl := NewClient("")
	d, err := cl.Discover(context.Background(), srvs[1].URL)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{srvs[1].URL, srvs[0].URL, srvs[2].URL}
	if !slices.Equal(d.Replicas, want) || !slices.Equal(d.Unresolved, []string{"r4"}) {
		t.Fatalf("replicas %v unresolved %v, want %v [r4]", d.Replicas, d.Unresolved, want)
	}

	// With a node registry in the status, its addresses are used (and a
	// wrong one, answering with another node id, is refused).
	var peers2 []Peer
	var nodes []Node
	a := fakeReplica(t, "a", 0, &peers2, &nodes)
	b := fakeReplica(t, "b", 0, &peers2, &nodes)
	c := fakeReplica(t, "c", 0, &peers2, &nodes)
	peers2 = []Peer{{ID: "a"}, {ID: "b"}, {ID: "c"}}
	// b's registry address is https:// (a TLS cluster's); its port answers
	// plain http://, as make run's loopback ports do.
	nodes = []Node{{ID: "a", HTTPAddr: strings.TrimPrefix(a.URL, "http://")}, {ID: "b", HTTP: "https://" + strings.TrimPrefix(b.URL, "http://")}, {ID: "c", HTTP: a.URL}}
	d, err = cl.Discover(context.Background(), a.URL)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(d.Replicas, []string{a.URL, b.URL}) || !slices.Equal(d.Unresolved, []string{"c"}) {
		t.Fatalf("registry: replicas %v unresolved %v", d.Replicas, d.Unresolved)
	}
	_ = c
}

func TestLoadPromptText(t *testing.T) {
	tok := tokenize.Builtin()
	ids := []uint32{0, 1, 151935, 31616, 31615, 77, 77, 100000}
	text := PromptText(ids, 0)
	got := tok.Encode(text)
	if len(got) != len(ids) || CountTokens(text) != len(ids) {
		t.Fatalf("%q encodes to %d tokens, want %d", text, len(got), len(ids))
	}
	if got[5] != got[6] || got[0] == got[1] {
		t.Fatalf("equal ids must give equal words and different ids different ones: %v", got)
	}
	// A shared prefix stays shared; a salt changes every word.
	a, b := PromptText(append([]uint32{1, 2, 3}, 9), 0), PromptText(append([]uint32{1, 2, 3}, 8), 0)
	if !strings.HasPrefix(b, a[:strings.LastIndexByte(a, ' ')]) {
		t.Fatalf("prefix not shared: %q vs %q", a, b)
	}
	s := tok.Encode(PromptText(ids, 7))
	for i := range s {
		if s[i] == got[i] {
			t.Fatalf("salt left word %d unchanged", i)
		}
	}
}

// stepClock is a clock that moves only when the test advances it; arm
// returns a channel closed at the next reading, so a fake server can wait
// until the client has timestamped what it just sent before moving on.
type stepClock struct {
	mu    sync.Mutex
	now   time.Time
	armed chan struct{}
}

func (c *stepClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.armed != nil {
		close(c.armed)
		c.armed = nil
	}
	return c.now
}

func (c *stepClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

func (c *stepClock) arm() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.armed = make(chan struct{})
	return c.armed
}

// TestLoadStreamParsing checks what Complete reads from an SSE stream and
// when it stamps TTFT (at the first data chunk) and E2E (after [DONE]): the
// fake server advances a step clock instead of sleeping, and waits for the
// client to read the clock after the first chunk, so the figures are exact.
func TestLoadStreamParsing(t *testing.T) {
	clk := &stepClock{now: time.Unix(1000, 0)}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req CompletionRequest
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil || !req.Stream || req.StreamOptions == nil || !req.StreamOptions.IncludeUsage {
			http.Error(w, "bad request", 400)
			return
		}
		if strings.Contains(req.Prompt, "fail") {
			http.Error(w, `{"error":"nope"}`, 503)
			return
		}
		w.Header().Set("X-Worker-Id", "w7")
		w.Header().Set("Content-Type", "text/event-stream")
		fl := w.(http.Flusher)
		clk.Advance(20 * time.Millisecond) // time to first token
		fmt.Fprintf(w, "data: {\"choices\":[{\"text\":\"x\"}]}\n\n")
		read := clk.arm()
		fl.Flush()
		select {
		case <-read: // the client stamped TTFT
		case <-time.After(30 * time.Second): // hang guard only
			t.Errorf("client never read the clock after the first chunk")
			return
		}
		clk.Advance(10 * time.Millisecond) // the rest of the stream
		fmt.Fprintf(w, "data: {\"choices\":[{\"text\":\"y\"}]}\n\n")
		fmt.Fprintf(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":48}}}\n\n", CountTokens(req.Prompt))
		fmt.Fprintf(w, "data: [DONE]\n\n")
	}))
	defer srv.Close()
	hc := NewInferenceClient(2, nil)
	c, err := complete(context.Background(), hc, srv.URL, "", NewCompletionRequest("m", "a b c", 2), clk.Now)
	if err != nil {
		t.Fatal(err)
	}
	if c.Worker != "w7" || c.CachedTokens != 48 || c.PromptTokens != 3 || !c.HasUsage || c.OutputChunks != 2 {
		t.Fatalf("completion %+v", c)
	}
	if c.TTFT != 20*time.Millisecond || c.E2E != 30*time.Millisecond {
		t.Fatalf("ttft %v e2e %v, want 20ms 30ms", c.TTFT, c.E2E)
	}
	_, err = complete(context.Background(), hc, srv.URL, "", NewCompletionRequest("m", "fail", 2), clk.Now)
	var he *HTTPError
	if err == nil || !strings.Contains(err.Error(), "503") || !asHTTPError(err, &he) || he.Status != 503 {
		t.Fatalf("error %v", err)
	}
}

func asHTTPError(err error, target **HTTPError) bool {
	he, ok := err.(*HTTPError)
	if ok {
		*target = he
	}
	return ok
}

func TestIngestLocalURLs(t *testing.T) {
	for _, u := range []string{"http://127.0.0.1:8001", "http://localhost:8001/", "https://[::1]:9"} {
		if _, err := ParseLocalURL(u); err != nil {
			t.Errorf("%s: %v", u, err)
		}
	}
	for _, u := range []string{"http://10.0.0.1:8001", "ftp://127.0.0.1", "127.0.0.1:8001", "http://example.com", "http://127.0.0.1:8001/v1"} {
		if _, err := ParseLocalURL(u); err == nil {
			t.Errorf("%s accepted", u)
		}
	}
}
