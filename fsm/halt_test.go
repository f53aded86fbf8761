package fsm

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/hashicorp/raft"
)

// TestFSMHaltsOnUnknownType: an entry of a type (or envelope version) this
// build does not know, without the ignore bit, halts the FSM at that index:
// the state stays that of the entries before it, every later entry is
// refused, snapshots are refused (raft would compact the entries not
// applied), and a restore of a state this build can read resumes applying.
func TestFSMHaltsOnUnknownType(t *testing.T) {
	for _, tc := range []struct {
		name    string
		entry   []byte
		typ     CommandType
		version byte
	}{
		{"unknown type", []byte{50, 1, 9, 9}, 50, 1},
		{"unknown envelope version", []byte{byte(CmdTick), 2, 10}, CmdTick, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			h.ok(worker("w1", 1))
			h.events(stored("w1", 0, 1, 1))
			before, applied := h.f.Digest(), h.f.AppliedIndex()
			if h.f.Halted() != nil {
				t.Fatal("halted before the unknown entry")
			}

			r := h.raw(tc.entry)
			var he *HaltError
			if !errors.As(r.Err, &he) || !errors.Is(r.Err, ErrUnknownCommand) || !errors.Is(r.Err, ErrHalted) {
				t.Fatalf("result error %v", r.Err)
			}
			want := HaltError{Index: applied + 1, Type: tc.typ, Version: tc.version}
			if *he != want {
				t.Fatalf("halt %+v, want %+v", *he, want)
			}
			if err := h.f.Halted(); !errors.Is(err, ErrHalted) || err.Error() != he.Error() {
				t.Fatalf("Halted() = %v", err)
			}
			if st := h.f.Stats(); st.UnknownTypes != 1 {
				t.Fatalf("stats %+v", st)
			}

			// Everything after it is refused, commands or not.
			for _, c := range []Command{worker("w2", 1), Tick{Now: 1}, DeregisterWorker{ID: "w1"}} {
				if r := h.apply(c); !errors.Is(r.Err, ErrHalted) || r.Applied != 0 {
					t.Fatalf("%T while halted: %+v", c, r)
				}
			}
			if r := h.f.Apply(h.next(nil)); !errors.Is(r.(*ApplyResult).Err, ErrHalted) {
				t.Fatalf("entry while halted: %+v", r)
			}
			h.idx++
			if out := h.f.ApplyBatch([]*raft.Log{{Index: h.idx, Type: raft.LogNoop}}); out[0] != nil {
				t.Fatalf("no-op response %v", out[0])
			}
			if h.f.Digest() != before || h.f.AppliedIndex() != applied {
				t.Fatalf("halted FSM moved: applied %d (want %d), digest changed %v", h.f.AppliedIndex(), applied, h.f.Digest() != before)
			}
			if st := h.f.Stats(); st.HaltedEntries != 5 || st.UnknownTypes != 1 {
				t.Fatalf("stats %+v", st)
			}
			if _, err := h.f.Snapshot(); !errors.Is(err, ErrHalted) {
				t.Fatalf("snapshot while halted: %v", err)
			}

			// The results cross the wire (forwarded writes): the entry that
			// halted as an unknown command, the later ones as halted.
			for _, res := range []*ApplyResult{r, h.apply(Tick{Now: 2})} {
				b, err := json.Marshal(res)
				if err != nil {
					t.Fatal(err)
				}
				var back ApplyResult
				if err := json.Unmarshal(b, &back); err != nil || back.Err == nil || back.Err.Error() != res.Err.Error() {
					t.Fatalf("forwarded result %s: %v", b, back.Err)
				}
				if res == r && !errors.Is(back.Err, ErrUnknownCommand) || res != r && !errors.Is(back.Err, ErrHalted) {
					t.Fatalf("forwarded result %s: %v", b, back.Err)
				}
			}
			if !strings.Contains(he.Error(), "log index "+itoa(want.Index)+": command type "+itoa(uint64(tc.typ))) {
				t.Fatalf("message %q does not name the index and type", he.Error())
			}
		})
	}
}

// TestFSMHaltIsDeterministic: the same log halts a restarted replica of the
// same build at the same index with the same state, and a restore of a
// snapshot (from a replica of a build that applied the entry) clears the
// halt: the replica follows the log again and converges.
func TestFSMHaltIsDeterministic(t *testing.T) {
	entries := [][]byte{
		mustEncode(t, worker("w1", 2)),
		mustEncode(t, KVEventBatch{Events: []KVBatchEvent{stored("w1", 0, 1, 1, 2)}}),
		{60, 1, 1, 2, 3}, // unknown here; the newer build applies it (as a no-op, below)
		mustEncode(t, KVEventBatch{Events: []KVBatchEvent{stored("w1", 1, 1, 3)}}),
		mustEncode(t, Tick{Now: 5}),
	}
	logs := logsOf(entries, 1)
	old1, old2 := newFSM(t), newFSM(t)
	old1.ApplyBatch(logs)
	for _, l := range logs {
		old2.Apply(l)
	}
	if old1.Digest() != old2.Digest() || old1.AppliedIndex() != 2 || old2.AppliedIndex() != 2 {
		t.Fatalf("halted replicas differ: applied %d / %d", old1.AppliedIndex(), old2.AppliedIndex())
	}
	var h1, h2 *HaltError
	if !errors.As(old1.Halted(), &h1) || !errors.As(old2.Halted(), &h2) || *h1 != *h2 || h1.Index != 3 {
		t.Fatalf("halts %v / %v", old1.Halted(), old2.Halted())
	}

	// The newer build: here the entry's ignorable form stands in for a
	// type it knows whose effect on this state is nil.
	newer := newFSM(t)
	known := append([]byte{60 | IgnoreIfUnknown}, entries[2][1:]...)
	newer.ApplyBatch(logsOf(append(append(append([][]byte{}, entries[:2]...), known), entries[3:]...), 1))
	if newer.Halted() != nil || newer.AppliedIndex() != 5 {
		t.Fatalf("newer build: halted %v applied %d", newer.Halted(), newer.AppliedIndex())
	}
	if err := restoreBytes(old1, snapshotBytes(t, newer)); err != nil {
		t.Fatal(err)
	}
	if old1.Halted() != nil || old1.Digest() != newer.Digest() || old1.AppliedIndex() != 5 {
		t.Fatalf("after restore: halted %v applied %d", old1.Halted(), old1.AppliedIndex())
	}
	next := logsOf([][]byte{mustEncode(t, Tick{Now: 9})}, 6)
	old1.ApplyBatch(next)
	newer.ApplyBatch(next)
	if old1.Digest() != newer.Digest() || old1.AppliedIndex() != 6 {
		t.Fatal("restored replica does not follow the log")
	}
}

func itoa(v uint64) string {
	b, _ := json.Marshal(v)
	return string(b)
}
