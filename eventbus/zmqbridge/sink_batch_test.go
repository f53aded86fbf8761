package zmqbridge

import (
	"context"
	"testing"

	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/router"
)

// batchRecorder is a Publisher that can send batch messages, recording
// how the sink used it.
type batchRecorder struct {
	Publisher
	singles int
	batches [][]eventbus.WireEvent
}

func (b *batchRecorder) PublishAsync(context.Context, eventbus.WireEvent) (uint64, error) {
	b.singles++
	return 0, nil
}

func (b *batchRecorder) PublishBatchAsync(_ context.Context, evs []eventbus.WireEvent) (uint64, error) {
	b.batches = append(b.batches, evs)
	return 0, nil
}

// TestBridgeSinkBatchMessages: with Config.BatchMessages an engine event
// batch goes to the publisher as one batch, in order and of its worker
// rank; without it (the default) one event at a time, as before.
func TestBridgeSinkBatchMessages(t *testing.T) {
	evs := []router.KVEvent{
		{Kind: router.EventStored, Blocks: []router.StoredBlock{{EngineHash: 1, ContentHash: 11}}},
		{Kind: router.EventStored, HasParent: true, Parent: 1, Blocks: []router.StoredBlock{{EngineHash: 2, ContentHash: 12}}},
		{Kind: router.EventRemoved, Removed: []uint64{1}},
	}
	for _, batch := range []bool{false, true} {
		rec := &batchRecorder{}
		sink := &publisherSink{pub: rec, worker: "w", rank: 2, batch: batch}
		if err := sink.Emit(t.Context(), evs); err != nil {
			t.Fatal(err)
		}
		switch {
		case !batch && (rec.singles != 3 || len(rec.batches) != 0):
			t.Errorf("off: %d singles, %d batches; want 3 singles", rec.singles, len(rec.batches))
		case batch && (rec.singles != 0 || len(rec.batches) != 1 || len(rec.batches[0]) != 3):
			t.Errorf("on: %d singles, %d batches; want one batch of 3", rec.singles, len(rec.batches))
		case batch:
			for i, ev := range rec.batches[0] {
				if ev.Worker != "w" || ev.DPRank != 2 || ev.EventID != 0 || ev.Kind != uint8(evs[i].Kind) {
					t.Errorf("member %d: %+v", i, ev)
				}
			}
		}
	}
}
