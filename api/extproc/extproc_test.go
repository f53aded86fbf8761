package extproc

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/router"
)

func chatBody(prompt string, stream bool) string {
	b, _ := json.Marshal(map[string]any{"model": model, "stream": stream,
		"messages": []map[string]string{{"role": "user", "content": prompt}}})
	return string(b)
}

func completionBody(prompt string) string {
	b, _ := json.Marshal(map[string]any{"model": model, "prompt": prompt})
	return string(b)
}

// prompts long enough for several blocks of the builtin tokenizer.
var prompts = []string{
	strings.Repeat("alpha beta gamma delta epsilon zeta eta theta ", 12),
	strings.Repeat("one two three four five six seven eight nine ten ", 12),
	strings.Repeat("red orange yellow green blue indigo violet ", 12),
}

// fleet is two replicas in identical states over the same three workers:
// one answers through its proxy, the other as the endpoint picker, so a
// request sent to both must get the same worker.
type fleet struct {
	workers []*httptest.Server
	proxy   side
	picker  side
	client  extprocv3.ExternalProcessorClient
}

func newFleet(t *testing.T, cfg router.Config, pcfg Config) *fleet {
	f := &fleet{}
	for range 3 {
		f.workers = append(f.workers, fakeWorker(t))
	}
	f.proxy = newSide(t, cfg, f.workers)
	f.picker = newSide(t, cfg, f.workers)
	f.client = pickerConn(t, Adapt(f.picker.srv), pcfg)
	return f
}

// endpointOf is worker i's (1-based) ip:port.
func (f *fleet) endpointOf(i int) string {
	ep, _ := api.WorkerEndpoint(f.workers[i-1].URL)
	return ep
}

// workerAt names the worker serving an ip:port.
func (f *fleet) workerAt(ep string) string {
	for i := range f.workers {
		if f.endpointOf(i+1) == ep {
			return fmt.Sprintf("w%d", i+1)
		}
	}
	return "?" + ep
}

// both applies fn to both replicas' states.
func (f *fleet) both(fn func(s side)) {
	fn(f.proxy)
	fn(f.picker)
}

// costOrder is the eligible workers by cost (then id) in a /debug/route
// table of s, without booking.
func costOrder(t *testing.T, s *api.Server, path, body string) []string {
	t.Helper()
	url := "/debug/route"
	if path == "/v1/completions" {
		url += "?endpoint=completions"
	}
	rec := httptest.NewRecorder()
	s.Handler().ServeHTTP(rec, httptest.NewRequest("POST", url, strings.NewReader(body)))
	var table struct {
		Workers []struct {
			Worker string  `json:"worker"`
			Cost   float64 `json:"cost"`
			Busy   bool    `json:"busy"`
		} `json:"workers"`
	}
	if rec.Code != 200 || json.Unmarshal(rec.Body.Bytes(), &table) != nil {
		t.Fatalf("debug/route: %d %s", rec.Code, rec.Body)
	}
	rows := table.Workers[:0]
	for _, r := range table.Workers {
		if !r.Busy {
			rows = append(rows, r)
		}
	}
	slices.SortStableFunc(rows, func(a, b struct {
		Worker string  `json:"worker"`
		Cost   float64 `json:"cost"`
		Busy   bool    `json:"busy"`
	}) int {
		if a.Cost != b.Cost {
			if a.Cost < b.Cost {
				return -1
			}
			return 1
		}
		return strings.Compare(a.Worker, b.Worker)
	})
	var out []string
	for _, r := range rows {
		out = append(out, r.Worker)
	}
	return out
}

// The picker's choice is the proxy's for the same request and state, with
// the other eligible workers ranked after it by cost; chat and
// completions, streamed and plain answers, bodies in one message and in
// chunks; every booking ends with its answer.
func TestExtProcSameChoiceAsProxy(t *testing.T) {
	f := newFleet(t, router.DefaultConfig(), Config{Fallbacks: 2})
	// Prefixes cached on w2 and w3, w1 loaded by a long-running request.
	f.both(func(s side) {
		s.rep.store(t, "w2", tokensOf(t, s.srv, chatBody(prompts[0], false)))
		s.rep.store(t, "w3", tokensOf(t, s.srv, chatBody(prompts[1], false)))
		s.rep.rt.Load().Add(router.Booking{ID: "held", Worker: "w1", PrefillTokens: 300, Sequences: 1, Added: time.Now()})
	})
	cases := []struct {
		name, path, body string
		stream           bool
		chunk            int
	}{
		{"chat prefix on w2", "/v1/chat/completions", chatBody(prompts[0], false), false, 0},
		{"chat prefix on w3, streamed answer", "/v1/chat/completions", chatBody(prompts[1], true), true, 0},
		{"chat no prefix, body in 7-byte chunks", "/v1/chat/completions", chatBody(prompts[2], false), false, 7},
		{"completions", "/v1/completions", completionBody(prompts[2]), false, 64},
		{"chat prefix on w2 again, streamed", "/v1/chat/completions", chatBody(prompts[0], true), true, 0},
	}
	want := map[string]string{"chat prefix on w2": "w2", "chat prefix on w3, streamed answer": "w3"}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			order := costOrder(t, f.picker.srv, tc.path, tc.body)
			if o := costOrder(t, f.proxy.srv, tc.path, tc.body); !slices.Equal(o, order) {
				t.Fatalf("the replicas' states differ: %v vs %v", o, order)
			}
			byProxy := proxied(t, f.proxy.srv, tc.path, tc.body)

			e := openStream(t, f.client)
			d := e.placeDuplex(tc.path, []byte(tc.body), tc.chunk, nil)
			if d.immediate != nil {
				t.Fatalf("refused: %d %s", d.immediate.GetStatus().GetCode(), d.immediate.GetBody())
			}
			if d.header != d.metadata {
				t.Fatalf("header %q and envoy.lb metadata %q differ", d.header, d.metadata)
			}
			if string(d.body) != tc.body {
				t.Fatalf("body streamed back as %q", d.body)
			}
			var got []string
			for _, ep := range d.endpoints() {
				got = append(got, f.workerAt(ep))
			}
			if got[0] != byProxy {
				t.Fatalf("picker chose %s, the proxy %s", got[0], byProxy)
			}
			if w, ok := want[tc.name]; ok && byProxy != w {
				t.Fatalf("chose %s, want the prefix holder %s", byProxy, w)
			}
			wantOrder := append([]string{got[0]}, slices.DeleteFunc(slices.Clone(order), func(w string) bool { return w == got[0] })...)
			if !slices.Equal(got, wantOrder) {
				t.Fatalf("endpoints ranked %v, want the choice then by cost %v", got, wantOrder)
			}
			id := lastBooking(t, f.picker.rep)
			answer, ct := plainAnswer, "application/json"
			if tc.stream {
				answer, ct = streamAnswer, "text/event-stream"
			}
			e.answer(d.endpoints()[0], ct, []byte(answer), 16)
			waitFor(t, "the booking freed at end of stream", func() bool { return slices.Contains(f.picker.rep.noted(), "free "+id) })
			ev := f.picker.rep.noted()
			if !slices.Contains(ev, "prefill "+id) {
				t.Fatalf("first byte not reported: %v", ev)
			}
			// The cache audit gets the engine's cached tokens from the usage
			// relayed through the response phase, as from a proxied answer.
			cached := 0
			if tc.stream {
				cached = 16
			}
			booked := slices.IndexFunc(ev, func(e string) bool { return strings.HasPrefix(e, "add "+id+" ") })
			if !slices.ContainsFunc(ev[booked:], func(e string) bool {
				return strings.HasPrefix(e, "audit "+got[0]+" ") && strings.HasSuffix(e, fmt.Sprintf("/%d", cached))
			}) {
				t.Fatalf("no cache audit of %s reporting %d cached tokens: %v", got[0], cached, ev)
			}
		})
	}
}

// lastBooking is the id of the latest booking rep announced.
func lastBooking(t *testing.T, rep *testReplica) string {
	t.Helper()
	ev := rep.noted()
	for i := len(ev) - 1; i >= 0; i-- {
		if id, ok := strings.CutPrefix(ev[i], "add "); ok {
			id, _, _ = strings.Cut(id, " ")
			return id
		}
	}
	t.Fatal("nothing booked")
	return ""
}

func requestsOn(rep *testReplica, w router.WorkerID) int { return rep.rt.Load().Load(w).Requests }

// BUFFERED mode: the request headers are answered at once, the body's
// answer carries the destination header and metadata; the response's
// body is not echoed back.
func TestExtProcBufferedMode(t *testing.T) {
	f := newFleet(t, router.DefaultConfig(), Config{Fallbacks: 2})
	f.picker.rep.store(t, "w3", tokensOf(t, f.picker.srv, chatBody(prompts[1], false)))
	e := openStream(t, f.client)
	e.send(requestHeaders("/v1/chat/completions", buffered, nil))
	if r := e.recv().GetRequestHeaders(); r == nil || r.GetResponse().GetHeaderMutation() != nil {
		t.Fatalf("headers answered %v, want a plain continue", r)
	}
	e.send(requestBody([]byte(chatBody(prompts[1], false)), true))
	r := e.recv()
	br := r.GetRequestBody()
	if br == nil {
		t.Fatalf("answered %T, want the request body's answer", r.GetResponse())
	}
	header, md := destinationOf(r, br.GetResponse())
	if eps := strings.Split(header, ","); header != md || f.workerAt(eps[0]) != "w3" || len(eps) != 3 {
		t.Fatalf("destination header %q metadata %q, want w3 first of three", header, md)
	}
	if !br.GetResponse().GetClearRouteCache() {
		t.Fatal("the route cache must be cleared for the new destination")
	}
	if requestsOn(f.picker.rep, "w3") != 1 {
		t.Fatal("not booked on w3")
	}
	e.send(responseHeaders(200, header, "application/json"))
	e.recv()
	e.send(responseBody([]byte(plainAnswer), true))
	if b := e.recv().GetResponseBody(); b == nil || b.GetResponse().GetBodyMutation() != nil {
		t.Fatalf("buffered response body answered %v, want a plain continue", b)
	}
	if requestsOn(f.picker.rep, "w3") != 0 {
		t.Fatal("booking not freed at the end of the buffered answer")
	}
}

// The subset hint limits the choice even against the prefix holder; an
// empty or foreign subset is a 503.
func TestExtProcSubsetHint(t *testing.T) {
	f := newFleet(t, router.DefaultConfig(), Config{Fallbacks: 2})
	body := chatBody(prompts[0], false)
	f.picker.rep.store(t, "w2", tokensOf(t, f.picker.srv, body))
	d := openStream(t, f.client).placeDuplex("/v1/chat/completions", []byte(body), 0, subsetMD(f.endpointOf(3), f.endpointOf(1)))
	if d.immediate != nil {
		t.Fatalf("refused: %s", d.immediate.GetBody())
	}
	var got []string
	for _, ep := range d.endpoints() {
		got = append(got, f.workerAt(ep))
	}
	if slices.Contains(got, "w2") || len(got) != 2 {
		t.Fatalf("endpoints %v, want w1 and w3 only", got)
	}
	for name, md := range map[string][]string{"empty": {}, "foreign": {"10.9.9.9:8000"}} {
		d := openStream(t, f.client).placeDuplex("/v1/chat/completions", []byte(body), 0, subsetMD(md...))
		if d.immediate == nil || d.immediate.GetStatus().GetCode() != http.StatusServiceUnavailable {
			t.Fatalf("%s subset: %+v, want an immediate 503", name, d)
		}
	}
}

// A stream closed before the answer ended (the client cancelled, the
// gateway reset it) frees the booking; so does one closed mid-answer.
func TestExtProcCancelFreesBooking(t *testing.T) {
	f := newFleet(t, router.DefaultConfig(), Config{Fallbacks: 2})
	for _, midAnswer := range []bool{false, true} {
		e := openStream(t, f.client)
		d := e.placeDuplex("/v1/chat/completions", []byte(chatBody(prompts[2], true)), 0, nil)
		w := router.WorkerID(f.workerAt(d.endpoints()[0]))
		if requestsOn(f.picker.rep, w) != 1 {
			t.Fatalf("not booked on %s", w)
		}
		if midAnswer {
			e.send(responseHeaders(200, d.endpoints()[0], "text/event-stream"))
			e.recv()
			e.send(responseBody([]byte("data: {\"choices\":[{\"delta\":{\"content\":\"t0\"}}]}\n\n"), false))
			e.recv()
		}
		e.cancel()
		waitFor(t, "the cancelled request's booking freed", func() bool { return requestsOn(f.picker.rep, w) == 0 })
	}
}

// When the gateway served a fallback, the booking moves to its worker.
func TestExtProcServedFallbackMovesBooking(t *testing.T) {
	f := newFleet(t, router.DefaultConfig(), Config{Fallbacks: 2})
	e := openStream(t, f.client)
	d := e.placeDuplex("/v1/chat/completions", []byte(chatBody(prompts[2], false)), 0, nil)
	first, second := router.WorkerID(f.workerAt(d.endpoints()[0])), router.WorkerID(f.workerAt(d.endpoints()[1]))
	e.send(responseHeaders(200, d.endpoints()[1], "application/json"))
	r := e.recv().GetResponseHeaders()
	if requestsOn(f.picker.rep, first) != 0 || requestsOn(f.picker.rep, second) != 1 {
		t.Fatalf("booking not moved from %s to %s", first, second)
	}
	var wid string
	for _, h := range r.GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == "x-worker-id" {
			wid = string(h.GetHeader().GetRawValue())
		}
	}
	if wid != string(second) {
		t.Fatalf("x-worker-id %q, want %s", wid, second)
	}
	e.send(responseBody([]byte(plainAnswer), true))
	e.recv()
	if requestsOn(f.picker.rep, second) != 0 {
		t.Fatal("moved booking not freed at the end")
	}
}

// Refusals are immediate responses in OpenAI's error shape: 429 when every
// worker is over its busy threshold (shedding), 503 with no worker, 404
// for an unknown model, 400 for a body that is not JSON or a bodiless
// request, 413 past the body limit.
func TestExtProcRefusals(t *testing.T) {
	busy := router.DefaultConfig()
	one := int64(1)
	busy.Thresholds.ActivePrefillTokens = &one
	bf := newFleet(t, busy, Config{})
	for _, w := range []router.WorkerID{"w1", "w2", "w3"} {
		bf.picker.rep.rt.Load().Add(router.Booking{ID: "held-" + string(w), Worker: w, PrefillTokens: 500, Sequences: 1, Added: time.Now()})
	}
	empty := newTestReplica(t, router.DefaultConfig())
	nobody := pickerConn(t, Adapt(api.New(api.Config{Registry: nil}, empty)), Config{})
	small := newFleet(t, router.DefaultConfig(), Config{MaxBodyBytes: 64})

	cases := []struct {
		name   string
		client extprocv3.ExternalProcessorClient
		body   string
		want   int
	}{
		{"all busy", bf.client, chatBody(prompts[0], false), http.StatusTooManyRequests},
		{"no workers", nobody, chatBody(prompts[0], false), http.StatusServiceUnavailable},
		{"unknown model", bf.client, `{"model":"nope","messages":[{"role":"user","content":"x"}]}`, http.StatusNotFound},
		{"not JSON", bf.client, `{"model":`, http.StatusBadRequest},
		{"too large", small.client, chatBody(prompts[0], false), http.StatusRequestEntityTooLarge},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			d := openStream(t, tc.client).placeDuplex("/v1/chat/completions", []byte(tc.body), 16, nil)
			if d.immediate == nil || int(d.immediate.GetStatus().GetCode()) != tc.want {
				t.Fatalf("%+v, want an immediate %d", d, tc.want)
			}
			var e struct {
				Error struct {
					Message string `json:"message"`
				} `json:"error"`
			}
			if json.Unmarshal(d.immediate.GetBody(), &e) != nil || e.Error.Message == "" {
				t.Fatalf("body %q is not an OpenAI error", d.immediate.GetBody())
			}
		})
	}
	t.Run("bodiless without workers", func(t *testing.T) {
		e := openStream(t, nobody)
		m := requestHeaders("/v1/models", duplex, nil)
		m.Request.(*extprocv3.ProcessingRequest_RequestHeaders).RequestHeaders.EndOfStream = true
		e.send(m)
		if im := e.recv().GetImmediateResponse(); im == nil || im.GetStatus().GetCode() != http.StatusServiceUnavailable {
			t.Fatalf("%v, want an immediate 503", im)
		}
	})
}

// Trailers end the answer as well as a body's end of stream.
func TestExtProcTrailersEndAnswer(t *testing.T) {
	f := newFleet(t, router.DefaultConfig(), Config{Fallbacks: 2})
	e := openStream(t, f.client)
	d := e.placeDuplex("/v1/chat/completions", []byte(chatBody(prompts[1], true)), 0, nil)
	w := router.WorkerID(f.workerAt(d.endpoints()[0]))
	e.send(responseHeaders(200, d.endpoints()[0], "text/event-stream"))
	e.recv()
	e.send(responseBody([]byte(streamAnswer), false))
	e.recv()
	if requestsOn(f.picker.rep, w) != 1 {
		t.Fatal("freed before the answer ended")
	}
	e.send(responseTrailers())
	if e.recv().GetResponseTrailers() == nil {
		t.Fatal("trailers not answered")
	}
	if requestsOn(f.picker.rep, w) != 0 {
		t.Fatal("booking not freed at the trailers")
	}
}

// A worker with data-parallel ranks behind one engine: the gateway gets the
// engine's endpoint once (ranks share it) and the booked rank in
// x-data-parallel-rank, as the proxy sends it; the prefix holder's rank is
// the one booked.
func TestExtProcDataParallelRank(t *testing.T) {
	w := fakeWorker(t)
	other := fakeWorker(t)
	rep := newTestReplica(t, router.DefaultConfig())
	rep.ranks = map[router.WorkerID]int{"e#0": 0, "e#1": 1}
	rep.addWorker("e#0", w.URL)
	rep.addWorker("e#1", w.URL)
	rep.addWorker("o", other.URL)
	srv := api.New(api.Config{AllowLoopbackWorkers: true}, rep)
	body := chatBody(prompts[1], false)
	rep.store(t, "e#1", tokensOf(t, srv, body))
	client := pickerConn(t, Adapt(srv), Config{Fallbacks: 2})
	e := openStream(t, client)
	e.send(requestHeaders("/v1/chat/completions", duplex, nil))
	e.send(requestBody([]byte(body), true))
	r := e.recv()
	got := map[string]string{}
	for _, h := range r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		got[h.GetHeader().GetKey()] = string(h.GetHeader().GetRawValue())
	}
	wEP, _ := api.WorkerEndpoint(w.URL)
	oEP, _ := api.WorkerEndpoint(other.URL)
	if got[DestinationHeader] != wEP+","+oEP || got["x-data-parallel-rank"] != "1" {
		t.Fatalf("headers %v, want %s then %s, rank 1", got, wEP, oEP)
	}
	if requestsOn(rep, "e#1") != 1 {
		t.Fatal("rank 1 not booked")
	}
}

// A request without a body (GET /v1/models) goes to the worker with the
// fewest requests in flight, nothing booked, answered on its headers.
func TestExtProcBodiless(t *testing.T) {
	f := newFleet(t, router.DefaultConfig(), Config{Fallbacks: 2})
	for _, w := range []router.WorkerID{"w1", "w3"} {
		f.picker.rep.rt.Load().Add(router.Booking{ID: "held-" + string(w), Worker: w, Sequences: 1, Added: time.Now()})
	}
	e := openStream(t, f.client)
	m := requestHeaders("/v1/models", duplex, nil)
	m.Request.(*extprocv3.ProcessingRequest_RequestHeaders).RequestHeaders.EndOfStream = true
	e.send(m)
	r := e.recv()
	header, md := destinationOf(r, r.GetRequestHeaders().GetResponse())
	if header != f.endpointOf(2) || md != header {
		t.Fatalf("destination %q / %q, want the idle w2 %s", header, md, f.endpointOf(2))
	}
	if n := f.picker.rep.rt.Load().Len(); n != 2 {
		t.Fatalf("%d bookings, want the two held only", n)
	}
}

// By default the answer names the choice alone, as GAIE's reference
// picker does (one ip:port for an ORIGINAL_DST cluster).
func TestExtProcNoFallbacksByDefault(t *testing.T) {
	f := newFleet(t, router.DefaultConfig(), Config{})
	d := openStream(t, f.client).placeDuplex("/v1/chat/completions", []byte(chatBody(prompts[0], false)), 0, nil)
	if eps := d.endpoints(); len(eps) != 1 || d.metadata != eps[0] {
		t.Fatalf("endpoints %v, metadata %q: want the choice alone", eps, d.metadata)
	}
}
