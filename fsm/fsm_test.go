package fsm

import (
	"encoding/json"
	"errors"
	"math"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/router"
)

func worker(id string, ranks uint32) RegisterWorker {
	return RegisterWorker{ID: id, DPRanks: ranks, Address: id + ":8000", Model: "m", TotalBlocks: 1000, MaxBatchedTokens: 4096}
}

func TestFSMNewRejectsBadBase(t *testing.T) {
	cfg := router.DefaultConfig()
	cfg.BlockSize = 0
	if _, err := NewFSM(cfg); !errors.Is(err, router.ErrInvalidConfig) {
		t.Fatalf("NewFSM with block size 0: %v", err)
	}
}

func TestFSMRegisterWorker(t *testing.T) {
	cases := []struct {
		name    string
		cmd     RegisterWorker
		wantErr error
		keys    []router.WorkerID
	}{
		{"one rank", worker("w1", 1), nil, []router.WorkerID{"w1"}},
		{"three ranks", worker("w1", 3), nil, []router.WorkerID{"w1", "w1#1", "w1#2"}},
		{"explicit block size", func() RegisterWorker { c := worker("w1", 1); c.BlockSize = 16; return c }(), nil, []router.WorkerID{"w1"}},
		{"with lease", func() RegisterWorker { c := worker("w1", 1); c.LeaseUntil = 5; return c }(), nil, []router.WorkerID{"w1"}},
		{"empty id", worker("", 1), ErrInvalidCommand, nil},
		{"hash in id", worker("w#1", 1), ErrInvalidCommand, nil},
		{"zero ranks", worker("w1", 0), ErrInvalidCommand, nil},
		{"too many ranks", worker("w1", MaxDPRanks+1), ErrInvalidCommand, nil},
		{"block size mismatch", func() RegisterWorker { c := worker("w1", 1); c.BlockSize = 32; return c }(), ErrBlockSizeMismatch, nil},
		{"negative lease", func() RegisterWorker { c := worker("w1", 1); c.LeaseUntil = -1; return c }(), ErrInvalidCommand, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			before := h.f.Digest()
			r := h.apply(tc.cmd)
			if !errors.Is(r.Err, tc.wantErr) || (tc.wantErr == nil) != (r.Err == nil) {
				t.Fatalf("err %v, want %v", r.Err, tc.wantErr)
			}
			if tc.wantErr != nil {
				if h.f.Digest() != before || len(h.f.Workers()) != 0 {
					t.Fatal("refused registration changed the state")
				}
				if h.f.Stats().DomainErrors != 1 {
					t.Fatalf("stats %+v", h.f.Stats())
				}
				return
			}
			if got := h.f.Index().Workers(); !slices.Equal(got, tc.keys) {
				t.Fatalf("index workers %v, want %v", got, tc.keys)
			}
			if got := h.f.Predicted().Workers(); !slices.Equal(got, tc.keys) {
				t.Fatalf("predicted workers %v, want %v", got, tc.keys)
			}
			rec, ok := h.f.Worker(tc.cmd.ID)
			want := tc.cmd.record()
			want.BlockSize = 16
			if !ok || rec != want {
				t.Fatalf("record %+v, want %+v", rec, want)
			}
			if got := tc.cmd.record().Keys(); !slices.Equal(got, tc.keys) {
				t.Fatalf("Keys %v", got)
			}
			infos := h.f.WorkerInfos("m")
			if len(infos) != len(tc.keys) || infos[0].TotalBlocks != 1000 || infos[0].MaxBatchedTokens != 4096 {
				t.Fatalf("infos %+v", infos)
			}
			if len(h.f.WorkerInfos("other")) != 0 {
				t.Fatal("infos of another model")
			}
		})
	}
}

func TestFSMReregisterUpdates(t *testing.T) {
	h := newHarness(t)
	var changes []Change
	h.f.OnChange(func(c Change) { changes = append(changes, c) })
	h.ok(worker("w1", 3))
	h.events(stored("w1", 0, 1, 10), stored("w1", 2, 1, 20, 21))
	h.ok(Predictions{Worker: "w1#2", Hashes: []uint64{7}, Until: 100})

	// A lease renewal changes the record but not the candidate set: no change event.
	renew := worker("w1", 3)
	renew.LeaseUntil = 1000
	changes = nil
	h.ok(renew)
	if len(changes) != 0 {
		t.Fatalf("lease renewal notified %+v", changes)
	}
	if rec, _ := h.f.Worker("w1"); rec.LeaseUntil != 1000 {
		t.Fatalf("lease %d", rec.LeaseUntil)
	}
	// Fewer ranks: rank 2 goes with its blocks, cursor and predictions.
	shrink := worker("w1", 2)
	shrink.Model = "m2"
	h.ok(shrink)
	if len(changes) != 1 || changes[0].Kind != ChangeWorkers || changes[0].Reason != "updated" || changes[0].Model != "m2" {
		t.Fatalf("changes %+v", changes)
	}
	if got := h.f.Index().Workers(); !slices.Equal(got, []router.WorkerID{"w1", "w1#1"}) {
		t.Fatalf("index workers %v", got)
	}
	if h.f.Index().Holders(20) != 0 || h.f.Index().Held("w1") != 1 || h.f.PredictionCount() != 0 {
		t.Fatal("rank 2's state survived")
	}
	if _, ok := h.f.Cursors()[RankKey{"w1", 2}]; ok {
		t.Fatal("rank 2's cursor survived")
	}
	// More ranks again: rank 2 comes back empty, its events start afresh.
	h.ok(worker("w1", 3))
	if r := h.events(stored("w1", 2, 1, 20)); r.Applied != 1 || r.Duplicates != 0 {
		t.Fatalf("fresh rank: %+v", r)
	}
	if got := h.f.Models(); !slices.Equal(got, []string{"m"}) {
		t.Fatalf("models %v", got)
	}
}

func TestFSMDeregisterWorker(t *testing.T) {
	h := newHarness(t)
	h.ok(worker("w1", 2))
	h.ok(worker("w2", 1))
	h.events(stored("w1", 0, 1, 1, 2), stored("w1", 1, 1, 3), stored("w2", 0, 1, 1))
	h.ok(Predictions{Worker: "w1#1", Hashes: []uint64{9}, Until: 50})
	h.ok(DeregisterWorker{ID: "w1"})
	if got := h.f.Index().Workers(); !slices.Equal(got, []router.WorkerID{"w2"}) {
		t.Fatalf("index workers %v", got)
	}
	if h.f.Index().Len() != 1 || h.f.Predicted().Len() != 0 || h.f.PredictionCount() != 0 || len(h.f.Cursors()) != 1 {
		t.Fatal("w1's blocks, predictions or cursors survived")
	}
	before := h.f.Digest()
	if r := h.apply(DeregisterWorker{ID: "w1"}); !errors.Is(r.Err, ErrUnknownWorker) {
		t.Fatalf("second deregister: %v", r.Err)
	}
	if h.f.Digest() != before {
		t.Fatal("refused deregister changed the state")
	}
	// Re-registration starts from scratch: event ids may restart at 1.
	h.ok(worker("w1", 1))
	if r := h.events(stored("w1", 0, 1, 5)); r.Applied != 1 {
		t.Fatalf("after re-register: %+v", r)
	}
}

// TestFSMKVEvents drives event sequences through the FSM and checks the
// results, cursors, staleness and index contents.
func TestFSMKVEvents(t *testing.T) {
	type want struct {
		applied, dups, gaps, rejected, unknown int
	}
	cases := []struct {
		name    string
		batches [][]KVBatchEvent
		want    want // of the last batch
		cursors map[RankKey]uint64
		stale   map[RankKey]StaleInfo
		held    map[router.WorkerID]int
		unknown []router.WorkerID
		reject  map[string]uint64
	}{
		{
			name:    "in order",
			batches: [][]KVBatchEvent{{stored("w1", 0, 1, 1), stored("w1", 0, 2, 2), storedAfter("w1", 0, 3, 2, 3)}},
			want:    want{applied: 3},
			cursors: map[RankKey]uint64{{"w1", 0}: 3, {"w1", 1}: 0},
			held:    map[router.WorkerID]int{"w1": 3},
		},
		{
			name:    "duplicates skipped",
			batches: [][]KVBatchEvent{{stored("w1", 0, 1, 1), stored("w1", 0, 2, 2)}, {stored("w1", 0, 2, 2), stored("w1", 0, 1, 1), removed("w1", 0, 1, 1), stored("w1", 0, 3, 4)}},
			want:    want{applied: 1, dups: 3},
			cursors: map[RankKey]uint64{{"w1", 0}: 3, {"w1", 1}: 0},
			held:    map[router.WorkerID]int{"w1": 3},
		},
		{
			name:    "gap marks stale but applies",
			batches: [][]KVBatchEvent{{stored("w1", 0, 1, 1), stored("w1", 0, 5, 2), stored("w1", 0, 9, 3)}},
			want:    want{applied: 3, gaps: 2},
			cursors: map[RankKey]uint64{{"w1", 0}: 9, {"w1", 1}: 0},
			stale:   map[RankKey]StaleInfo{{"w1", 0}: {Reason: "gap from 1 to 5", EventID: 5}},
			held:    map[router.WorkerID]int{"w1": 3},
		},
		{
			name:    "first event after registration is a gap unless 1",
			batches: [][]KVBatchEvent{{stored("w1", 1, 3, 1)}},
			want:    want{applied: 1, gaps: 1},
			cursors: map[RankKey]uint64{{"w1", 0}: 0, {"w1", 1}: 3},
			stale:   map[RankKey]StaleInfo{{"w1", 1}: {Reason: "gap from 0 to 3", EventID: 3}},
			held:    map[router.WorkerID]int{"w1#1": 1},
		},
		{
			name:    "ranks have separate cursors",
			batches: [][]KVBatchEvent{{stored("w1", 0, 1, 1), stored("w1", 1, 1, 1), stored("w1", 1, 2, 2)}},
			want:    want{applied: 3},
			cursors: map[RankKey]uint64{{"w1", 0}: 1, {"w1", 1}: 2},
			held:    map[router.WorkerID]int{"w1": 1, "w1#1": 2},
		},
		{
			name:    "unknown worker and rank",
			batches: [][]KVBatchEvent{{stored("ghost", 0, 1, 1), stored("w1", 2, 1, 1), stored("ghost", 0, 2, 2), stored("w1", 0, 1, 1)}},
			want:    want{applied: 1, rejected: 3, unknown: 3},
			cursors: map[RankKey]uint64{{"w1", 0}: 1, {"w1", 1}: 0},
			held:    map[router.WorkerID]int{"w1": 1},
			unknown: []router.WorkerID{"ghost", "w1#2"},
			reject:  map[string]uint64{RejectUnknownWorker: 3},
		},
		{
			name: "block size mismatch rejected",
			batches: [][]KVBatchEvent{{func() KVBatchEvent { e := stored("w1", 0, 1, 1); e.Event.BlockSize = 32; return e }(),
				stored("w1", 0, 2, 2)}},
			want:    want{applied: 1, rejected: 1},
			cursors: map[RankKey]uint64{{"w1", 0}: 2, {"w1", 1}: 0},
			held:    map[router.WorkerID]int{"w1": 1},
			reject:  map[string]uint64{RejectBlockSize: 1},
		},
		{
			name:    "missing parent marks stale",
			batches: [][]KVBatchEvent{{stored("w1", 0, 1, 1), storedAfter("w1", 0, 2, 77, 2, 3), storedAfter("w1", 0, 3, 1, 4)}},
			want:    want{applied: 2, rejected: 1},
			cursors: map[RankKey]uint64{{"w1", 0}: 3, {"w1", 1}: 0},
			stale:   map[RankKey]StaleInfo{{"w1", 0}: {Reason: "missing parent", EventID: 2}},
			held:    map[router.WorkerID]int{"w1": 2},
			reject:  map[string]uint64{RejectMissingParent: 1},
		},
		{
			name:    "unsequenced events are never deduplicated",
			batches: [][]KVBatchEvent{{stored("w1", 0, 0, 1), removed("w1", 0, 0, 1), stored("w1", 0, 0, 1)}},
			want:    want{applied: 3},
			cursors: map[RankKey]uint64{{"w1", 0}: 0, {"w1", 1}: 0},
			held:    map[router.WorkerID]int{"w1": 1},
		},
		{
			name: "cleared",
			batches: [][]KVBatchEvent{{stored("w1", 0, 1, 1, 2, 3),
				{Worker: "w1", EventID: 2, Event: router.KVEvent{Kind: router.EventCleared}}}},
			want:    want{applied: 2},
			cursors: map[RankKey]uint64{{"w1", 0}: 2, {"w1", 1}: 0},
			held:    map[router.WorkerID]int{"w1": 0},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			h.ok(worker("w1", 2))
			var r *ApplyResult
			for _, b := range tc.batches {
				r = h.events(b...)
				if r.Err != nil {
					t.Fatal(r.Err)
				}
			}
			got := want{r.Applied, r.Duplicates, r.Gaps, r.Rejected, r.Unknown}
			if got != tc.want {
				t.Errorf("result %+v, want %+v", got, tc.want)
			}
			if c := h.f.Cursors(); !reflect.DeepEqual(c, tc.cursors) {
				t.Errorf("cursors %v, want %v", c, tc.cursors)
			}
			wantStale := tc.stale
			if wantStale == nil {
				wantStale = map[RankKey]StaleInfo{}
			}
			if s := h.f.Stale(); !reflect.DeepEqual(s, wantStale) {
				t.Errorf("stale %v, want %v", s, wantStale)
			}
			for w, n := range tc.held {
				if got := h.f.Index().Held(w); got != n {
					t.Errorf("%s holds %d, want %d", w, got, n)
				}
			}
			if !slices.Equal(r.UnknownWorkers, tc.unknown) {
				t.Errorf("unknown workers %v, want %v", r.UnknownWorkers, tc.unknown)
			}
			st := h.f.Stats()
			for reason, n := range st.Rejected {
				if n != tc.reject[reason] {
					t.Errorf("rejected[%s] = %d, want %d", reason, n, tc.reject[reason])
				}
			}
		})
	}
}

func TestFSMStaleNotifiesOnce(t *testing.T) {
	h := newHarness(t)
	var changes []Change
	h.f.OnChange(func(c Change) { changes = append(changes, c) })
	h.ok(worker("w1", 1))
	changes = nil
	r := h.events(stored("w1", 0, 3, 1), stored("w1", 0, 9, 2), storedAfter("w1", 0, 10, 55, 3))
	if !slices.Equal(r.Stale, []router.WorkerID{"w1"}) || len(changes) != 1 || changes[0].Kind != ChangeStale || changes[0].Reason != "gap from 0 to 3" {
		t.Fatalf("stale %v changes %+v", r.Stale, changes)
	}
	if h.f.Stale()[RankKey{"w1", 0}].Reason != "gap from 0 to 3" {
		t.Fatal("first reason not kept")
	}
}

func TestFSMResyncWorker(t *testing.T) {
	h := newHarness(t)
	h.ok(worker("w1", 2))
	h.events(stored("w1", 1, 1, 1, 2), stored("w1", 1, 4, 3), stored("w1", 0, 1, 1))
	if len(h.f.Stale()) != 1 {
		t.Fatal("gap not recorded")
	}
	var changes []Change
	h.f.OnChange(func(c Change) { changes = append(changes, c) })
	h.ok(ResyncWorker{Worker: "w1", DPRank: 1})
	if len(h.f.Stale()) != 0 || h.f.Index().Held("w1#1") != 0 || h.f.Cursors()[RankKey{"w1", 1}] != 0 {
		t.Fatal("resync left blocks, cursor or stale flag")
	}
	if h.f.Index().Held("w1") != 1 {
		t.Fatal("resync touched another rank")
	}
	if len(changes) != 1 || changes[0].Kind != ChangeResync || changes[0].DPRank != 1 {
		t.Fatalf("changes %+v", changes)
	}
	// The republished stream may start anywhere: its first id is the baseline.
	r := h.events(stored("w1", 1, 50, 1), stored("w1", 1, 51, 2), stored("w1", 1, 50, 1))
	if r.Applied != 2 || r.Gaps != 0 || r.Duplicates != 1 || len(h.f.Stale()) != 0 {
		t.Fatalf("after resync: %+v stale %v", r, h.f.Stale())
	}
	for _, bad := range []ResyncWorker{{Worker: "w1", DPRank: 2}, {Worker: "ghost"}} {
		if r := h.apply(bad); !errors.Is(r.Err, ErrUnknownWorker) {
			t.Fatalf("resync %+v: %v", bad, r.Err)
		}
	}
}

func TestFSMSetModelConfig(t *testing.T) {
	base := router.DefaultConfig()
	cases := []struct {
		name    string
		updates []SetModelConfig
		wantErr error
		check   func(t *testing.T, c router.Config)
	}{
		{
			name:    "partial thresholds",
			updates: []SetModelConfig{{Model: "m", Thresholds: router.Thresholds{ActiveDecodeBlocks: ptr(0.9)}}},
			check: func(t *testing.T, c router.Config) {
				if *c.Thresholds.ActiveDecodeBlocks != 0.9 || c.Thresholds.ActivePrefillTokens != nil || c.OverlapCredit != 1 {
					t.Fatalf("%+v", c)
				}
			},
		},
		{
			name: "later updates keep earlier fields",
			updates: []SetModelConfig{
				{Model: "m", Thresholds: router.Thresholds{ActiveDecodeBlocks: ptr(0.9)}, Temperature: ptr(0.5)},
				{Model: "m", Thresholds: router.Thresholds{ActivePrefillTokens: ptr(int64(5000))}, QueuePolicy: ptr(router.QueueWSPT)},
			},
			check: func(t *testing.T, c router.Config) {
				if *c.Thresholds.ActiveDecodeBlocks != 0.9 || *c.Thresholds.ActivePrefillTokens != 5000 ||
					c.Temperature != 0.5 || c.QueuePolicy != router.QueueWSPT {
					t.Fatalf("%+v", c)
				}
			},
		},
		{
			name: "reset returns to base, then sets",
			updates: []SetModelConfig{
				{Model: "m", Temperature: ptr(0.5), OverlapCredit: ptr(0.2), TrackPrefillTokens: ptr(false), QueueThreshold: ptr(1.5)},
				{Model: "m", Reset: FieldTemperature | FieldTrackPrefillTokens | FieldOverlapCredit | FieldQueueThreshold, OverlapCredit: ptr(0.7)},
			},
			check: func(t *testing.T, c router.Config) {
				if c.Temperature != base.Temperature || !c.TrackPrefillTokens || c.OverlapCredit != 0.7 || c.QueueThreshold != nil {
					t.Fatalf("%+v", c)
				}
			},
		},
		{
			name:    "all knobs",
			updates: []SetModelConfig{func() SetModelConfig { c := goldenCommands()[3].cmd.(SetModelConfig); c.Model = "m"; return c }()},
			check: func(t *testing.T, c router.Config) {
				if c.OverlapCredit != 0.5 || c.PrefillLoadScale != 1.5 || c.Temperature != 0.25 || c.TrackPrefillTokens ||
					*c.QueueThreshold != 2 || *c.Thresholds.ActivePrefillTokensFrac != 1.5 {
					t.Fatalf("%+v", c)
				}
			},
		},
		{name: "decode threshold above 1", updates: []SetModelConfig{{Model: "m", Thresholds: router.Thresholds{ActiveDecodeBlocks: ptr(1.5)}}}, wantErr: ErrInvalidConfig},
		{name: "negative decode threshold", updates: []SetModelConfig{{Model: "m", Thresholds: router.Thresholds{ActiveDecodeBlocks: ptr(-0.1)}}}, wantErr: ErrInvalidConfig},
		{name: "negative prefill tokens", updates: []SetModelConfig{{Model: "m", Thresholds: router.Thresholds{ActivePrefillTokens: ptr(int64(-1))}}}, wantErr: ErrInvalidConfig},
		{name: "NaN prefill fraction", updates: []SetModelConfig{{Model: "m", Thresholds: router.Thresholds{ActivePrefillTokensFrac: ptr(math.NaN())}}}, wantErr: ErrInvalidConfig},
		{name: "credit above 1", updates: []SetModelConfig{{Model: "m", OverlapCredit: ptr(2.0)}}, wantErr: ErrInvalidConfig},
		{name: "infinite temperature", updates: []SetModelConfig{{Model: "m", Temperature: ptr(math.Inf(1))}}, wantErr: ErrInvalidConfig},
		{name: "bad queue policy", updates: []SetModelConfig{{Model: "m", QueuePolicy: ptr(router.QueuePolicy("sjf"))}}, wantErr: ErrInvalidConfig},
		{name: "empty model", updates: []SetModelConfig{{Temperature: ptr(0.1)}}, wantErr: ErrInvalidCommand},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			var changes []Change
			h.f.OnChange(func(c Change) { changes = append(changes, c) })
			before := h.f.Digest()
			var r *ApplyResult
			for _, u := range tc.updates {
				if _, err := h.f.CheckModelConfig(u); !errors.Is(err, tc.wantErr) {
					t.Fatalf("CheckModelConfig: %v, want %v", err, tc.wantErr)
				}
				r = h.apply(u)
			}
			if tc.wantErr != nil {
				if !errors.Is(r.Err, tc.wantErr) {
					t.Fatalf("err %v, want %v", r.Err, tc.wantErr)
				}
				if h.f.Digest() != before || len(h.f.Models()) != 0 || len(changes) != 0 {
					t.Fatal("refused update changed the state")
				}
				return
			}
			if r.Err != nil {
				t.Fatal(r.Err)
			}
			if len(changes) != len(tc.updates) || changes[0].Kind != ChangeModelConfig || changes[0].Model != "m" {
				t.Fatalf("changes %+v", changes)
			}
			c := h.f.ModelConfig("m")
			if err := c.Validate(); err != nil {
				t.Fatal(err)
			}
			tc.check(t, c)
			if !reflect.DeepEqual(h.f.ModelConfig("other"), base) {
				t.Fatal("another model's config is not the base")
			}
			if got := h.f.Models(); !slices.Equal(got, []string{"m"}) {
				t.Fatalf("models %v", got)
			}
			// Returned configs are copies: mutating one changes nothing.
			if p := c.Thresholds.ActiveDecodeBlocks; p != nil {
				*p = 7
				if *h.f.ModelConfig("m").Thresholds.ActiveDecodeBlocks == 7 {
					t.Fatal("ModelConfig aliases the FSM's state")
				}
			}
			if o, ok := h.f.ModelOverrides("m"); !ok || o.Model != "m" || o.Reset != 0 {
				t.Fatalf("overrides %+v %v", o, ok)
			}
		})
	}
}

// TestFSMUnknownAndUndecodable: entries skipped without halting (unknown
// types without the ignore bit halt: TestFSMHaltsOnUnknownType).
func TestFSMUnknownAndUndecodable(t *testing.T) {
	good := mustEncode(t, Tick{Now: 5})
	cases := []struct {
		name    string
		data    []byte
		ignored bool
		wantErr error
		stat    func(Stats) uint64
	}{
		{"unknown type with ignore bit", []byte{50 | IgnoreIfUnknown, 1, 9, 9}, true, nil, func(s Stats) uint64 { return s.Ignored }},
		{"unknown version with ignore bit", []byte{byte(CmdTick) | IgnoreIfUnknown, 2, 9}, true, nil, func(s Stats) uint64 { return s.Ignored }},
		{"empty", nil, false, ErrUndecodable, func(s Stats) uint64 { return s.Undecodable }},
		{"truncated", good[:2], false, ErrUndecodable, func(s Stats) uint64 { return s.Undecodable }},
		{"trailing bytes", append(append([]byte{}, good...), 1), false, ErrUndecodable, func(s Stats) uint64 { return s.Undecodable }},
		{"bad batch", []byte{byte(CmdKVEventBatch), 1, 1, 1, 'w', 1, 0, 0, 0, 9, 0, 0}, false, ErrUndecodable, func(s Stats) uint64 { return s.Undecodable }},
		{"known type with ignore bit applies", append([]byte{good[0] | IgnoreIfUnknown}, good[1:]...), false, nil, func(s Stats) uint64 { return s.Commands }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			h.ok(worker("w1", 1))
			h.events(stored("w1", 0, 1, 1))
			before := h.f.Digest()
			r := h.raw(tc.data)
			if r.Ignored != tc.ignored || !errors.Is(r.Err, tc.wantErr) || (tc.wantErr == nil) != (r.Err == nil) {
				t.Fatalf("result %+v, want ignored=%v err=%v", r, tc.ignored, tc.wantErr)
			}
			if tc.stat(h.f.Stats()) == 0 {
				t.Fatalf("not counted: %+v", h.f.Stats())
			}
			if tc.name != "known type with ignore bit applies" && h.f.Digest() != before {
				t.Fatal("state changed")
			}
			if h.f.AppliedIndex() != h.idx {
				t.Fatal("applied index did not advance past the entry")
			}
		})
	}
}

func TestFSMNonCommandLogs(t *testing.T) {
	f := newFSM(t)
	for i, typ := range []raft.LogType{raft.LogConfiguration, raft.LogNoop, raft.LogBarrier} {
		if r := f.Apply(&raft.Log{Index: uint64(i + 1), Type: typ, Data: []byte{1, 2, 3}}); r != nil {
			t.Fatalf("%v: response %v", typ, r)
		}
	}
	if f.AppliedIndex() != 3 || f.Stats().Commands != 0 {
		t.Fatalf("applied %d stats %+v", f.AppliedIndex(), f.Stats())
	}
	out := f.ApplyBatch([]*raft.Log{
		{Index: 4, Type: raft.LogConfiguration},
		{Index: 5, Type: raft.LogCommand, Data: mustEncode(t, Tick{Now: 1})},
	})
	if out[0] != nil || out[1].(*ApplyResult).Err != nil {
		t.Fatalf("batch responses %v", out)
	}
}

// TestFSMIdempotence: an entry applied twice, a whole log replayed, and
// events proposed again in a new entry all leave the state as it was.
func TestFSMIdempotence(t *testing.T) {
	entries := newGen(7).stream(t, 400)
	logs := logsOf(entries, 1)

	a := newFSM(t)
	a.ApplyBatch(logs)
	want := a.Digest()

	t.Run("same entry twice", func(t *testing.T) {
		for _, l := range logs[len(logs)-50:] {
			r := a.Apply(l)
			if res, ok := r.(*ApplyResult); !ok || !res.Replayed {
				t.Fatalf("replayed entry %d: %+v", l.Index, r)
			}
		}
		if a.Digest() != want || a.AppliedIndex() != uint64(len(logs)) {
			t.Fatal("replayed entries changed the state")
		}
	})
	t.Run("whole log replayed", func(t *testing.T) {
		a.ApplyBatch(logs)
		if a.Digest() != want {
			t.Fatal("replay changed the state")
		}
		b := newFSM(t)
		for _, l := range logs {
			b.Apply(l)
		}
		if b.Digest() != want {
			t.Fatal("a fresh FSM replaying the log disagrees")
		}
	})
	t.Run("events proposed again", func(t *testing.T) {
		h := newHarness(t)
		h.ok(worker("w1", 1))
		batch := []KVBatchEvent{stored("w1", 0, 1, 1, 2), storedAfter("w1", 0, 2, 2, 3), removed("w1", 0, 3, 1)}
		h.events(batch...)
		d := h.f.Digest()
		r := h.events(batch...) // a JetStream redelivery after a leader change
		if r.Applied != 0 || r.Duplicates != 3 || h.f.Digest() != d {
			t.Fatalf("redelivery %+v", r)
		}
	})
}

// TestFSMDigestIgnoresAppliedIndex: the same commands at other log indexes
// (one replica saw extra no-op entries) give the same digest.
func TestFSMDigestIgnoresAppliedIndex(t *testing.T) {
	entries := newGen(3).stream(t, 200)
	a, b := newFSM(t), newFSM(t)
	a.ApplyBatch(logsOf(entries, 1))
	idx := uint64(10)
	for _, e := range entries {
		b.Apply(&raft.Log{Index: idx, Type: raft.LogNoop})
		b.Apply(&raft.Log{Index: idx + 1, Type: raft.LogCommand, Data: e})
		idx += 7
	}
	if a.AppliedIndex() == b.AppliedIndex() || a.Digest() != b.Digest() {
		t.Fatalf("applied %d/%d digests %s/%s", a.AppliedIndex(), b.AppliedIndex(), a.Digest(), b.Digest())
	}
	if a.Digest() == newFSM(t).Digest() {
		t.Fatal("digest does not see the state")
	}
}

func TestFSMTickExpiry(t *testing.T) {
	h := newHarness(t)
	leased := worker("leased", 2)
	leased.LeaseUntil = 1000
	h.ok(leased)
	h.ok(worker("forever", 1))
	h.events(stored("leased", 1, 1, 1), stored("forever", 0, 1, 1))
	h.ok(Predictions{Worker: "forever", Hashes: []uint64{10, 11}, Until: 500})
	h.ok(Predictions{Worker: "leased#1", Hashes: []uint64{10}, Until: 2000})
	h.ok(Predictions{Worker: "forever", Hashes: []uint64{11}, Until: 800}) // refresh: 11 lives to 800
	h.ok(Predictions{Worker: "forever", Hashes: []uint64{10}, Until: 300}) // never shortens

	var changes []Change
	h.f.OnChange(func(c Change) { changes = append(changes, c) })
	steps := []struct {
		now                   int64
		expired               int
		workers               int
		holders10, holders11  int
		clock                 int64
		wantLeaseExpiryChange bool
	}{
		{now: 499, expired: 0, workers: 2, holders10: 2, holders11: 1, clock: 499},
		{now: 500, expired: 1, workers: 2, holders10: 1, holders11: 1, clock: 500}, // Until <= Now expires
		{now: 100, expired: 0, workers: 2, holders10: 1, holders11: 1, clock: 500}, // clock never runs back
		{now: 1000, expired: 2, workers: 1, holders10: 0, holders11: 0, clock: 1000, // lease and 11 at 800
			wantLeaseExpiryChange: true},
	}
	for _, s := range steps {
		changes = nil
		r := h.ok(Tick{Now: s.now})
		if r.Expired != s.expired || len(h.f.Workers()) != s.workers || h.f.LastTick() != s.clock {
			t.Fatalf("tick %d: expired %d workers %d clock %d", s.now, r.Expired, len(h.f.Workers()), h.f.LastTick())
		}
		if got := h.f.Predicted().Holders(10); got != s.holders10 {
			t.Fatalf("tick %d: hash 10 predicted on %d workers, want %d", s.now, got, s.holders10)
		}
		if got := h.f.Predicted().Holders(11); got != s.holders11 {
			t.Fatalf("tick %d: hash 11 predicted on %d workers, want %d", s.now, got, s.holders11)
		}
		if s.wantLeaseExpiryChange != (len(changes) == 1 && changes[0].Reason == "lease expired" && changes[0].Removed) {
			t.Fatalf("tick %d: changes %+v", s.now, changes)
		}
	}
	if h.f.Index().HasWorker("leased#1") || h.f.Index().Len() != 1 {
		t.Fatal("expired worker's blocks survived")
	}
	// Predictions already expired by the FSM's clock are not stored.
	if r := h.ok(Predictions{Worker: "forever", Hashes: []uint64{12}, Until: 1000}); r.Applied != 0 || h.f.PredictionCount() != 0 {
		t.Fatalf("expired prediction stored: %+v", r)
	}
	for _, bad := range []Predictions{{Worker: "leased", Hashes: []uint64{1}, Until: 5000}, {Worker: "forever", Hashes: []uint64{1}}} {
		if r := h.apply(bad); r.Err == nil {
			t.Fatalf("predictions %+v accepted", bad)
		}
	}
	st := h.f.Stats()
	if st.ExpiredLeases != 1 || st.ExpiredPredictions != 2 {
		t.Fatalf("stats %+v", st)
	}
}

// TestFSMPredictionHeapBounded: refreshing the same predictions forever
// must not grow the expiry heap without bound.
func TestFSMPredictionHeapBounded(t *testing.T) {
	h := newHarness(t)
	h.ok(worker("w", 1))
	h.ok(Predictions{Worker: "w", Hashes: []uint64{1, 2, 3}, Until: 100})
	h.ok(Tick{Now: 99}) // the first tick sets the clock and expires nothing (clock.go)
	for i := range 5000 {
		h.ok(Predictions{Worker: "w", Hashes: []uint64{1, 2, 3}, Until: int64(100 + i)})
	}
	if n := len(h.f.st.heap); n > 2*3+1024+3 {
		t.Fatalf("heap has %d entries for 3 predictions", n)
	}
	h.ok(Tick{Now: 100 + 4999})
	if h.f.PredictionCount() != 0 || h.f.Predicted().Len() != 0 {
		t.Fatal("predictions survived their expiry")
	}
}

func TestFSMNodes(t *testing.T) {
	h := newHarness(t)
	var changes []Change
	h.f.OnChange(func(c Change) { changes = append(changes, c) })
	h.ok(RegisterNode{NodeID: "r2", RaftAddr: "b:7000", HTTPAddr: "b:8000"})
	h.ok(RegisterNode{NodeID: "r1", RaftAddr: "a:7000", HTTPAddr: "a:8000"})
	h.ok(RegisterNode{NodeID: "r1", RaftAddr: "a:7000", HTTPAddr: "a:8000"}) // no change, no event
	h.ok(RegisterNode{NodeID: "r1", RaftAddr: "a:7000", HTTPAddr: "a:9000"})
	want := []NodeRecord{{"r1", "a:7000", "a:9000"}, {"r2", "b:7000", "b:8000"}}
	if got := h.f.Nodes(); !reflect.DeepEqual(got, want) {
		t.Fatalf("nodes %+v", got)
	}
	if len(changes) != 3 {
		t.Fatalf("changes %+v", changes)
	}
	h.ok(RemoveNode{NodeID: "r2"})
	if n, ok := h.f.Node("r2"); ok {
		t.Fatalf("removed node %+v", n)
	}
	if r := h.apply(RemoveNode{NodeID: "r2"}); !errors.Is(r.Err, ErrUnknownNode) {
		t.Fatal(r.Err)
	}
	if r := h.apply(RegisterNode{}); !errors.Is(r.Err, ErrInvalidCommand) {
		t.Fatal(r.Err)
	}
}

// TestFSMOnChangeOutsideLocks: observers run without the FSM's lock, so
// they may read it (the API refreshes its candidate set this way).
func TestFSMOnChangeOutsideLocks(t *testing.T) {
	h := newHarness(t)
	var seen [][]WorkerRecord
	h.f.OnChange(func(c Change) { seen = append(seen, h.f.Workers()) })
	var kinds []ChangeKind
	h.f.OnChange(func(c Change) { kinds = append(kinds, c.Kind) })
	h.f.ApplyBatch(logsOf([][]byte{
		mustEncode(t, worker("w1", 1)),
		mustEncode(t, worker("w2", 1)),
		mustEncode(t, SetModelConfig{Model: "m", Temperature: ptr(0.5)}),
		mustEncode(t, DeregisterWorker{ID: "w1"}),
	}, 1))
	if !slices.Equal(kinds, []ChangeKind{ChangeWorkers, ChangeWorkers, ChangeModelConfig, ChangeWorkers}) {
		t.Fatalf("kinds %v", kinds)
	}
	// Observers run after the whole batch: they all see its end state.
	if len(seen) != 4 || len(seen[0]) != 1 || seen[0][0].ID != "w2" {
		t.Fatalf("seen %+v", seen)
	}
	for _, k := range kinds {
		if strings.HasPrefix(k.String(), "ChangeKind(") {
			t.Fatalf("unnamed kind %d", k)
		}
	}
}

// TestFSMConcurrentReads runs every reader against a stream of applies,
// snapshots and a restore; with -race it checks the locking.
func TestFSMConcurrentReads(t *testing.T) {
	f := newFSM(t)
	entries := newGen(11).stream(t, 1500)
	overlaps := f.Overlaps()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for g := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var dst []router.Overlap
			for {
				select {
				case <-stop:
					return
				default:
				}
				switch g {
				case 0:
					_ = f.Workers()
					_ = f.WorkerInfos("m1")
					_ = f.Stale()
					_ = f.Cursors()
					_ = f.Models()
					_ = f.ModelConfig("m1")
				case 1:
					_ = f.Digest()
					_ = f.Stats()
					_ = f.Nodes()
				case 2:
					dst = overlaps.FindMatches([]uint64{1, 2, 3}, dst)
					dst = f.Index().FindMatches([]uint64{1, 2, 3}, dst)
					dst = f.PredictedOverlaps().FindMatches([]uint64{1}, dst)
				}
			}
		}()
	}
	var snap []byte
	for i, l := range logsOf(entries, 1) {
		f.Apply(l)
		if i == 700 {
			snap = snapshotBytes(t, f)
		}
	}
	if err := restoreBytes(f, snap); err != nil {
		t.Fatal(err)
	}
	close(stop)
	wg.Wait()
}

func TestFSMApplyResultJSON(t *testing.T) {
	h := newHarness(t)
	h.ok(worker("w1", 1))
	h.ok(RegisterNode{NodeID: "n1"})
	results := []*ApplyResult{
		h.events(stored("w1", 0, 3, 1), stored("ghost", 0, 1, 2)),
		h.apply(DeregisterWorker{ID: "ghost"}),
		h.apply(SetModelConfig{Model: "m", OverlapCredit: ptr(5.0)}),
		h.apply(RegisterWorker{ID: "w2", DPRanks: 1, BlockSize: 64}),
		h.apply(SetGroups{Groups: 2, Checked: []string{"n0"}}),
		h.raw([]byte{99, 1}),
	}
	sentinels := []error{nil, ErrUnknownWorker, ErrInvalidConfig, ErrBlockSizeMismatch, ErrUncheckedNode, ErrUnknownCommand}
	for i, r := range results {
		raw, err := json.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		var back ApplyResult
		if err := json.Unmarshal(raw, &back); err != nil {
			t.Fatal(err)
		}
		if errString(back.Err) != errString(r.Err) || (sentinels[i] != nil && !errors.Is(back.Err, sentinels[i])) ||
			(sentinels[i] == ErrUncheckedNode && !errors.Is(back.Err, ErrInvalidCommand)) {
			t.Fatalf("%s: err %v → %v", raw, r.Err, back.Err)
		}
		back.Err, r.Err = nil, nil
		if !reflect.DeepEqual(back, *r) {
			t.Fatalf("round trip %+v → %s → %+v", *r, raw, back)
		}
	}
}
