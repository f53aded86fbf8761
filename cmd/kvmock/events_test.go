package main

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/router"
)

// routerTokens computes a chat body's token ids the way the router does
// (api/openai.go prepare) with its defaults for the builtin tokenizer: the
// body decoded into tokenize.Message, rendered with the plain template and
// the generation prompt, encoded with the builtin tokenizer.
func routerTokens(t *testing.T, body []byte) []uint32 {
	t.Helper()
	var in struct {
		Messages []tokenize.Message `json:"messages"`
	}
	if err := json.Unmarshal(body, &in); err != nil {
		t.Fatal(err)
	}
	text, err := tokenize.RenderChat(in.Messages, tokenize.Plain, true)
	if err != nil {
		t.Fatal(err)
	}
	return tokenize.Builtin().Encode(text)
}

// checkContiguous: consecutive ids in publish order, every event valid.
func checkContiguous(t *testing.T, evs []eventbus.WireEvent) {
	t.Helper()
	for i, ev := range evs {
		if ev.EventID != evs[0].EventID+uint64(i) {
			t.Fatalf("event %d has id %d after %d", i, ev.EventID, evs[0].EventID)
		}
		if ev.Worker != "mock-1" || ev.DPRank != 0 || ev.BlockSize != 16 {
			t.Fatalf("event %d: worker %q rank %d block size %d", i, ev.Worker, ev.DPRank, ev.BlockSize)
		}
	}
}

func storedContent(evs []eventbus.WireEvent) []uint64 {
	var out []uint64
	for _, ev := range evs {
		if ev.Kind == eventbus.KindStored {
			for _, b := range ev.Blocks {
				out = append(out, b.Content)
			}
		}
	}
	return out
}

// waitEvents waits until the fake publisher holds at least n events.
func waitEvents(t *testing.T, pub *fakePublisher, n int) []eventbus.WireEvent {
	t.Helper()
	checkFor(t, 5*time.Second, 5*time.Millisecond, func() error {
		if got := len(pub.snapshot()); got < n {
			return fmt.Errorf("%d events, want %d", got, n)
		}
		return nil
	})
	return pub.snapshot()
}

// The token ids kvmock computes for a chat body are the router's, so the
// block hashes it publishes are the ones the router looks up.
func TestMockTokenIDsMatchRouter(t *testing.T) {
	tm := startMock(t, nil, false)
	bodies := []string{
		`{"model":"kvmock","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Count to five, please!\nThen stop."}]}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"part one"},{"type":"text","text":"part two: ünïcödé, emoji 🙂"}]},{"role":"assistant","content":null},{"role":"user","content":"again\n\n  spaced"}]}`,
		`{"messages":[{"role":"user","content":"` + words("w", 300) + `"}]}`,
	}
	for i, b := range bodies {
		var in genRequest
		if err := json.Unmarshal([]byte(b), &in); err != nil {
			t.Fatal(err)
		}
		prompts, err := tm.m.promptTokens([]byte(b), &in, true)
		if err != nil || len(prompts) != 1 {
			t.Fatal(len(prompts), err)
		}
		got, want := prompts[0], routerTokens(t, []byte(b))
		if !slices.Equal(got, want) {
			t.Fatalf("body %d: kvmock tokens %v, router tokens %v", i, got, want)
		}
	}
	// Completions: a string prompt is encoded as is, token ids are taken as is.
	for _, p := range []string{`"Once upon a time"`, `[5, 400, 31999]`, `["one string"]`} {
		in := genRequest{Prompt: json.RawMessage(p)}
		prompts, err := tm.m.promptTokens([]byte(`{"prompt":`+p+`}`), &in, false)
		if err != nil || len(prompts) != 1 {
			t.Fatal(len(prompts), err)
		}
		got := prompts[0]
		var want []uint32
		var s string
		var ss []string
		switch {
		case json.Unmarshal([]byte(p), &s) == nil:
			want = tokenize.Builtin().Encode(s)
		case json.Unmarshal([]byte(p), &want) == nil:
		case json.Unmarshal([]byte(p), &ss) == nil:
			want = tokenize.Builtin().Encode(ss[0])
		}
		if !slices.Equal(got, want) {
			t.Fatalf("prompt %s: %v, want %v", p, got, want)
		}
	}

	// And the published content hashes are router.SequenceHashes of them.
	body := []byte(bodies[2])
	var bodyMap map[string]any
	_ = json.Unmarshal(body, &bodyMap)
	bodyMap["max_tokens"] = 1
	if status, out := post(t, tm.url+"/v1/chat/completions", bodyMap); status != 200 {
		t.Fatalf("HTTP %d: %s", status, out)
	}
	hashes := router.SequenceHashes(routerTokens(t, body), 16, "")
	checkFor(t, 5*time.Second, 5*time.Millisecond, func() error {
		got := storedContent(tm.pub.snapshot())
		if len(got) < len(hashes) || !slices.Equal(got[:len(hashes)], hashes) {
			return fmt.Errorf("stored %d content hashes, want the router's %d", len(got), len(hashes))
		}
		return nil
	})
}

func TestMockEvents(t *testing.T) {
	tm := startMock(t, nil, false)
	body := chatBody(words("ev", 100), 3, false)
	data, _ := json.Marshal(body)
	hashes := router.SequenceHashes(routerTokens(t, data), 16, "")
	post(t, tm.url+"/v1/chat/completions", body)
	evs := waitEvents(t, tm.pub, 2)
	checkContiguous(t, evs)
	if evs[0].Kind != eventbus.KindCleared || evs[0].EventID != tm.m.firstEventID {
		t.Fatalf("first event: kind %d id %d, want cleared (the cache starts empty) with id %d", evs[0].Kind, evs[0].EventID, tm.m.firstEventID)
	}
	// Ids are unique per run: a later run starts past this one's.
	if tm.m.firstEventID != uint64(tm.m.started.UnixMicro()) {
		t.Fatalf("first event id %d, start %v", tm.m.firstEventID, tm.m.started)
	}
	st := evs[1]
	if st.Kind != eventbus.KindStored || st.HasParent || len(st.Blocks) != len(hashes) {
		t.Fatalf("stored event: %+v, want %d root blocks", st, len(hashes))
	}
	for i, b := range st.Blocks {
		if b.Content != hashes[i] || b.Engine != hashes[i] {
			t.Fatalf("block %d: %+v, want content %d", i, b, hashes[i])
		}
	}
	// A different prompt sharing the prefix stores only its new blocks,
	// chained under the shared ones.
	body2 := chatBody(words("ev", 100)+" and more words to fill another block or two", 1, false)
	data2, _ := json.Marshal(body2)
	hashes2 := router.SequenceHashes(routerTokens(t, data2), 16, "")
	post(t, tm.url+"/v1/chat/completions", body2)
	evs = waitEvents(t, tm.pub, 3)
	checkContiguous(t, evs)
	last := evs[len(evs)-1]
	shared := 0
	for shared < len(hashes) && hashes[shared] == hashes2[shared] {
		shared++
	}
	if last.Kind != eventbus.KindStored || !last.HasParent || last.Parent != hashes2[shared-1] || last.Blocks[0].Content != hashes2[shared] {
		t.Fatalf("second stored event %+v: want a chain under block %d", last, shared-1)
	}
}

// With an opaque engine hash, events name blocks by it and carry our
// content hash alongside.
func TestMockEventsEngineHashSeed(t *testing.T) {
	tm := startMock(t, func(c *config) { c.EngineHashSeed = 99 }, false)
	body := chatBody(words("h", 60), 1, false)
	data, _ := json.Marshal(body)
	hashes := router.SequenceHashes(routerTokens(t, data), 16, "")
	post(t, tm.url+"/v1/chat/completions", body)
	evs := waitEvents(t, tm.pub, 2)
	for i, b := range evs[1].Blocks {
		if b.Content != hashes[i] || b.Engine == b.Content {
			t.Fatalf("block %d: %+v", i, b)
		}
	}
}

// A resync request republishes the whole cache: cleared, then every cached
// block, with fresh ids at or after the reply's NextEventID.
func TestMockResync(t *testing.T) {
	tm := startMock(t, nil, false)
	hooks := <-tm.hooks
	for i := range 3 {
		post(t, tm.url+"/v1/completions", map[string]any{"prompt": words(fmt.Sprintf("r%d-", i), 70), "max_tokens": 20})
	}
	before := waitEvents(t, tm.pub, 4)
	cached := storedContent(before)

	next := before[len(before)-1].EventID + 1
	rep := hooks.resync(eventbus.ResyncRequest{Worker: "mock-1", LastEventID: 2, Reason: "test gap"}, tm.pub)
	if !rep.Accepted || rep.Error != "" || rep.NextEventID != next {
		t.Fatalf("reply %+v, want accepted with next id %d", rep, next)
	}
	all := waitEvents(t, tm.pub, len(before)+2)
	checkContiguous(t, all)
	after := all[len(before):]
	if after[0].Kind != eventbus.KindCleared || after[0].EventID < rep.NextEventID {
		t.Fatalf("first resync event %+v", after[0])
	}
	got := storedContent(after[1:])
	st, _ := tm.m.drv.stats(context.Background())
	if len(got) != st.CachedBlocks {
		t.Fatalf("resync stored %d blocks, engine caches %d", len(got), st.CachedBlocks)
	}
	slices.Sort(got)
	slices.Sort(cached)
	if !slices.Equal(got, cached) { // nothing was evicted: the cache holds all it ever stored
		t.Fatalf("resync blocks differ from the stored ones")
	}
	for _, ev := range after[1:] {
		if ev.Kind != eventbus.KindStored || ev.HasParent {
			t.Fatalf("resync event %+v", ev)
		}
	}
	if rep := hooks.resync(eventbus.ResyncRequest{Worker: "mock-1", DPRank: 1}, tm.pub); rep.Accepted || rep.Error == "" {
		t.Fatalf("rank 1: %+v", rep)
	}
}

// The publisher refusing events (NATS down) delays them; it never reorders
// or drops them.
func TestMockPublishRetryInOrder(t *testing.T) {
	tm := startMock(t, nil, false, func(tm *testMock) { tm.pub.failFirst = 4 })
	for i := range 3 {
		post(t, tm.url+"/v1/completions", map[string]any{"prompt": words(fmt.Sprintf("q%d-", i), 40), "max_tokens": 2})
	}
	evs := waitEvents(t, tm.pub, 4)
	checkContiguous(t, evs)
	if evs[0].Kind != eventbus.KindCleared {
		t.Fatalf("first event kind %d", evs[0].Kind)
	}
	for i := range 3 {
		tokens := tokenize.Builtin().Encode(words(fmt.Sprintf("q%d-", i), 40))
		if got, want := evs[i+1].Blocks[0].Content, router.SequenceHashes(tokens, 16, "")[0]; got != want {
			t.Fatalf("event %d is not request %d's", i+1, i)
		}
	}
	if got := tm.m.q.publishErrors.Load(); got != 4 {
		t.Fatalf("%d publish errors counted, want 4", got)
	}
}

// A queue that overflows (NATS down for long) is replaced by the full
// state, in order.
func TestMockEventQueueOverflow(t *testing.T) {
	eng, err := engine.New("mock-1", engine.Config{BlockSize: 16, CapacityBlocks: 64})
	if err != nil {
		t.Fatal(err)
	}
	q := newEventQueue(3, testLog(t))
	d := newDriver(eng, q, testLog(t))
	now := time.Duration(0)
	for i := range 6 {
		tokens := tokenize.Builtin().Encode(words(fmt.Sprintf("o%d-", i), 100))
		if err := eng.Submit(now, engine.Request{ID: fmt.Sprint(i), Tokens: tokens, OutputTokens: 1}); err != nil {
			t.Fatal(err)
		}
		for {
			next, busy := eng.NextEventTime()
			if !busy {
				break
			}
			now = next
			eng.Advance(now)
		}
		d.drain() // the loop's call site: runs on "the loop" here
	}
	if q.overflows.Load() == 0 || q.snapshots.Load() == 0 {
		t.Fatalf("no overflow: %d queued", q.len())
	}
	q.mu.Lock()
	items := slices.Clone(q.items)
	q.mu.Unlock()
	var evs []eventbus.WireEvent
	for _, it := range items {
		evs = append(evs, it.ev)
	}
	i := slices.IndexFunc(evs, func(ev eventbus.WireEvent) bool { return ev.Kind == eventbus.KindCleared })
	if i < 0 {
		t.Fatalf("no cleared event in the queue")
	}
	// Replaying the queue from the cleared event gives the engine's state.
	ix := router.NewIndex(16)
	ix.AddWorker("mock-1")
	for _, ev := range evs[i:] {
		if err := ix.Apply("mock-1", ev.KVEvent()); err != nil {
			t.Fatal(err)
		}
	}
	content := func(bs []router.StoredBlock) []uint64 {
		out := make([]uint64, len(bs))
		for i, b := range bs {
			out[i] = b.ContentHash
		}
		slices.Sort(out)
		return out
	}
	got, want := content(ix.WorkerBlocks("mock-1")), content(eng.CachedBlocks())
	if len(want) == 0 || !slices.Equal(got, want) {
		t.Fatalf("replayed index holds %d blocks, engine %d, or they differ", len(got), len(want))
	}
}

func TestMockSplitLargeEvents(t *testing.T) {
	blocks := make([]router.StoredBlock, 2500)
	for i := range blocks {
		blocks[i] = router.StoredBlock{EngineHash: uint64(1000 + i), ContentHash: uint64(5000 + i)}
	}
	out := appendWire(nil, router.KVEvent{Kind: router.EventStored, BlockSize: 16, HasParent: true, Parent: 7, Blocks: blocks})
	if len(out) != 3 || len(out[0].Blocks) != maxEventBlocks || len(out[2].Blocks) != 2500-2*maxEventBlocks {
		t.Fatalf("split into %d events", len(out))
	}
	if !out[0].HasParent || out[0].Parent != 7 {
		t.Fatalf("first part lost its parent: %+v", out[0].Parent)
	}
	for k := 1; k < 3; k++ {
		if !out[k].HasParent || out[k].Parent != out[k-1].Blocks[len(out[k-1].Blocks)-1].Engine {
			t.Fatalf("part %d not chained", k)
		}
	}
	removed := make([]uint64, 2100)
	out = appendWire(nil, router.KVEvent{Kind: router.EventRemoved, BlockSize: 16, Removed: removed})
	if len(out) != 3 || len(out[2].Removed) != 2100-2*maxEventBlocks {
		t.Fatalf("removed split into %d events", len(out))
	}
	for _, ev := range out {
		ev.Worker, ev.EventID = "w", 1
		if err := eventbus.Validate(&ev, 0); err != nil {
			t.Fatal(err)
		}
	}
	snap := snapshotEvents(blocks, 16)
	if len(snap) != 4 || snap[0].Kind != eventbus.KindCleared || snap[1].HasParent {
		t.Fatalf("snapshot: %d events", len(snap))
	}
}

// Without --nats nothing is queued, and the worker still serves.
func TestMockNoBus(t *testing.T) {
	tm := startMock(t, nil, true)
	if status, body := post(t, tm.url+"/v1/completions", map[string]any{"prompt": words("nb", 40), "max_tokens": 2}); status != 200 {
		t.Fatalf("HTTP %d: %s", status, body)
	}
	checkFor(t, 2*time.Second, 5*time.Millisecond, func() error {
		if tm.m.drv.droppedNoBus.Load() == 0 {
			return fmt.Errorf("no events counted as dropped")
		}
		return nil
	})
}
