package eventbus

import (
	"context"
	"encoding/binary"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/internal/poll"
)

// compactSamples: sampleEvents plus the shapes the compact form has to get
// right: aliased and non-aliased blocks, a vLLM-sized chunk, a long removal,
// a worker name past the fixstr range, hashes of every width.
func compactSamples() []WireEvent {
	evs := sampleEvents()
	chunk := WireEvent{Worker: "ingest-0a1b2c3d-7", EventID: 123456, Kind: KindStored, BlockSize: 16, HasParent: true, Parent: 1 << 60}
	for i := range 32 {
		h := uint64(i+1) * 0x9e3779b97f4a7c15
		chunk.Blocks = append(chunk.Blocks, WireBlock{Engine: h, Content: h})
	}
	mixed := chunk
	mixed.Blocks = append([]WireBlock(nil), chunk.Blocks...)
	mixed.Blocks[7].Content++ // one block named by the engine's own hash: "bp"
	removal := WireEvent{Worker: "ingest-0a1b2c3d-7", DPRank: 70000, EventID: 1 << 35, Kind: KindRemoved}
	for i := range 1024 {
		removal.Removed = append(removal.Removed, uint64(i)*0x9e3779b97f4a7c15)
	}
	long := WireEvent{Worker: strings.Repeat("é", MaxWorkerNameLen/2), EventID: 300, Kind: KindStored, BlockSize: 1 << 20,
		Blocks: []WireBlock{{Engine: 0, Content: 0}, {Engine: 255, Content: 255}, {Engine: 1 << 32, Content: 1 << 32}}}
	return append(evs, chunk, mixed, removal, long)
}

// TestBusCompactWire: the compact form decodes to exactly the event the map
// form decodes to (and what the library reference reads), picks "bh" for
// aliased blocks and "bp" otherwise, and takes about half the bytes of a
// 32-block stored event.
func TestBusCompactWire(t *testing.T) {
	for _, ev := range compactSamples() {
		verbose := mustEncode(t, ev)
		compact, err := EncodeCompact(&ev)
		if err != nil {
			t.Fatalf("%s: %v", ev.MsgID(), err)
		}
		want, err := Decode(verbose)
		if err != nil {
			t.Fatal(err)
		}
		got, err := Decode(compact)
		if err != nil {
			t.Fatalf("%s: compact form undecodable: %v", ev.MsgID(), err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("%s: compact decodes to\n%+v\nmap form to\n%+v", ev.MsgID(), got, want)
		}
		if ref, err := refDecode(compact); err != nil || !reflect.DeepEqual(ref, want) {
			t.Fatalf("%s: reference decoder: %+v, %v", ev.MsgID(), ref, err)
		}
		var keys map[string]any
		if err := msgpack.Unmarshal(compact, &keys); err != nil {
			t.Fatal(err)
		}
		aliased := true
		for _, b := range ev.Blocks {
			aliased = aliased && b.Engine == b.Content
		}
		_, bh := keys["bh"]
		_, bp := keys["bp"]
		_, xh := keys["xh"]
		_, b := keys["b"]
		_, x := keys["x"]
		if b || x || bh != (len(ev.Blocks) > 0 && aliased) || bp != (len(ev.Blocks) > 0 && !aliased) || xh != (len(ev.Removed) > 0) {
			t.Errorf("%s: keys %v", ev.MsgID(), keys)
		}
		if len(ev.Blocks) == 32 {
			t.Logf("%s: %d blocks, map form %d bytes, compact %d", ev.MsgID(), len(ev.Blocks), len(verbose), len(compact))
			if aliased && 2*len(compact) > len(verbose) {
				t.Errorf("%s: compact %d bytes, map form %d: not half", ev.MsgID(), len(compact), len(verbose))
			}
		}
	}
	// Batch members may be in either form.
	evs := []WireEvent{{Worker: "w1", EventID: 5, Kind: KindCleared}, {Worker: "w1", EventID: 6, Kind: KindStored, Blocks: []WireBlock{{Engine: 9, Content: 9}}},
		{Worker: "w1", EventID: 7, Kind: KindRemoved, Removed: []uint64{9}}}
	var b []byte
	b = appendArrayHeader(b, len(evs))
	b = append(b, mustEncode(t, evs[0])...)
	for i := range evs[1:] {
		var err error
		if b, err = AppendCompact(b, &evs[1+i]); err != nil {
			t.Fatal(err)
		}
	}
	got, err := DecodeBatch(b)
	if err != nil || !reflect.DeepEqual(got, evs) {
		t.Fatalf("mixed batch: %+v, %v", got, err)
	}
	if _, err := EncodeCompact(&WireEvent{Worker: strings.Repeat("w", MaxWorkerNameLen+1), EventID: 1, Kind: KindCleared}); err == nil {
		t.Error("a worker name Decode refuses was encoded")
	}
}

// TestBusCompactWireRefusals: what Decode refuses in the compact keys (and
// accepts: nil and an empty bin as no hashes), the reference alike.
func TestBusCompactWireRefusals(t *testing.T) {
	head := func(n int, kind uint8) []byte { // a map of n entries: w, i, k, then n-3 more
		return []byte{0x80 | byte(n), 0xa1, 'w', 0xa2, 'w', '1', 0xa1, 'i', 0x01, 0xa1, 'k', kind}
	}
	bin := func(key string, p []byte) []byte {
		return append(appendBinHeader(appendStr(nil, key), len(p)), p...)
	}
	h8 := binary.BigEndian.AppendUint64(nil, 0x9e3779b97f4a7c15)
	h16 := append(append([]byte(nil), h8...), h8...)
	for _, c := range []struct {
		name string
		data []byte
		ok   bool
		want WireEvent
	}{
		{"bh", cat(head(4, KindStored), bin("bh", h16)), true,
			WireEvent{Worker: "w1", EventID: 1, Kind: KindStored, Blocks: []WireBlock{{Engine: 0x9e3779b97f4a7c15, Content: 0x9e3779b97f4a7c15}, {Engine: 0x9e3779b97f4a7c15, Content: 0x9e3779b97f4a7c15}}}},
		{"bp", cat(head(4, KindStored), bin("bp", h16)), true,
			WireEvent{Worker: "w1", EventID: 1, Kind: KindStored, Blocks: []WireBlock{{Engine: 0x9e3779b97f4a7c15, Content: 0x9e3779b97f4a7c15}}}},
		{"xh", cat(head(4, KindRemoved), bin("xh", h8)), true,
			WireEvent{Worker: "w1", EventID: 1, Kind: KindRemoved, Removed: []uint64{0x9e3779b97f4a7c15}}},
		{"empty bin", cat(head(4, KindStored), bin("bh", nil)), true, WireEvent{Worker: "w1", EventID: 1, Kind: KindStored}},
		{"nil", cat(head(4, KindRemoved), []byte{0xa2, 'x', 'h', 0xc0}), true, WireEvent{Worker: "w1", EventID: 1, Kind: KindRemoved}},
		{"bh not a multiple of 8", cat(head(4, KindStored), bin("bh", h8[:7])), false, WireEvent{}},
		{"bp not a multiple of 16", cat(head(4, KindStored), bin("bp", h8)), false, WireEvent{}},
		{"xh not a multiple of 8", cat(head(4, KindRemoved), bin("xh", h16[:9])), false, WireEvent{}},
		{"bin longer than the message", cat(head(4, KindStored), []byte{0xa2, 'b', 'h', 0xc6, 0xff, 0xff, 0xff, 0xf8}, h8), false, WireEvent{}},
		{"bh as an array", cat(head(4, KindStored), []byte{0xa2, 'b', 'h', 0x91}, u64(0xcf, 1)), false, WireEvent{}},
		{"b and bh", cat(head(5, KindStored), []byte{0xa1, 'b', 0x90}, bin("bh", h8)), false, WireEvent{}},
		{"bh and bp", cat(head(5, KindStored), bin("bh", h8), bin("bp", h16)), false, WireEvent{}},
		{"xh and x", cat(head(5, KindRemoved), bin("xh", h8), []byte{0xa1, 'x', 0x91, 0x01}), false, WireEvent{}},
		{"bh twice", cat(head(5, KindStored), bin("bh", h8), bin("bh", h8)), false, WireEvent{}},
	} {
		got, err := Decode(c.data)
		ref, rerr := refDecode(c.data)
		if (err == nil) != c.ok || (rerr == nil) != c.ok {
			t.Errorf("%s: err %v, reference %v, want ok %v", c.name, err, rerr, c.ok)
			continue
		}
		if c.ok && (!reflect.DeepEqual(got, c.want) || !reflect.DeepEqual(ref, c.want)) {
			t.Errorf("%s: got %+v, reference %+v, want %+v", c.name, got, ref, c.want)
		}
	}
}

// FuzzCompactMatchesMapForm: any event Validate accepts encodes in both
// forms to the same decoded event.
func FuzzCompactMatchesMapForm(f *testing.F) {
	f.Add("w1", uint32(0), uint64(1), uint8(KindStored), 16, true, uint64(7), []byte("0123456789abcdef"), false, uint8(0))
	f.Add("w", uint32(3), uint64(1<<40), uint8(KindRemoved), 0, false, uint64(0), []byte("0123456789abcdef01234567"), true, uint8(0))
	f.Add("é", uint32(1), uint64(9), uint8(KindCleared), 0, false, uint64(0), []byte{}, false, uint8(2))
	f.Fuzz(func(t *testing.T, worker string, rank uint32, id uint64, kind uint8, bs int, hp bool, parent uint64, hashes []byte, alias bool, tier uint8) {
		ev := WireEvent{Worker: worker, DPRank: rank, EventID: id, Kind: kind, BlockSize: bs, Tier: tier}
		switch kind {
		case KindStored:
			ev.HasParent, ev.Parent = hp, parent
			for i := 0; i+16 <= len(hashes); i += 16 {
				b := WireBlock{Engine: binary.BigEndian.Uint64(hashes[i:]), Content: binary.BigEndian.Uint64(hashes[i+8:])}
				if alias {
					b.Content = b.Engine
				}
				ev.Blocks = append(ev.Blocks, b)
			}
		case KindRemoved:
			for i := 0; i+8 <= len(hashes); i += 8 {
				ev.Removed = append(ev.Removed, binary.BigEndian.Uint64(hashes[i:]))
			}
		}
		if Validate(&ev, 0) != nil {
			return
		}
		compact, err := EncodeCompact(&ev)
		if err != nil {
			t.Fatalf("%+v: %v", ev, err)
		}
		got, err := Decode(compact)
		if err != nil {
			t.Fatalf("%+v: compact form undecodable: %v", ev, err)
		}
		want, err := Decode(mustEncode(t, ev))
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("compact decodes to\n%+v\nmap form to\n%+v", got, want)
		}
	})
}

// TestBusPublisherCompactHashes: a publisher with WithCompactHashes, alone
// and batching, gets every event to the consumer's applier as published.
func TestBusPublisherCompactHashes(t *testing.T) {
	log := testLogger(t)
	s := startSingle(t, log)
	nc, js := connect(t, s.ClientURL(), "t", log)
	ensureStream(t, js, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var mu sync.Mutex
	applied := map[string][]WireEvent{}
	c, err := NewConsumer(ctx, js, ConsumerConfig{Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	runConsumer(t, c, ApplierFunc(func(_ context.Context, evs []WireEvent) error {
		mu.Lock()
		defer mu.Unlock()
		for _, ev := range evs {
			applied[ev.Worker] = append(applied[ev.Worker], ev)
		}
		return nil
	}))
	want := map[string][]WireEvent{}
	for _, w := range []struct {
		name  string
		batch int
	}{{"w-alone", 1}, {"w-batched", 4}} {
		p, err := NewPublisher(nc, w.name, 0, WithPublisherLogger(log), WithCompactHashes(), WithBatching(w.batch, 0, time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		for i := range 10 {
			ev := storedEvent(0, uint64(100*i+1), uint64(100*i+2)) // engine ≠ content: "bp"
			switch i % 3 {
			case 1:
				for j := range ev.Blocks {
					ev.Blocks[j].Content = ev.Blocks[j].Engine // "bh"
				}
			case 2:
				ev = WireEvent{Kind: KindRemoved, Removed: []uint64{uint64(100*i - 99), uint64(100*i - 98)}}
			}
			id, err := p.PublishAsync(ctx, ev)
			if err != nil {
				t.Fatal(err)
			}
			ev.Worker, ev.EventID = w.name, id
			want[w.name] = append(want[w.name], ev)
		}
		if err := p.Flush(ctx); err != nil {
			t.Fatal(err)
		}
	}
	poll.Until(t, 10*time.Second, 5*time.Millisecond, func() error {
		mu.Lock()
		defer mu.Unlock()
		if !reflect.DeepEqual(applied, want) {
			return fmt.Errorf("applied %+v\nwant %+v", applied, want)
		}
		return nil
	})
}
