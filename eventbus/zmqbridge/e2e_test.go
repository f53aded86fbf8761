package zmqbridge

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"reflect"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// cacheModel is what a fake engine caches, and the batches that say so in
// one engine's dialect: "vllm" (events as maps tagged by "type", 32-byte
// hashes, several blocks per event) or "sglang" (tagged arrays, int64
// hashes, one event per block).
type cacheModel struct {
	t       *testing.T
	dialect string
	gen     uint64 // engine incarnation: hashes differ per incarnation
	n       uint64
	chains  [][]uint64        // engine hashes of each stored chain, root first
	truth   map[uint64]uint64 // engine hash → content hash
}

func newCacheModel(t *testing.T, dialect string, gen uint64) *cacheModel {
	return &cacheModel{t: t, dialect: dialect, gen: gen, truth: map[uint64]uint64{}}
}

func (m *cacheModel) hash(h uint64) any {
	if m.dialect == "sglang" {
		return int64Code(int64(h))
	}
	return hash32(h, byte(m.gen))
}

func (m *cacheModel) hashes(hs []uint64) []any {
	out := make([]any, len(hs))
	for i, h := range hs {
		out[i] = m.hash(h)
	}
	return out
}

// batch stores a new chain of three blocks (two in one event, the third
// as a child event naming its parent) and, when evict, removes the oldest
// chain still cached.
func (m *cacheModel) batch(evict bool) []byte {
	m.n++
	base := m.gen<<40 | m.n<<8
	hs := []uint64{base | 1, base | 2, base | 3}
	toks := tokens(uint32(m.gen*1_000_000+m.n*48), 3)
	content := seqHashes(toks, "")
	for i, h := range hs {
		m.truth[h] = content[i]
	}
	var evs []any
	switch m.dialect {
	case "sglang":
		var parent any
		for i, h := range hs {
			evs = append(evs, []any{"BlockStored", []any{m.hash(h)}, parent, toks[i*16 : (i+1)*16], 16, nil, "GPU"})
			parent = m.hash(h)
		}
	default:
		evs = append(evs,
			storedMap(m.hashes(hs[:2]), nil, toks[:32], "GPU"),
			storedMap(m.hashes(hs[2:]), m.hash(hs[1]), toks[32:], "GPU"))
	}
	m.chains = append(m.chains, hs)
	if evict && len(m.chains) > 1 {
		old := m.chains[0]
		m.chains = m.chains[1:]
		rm := []uint64{old[2], old[1], old[0]} // leaves first
		for _, h := range rm {
			delete(m.truth, h)
		}
		if m.dialect == "sglang" {
			evs = append(evs, []any{"BlockRemoved", m.hashes(rm), "GPU"})
		} else {
			evs = append(evs, removedMap(m.hashes(rm), "GPU"))
		}
	}
	// An offloaded copy on the CPU tier and an event of an unknown type:
	// neither may reach the index.
	if m.dialect == "sglang" {
		evs = append(evs, []any{"BlockStored", []any{m.hash(base | 9)}, nil, tokens(7, 1), 16, nil, "CPU_PINNED"})
	} else {
		evs = append(evs, storedMap(m.hashes([]uint64{base | 9}), nil, tokens(7, 1), "CPU"), omap{{"type", "BlockPinned"}})
	}
	return mp(m.t, batchArr(float64(time.Now().UnixNano())/1e9, evs, 0))
}

func (m *cacheModel) contents() map[uint64]bool {
	out := map[uint64]bool{}
	for _, c := range m.truth {
		out[c] = true
	}
	return out
}

func sameSet(a, b map[uint64]bool) error {
	if reflect.DeepEqual(a, b) || (len(a) == 0 && len(b) == 0) {
		return nil
	}
	missing, extra := 0, 0
	for k := range b {
		if !a[k] {
			missing++
		}
	}
	for k := range a {
		if !b[k] {
			extra++
		}
	}
	return fmt.Errorf("index has %d blocks (%d missing, %d extra), engine has %d", len(a), missing, extra, len(b))
}

// TestBridgeEndToEnd runs the bridge against fake engines that speak the
// real ZMQ protocol over tcp://127.0.0.1 (PUB + ROUTER replay) and an
// OpenAI HTTP surface, into fake publishers over an index: startup in the
// middle of a stream, registration with capacity read from metrics, live
// events, a gap repaired by replay, malformed frames, an engine restart,
// a second engine (SGLang dialect, old replay format) added through the
// register API, status, metrics, and removal.
func TestBridgeEndToEnd(t *testing.T) {
	log := testLogger(t)
	vllm := startFakeEngine(t, engineOpts{topic: "kv@vllm-0", newReplay: true, model: "qwen3", blocks: 27024})
	replica := startFakeReplica(t, "s3cret")
	cluster := newFakeCluster()

	// The engine has been serving before the bridge starts.
	m := newCacheModel(t, "vllm", 1)
	for i := range 4 {
		vllm.publish(m.batch(i == 3), false)
	}

	b, err := New(Config{BlockSize: 16, Publishers: cluster.factory, Register: []string{replica.srv.URL},
		AdminToken: "s3cret", RegisterInterval: 100 * time.Millisecond, ReplayTimeout: 5 * time.Second, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(b.Collector())
	api := httptest.NewServer(b.Handler(reg, "apitoken"))
	defer api.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	runDone := make(chan error, 1)
	go func() {
		runDone <- b.Run(ctx, []WorkerSpec{{ID: "vllm-0", URL: vllm.url(), Events: vllm.pubAddr, Replay: vllm.rtrAddr, Topic: "kv@vllm-0"}})
	}()

	id := router.WorkerKey("vllm-0", 0)
	converge := func(what string, m *cacheModel, id router.WorkerID) {
		t.Helper()
		poll.Until(t, 15*time.Second, 10*time.Millisecond, func() error {
			if err := sameSet(cluster.contents(id), m.contents()); err != nil {
				return fmt.Errorf("%s: %w", what, err)
			}
			return nil
		})
	}
	converge("catch-up at startup", m, id)
	if reqs := vllm.replayRequests(); len(reqs) == 0 || reqs[0] != 0 {
		t.Fatalf("replay requests %v: the bridge should have asked for the history from 0", reqs)
	}
	r, ok := replica.last("vllm-0")
	if !ok || r.Model != "qwen3" || r.TotalBlocks != 27024 || r.BlockSize != 16 || r.URL != vllm.url() || r.DPRanks != 1 {
		t.Fatalf("registration %+v", r)
	}

	// Live events.
	vllm.waitSubscribed(t)
	for i := range 5 {
		vllm.publish(m.batch(i%2 == 0), false)
	}
	converge("live", m, id)

	// Two batches lost on the way (high-water mark): the next one shows
	// the gap and the replay socket fills it.
	before := len(vllm.replayRequests())
	vllm.publish(m.batch(true), true)
	vllm.publish(m.batch(false), true)
	vllm.publish(m.batch(true), false)
	converge("gap repaired", m, id)
	if reqs := vllm.replayRequests(); len(reqs) != before+1 {
		t.Fatalf("replay requests %v after one gap", reqs)
	}

	// Malformed frames and payloads are counted, not fatal.
	vllm.sendRaw([]byte("kv@vllm-0"), []byte{1, 2, 3}, []byte("x"))
	vllm.sendRaw([]byte("kv@vllm-0"), []byte{0, 0, 0, 0, 0, 0, 0, 0})
	vllm.publish([]byte{0xc1, 0x00}, false) // takes its sequence number, decodes to nothing
	vllm.publish(m.batch(false), false)
	converge("after malformed input", m, id)

	// The engine restarts: empty cache, sequence from 0.
	vllm.restart()
	m = newCacheModel(t, "vllm", 2)
	vllm.publish(m.batch(false), false)
	vllm.publish(m.batch(false), false) // the bridge may miss both (reconnecting)
	vllm.waitSubscribed(t)
	vllm.publish(m.batch(true), false)
	converge("engine restarted", m, id)

	st := statusOf(t, api.URL)
	if len(st) != 1 || st[0].State != "running" || !st[0].Registered || st[0].Engine != "vllm" || len(st[0].Ranks) != 1 {
		t.Fatalf("status %+v", st)
	}
	rk := st[0].Ranks[0]
	if rk.MalformedFrames != 2 || rk.MalformedBatches != 1 || rk.Resyncs < 1 || rk.Restarts < 1 || rk.Gaps < 1 ||
		rk.Converter.Skipped[SkipOtherMedium] == 0 || rk.Converter.Skipped[SkipUnknownType] == 0 || rk.Converter.Skipped[SkipBlockSizeMismatch] != 0 {
		t.Fatalf("rank stats %+v", rk)
	}

	// A second engine, SGLang dialect and older replay format, added
	// through the bridge's register API (which wants its token).
	sgl := startFakeEngine(t, engineOpts{model: "qwen3", blocks: 500})
	m2 := newCacheModel(t, "sglang", 7)
	sgl.publish(m2.batch(false), false)
	spec := WorkerSpec{ID: "sgl-0", URL: sgl.url(), Model: "qwen3", Events: sgl.pubAddr, Replay: sgl.rtrAddr, TotalBlocks: 4096}
	if code := post(t, api.URL+"/workers/register", spec, ""); code != http.StatusUnauthorized {
		t.Fatalf("register without token: %d", code)
	}
	if code := post(t, api.URL+"/workers/register", spec, "apitoken"); code != http.StatusOK {
		t.Fatalf("register: %d", code)
	}
	if code := post(t, api.URL+"/workers/register", spec, "apitoken"); code != http.StatusOK {
		t.Fatalf("register again (same spec): %d", code)
	}
	spec2 := spec
	spec2.Events = vllm.pubAddr
	if code := post(t, api.URL+"/workers/register", spec2, "apitoken"); code != http.StatusConflict {
		t.Fatalf("register a different spec under the same id: %d", code)
	}
	id2 := router.WorkerKey("sgl-0", 0)
	converge("sglang catch-up", m2, id2)
	sgl.waitSubscribed(t)
	for i := range 4 {
		sgl.publish(m2.batch(i > 0), i == 1)
	}
	converge("sglang live with a gap", m2, id2)
	if r, _ := replica.last("sgl-0"); r.TotalBlocks != 4096 {
		t.Fatalf("given capacity not registered: %+v", r)
	}

	// Metrics.
	mf, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, f := range mf {
		names[f.GetName()] = true
	}
	for _, n := range []string{"kvrouter_bridge_batches_total", "kvrouter_bridge_gaps_total", "kvrouter_bridge_events_skipped_total",
		"kvrouter_bridge_resyncs_total", "kvrouter_bridge_worker_registered", "kvrouter_bridge_blocks"} {
		if !names[n] {
			t.Errorf("metric %s missing", n)
		}
	}

	// Event ids of each rank increase by one from 1; each stream opens
	// with a cleared event; the index accepted everything.
	for _, wid := range []router.WorkerID{id, id2} {
		p := cluster.publisher(wid)
		p.mu.Lock()
		if len(p.errs) > 0 {
			t.Errorf("%s: index errors %v", wid, p.errs)
		}
		for i, ev := range p.events {
			if ev.EventID != uint64(i+1) {
				t.Errorf("%s: event %d has id %d", wid, i, ev.EventID)
				break
			}
		}
		if len(p.events) == 0 || p.events[0].Kind != uint8(router.EventCleared) {
			t.Errorf("%s: first event %+v", wid, p.events)
		}
		p.mu.Unlock()
	}

	// Deregistration through the API stops following the worker and
	// deregisters it from the replicas.
	if code := post(t, api.URL+"/workers/deregister", map[string]string{"id": "sgl-0"}, "apitoken"); code != http.StatusOK {
		t.Fatalf("deregister: %d", code)
	}
	replica.mu.Lock()
	deregs := append([]string(nil), replica.deregs...)
	replica.mu.Unlock()
	if !reflect.DeepEqual(deregs, []string{"sgl-0"}) {
		t.Fatalf("deregistrations %v", deregs)
	}
	if st := statusOf(t, api.URL); len(st) != 1 {
		t.Fatalf("status after removal: %+v", st)
	}

	cancel()
	select {
	case err := <-runDone:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("bridge did not stop")
	}
	if p := cluster.publisher(id); !p.closed {
		t.Fatal("publisher not closed at shutdown")
	}
}

// TestBridgeRejectsBlockSize: an engine whose metrics report another block
// size is refused loudly and never registered; one whose events do is
// counted under block_size_mismatch.
func TestBridgeRejectsBlockSize(t *testing.T) {
	eng := startFakeEngine(t, engineOpts{model: "m", blocks: 10, blockSize: 32})
	replica := startFakeReplica(t, "")
	cluster := newFakeCluster()
	b, err := New(Config{BlockSize: 16, Publishers: cluster.factory, Register: []string{replica.srv.URL},
		RegisterInterval: 50 * time.Millisecond, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = b.Run(ctx, []WorkerSpec{{ID: "w32", URL: eng.url(), Events: eng.pubAddr}})
	}()
	poll.Until(t, 5*time.Second, 10*time.Millisecond, func() error {
		st := b.Status()
		if len(st) != 1 || st[0].State != "rejected" {
			return fmt.Errorf("status %+v", st)
		}
		return nil
	})
	if _, ok := replica.last("w32"); ok {
		t.Fatal("a worker with the wrong block size was registered")
	}
	cancel()
	wg.Wait()

	// Without metrics to tell, the events do.
	eng2 := startFakeEngine(t, engineOpts{model: "m", blocks: 10})
	b2, _ := New(Config{BlockSize: 16, Publishers: cluster.factory, Logger: testLogger(t)})
	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	go func() {
		_ = b2.Run(ctx2, []WorkerSpec{{ID: "w2", URL: eng2.url(), Events: eng2.pubAddr, TotalBlocks: 10}})
	}()
	poll.Until(t, 10*time.Second, 10*time.Millisecond, func() error {
		if st := b2.Status(); len(st) != 1 || st[0].State != "running" {
			return fmt.Errorf("status %+v", st)
		}
		return nil
	})
	eng2.waitSubscribed(t)
	eng2.publish(mp(t, batchArr(0, []any{[]any{"BlockStored", u64s(1), nil, tokens(0, 2), 32, nil, "GPU"}}, 0)), false)
	poll.Until(t, 5*time.Second, 10*time.Millisecond, func() error {
		st := b2.Status()
		if len(st[0].Ranks) == 0 || st[0].Ranks[0].Converter.Skipped[SkipBlockSizeMismatch] != 1 {
			return fmt.Errorf("status %+v", st)
		}
		return nil
	})
	if got := cluster.contents(router.WorkerKey("w2", 0)); len(got) != 0 {
		t.Fatalf("mismatched blocks reached the index: %v", got)
	}
}

func statusOf(t *testing.T, base string) []WorkerStatus {
	t.Helper()
	resp, err := http.Get(base + "/status")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var doc struct {
		Workers []WorkerStatus `json:"workers"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
		t.Fatal(err)
	}
	sort.Slice(doc.Workers, func(i, j int) bool { return doc.Workers[i].Spec.ID < doc.Workers[j].Spec.ID })
	return doc.Workers
}

func post(t *testing.T, u string, body any, token string) int {
	t.Helper()
	data, _ := json.Marshal(body)
	req, _ := http.NewRequest(http.MethodPost, u, bytes.NewReader(data))
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}
