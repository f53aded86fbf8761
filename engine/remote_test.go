package engine

import (
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/router"
)

// storedContent returns the content hashes of the stored events in evs.
func storedContent(evs []Event) []uint64 {
	var out []uint64
	for _, ev := range evs {
		if ev.KV.Kind == router.EventStored {
			for _, b := range ev.KV.Blocks {
				out = append(out, b.ContentHash)
			}
		}
	}
	return out
}

// A RemotePrefill request is admitted holding blocks for its whole prompt,
// waits without compute until KVReceived, then computes only its last
// prompt token; its blocks enter the cache (stored events) when the KV
// arrives, and cached_tokens counts every prompt token not computed here.
func TestEngineRemotePrefill(t *testing.T) {
	const bs = 16
	prefix := seqTokens(1, 64)
	tests := []struct {
		name       string
		warm       []uint32 // run first, aggregated: the local prefix cache
		prompt     []uint32
		wantLocal  int // AwaitingKV's CachedTokens
		wantStored int // blocks stored when the KV arrives
	}{
		{"cold, 100 tokens", nil, seqTokens(1, 100), 0, 6},
		{"cold, whole blocks", nil, seqTokens(1, 96), 0, 5}, // the last block holds the recomputed token
		{"local prefix hit", prefix, cat(prefix, seqTokens(500, 36)), 64, 2},
		{"shorter than a block", nil, seqTokens(1, 5), 0, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := mustNew(t, "d", Config{BlockSize: bs, CapacityBlocks: 64})
			if tc.warm != nil {
				runOne(t, e, Request{ID: "warm", Tokens: tc.warm, OutputTokens: 1})
			}
			e.DrainEvents()
			st0 := e.Stats()
			now := st0.Now
			if err := e.Submit(now, Request{ID: "r", Tokens: tc.prompt, OutputTokens: 3, RemotePrefill: true}); err != nil {
				t.Fatal(err)
			}
			if _, busy := e.NextEventTime(); busy {
				t.Fatal("a step runs for a request awaiting its KV")
			}
			outs := e.TakeOutputs()
			if len(outs) != 1 || outs[0].Kind != AwaitingKV || outs[0].CachedTokens != tc.wantLocal || outs[0].PromptTokens != len(tc.prompt) {
				t.Fatalf("outputs %+v, want one awaiting-kv with local hit %d", outs, tc.wantLocal)
			}
			st := e.Stats()
			blocks := (len(tc.prompt) + bs - 1) / bs
			if st.AwaitingKV != 1 || st.Running != 0 || st.Waiting != 0 || st.UsedBlocks != blocks {
				t.Fatalf("stats while awaiting: %+v (want %d used blocks)", st, blocks)
			}
			if evs := e.DrainEvents(); len(storedContent(evs)) != 0 {
				t.Fatalf("blocks stored before the KV arrived: %+v", evs)
			}
			if e.KVReceived(now, "nope") {
				t.Fatal("KVReceived of an unknown request")
			}
			arrive := now + time.Second
			if !e.KVReceived(arrive, "r") || e.KVReceived(arrive, "r") {
				t.Fatal("KVReceived: want true once")
			}
			evs := e.DrainEvents()
			want := router.SequenceHashes(tc.prompt, bs, "")[tc.wantLocal/bs : tc.wantLocal/bs+tc.wantStored]
			if got := storedContent(evs); !slices.Equal(got, want) {
				t.Fatalf("stored on arrival %x, want %x", got, want)
			}
			for _, ev := range evs {
				if ev.At != arrive {
					t.Fatalf("event at %v, want %v", ev.At, arrive)
				}
			}
			outs = runIdle(t, e)
			first, ok := find(outs, "r", FirstToken)
			if !ok {
				t.Fatalf("no first token: %+v", outs)
			}
			// One token computed, the first sampled; as on Dynamo's decode
			// workers, a received prompt costs no prefill time: one
			// decode step.
			if want := arrive + msToDuration(e.Profile().DecodeMs(float64(blocks)/64), 1); first.At != want {
				t.Errorf("first token at %v, want %v", first.At, want)
			}
			fin, _ := find(outs, "r", Finished)
			if fin.CachedTokens != len(tc.prompt)-1 || fin.PromptTokens != len(tc.prompt) || fin.OutputTokens != 3 {
				t.Errorf("finished %+v, want cached %d", fin, len(tc.prompt)-1)
			}
			st = e.Stats()
			if got := st.PrefillTokens - st0.PrefillTokens; got != 1 {
				t.Errorf("prefill tokens computed %d, want 1", got)
			}
			if got := st.ReceivedTokens; got != uint64(len(tc.prompt)-tc.wantLocal) {
				t.Errorf("received tokens %d, want %d", got, len(tc.prompt)-tc.wantLocal)
			}
			if st.AwaitingKV != 0 || st.UsedBlocks != 0 {
				t.Errorf("after finishing: %+v", st)
			}
			// The received blocks are a prefix hit for the next request.
			o := runOne(t, e, Request{ID: "again", Tokens: tc.prompt, OutputTokens: 1})
			if wantHit := (len(tc.prompt) - 1) / bs * bs; o.CachedTokens != wantHit {
				t.Errorf("next request hit %d, want %d", o.CachedTokens, wantHit)
			}
		})
	}
}

// Cancelling a request that awaits its KV frees its blocks; requests
// awaiting KV count against MaxRunning and do not block the queue behind
// them from running.
func TestEngineRemotePrefillCancelAndLimits(t *testing.T) {
	e := mustNew(t, "d", Config{BlockSize: 4, CapacityBlocks: 32, MaxRunning: 2})
	if err := e.Submit(0, Request{ID: "r1", Tokens: seqTokens(1, 10), RemotePrefill: true}); err != nil {
		t.Fatal(err)
	}
	if err := e.Submit(0, Request{ID: "r2", Tokens: seqTokens(50, 10), RemotePrefill: true}); err != nil {
		t.Fatal(err)
	}
	if err := e.Submit(0, Request{ID: "a", Tokens: seqTokens(100, 10)}); err != nil {
		t.Fatal(err)
	}
	e.NextEventTime()
	if st := e.Stats(); st.AwaitingKV != 2 || st.Waiting != 1 || st.Running != 0 {
		t.Fatalf("stats %+v: want 2 awaiting (max running 2), 1 waiting", st)
	}
	if len(e.TakeOutputs()) != 2 {
		t.Fatal("want two awaiting-kv outputs")
	}
	if !e.Cancel(0, "r1") || e.KVReceived(0, "r1") {
		t.Fatal("cancel of an awaiting request")
	}
	st := e.Stats()
	if st.AwaitingKV != 1 || st.UsedBlocks != 3 || st.Cancelled != 1 {
		t.Fatalf("after cancel: %+v", st)
	}
	// r1's slot went to a.
	outs := runIdle(t, e)
	if _, ok := find(outs, "a", Finished); !ok {
		t.Fatalf("a did not run: %+v", outs)
	}
	if !e.KVReceived(e.Stats().Now, "r2") {
		t.Fatal("r2 not awaiting")
	}
	outs = runIdle(t, e)
	if o, ok := find(outs, "r2", Finished); !ok || o.CachedTokens != 9 {
		t.Fatalf("r2: %+v", outs)
	}
	if st := e.Stats(); st.UsedBlocks != 0 || st.Finished != 2 {
		t.Fatalf("end: %+v", st)
	}
}
