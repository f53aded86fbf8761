package eventbus

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/router"
)

func sampleEvents() []WireEvent {
	return []WireEvent{
		{Worker: "w1", EventID: 1, Kind: KindStored, BlockSize: 16,
			Blocks: []WireBlock{{Engine: 1, Content: 14643705804678351452}, {Engine: 2, Content: 4945711292740353085}}},
		{Worker: "w1", DPRank: 3, EventID: 2, Kind: KindStored, BlockSize: 16, HasParent: true, Parent: 2,
			Blocks: []WireBlock{{Engine: 1<<64 - 1, Content: 12583592247330656132}}},
		{Worker: "engine-a.pod/7", EventID: 1<<40 + 5, Kind: KindRemoved, Removed: []uint64{1, 2, 1 << 63}},
		{Worker: "w2", EventID: 9, Kind: KindCleared},
		// Lower storage tiers (the "t" key).
		{Worker: "w1", EventID: 3, Kind: KindStored, BlockSize: 16, Tier: uint8(router.TierHost),
			Blocks: []WireBlock{{Engine: 1, Content: 14643705804678351452}}},
		{Worker: "w1", EventID: 4, Kind: KindRemoved, Tier: uint8(router.TierDisk), Removed: []uint64{7}},
		{Worker: "w1", EventID: 5, Kind: KindCleared, Tier: uint8(router.TierExternal)},
	}
}

// TestBusEventTier: a device event carries no "t" key (it encodes as
// before tiers, and a consumer without tiers reads it); a lower tier's
// event does and converts to the router's tier; an unknown tier is
// invalid.
func TestBusEventTier(t *testing.T) {
	keys := func(ev WireEvent) map[string]any {
		var m map[string]any
		if err := msgpack.Unmarshal(mustEncode(t, ev), &m); err != nil {
			t.Fatal(err)
		}
		return m
	}
	evs := sampleEvents()
	if _, ok := keys(evs[0])["t"]; ok {
		t.Fatal("a device event encodes a tier")
	}
	host := evs[4]
	if _, ok := keys(host)["t"]; !ok || host.KVEvent().Tier != router.TierHost {
		t.Fatalf("host event: %v, tier %v", keys(host), host.KVEvent().Tier)
	}
	bad := host
	bad.Tier = router.NumTiers
	if err := Validate(&bad, 0); ReasonOf(err) != ReasonBadTier {
		t.Fatalf("tier %d: %v", bad.Tier, err)
	}
}

func TestBusEventRoundTrip(t *testing.T) {
	for _, ev := range sampleEvents() {
		b := mustEncode(t, ev)
		got, err := Decode(b)
		if err != nil {
			t.Fatalf("decode %s: %v (%x)", ev.MsgID(), err, b)
		}
		if !reflect.DeepEqual(got, ev) {
			t.Fatalf("round trip:\n got %+v\nwant %+v", got, ev)
		}
		// The reflection decoder of the library agrees with ours.
		var lib WireEvent
		if err := msgpack.Unmarshal(b, &lib); err != nil || !reflect.DeepEqual(lib, ev) {
			t.Fatalf("msgpack.Unmarshal: %v %+v", err, lib)
		}
		if err := Validate(&got, 0); err != nil {
			t.Fatalf("validate %s: %v", ev.MsgID(), err)
		}
		// Router conversion both ways.
		kv := got.KVEvent()
		back := FromKVEvent(got.Worker, got.DPRank, got.EventID, kv)
		if !reflect.DeepEqual(back, ev) {
			t.Fatalf("router round trip:\n got %+v\nwant %+v", back, ev)
		}
	}
	ev := sampleEvents()[1]
	if got, want := ev.WorkerID(), router.WorkerKey("w1", 3); got != want {
		t.Fatalf("WorkerID %q, want %q", got, want)
	}
	if got := ev.MsgID(); got != "w1:3:2" {
		t.Fatalf("MsgID %q", got)
	}
	kv := ev.KVEvent()
	if kv.Kind != router.EventStored || !kv.HasParent || kv.Parent != 2 || kv.BlockSize != 16 ||
		kv.Blocks[0] != (router.StoredBlock{EngineHash: 1<<64 - 1, ContentHash: 12583592247330656132}) {
		t.Fatalf("KVEvent %+v", kv)
	}
}

// The wire numbers are a contract.
func TestBusEventKindNumbers(t *testing.T) {
	if KindStored != 1 || KindRemoved != 2 || KindCleared != 3 {
		t.Fatal("event kind numbers changed")
	}
	if SyncAdd != 1 || SyncPrefillDone != 2 || SyncFree != 3 || SyncFull != 4 {
		t.Fatal("sync op numbers changed")
	}
	// Pin the encoding of one event (short keys, compact ints).
	b := mustEncode(t, WireEvent{Worker: "w", EventID: 1, Kind: KindCleared})
	if got, want := string(b), "\x83\xa1w\xa1w\xa1i\x01\xa1k\x03"; got != want {
		t.Fatalf("encoding %q, want %q", got, want)
	}
}

func TestBusDecodeRejectsGarbage(t *testing.T) {
	enc := func(v any) []byte {
		b, err := msgpack.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	good := mustEncode(t, sampleEvents()[0])
	cases := map[string][]byte{
		"empty":            nil,
		"nil":              {0xc0},
		"int":              {0x01},
		"string":           enc("hello"),
		"array":            enc([]int{1, 2}),
		"json":             []byte(`{"w":"x","i":1,"k":1}`),
		"trailing":         append(append([]byte(nil), good...), 0x00),
		"truncated":        good[:len(good)-3],
		"unknown key":      enc(map[string]any{"w": "x", "i": 1, "k": 1, "zz": 1}),
		"duplicate key":    {0x82, 0xa1, 'i', 0x01, 0xa1, 'i', 0x02},
		"negative id":      enc(map[string]any{"w": "x", "i": -1, "k": 1}),
		"float id":         enc(map[string]any{"w": "x", "i": 1.5, "k": 1}),
		"nil id":           enc(map[string]any{"w": "x", "i": nil, "k": 1}),
		"kind overflow":    enc(map[string]any{"w": "x", "i": 1, "k": 256}),
		"rank overflow":    enc(map[string]any{"w": "x", "i": 1, "k": 1, "r": uint64(1) << 32}),
		"worker number":    enc(map[string]any{"w": 7, "i": 1, "k": 1}),
		"worker binary":    enc(map[string]any{"w": []byte("x"), "i": 1, "k": 1}),
		"worker too long":  enc(map[string]any{"w": strings.Repeat("x", MaxWorkerNameLen+1), "i": 1, "k": 1}),
		"worker not utf8":  enc(map[string]any{"w": "\xff\xfe", "i": 1, "k": 1}),
		"bool as int":      enc(map[string]any{"w": "x", "i": 1, "k": 1, "hp": 1}),
		"blocks not array": enc(map[string]any{"w": "x", "i": 1, "k": 1, "b": 5}),
		"block not map":    enc(map[string]any{"w": "x", "i": 1, "k": 1, "b": []int{1}}),
		"block bad key":    enc(map[string]any{"w": "x", "i": 1, "k": 1, "b": []any{map[string]any{"z": 1}}}),
		"removed strings":  enc(map[string]any{"w": "x", "i": 1, "k": 2, "x": []string{"a"}}),
		// An array header claiming 2^32-1 elements in a few bytes must fail
		// before allocating.
		"huge array":  {0x84, 0xa1, 'w', 0xa1, 'x', 0xa1, 'i', 0x01, 0xa1, 'k', 0x02, 0xa1, 'x', 0xdd, 0xff, 0xff, 0xff, 0xff, 0x01},
		"huge map":    {0xdf, 0xff, 0xff, 0xff, 0xff},
		"huge string": {0x81, 0xa1, 'w', 0xdb, 0xff, 0xff, 0xff, 0xff, 'x'},
	}
	for name, b := range cases {
		ev, err := Decode(b)
		if err == nil {
			t.Errorf("%s: decoded %+v", name, ev)
			continue
		}
		if !errors.Is(err, ErrUndecodable) {
			t.Errorf("%s: error %v does not wrap ErrUndecodable", name, err)
		}
	}
	// Absent optional keys are zero; int encodings of any width are fine.
	ev, err := Decode(enc(map[string]any{"w": "x", "i": int64(7), "k": int8(1), "bs": uint16(16)}))
	if err != nil || ev.EventID != 7 || ev.Kind != KindStored || ev.BlockSize != 16 {
		t.Fatalf("lenient ints: %v %+v", err, ev)
	}
}

func TestBusValidate(t *testing.T) {
	base := func() WireEvent { return sampleEvents()[0] }
	cases := []struct {
		name string
		mod  func(*WireEvent)
		want Reason
	}{
		{"ok", func(*WireEvent) {}, ""},
		{"empty stored ok", func(e *WireEvent) { e.Blocks = nil }, ""},
		{"no worker", func(e *WireEvent) { e.Worker = "" }, ReasonBadWorker},
		{"control char", func(e *WireEvent) { e.Worker = "a\nb" }, ReasonBadWorker},
		{"rank separator", func(e *WireEvent) { e.Worker = "a#1" }, ReasonBadWorker},
		{"zero id", func(e *WireEvent) { e.EventID = 0 }, ReasonBadEventID},
		{"kind 0", func(e *WireEvent) { e.Kind = 0 }, ReasonBadKind},
		{"kind 4", func(e *WireEvent) { e.Kind = 4 }, ReasonBadKind},
		{"too many blocks", func(e *WireEvent) { e.Blocks = make([]WireBlock, 11) }, ReasonTooManyBlocks},
		{"too many removed", func(e *WireEvent) { e.Kind = KindRemoved; e.Blocks = nil; e.Removed = make([]uint64, 11) }, ReasonTooManyBlocks},
		{"huge block size", func(e *WireEvent) { e.BlockSize = MaxBlockSize + 1 }, ReasonBadBlockSize},
		{"negative block size", func(e *WireEvent) { e.BlockSize = -1 }, ReasonBadBlockSize},
		{"stored with removed", func(e *WireEvent) { e.Removed = []uint64{1} }, ReasonInconsistent},
		{"removed with blocks", func(e *WireEvent) { e.Kind = KindRemoved }, ReasonInconsistent},
		{"cleared with blocks", func(e *WireEvent) { e.Kind = KindCleared }, ReasonInconsistent},
	}
	for _, c := range cases {
		ev := base()
		c.mod(&ev)
		err := Validate(&ev, 10)
		if got := ReasonOf(err); got != c.want {
			t.Errorf("%s: reason %q (%v), want %q", c.name, got, err, c.want)
		}
		if err != nil && !errors.Is(err, ErrInvalidEvent) {
			t.Errorf("%s: %v does not wrap ErrInvalidEvent", c.name, err)
		}
	}
}

func TestBusSubjectToken(t *testing.T) {
	seen := map[string]string{}
	for _, name := range []string{"w1", "a.b", "a_b", "a~2Eb", "a b", "*", ">", "", "~", "é", "pod-7_x"} {
		tok := SubjectToken(name)
		if tok == "" || strings.ContainsAny(tok, ". *>\t\r\n") {
			t.Errorf("%q → bad token %q", name, tok)
		}
		if other, dup := seen[tok]; dup {
			t.Errorf("%q and %q share token %q", name, other, tok)
		}
		seen[tok] = name
	}
	if got := EventSubject("w1"); got != "kv.events.w1" {
		t.Fatalf("EventSubject %q", got)
	}
	if got := SyncSubject(""); got != "kv.sync.all" {
		t.Fatalf("SyncSubject %q", got)
	}
	if got := ResyncSubject("a.b"); got != "kv.resync.a~2Eb" {
		t.Fatalf("ResyncSubject %q", got)
	}
}

// FuzzDecodeEvent: Decode never panics, never allocates absurdly, and what
// it accepts re-encodes to an equal event.
func FuzzDecodeEvent(f *testing.F) {
	for _, ev := range sampleEvents() {
		b, err := Encode(&ev)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		ev, err := Decode(data)
		if err != nil {
			if !errors.Is(err, ErrUndecodable) {
				t.Fatalf("error %v does not wrap ErrUndecodable", err)
			}
			return
		}
		if len(ev.Blocks) > len(data) || len(ev.Removed) > len(data) {
			t.Fatalf("decoded %d blocks, %d removed from %d bytes", len(ev.Blocks), len(ev.Removed), len(data))
		}
		_ = Validate(&ev, 0)
		_ = ev.KVEvent()
		b, err := Encode(&ev)
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		again, err := Decode(b)
		if err != nil {
			t.Fatalf("decode of re-encoded %+v: %v", ev, err)
		}
		if !reflect.DeepEqual(again, ev) {
			t.Fatalf("unstable:\n%+v\n%+v", ev, again)
		}
	})
}

// The consumer's allocation-free checks agree with the ids they stand for.
func TestBusSubjectAndMsgIDChecks(t *testing.T) {
	workers := []string{"w1", "a.b", "a~2Eb", "a b", "", "~", "é", "pod-7_x", "w1:0"}
	for _, w := range workers {
		for _, other := range workers {
			subj := EventSubject(other)
			if got, want := isEventSubject(subj, w), subj == EventSubject(w); got != want {
				t.Errorf("isEventSubject(%q, %q) = %v, want %v", subj, w, got, want)
			}
		}
		if isEventSubject("kv.sync."+SubjectToken(w), w) {
			t.Errorf("isEventSubject accepts a sync subject for %q", w)
		}
		for _, id := range []string{MsgID(w, 0, 1), MsgID(w, 3, 1<<63), MsgID(w+":1", 0, 1), MsgID(w, 0, 10), w + ":0:01", w + ":00:1", w + ":0:1 ", ""} {
			for _, c := range []struct {
				rank uint32
				id   uint64
			}{{0, 1}, {3, 1 << 63}, {1, 0}, {0, 10}} {
				if got, want := isMsgID(id, w, c.rank, c.id), id == MsgID(w, c.rank, c.id); got != want {
					t.Errorf("isMsgID(%q, %q, %d, %d) = %v, want %v", id, w, c.rank, c.id, got, want)
				}
			}
		}
	}
}
