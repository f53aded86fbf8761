package api

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/router"
)

// fakePins is a fakeReplica that keeps prefix pins in memory, matched by
// their last block hash as the FSM matches them, and records every write.
type fakePins struct {
	*fakeReplica
	enabled bool

	pmu    sync.Mutex
	pins   []fakePin
	writes []PinWrite
	unpins []PinUnpin
}

type fakePin struct {
	model  string
	blocks []uint64
	holder PinHolder
}

func (f *fakePins) PinsEnabled() bool { return f.enabled }
func (f *fakePins) PinCount() int {
	f.pmu.Lock()
	defer f.pmu.Unlock()
	return len(f.pins)
}
func (f *fakePins) Pins() []PinInfo { return nil }
func (f *fakePins) Unpin(_ context.Context, u PinUnpin) (int, error) {
	f.pmu.Lock()
	defer f.pmu.Unlock()
	f.unpins = append(f.unpins, u)
	return 1, nil
}
func (f *fakePins) PinLookup(model string, hashes []uint64) (PinMatch, bool) {
	f.pmu.Lock()
	defer f.pmu.Unlock()
	for i := len(hashes) - 1; i >= 0; i-- {
		var m PinMatch
		for _, p := range f.pins {
			if p.model == model && p.blocks[len(p.blocks)-1] == hashes[i] {
				m.Holders = append(m.Holders, p.holder)
			}
		}
		if len(m.Holders) > 0 {
			m.Depth, m.Key = i+1, hashes[i]
			return m, true
		}
	}
	return PinMatch{}, false
}
func (f *fakePins) Pin(w PinWrite) {
	f.pmu.Lock()
	defer f.pmu.Unlock()
	f.writes = append(f.writes, w)
}
func (f *fakePins) put(model string, blocks []uint64, h PinHolder) {
	f.pmu.Lock()
	defer f.pmu.Unlock()
	f.pins = append(f.pins, fakePin{model: model, blocks: blocks, holder: h})
}
func (f *fakePins) takeWrites() []PinWrite {
	f.pmu.Lock()
	defer f.pmu.Unlock()
	w := f.writes
	f.writes = nil
	return w
}

// newPinServer: model m with workers w1..wn, pinning on or off.
func newPinServer(t *testing.T, n int, enabled bool) (*Server, *fakePins, *atomic.Int64) {
	t.Helper()
	rep := newFakeReplica("m", router.DefaultConfig())
	var hits atomic.Int64
	for i := 1; i <= n; i++ {
		rep.addWorker("m", router.WorkerID(fmt.Sprintf("w%d", i)), fakeWorker(t, &hits).URL)
	}
	fp := &fakePins{fakeReplica: rep, enabled: enabled}
	return New(Config{Registry: prometheus.NewRegistry(), Retries: 2, AllowLoopbackWorkers: true}, fp), fp, &hits
}

func TestAPIPinTTL(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want time.Duration // 0: refused
	}{
		{"30s", 30 * time.Second}, {"5m", 5 * time.Minute}, {"30m", 30 * time.Minute}, {"1h", time.Hour},
		{"1s", time.Second}, {"3600s", time.Hour}, {"60m", time.Hour},
		{"2h", 0}, {"3601s", 0}, {"61m", 0}, {"0s", 0}, {"-5m", 0}, {"5", 0}, {"5x", 0}, {"m", 0}, {"", 0},
		{"1.5m", 0}, {"1h30m", 0}, {"5M", 0}, {" 5m", 0}, {"99999999999s", 0}, {"+5m", 0},
	} {
		got, err := parsePinTTL(tc.in)
		if tc.want == 0 {
			if err == nil || !strings.Contains(err.Error(), "nvext.cache_control.ttl") {
				t.Errorf("%q: %v, %v, want a refusal naming the field", tc.in, got, err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%q: %v, %v, want %v", tc.in, got, err, tc.want)
		}
	}
}

// TestAPIAgentHintsParse: nvext.agent_hints.latency_sensitivity and
// nvext.cache_control as prepareBody reads them: a value, or a 400 naming
// the field; cache_control only while pinning is on (off, it is not read:
// a malformed one passes as Dynamo passes it without its flag).
func TestAPIAgentHintsParse(t *testing.T) {
	on, _, _ := newPinServer(t, 1, true)
	off, _, _ := newPinServer(t, 1, false)
	body := func(nvext string) []byte {
		return []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"nvext":` + nvext + `}`)
	}
	for _, tc := range []struct {
		name  string
		s     *Server
		nvext string
		ls    time.Duration
		ttl   time.Duration // 0: no pin
		err   string
	}{
		{"none", on, `{}`, 0, 0, ""},
		{"sensitivity", on, `{"agent_hints":{"latency_sensitivity":1.2}}`, 1200 * time.Millisecond, 0, ""},
		{"sensitivity zero", on, `{"agent_hints":{"latency_sensitivity":0}}`, 0, 0, ""},
		{"sensitivity null", on, `{"agent_hints":{"latency_sensitivity":null}}`, 0, 0, ""},
		{"sensitivity integer", on, `{"agent_hints":{"latency_sensitivity":5}}`, 5 * time.Second, 0, ""},
		{"sensitivity max", on, `{"agent_hints":{"latency_sensitivity":3600}}`, time.Hour, 0, ""},
		{"sensitivity over", on, `{"agent_hints":{"latency_sensitivity":3600.5}}`, 0, 0, "latency_sensitivity"},
		{"sensitivity negative", on, `{"agent_hints":{"latency_sensitivity":-0.5}}`, 0, 0, "latency_sensitivity"},
		{"sensitivity string", on, `{"agent_hints":{"latency_sensitivity":"5"}}`, 0, 0, "latency_sensitivity"},
		{"sensitivity huge", on, `{"agent_hints":{"latency_sensitivity":1e308}}`, 0, 0, "latency_sensitivity"},
		{"sensitivity with pins off", off, `{"agent_hints":{"latency_sensitivity":2}}`, 2 * time.Second, 0, ""},
		{"speculative_prefill accepted, ignored", on, `{"agent_hints":{"speculative_prefill":true}}`, 0, 0, ""},
		{"cache_control default ttl", on, `{"cache_control":{"type":"ephemeral"}}`, 0, DefaultPinTTL, ""},
		{"cache_control ttl", on, `{"cache_control":{"type":"ephemeral","ttl":"30s"}}`, 0, 30 * time.Second, ""},
		{"cache_control null ttl", on, `{"cache_control":{"type":"ephemeral","ttl":null}}`, 0, DefaultPinTTL, ""},
		{"cache_control unknown field ignored", on, `{"cache_control":{"type":"ephemeral","ttl":"1h","scope":"x"}}`, 0, time.Hour, ""},
		{"cache_control null", on, `{"cache_control":null}`, 0, 0, ""},
		{"cache_control no type", on, `{"cache_control":{"ttl":"5m"}}`, 0, 0, "nvext.cache_control.type"},
		{"cache_control other type", on, `{"cache_control":{"type":"persistent"}}`, 0, 0, "nvext.cache_control.type"},
		{"cache_control type number", on, `{"cache_control":{"type":1}}`, 0, 0, "nvext.cache_control"},
		{"cache_control ttl number", on, `{"cache_control":{"type":"ephemeral","ttl":300}}`, 0, 0, "nvext.cache_control.ttl"},
		{"cache_control bad ttl", on, `{"cache_control":{"type":"ephemeral","ttl":"5 minutes"}}`, 0, 0, "nvext.cache_control.ttl"},
		{"cache_control ttl too long", on, `{"cache_control":{"type":"ephemeral","ttl":"24h"}}`, 0, 0, "nvext.cache_control.ttl"},
		{"cache_control a string", on, `{"cache_control":"ephemeral"}`, 0, 0, "nvext.cache_control must be an object"},
		{"cache_control an array", on, `{"cache_control":[]}`, 0, 0, "nvext.cache_control must be an object"},
		{"cache_control pins off: not read", off, `{"cache_control":"garbage"}`, 0, 0, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, ref := tc.s.prepareBody(body(tc.nvext), "/v1/chat/completions", epChat, "", http.Header{}, time.Now())
			if tc.err != "" {
				if ref == nil || ref.status != 400 || !strings.Contains(ref.msg, tc.err) {
					t.Fatalf("refusal %+v, want a 400 naming %q", ref, tc.err)
				}
				return
			}
			if ref != nil {
				t.Fatalf("refused: %+v", ref)
			}
			if p.req.LatencySensitivity != tc.ls {
				t.Errorf("latency sensitivity %v, want %v", p.req.LatencySensitivity, tc.ls)
			}
			if got := p.pin; (got == nil) != (tc.ttl == 0) || (got != nil && got.ttl != tc.ttl) {
				t.Errorf("pin %+v, want ttl %v", got, tc.ttl)
			}
		})
	}
}

// TestAPIPinRouting: a request with cache_control pins its prefix on the
// worker that served it; requests starting with a pinned prefix go to its
// holder whatever the router would pick, refresh it only when less than
// half its TTL is left, and move it when the holder is gone; bad input
// reaches no worker and writes nothing; with pinning off nothing is read
// or written.
func TestAPIPinRouting(t *testing.T) {
	s, fp, hits := newPinServer(t, 3, true)
	prefix := strings.Repeat("a long agent conversation that grows turn after turn. ", 8)
	chat := func(content, nvext string) string {
		b := fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":%q}]`, content)
		if nvext != "" {
			b += `,"nvext":` + nvext
		}
		return b + "}"
	}
	rec := doWith(s, "/v1/chat/completions", chat(prefix, `{"cache_control":{"type":"ephemeral","ttl":"5m"}}`), nil)
	if rec.Code != 200 {
		t.Fatalf("pinning request: %d %s", rec.Code, rec.Body)
	}
	ws := fp.takeWrites()
	if len(ws) != 1 || string(ws[0].Worker) != rec.Header().Get("X-Worker-Id") || len(ws[0].Blocks) < 4 ||
		ws[0].Key != ws[0].Blocks[len(ws[0].Blocks)-1] || ws[0].TTL != 5*time.Minute || ws[0].Replace != "" {
		t.Fatalf("writes %+v, worker %s", ws, rec.Header().Get("X-Worker-Id"))
	}
	pinned := ws[0].Blocks

	// The pin held by w3, fresh: ten requests extending the prefix all go
	// to w3 and write nothing; one with cache_control and a prompt not
	// twice the pin writes nothing either.
	fp.put("m", pinned, PinHolder{Worker: "w3", Until: time.Now().Add(5 * time.Minute), TTL: 5 * time.Minute})
	for i := range 10 {
		rec := doWith(s, "/v1/chat/completions", chat(prefix+fmt.Sprintf("turn %d", i), ""), nil)
		if rec.Code != 200 || rec.Header().Get("X-Worker-Id") != "w3" {
			t.Fatalf("request %d of the pinned prefix: %d on %q", i, rec.Code, rec.Header().Get("X-Worker-Id"))
		}
	}
	doWith(s, "/v1/chat/completions", chat(prefix+"one more turn", `{"cache_control":{"type":"ephemeral"}}`), nil)
	if ws := fp.takeWrites(); len(ws) != 0 {
		t.Fatalf("fresh pin hits wrote %+v", ws)
	}
	// A prompt that doubled the pinned prefix re-pins (the FSM lets the
	// longer pin supersede the shorter).
	rec = doWith(s, "/v1/chat/completions", chat(prefix+prefix+"next", `{"cache_control":{"type":"ephemeral"}}`), nil)
	if ws := fp.takeWrites(); rec.Header().Get("X-Worker-Id") != "w3" || len(ws) != 1 || ws[0].Worker != "w3" || len(ws[0].Blocks) < 2*len(pinned) {
		t.Fatalf("a doubled prompt on %s wrote %+v", rec.Header().Get("X-Worker-Id"), ws)
	}

	// A pin close to its expiry: a hit refreshes it (no blocks).
	fp.pins = nil
	fp.put("m", pinned, PinHolder{Worker: "w2", Until: time.Now().Add(time.Minute), TTL: 5 * time.Minute})
	rec = doWith(s, "/v1/chat/completions", chat(prefix+"late turn", ""), nil)
	ws = fp.takeWrites()
	if rec.Header().Get("X-Worker-Id") != "w2" || len(ws) != 1 || ws[0].Blocks != nil || ws[0].Key != pinned[len(pinned)-1] || ws[0].Worker != "w2" {
		t.Fatalf("a due pin's hit on %s wrote %+v", rec.Header().Get("X-Worker-Id"), ws)
	}

	// The holder is gone: the normal decision, and the pin moves there.
	fp.pins = nil
	fp.put("m", pinned, PinHolder{Worker: "gone", Until: time.Now().Add(5 * time.Minute), TTL: 5 * time.Minute})
	rec = doWith(s, "/v1/chat/completions", chat(prefix+"after", ""), nil)
	ws = fp.takeWrites()
	if rec.Code != 200 || len(ws) != 1 || ws[0].Replace != "gone" || string(ws[0].Worker) != rec.Header().Get("X-Worker-Id") ||
		!slices.Equal(ws[0].Blocks, pinned) {
		t.Fatalf("a gone holder: %d, writes %+v", rec.Code, ws)
	}

	// Bad input: 400 with a JSON error, no worker, no write.
	before := hits.Load()
	for _, nv := range []string{`{"cache_control":{"type":"ephemeral","ttl":"-5m"}}`, `{"cache_control":{"type":"ephemeral","ttl":"1d"}}`,
		`{"cache_control":{"type":"ephemeral","ttl":["5m"]}}`, `{"cache_control":true}`, `{"agent_hints":{"latency_sensitivity":"fast"}}`} {
		rec := doWith(s, "/v1/chat/completions", chat(prefix, nv), nil)
		var e struct {
			Error struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if rec.Code != 400 || json.Unmarshal(rec.Body.Bytes(), &e) != nil || e.Error.Message == "" {
			t.Errorf("%s: %d %s", nv, rec.Code, rec.Body)
		}
	}
	if ws := fp.takeWrites(); len(ws) != 0 || hits.Load() != before {
		t.Fatalf("bad input wrote %+v, reached %d workers", ws, hits.Load()-before)
	}

	// Pinning off: cache_control passes unread, nothing is written.
	off, fpOff, _ := newPinServer(t, 2, false)
	if rec := doWith(off, "/v1/chat/completions", chat(prefix, `{"cache_control":{"type":"ephemeral"}}`), nil); rec.Code != 200 {
		t.Fatalf("pins off: %d %s", rec.Code, rec.Body)
	}
	if ws := fpOff.takeWrites(); len(ws) != 0 {
		t.Fatalf("pins off wrote %+v", ws)
	}
}

// FuzzAPICacheControl: any nvext.cache_control value is either refused
// with an error naming the field or read as a pin with a TTL in
// [1s, MaxPinTTL]; never a panic.
func FuzzAPICacheControl(f *testing.F) {
	for _, s := range []string{`{"type":"ephemeral","ttl":"5m"}`, `{"type":"ephemeral"}`, `{"type":"ephemeral","ttl":"3600s"}`,
		`{"type":"ephemeral","ttl":"0h"}`, `{"type":"x"}`, `"5m"`, `null`, `{"type":"ephemeral","ttl":"99999999h"}`, `{`, ``} {
		f.Add([]byte(s))
	}
	s := New(Config{Registry: prometheus.NewRegistry()}, &fakePins{fakeReplica: newFakeReplica("m", router.DefaultConfig()), enabled: true})
	f.Fuzz(func(t *testing.T, raw []byte) {
		p, err := s.readCacheControl(raw)
		switch {
		case err != nil:
			if p != nil || !strings.Contains(err.Error(), "nvext.cache_control") {
				t.Fatalf("%q: %v with %+v", raw, err, p)
			}
		case p != nil && (p.ttl < time.Second || p.ttl > MaxPinTTL):
			t.Fatalf("%q: ttl %v", raw, p.ttl)
		}
	})
}

// TestAPIDeletePins: DELETE /pins ends a prefix's pins or a worker's; a
// malformed body is a 400 with a JSON error and writes nothing.
func TestAPIDeletePins(t *testing.T) {
	s, fp, _ := newPinServer(t, 1, true)
	del := func(body string) *httptest.ResponseRecorder {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest(http.MethodDelete, "/pins", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		s.Handler().ServeHTTP(rec, req)
		return rec
	}
	for _, tc := range []struct {
		body string
		code int
		want PinUnpin
	}{
		{`{"model":"m","key":"3c6d9d37b2a2440"}`, 200, PinUnpin{Model: "m", Key: 0x3c6d9d37b2a2440}},
		{`{"model":"m","key":"ff","worker":"w1"}`, 200, PinUnpin{Model: "m", Key: 0xff, Worker: "w1"}},
		{`{"worker":"w1"}`, 200, PinUnpin{Worker: "w1"}},
		{`{}`, 400, PinUnpin{}},
		{`{"model":"m"}`, 400, PinUnpin{}},
		{`{"model":"m","key":"xyz"}`, 400, PinUnpin{}},
		{`{"model":"m","key":"1ffffffffffffffff"}`, 400, PinUnpin{}},
		{`{"key":"ff","worker":"w1"}`, 400, PinUnpin{}},
		{`{"worker":"w1#2"}`, 400, PinUnpin{}},
		{`{"worker":7}`, 400, PinUnpin{}},
		{`[]`, 400, PinUnpin{}},
	} {
		rec := del(tc.body)
		var out map[string]any
		if rec.Code != tc.code || json.Unmarshal(rec.Body.Bytes(), &out) != nil {
			t.Errorf("%s: %d %s, want %d", tc.body, rec.Code, rec.Body, tc.code)
			continue
		}
		fp.pmu.Lock()
		got := fp.unpins
		fp.unpins = nil
		fp.pmu.Unlock()
		switch {
		case tc.code == 200 && (len(got) != 1 || got[0] != tc.want || out["unpinned"] != 1.0):
			t.Errorf("%s: unpinned %+v (%v), want %+v", tc.body, got, out, tc.want)
		case tc.code != 200 && (len(got) != 0 || out["error"] == nil):
			t.Errorf("%s: refused with %v but wrote %+v", tc.body, out, got)
		}
	}
}
